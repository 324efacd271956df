"""A cancel that commits while the run's heartbeat waits for it: the heartbeat blocks on the lease
row the cancel's transaction locked, then ends the run as cancelled and answers NULL; its own
statement's snapshot predates the cancel, so the client reads why in a statement of its own. The
holder learns an operator cancelled it, not that "the lease was taken or ended"."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from ledger import LeaseLost, Ledger
from waiting import wait_for


def test_a_cancel_committed_while_the_heartbeat_waits_is_reported_as_a_cancel(dsn, db, connect):
    db.execute("SELECT ledger.register_job('long', ttl => '30 seconds')")
    canceller = connect(autocommit=False)
    lost: list[LeaseLost] = []
    with pytest.raises(LeaseLost), Ledger(dsn, owner="race").run(
            "long", heartbeat_interval=timedelta(milliseconds=200), on_lost=lost.append) as run:
        # the cancel's transaction holds the lease row (request_cancel locks it first)
        assert canceller.execute("SELECT ledger.request_cancel(%s)", (run.run_id,)).fetchone() == (True,)

        def heartbeat_waits() -> bool:
            return db.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query LIKE '%%ledger.heartbeat(%%'").fetchone() == (1,)

        wait_for(heartbeat_waits, timeout=60, what="the heartbeat to wait for the cancel's lock")
        canceller.commit()
        wait_for(lambda: run.is_lost(), timeout=60, what="the heartbeat to find the run lost")
    [error] = lost
    assert error.reason == "an operator cancelled the run (ledger.request_cancel)", error.reason
    status, reason = db.execute("SELECT status, failure_reason FROM ledger.job_execution_log"
                                " WHERE run_id = %s", (run.run_id,)).fetchone()
    assert (status, reason) == ("failure", "cancelled")


def test_a_lost_run_whose_end_cannot_be_told_keeps_the_general_reason(dsn, db):
    # taken over: the heartbeat's statement sees the takeover (it committed before), so no second read
    db.execute("SELECT ledger.register_job('taken', ttl => '30 seconds')")
    lost: list[LeaseLost] = []
    with pytest.raises(LeaseLost), Ledger(dsn, owner="race").run(
            "taken", heartbeat_interval=timedelta(milliseconds=200), on_lost=lost.append) as run:
        db.execute("SELECT ledger.force_release('taken')")
        wait_for(lambda: run.is_lost(), timeout=60, what="the heartbeat to find the lease taken over")
    [error] = lost
    assert error.reason == "the lease was taken over: a newer token superseded it", error.reason
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
                            (run.run_id,)).fetchone() == ("superseded",)
