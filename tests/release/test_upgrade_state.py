"""Revision 0005 (one state per job) on a ledger that has history: its backfill gives every known job the
state row that its log, its schedule and its leases give (ledger.verify_state() empty right after the
upgrade), a cancel leaves the failure streak, a job behind is down with no write after the upgrade; and
its downgrade gives 0004's streak back (a cancel counted as a failure)."""

from __future__ import annotations

from typing import Any

import psycopg

from ledger import migrate

BEFORE = "0004"


def _call(conn: psycopg.Connection, sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0] if len(row) == 1 else row


def _run(conn: psycopg.Connection, job: str, end: str) -> None:
    run_id, token = _call(conn, "SELECT run_id, token FROM ledger.start_run(%s, 'host-1', '1 hour')", (job,))
    error = ", 'boom'" if end == "fail_run" else ""
    conn.execute(f"SELECT ledger.{end}(%s::bigint, %s::bigint{error})", (run_id, token))


def _at_0004_with_history(dsn: str) -> None:
    migrate.upgrade(dsn, BEFORE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        # behind: hourly, registered a day ago, never succeeded (a superuser's write: 0004 has no trigger on it)
        conn.execute("SELECT ledger.register_job('behind', '1 hour', ttl => '1 minute')")
        conn.execute("UPDATE ledger.jobs SET created_at = now() - interval '1 day' WHERE job = 'behind'")
        conn.execute("SELECT ledger.register_job('streak', ttl => '1 hour')")
        for end in ("complete_run", "fail_run", "cancel_run", "fail_run"):
            _run(conn, "streak", end)
        conn.execute("SELECT ledger.register_job('fresh', ttl => '1 hour')")
        conn.execute("SELECT ledger.register_job('fine', '1 day', ttl => '1 hour')")
        _run(conn, "fine", "complete_run")
        conn.execute("SELECT ledger.acquire('leased', 'host-2', '1 hour')")
        token = _call(conn, "SELECT token FROM ledger.acquire('released', 'host-2', '1 hour')")
        conn.execute("SELECT ledger.release('released', 'host-2', %s::bigint)", (token,))
        assert _call(conn, "SELECT consecutive_failures FROM ledger.job_status WHERE job = 'streak'") == 3


def test_the_upgrade_gives_every_known_job_the_state_row_its_log_gives(new_database):
    dsn = new_database()
    _at_0004_with_history(dsn)

    migrate.upgrade(dsn)

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT * FROM ledger.verify_state()").fetchall() == []
        states = dict(conn.execute("SELECT job, state FROM ledger.job_health").fetchall())
        assert states == {"behind": "down", "streak": "failing", "fresh": "never_run", "fine": "ok",
                          "leased": "never_run"}  # 'released': a lease row alone, no job (known at its next lease)
        # the cancel is no failure of the streak any more: two failures since the success, not three
        assert _call(conn, "SELECT consecutive_failures FROM ledger.job_status WHERE job = 'streak'") == 2
        assert dict(conn.execute("SELECT job, alert FROM ledger.alerts").fetchall()) == {
            "behind": "down", "streak": "failing"}  # one alert per job and cause
        # the due marks were backfilled: the hourly job behind reads as down with no write since
        assert _call(conn, "SELECT down_due < now() FROM ledger.counters WHERE job = 'behind'") is True


def test_the_downgrade_counts_a_cancel_as_a_failure_again(new_database):
    dsn = new_database()
    _at_0004_with_history(dsn)
    migrate.upgrade(dsn)

    migrate.downgrade(dsn, BEFORE)

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert _call(conn, "SELECT version_num FROM ledger.alembic_version") == BEFORE
        assert _call(conn, "SELECT consecutive_failures FROM ledger.job_status WHERE job = 'streak'") == 3
        assert _call(conn, "SELECT count(*) FROM pg_class WHERE relname = 'purged_state'") == 0
