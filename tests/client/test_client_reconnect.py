"""A run's own connection: kept for the next run, replaced when the server drops it, never pinned to one host.

- ``Ledger(conn)`` keeps its contexts' connections open for the next
  context: a run costs no new connection.
- When the server closed a run's connection since its last call (a restart,
  a failover, an administrator's ``pg_terminate_backend``), the end of the
  run is sent again on a new connection and the run completes: it is not
  left ``running`` until its ttl.
- A connection made from a multi-host conninfo knows only the host it
  reached; ``Ledger(conn)`` over one warns, unless it is given
  ``heartbeat_conninfo``.
"""

from __future__ import annotations

import asyncio
import warnings
from datetime import timedelta

import psycopg
import pytest

from ledger import AsyncLedger, Ledger
from waiting import wait_for

MINUTE = timedelta(minutes=1)
NEVER = timedelta(hours=1)  # no heartbeat during the test: nothing notices the dropped connection first


def backends(db: psycopg.Connection, application: str) -> list[int]:
    rows = db.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                      "AND application_name = %s ORDER BY pid", (application,)).fetchall()
    return [row[0] for row in rows]


def terminate(db: psycopg.Connection, pid: int) -> None:
    assert db.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,)).fetchone() == (True,)


def status_of(db: psycopg.Connection, run_id: int | None) -> tuple[str, str | None]:
    row = db.execute("SELECT status, failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
                     (run_id,)).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_ledger_over_a_connection_reuses_its_runs_own_connections(db, dsn):
    ledger = Ledger(db, owner="worker", heartbeat_conninfo=dsn + " application_name=ledger-own")
    try:
        seen = set()
        for number in range(30):
            with ledger.run("reused", ttl=MINUTE, idempotency_key=f"k{number}") as run:
                assert run.started
                seen.update(backends(db, "ledger-own"))
        # One connection served every run (runs one after another need one at a time).
        assert len(seen) == 1, seen
        assert db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'"
                          ).fetchone() == (30,)
    finally:
        ledger.close()
    # close() closed the spare connection (its backend leaves pg_stat_activity a moment later).
    wait_for(lambda: backends(db, "ledger-own") == [], timeout=30, what="the spare connection closed")


def test_a_run_whose_connection_the_server_dropped_still_records_its_end(db, dsn):
    ledger = Ledger(db, owner="worker", heartbeat_conninfo=dsn + " application_name=ledger-dropped")
    try:
        with ledger.run("dropped", ttl=MINUTE, heartbeat_interval=NEVER) as run:
            [pid] = backends(db, "ledger-dropped")
            terminate(db, pid)  # the run's own connection, idle between its start and its end
        assert run.result is not None and run.result.status == "success"
        assert status_of(db, run.run_id) == ("success", None)
        assert not run.lost.is_set()
        assert backends(db, "ledger-dropped") not in ([], [pid])  # the end went out on a new connection
    finally:
        ledger.close()


def test_the_async_client_also_sends_the_end_again_on_a_new_connection(db, dsn):
    async def main() -> tuple[object, int | None]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            ledger = AsyncLedger(conn, owner="worker", heartbeat_conninfo=dsn + " application_name=ledger-adropped")
            try:
                async with ledger.run("adropped", ttl=MINUTE, heartbeat_interval=NEVER) as run:
                    [pid] = backends(db, "ledger-adropped")
                    terminate(db, pid)
                return (None if run.result is None else run.result.status), run.run_id
            finally:
                await ledger.close()

    status, run_id = asyncio.run(main())
    assert status == "success"
    assert status_of(db, run_id) == ("success", None)


def test_a_failed_run_whose_connection_was_dropped_is_recorded_failed_not_left_running(db, dsn):
    ledger = Ledger(db, owner="worker", heartbeat_conninfo=dsn + " application_name=ledger-failed")
    try:
        with pytest.raises(ZeroDivisionError):
            with ledger.run("failed", ttl=MINUTE, heartbeat_interval=NEVER) as run:
                [pid] = backends(db, "ledger-failed")
                terminate(db, pid)
                1 / 0
        assert status_of(db, run.run_id) == ("failure", "error")
    finally:
        ledger.close()


def test_a_connection_from_a_multi_host_conninfo_draws_a_warning_unless_heartbeat_conninfo_is_given(dsn):
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    host = params.get("host", "127.0.0.1")
    port = str(params.get("port", 5432))
    multi = psycopg.conninfo.make_conninfo(dsn, host=f"{host},{host}", port=f"{port},{port}",
                                           target_session_attrs="read-write")
    with psycopg.connect(multi, autocommit=True) as conn:
        with pytest.warns(RuntimeWarning, match="heartbeat_conninfo"):
            Ledger(conn)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Ledger(conn, heartbeat_conninfo=multi)  # told the whole conninfo: nothing to warn about
    with psycopg.connect(dsn, autocommit=True) as conn, warnings.catch_warnings():
        warnings.simplefilter("error")
        Ledger(conn)  # one host: nothing to warn about
