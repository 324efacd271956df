"""The eight situations of issue 22, built in one ledger: one job in each state.

``build_situations(conn, clock)`` registers and runs eight jobs, moves the
ledger's clock two hours on (the ``ledger_clock`` fixture of tests/conftest.py:
no sleeping) and returns each job with the state the ledger must give it,
the same word in ``ledger.job_health``, ``ledger.job_status`` and every
surface that shows a job (the CLI, the dashboard and its badge, the metrics).
``TROUBLE`` is the one alert each job must raise (none for the others).

The jobs, named by their state:

- ``ok``: hourly, its due slot run and succeeded after the clock moved;
- ``failing``: no schedule, a success then two failures;
- ``down``: every 30 minutes, three failures of its first slot, then two
  hours without a run (a job behind after failures is down, not also
  overdue and failing);
- ``late``: hourly, its slot succeeded two hours ago: one or two slots missed;
- ``never_run``: registered, no run;
- ``paused``: a success, then paused by an operator;
- ``running``: a live run, started after the clock moved;
- ``crashed``: a run started two hours ago with a 5-minute lease that was
  never renewed nor ended (its runner was SIGKILLed), and no reaper ran.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import psycopg

#: The one alert each job raises (its state, when it is trouble); the others raise none.
TROUBLE = {"failing": "failing", "down": "down", "late": "late", "crashed": "crashed"}

#: How far the clock moves between the two halves of the build.
ADVANCE = timedelta(hours=2)


class Clock(Protocol):
    def advance(self, by: timedelta) -> None: ...


def _start(conn: psycopg.Connection[Any], job: str, *, due: bool = False, ttl: str | None = None) -> tuple[int, int]:
    if due:
        row = conn.execute("SELECT outcome, run_id, token FROM ledger.start_due_run(job => %s, owner => 'situations')",
                           (job,)).fetchone()
    else:
        row = conn.execute("SELECT outcome, run_id, token FROM ledger.start_run(job => %s, owner => 'situations',"
                           " ttl => %s)", (job, ttl)).fetchone()
    assert row is not None and row[0] == "started", (job, row)
    return int(row[1]), int(row[2])


def _run(conn: psycopg.Connection[Any], job: str, *, fail: bool = False, due: bool = False) -> None:
    run_id, token = _start(conn, job, due=due)
    if fail:
        conn.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => 'exit code 1')", (run_id, token))
    else:
        conn.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))


def build_situations(conn: psycopg.Connection[Any], clock: Clock) -> dict[str, str]:
    """Build the eight jobs on `conn` (autocommit), moving `clock` by ADVANCE; each job's expected state."""
    register = "SELECT ledger.register_job(job => %s, schedule => %s, ttl => %s, late_after => %s)"
    for job, schedule, ttl, late_after in [
        ("ok", "1 hour", "1 minute", "10 minutes"),
        ("failing", None, "1 minute", None),
        ("down", "30 minutes", "1 minute", "5 minutes"),
        ("late", "1 hour", "1 minute", "10 minutes"),
        ("never_run", None, "1 minute", None),
        ("paused", None, "1 minute", None),
        ("running", None, "1 hour", None),
        ("crashed", None, "5 minutes", None),
    ]:
        conn.execute(register, (job, schedule, ttl, late_after))

    # Two hours ago (the ledger's clock is about to move on).
    _run(conn, "failing")
    _run(conn, "failing", fail=True)
    _run(conn, "failing", fail=True)
    for _ in range(3):
        _run(conn, "down", fail=True, due=True)  # its first slot, failed and retried
    _run(conn, "late", due=True)
    _run(conn, "paused")
    conn.execute("SELECT ledger.pause_job(job => 'paused')")
    _start(conn, "crashed")  # never heartbeats, never ends

    clock.advance(ADVANCE)

    # Now.
    _run(conn, "ok", due=True)
    _start(conn, "running")
    return {"ok": "ok", "failing": "failing", "down": "down", "late": "late", "never_run": "never_run",
            "paused": "paused", "running": "running", "crashed": "crashed"}
