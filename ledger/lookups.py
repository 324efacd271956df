"""The read-only queries the command line needs beyond the client: alerts, recent runs, skipped slots.

Constants with named parameters and explicit columns, like ``ledger.queries``;
each function takes an open connection and returns plain dicts (the tables
and ``--json`` render them as they come).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

ALERTS = """
SELECT a.alert, a.job, a.run_id, a.message, a.since
  FROM ledger.alerts AS a
 ORDER BY a.job, a.alert, a.run_id
"""

RECENT_RUNS = """
SELECT r.run_id, r.job, r.owner, r.token, r.slot, r.idempotency_key, r.status, r.failure_reason,
       r.started_at, r.heartbeat_at, r.completed_at,
       coalesce(r.completed_at, clock_timestamp()) - r.started_at AS duration,
       r.error, r.detail
  FROM ledger.job_execution_log AS r
 WHERE r.job = %(job)s
 ORDER BY r.run_id DESC
 LIMIT %(limit)s
"""

SKIPPED_SLOTS = """
SELECT s.job, s.first_slot, s.last_slot, s.slot_count, s.reason, s.recorded_at
  FROM ledger.skipped_slots AS s
 WHERE s.job = %(job)s
 ORDER BY s.first_slot
"""

OVERLAPS = """
SELECT o.job, o.run_id, o.other_run_id, o.started_at, o.other_started_at
  FROM ledger.overlaps AS o
 WHERE %(jobs)s::text[] IS NULL OR o.job = ANY(%(jobs)s::text[])
 ORDER BY o.job, o.run_id
"""


def _rows(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall()


def alerts(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    return _rows(conn, ALERTS, {})


def recent_runs(conn: psycopg.Connection[Any], job: str, limit: int) -> list[dict[str, Any]]:
    """The job's newest runs, newest first."""
    return _rows(conn, RECENT_RUNS, {"job": job, "limit": limit})


def skipped_slots(conn: psycopg.Connection[Any], job: str) -> list[dict[str, Any]]:
    return _rows(conn, SKIPPED_SLOTS, {"job": job})


def overlaps(conn: psycopg.Connection[Any], jobs: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows of the overlap audit, of these jobs (None: all)."""
    return _rows(conn, OVERLAPS, {"jobs": jobs})
