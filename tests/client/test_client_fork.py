"""The sync client in a forked child (a prefork server: gunicorn, celery): the parent's timer thread and parked
threads were not copied, and the child's runs heartbeat all the same."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import psycopg
import pytest

from ledger import Ledger
from ledger._acompat import parked
from waiting import wait_for

HEARTBEAT = "SELECT heartbeat_at FROM ledger.job_execution_log WHERE run_id = %s"


def _child(dsn: str) -> int:
    """In the forked child: 0 when a run's heartbeat renewed it within 20 s, else why not."""
    with psycopg.connect(dsn, autocommit=True) as conn, Ledger(dsn, owner="child") as ledger:
        with ledger.run("forked", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=50)) as run:
            if not run.started:
                return 3
            row = conn.execute(HEARTBEAT, (run.run_id,)).fetchone()
            first = row[0] if row else None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                row = conn.execute(HEARTBEAT, (run.run_id,)).fetchone()
                if row and row[0] != first:
                    return 0
                time.sleep(0.05)
            return 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (a POSIX system)")
def test_a_forked_childs_runs_heartbeat_although_the_parent_had_the_timer_and_the_parked_threads(dsn, db):
    with Ledger(dsn, owner="parent") as ledger:
        with ledger.run("warm", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=20)):
            time.sleep(0.1)  # its heartbeat thread beats, then parks; the timer's thread runs
    # what the child would hand its heartbeat to, were it not reset
    wait_for(lambda: parked() > 0, what="a parked heartbeat thread", interval=0.01)
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            code = _child(dsn)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's run was not renewed by its heartbeat"
    assert db.execute("SELECT status FROM ledger.job_execution_log WHERE job = 'forked'").fetchone() == ("success",)
