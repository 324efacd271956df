"""Small helpers for tests that talk SQL to the ledger directly."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row


def one(conn: psycopg.Connection, query: str, params: Any = None) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)  # type: ignore[arg-type]
        return cur.fetchone()


def rows(conn: psycopg.Connection, query: str, params: Any = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)  # type: ignore[arg-type]
        return cur.fetchall()


def value(conn: psycopg.Connection, query: str, params: Any = None) -> Any:
    row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
    return None if row is None else row[0]


# Everything a call could have changed: compared before and after a call that
# must raise, to prove that it changed nothing.
STATE_QUERY = """
SELECT (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job), '[]') FROM ledger.jobs t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job), '[]') FROM ledger.leases t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job, t.seat), '[]') FROM ledger.lease_seats t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.resource), '[]') FROM ledger.fences t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.run_id), '[]') FROM ledger.job_execution_log t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job), '[]') FROM ledger.counters t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job, t.first_slot), '[]') FROM ledger.skipped_slots t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job), '[]') FROM ledger.purged_slots t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job, t.idempotency_key), '[]') FROM ledger.purged_keys t)
    || (SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.job), '[]') FROM ledger.purged_state t)
"""


def state(conn: psycopg.Connection) -> Any:
    return value(conn, STATE_QUERY)


class PlpgsqlCheckWarning(UserWarning):
    """A plpgsql_check finding below the failing levels (tests/sql/test_plpgsql_check.py).

    Here, not in the test file: pytest-xdist's controller imports a warning's class
    by its module name, and it has tests/ on its path, not tests/sql/.
    """
