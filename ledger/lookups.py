"""The read-only queries the command line needs beyond the client: alerts, recent runs, skipped slots, risks,
the schedulers.

The statements are in :mod:`ledger.queries`; each function takes an open
connection and returns plain dicts (the tables and ``--json`` render them as
they come), but ``db_risks`` its typed rows (``ledger.models.DbRisk``).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from ledger import queries
from ledger.models import DbRisk


def _rows(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def alerts(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return _rows(conn, queries.ALERTS, {})


def job_health(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Every row of ``ledger.job_health``, by job."""
    return _rows(conn, queries.JOB_HEALTH, {})


def recent_runs(conn: psycopg.Connection[Any], job: str, limit: int) -> list[dict[str, Any]]:
    """The job's newest runs, newest first."""
    return _rows(conn, queries.RECENT_RUNS, {"job": job, "limit": limit})


def skipped_slots(conn: psycopg.Connection[Any], job: str) -> list[dict[str, Any]]:
    return _rows(conn, queries.SKIPPED_SLOTS, {"job": job})


def overlaps(conn: psycopg.Connection[Any], jobs: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of the overlap audit, of these jobs (None: all)."""
    return _rows(conn, queries.OVERLAPS, {"jobs": jobs})


def protected_tables(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Every row of ``ledger.protected_tables`` (table, job, resource, mode, enabled), by job."""
    return _rows(conn, queries.PROTECTED_TABLES, {})


def verify_state(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """The jobs whose stored state differs from the log's (``ledger.verify_state``; reads the whole log)."""
    return _rows(conn, queries.VERIFY_STATE, {})


def schedulers(conn: psycopg.Connection[Any], *, expired: bool = False) -> list[dict[str, Any]]:
    """The rows of ``ledger.schedulers``, by name: the live ones, or every one with ``expired``; each
    with ``live``, ``status`` (live, stopping, expired), ``leader`` (it holds the upkeep lease now),
    ``job_count`` and ``heartbeat_age``."""
    return _rows(conn, queries.SCHEDULERS, {"all": expired, "first_jobs": None})


def db_risks(conn: psycopg.Connection[Any]) -> list[DbRisk]:
    """Every row of ``ledger.db_risks``, the xmin horizon first."""
    with conn.cursor(row_factory=class_row(DbRisk)) as cur:
        cur.execute(queries.DB_RISKS)
        return cur.fetchall()
