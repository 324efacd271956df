"""The client's catch-up iterator, job decorator and JobStatus, over the schedule functions."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from ledger import AsyncLedger, JobStatus, Ledger
from ledger.resources import sql_files

pytestmark = pytest.mark.skipif(
    not any("ledger.start_due_run" in path.read_text() for path in sql_files()),
    reason="needs ledger.start_due_run (sql/55_schedules.sql installed)")

TTL = timedelta(minutes=10)


@pytest.fixture
def ledger(db) -> Ledger:
    return Ledger(db, owner="worker-1")


def seed_success_hours_ago(ledger: Ledger, db, job: str, hours: int) -> None:
    """A success for the hourly slot `hours` ago: catch-up starts after it."""
    slot = db.execute("SELECT date_trunc('hour', clock_timestamp() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' "
                      "- make_interval(hours => %s)", (hours,)).fetchone()[0]
    start = ledger.start_run(job, slot=slot, owner="setup")
    assert start.started and start.run_id is not None and start.token is not None
    ledger.complete_run(start.run_id, start.token)


def test_catch_up_runs_the_due_slots_oldest_first_within_the_backfill_bound(ledger, db):
    ledger.register_job("hourly", schedule="1 hour", ttl=TTL, max_backfill=3)
    seed_success_hours_ago(ledger, db, "hourly", 6)
    due = ledger.due_slots("hourly")
    assert len(due) == 3 and due == sorted(due)
    served = []
    for run in ledger.catch_up("hourly"):
        with run:
            assert run.started and run.is_open
            served.append(run.slot)
    assert served == due
    assert ledger.start_due_run("hourly").outcome == "nothing_due"
    status = ledger.job_status("hourly")
    assert isinstance(status, JobStatus)
    assert (status.schedule, status.last_status, status.successes, status.skipped_backfill) == \
        ("1 hour", "success", 4, 3)
    assert status.running_run_id is None and status.overdue is False


def test_catch_up_stops_after_a_failed_run_and_retries_that_slot_next_time(ledger, db):
    ledger.register_job("hourly", schedule="1 hour", ttl=TTL, max_backfill=3)
    seed_success_hours_ago(ledger, db, "hourly", 3)
    attempts = []
    for run in ledger.catch_up("hourly"):
        try:
            with run:
                attempts.append(run.slot)
                raise RuntimeError("upstream down")
        except RuntimeError:
            pass
    assert len(attempts) == 1
    assert run.result is not None and run.result.status == "failure"
    retried = [run.slot for run in ledger.catch_up("hourly")]  # left open by the loop body: completed
    assert retried[0] == attempts[0] and len(retried) == 3
    assert ledger.job_status("hourly").consecutive_failures == 0


def test_the_decorator_registers_on_first_call_and_runs_the_due_slots(ledger, db):
    calls = []

    @ledger.job("report", schedule="1 hour", ttl=TTL, max_backfill=2)
    def report(run, suffix: str) -> str:
        calls.append(run.run_id)
        return f"{run.slot:%H}:{suffix}"

    assert db.execute("SELECT count(*) FROM ledger.jobs").fetchone()[0] == 0  # nothing at import
    first = report("x")
    assert len(first) == 1 and first[0].endswith(":x")  # a job that never ran: its latest slot only
    assert report("x") == []
    assert db.execute("SELECT schedule, ttl, max_backfill FROM ledger.jobs WHERE job = 'report'").fetchone() == \
        ("1 hour", TTL, 2)
    assert [s.job for s in ledger.job_statuses()] == ["report"]


def test_a_paused_job_has_nothing_to_catch_up(ledger):
    ledger.register_job("hourly", schedule="1 hour", ttl=TTL)
    assert ledger.pause_job("hourly")
    assert list(ledger.catch_up("hourly")) == []
    assert ledger.start_due_run("hourly").outcome == "paused"
    assert ledger.resume_job("hourly")
    assert len(list(ledger.catch_up("hourly"))) == 1


def test_async_catch_up_and_decorator(dsn, db):
    async def main():
        async with AsyncLedger(dsn, owner="worker-1") as ledger:
            await ledger.register_job("hourly", schedule="1 hour", ttl=TTL, max_backfill=3)
            seed_success_hours_ago(Ledger(db), db, "hourly", 3)
            served = []
            async for run in ledger.catch_up("hourly"):
                async with run:
                    served.append(run.slot)
            assert served == sorted(served) and len(served) == 3

            @ledger.job("report", schedule="1 hour", ttl=TTL)
            async def report(run) -> int:
                return run.token

            assert len(await report()) == 1
            assert await report() == []
            status = await ledger.job_status("report")
            assert status is not None and status.last_status == "success"

    asyncio.run(main())
