"""A scheduler round costs what is due (ledger.wakeups): each job's mark is at or before
its next start; start_due_runs visits only the jobs whose mark has passed and writes
their next start; whatever can make a start come earlier moves the mark back.

Time moves through the clock seam (ledger_clock), never by sleeping."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

from sqlhelp import rows, value

MINUTE = timedelta(minutes=1)


def _to_next_minute(db: psycopg.Connection, clock: Any, into: float = 1.0) -> None:
    now = value(db, "SELECT ledger._now()")
    clock.advance(timedelta(seconds=60 - (now.second + now.microsecond / 1e6) + into))


def _start(db: psycopg.Connection, jobs: list[str]) -> list[dict[str, Any]]:
    return rows(db, "SELECT * FROM ledger.start_due_runs(%s, 'sched-1')", (jobs,))


def _mark(db: psycopg.Connection, job: str) -> Any:
    return value(db, "SELECT at FROM ledger.wakeups WHERE job = %s", (job,))


def _marks_never_late(db: psycopg.Connection) -> None:
    """The invariant: no job's mark is later than its next start (nor NULL when it has one)."""
    late = db.execute("SELECT w.job, w.at, ledger._next_start_of(w.job) FROM ledger.wakeups w"
                      " WHERE ledger._next_start_of(w.job) IS NOT NULL"
                      "   AND (w.at IS NULL OR w.at > ledger._next_start_of(w.job))").fetchall()
    assert late == []


def test_a_round_writes_each_visited_jobs_next_start_and_next_start_agrees(db, ledger_clock):
    for job in ("a", "b", "c"):
        db.execute("SELECT ledger.register_job(%s, '1 minute', '30 seconds', jitter => '20 seconds')", (job,))
    assert _start(db, ["a", "b", "c"]) == []  # nothing due yet: each visited once
    marks = {job: _mark(db, job) for job in ("a", "b", "c")}
    for job, at in marks.items():
        assert at == value(db, "SELECT ledger._next_start_of(%s)", (job,)), job
    assert value(db, "SELECT ledger.next_start(ARRAY['a', 'b', 'c'])") == min(marks.values())
    assert value(db, "SELECT ledger.next_start(ARRAY['b'])") == marks["b"]
    _marks_never_late(db)


def test_a_started_runs_mark_is_its_lease_expiry_and_its_end_moves_it_back(db, ledger_clock):
    db.execute("SELECT ledger.register_job('j', '1 minute', '30 seconds')")
    _to_next_minute(db, ledger_clock)
    started = _start(db, ["j"])
    assert len(started) == 1
    assert _mark(db, "j") == started[0]["expires_at"]
    _marks_never_late(db)
    db.execute("SELECT ledger.complete_run(%s, %s)", (started[0]["run_id"], started[0]["token"]))
    assert _mark(db, "j") <= value(db, "SELECT ledger._now()")  # looked at again by the next round
    _marks_never_late(db)
    assert _start(db, ["j"]) == []  # the next slot is a minute away
    assert _mark(db, "j") == value(db, "SELECT ledger.next_start(ARRAY['j'])")
    _to_next_minute(db, ledger_clock)
    assert [r["job"] for r in _start(db, ["j"])] == ["j"]


def test_a_trigger_moves_a_future_mark_back_and_its_run_starts(db, ledger_clock):
    db.execute("SELECT ledger.register_job('t', '1 hour', '30 seconds')")
    assert _start(db, ["t"]) == []
    assert _mark(db, "t") > value(db, "SELECT ledger._now()")
    trigger_id = value(db, "SELECT ledger.trigger('t')")
    assert _mark(db, "t") <= value(db, "SELECT ledger._now()")
    started = _start(db, ["t"])
    assert [(r["job"], r["trigger_id"]) for r in started] == [("t", trigger_id)]
    _marks_never_late(db)


def test_pause_clears_the_mark_and_resume_brings_it_back(db, ledger_clock):
    db.execute("SELECT ledger.register_job('p', '1 minute', '30 seconds')")
    db.execute("SELECT ledger.pause_job('p')")
    assert _start(db, ["p"]) == []
    assert _mark(db, "p") is None
    assert value(db, "SELECT ledger.next_start(ARRAY['p'])") is None
    _to_next_minute(db, ledger_clock)
    assert _start(db, ["p"]) == []
    db.execute("SELECT ledger.resume_job('p')")
    assert _mark(db, "p") is not None
    assert [r["job"] for r in _start(db, ["p"])] == ["p"]


def test_a_heartbeat_past_the_mark_costs_a_visit_that_starts_nothing(db, ledger_clock):
    db.execute("SELECT ledger.register_job('h', '1 minute', '30 seconds')")
    _to_next_minute(db, ledger_clock)
    run = _start(db, ["h"])[0]
    ledger_clock.advance(timedelta(seconds=20))
    extended = value(db, "SELECT ledger.heartbeat(%s, %s)", (run["run_id"], run["token"]))
    assert extended > _mark(db, "h")  # the mark lags: still at or before the next start
    _marks_never_late(db)
    ledger_clock.advance(timedelta(seconds=15))  # past the old expiry, within the new one
    assert _start(db, ["h"]) == []
    assert _mark(db, "h") == extended
    assert value(db, "SELECT ledger.next_start(ARRAY['h'])") == extended


def test_a_schedule_change_moves_the_mark_back(db, ledger_clock):
    db.execute("SELECT ledger.register_job('s', '1 hour', '30 seconds')")
    assert _start(db, ["s"]) == []
    hour_mark = _mark(db, "s")
    db.execute("SELECT ledger.register_job('s', '1 minute', '30 seconds')")
    assert _mark(db, "s") < hour_mark
    _marks_never_late(db)
    _to_next_minute(db, ledger_clock)
    assert [r["job"] for r in _start(db, ["s"])] == ["s"]


def test_unregister_removes_the_mark(db):
    db.execute("SELECT ledger.register_job('u', '1 minute', '30 seconds')")
    assert value(db, "SELECT count(*) FROM ledger.wakeups WHERE job = 'u'") == 1
    db.execute("SELECT ledger.unregister_job('u')")
    assert value(db, "SELECT count(*) FROM ledger.wakeups WHERE job = 'u'") == 0
