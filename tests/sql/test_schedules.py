"""Schedules and bounded catch-up: register_job, due_slots, start_due_run."""

import json
import threading
from datetime import timedelta

import psycopg
import pytest

from sqlhelp import one, rows, state, value

MIN45 = timedelta(minutes=45)


def register(db, job="publish", schedule="45 minutes", ttl="80 minutes", max_backfill=1, time_zone="UTC"):
    return one(db, "SELECT * FROM ledger.register_job(job => %s, schedule => %s, ttl => %s, "
                   "max_backfill => %s, time_zone => %s)", (job, schedule, ttl, max_backfill, time_zone))


def due(db, job="publish", at=None):
    return [r["s"] for r in rows(db, "SELECT s FROM ledger.due_slots(job => %s, at => %s) s", (job, at))]


def start_due(db, job="publish", owner="host-1"):
    return one(db, "SELECT * FROM ledger.start_due_run(job => %s, owner => %s)", (job, owner))


def succeed_slot(db, slot, job="publish"):
    started = one(db, "SELECT * FROM ledger.start_run(job => %s, owner => 'setup', slot => %s)", (job, slot))
    assert started["outcome"] == "started"
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))


def newest_slot(db, job="publish"):
    """The newest slot at or before now, by the ledger's own clock."""
    return value(db, "SELECT ledger._slot_at_or_before(schedule_spec, time_zone, clock_timestamp()) "
                     "FROM ledger.jobs WHERE job = %s", (job,))


def test_register_job_inserts_then_updates_and_returns_the_row(db):
    job = register(db, schedule="*/15 * * * *", ttl="10 minutes", max_backfill=3, time_zone="Europe/Berlin")
    assert (job["job"], job["schedule"], job["time_zone"], job["max_backfill"], job["paused"]) == \
        ("publish", "*/15 * * * *", "Europe/Berlin", 3, False)
    assert job["ttl"] == timedelta(minutes=10)
    again = register(db, schedule="@daily", ttl="1 hour")
    assert (again["schedule"], again["time_zone"], again["max_backfill"]) == ("@daily", "UTC", 1)
    assert again["created_at"] == job["created_at"] and again["updated_at"] > job["updated_at"]
    assert value(db, "SELECT count(*) FROM ledger.jobs") == 1


def test_the_registered_ttl_is_the_default_for_acquire_start_run_and_start_due_run(db):
    register(db, ttl="80 minutes")
    lease = one(db, "SELECT * FROM ledger.acquire(job => 'publish', owner => 'a')")
    assert lease["expires_at"] - lease["acquired_at"] == timedelta(minutes=80)
    db.execute("SELECT ledger.release('publish', 'a', %s)", (lease["token"],))
    started = start_due(db)
    assert started["outcome"] == "started"
    assert value(db, "SELECT ttl FROM ledger.leases WHERE job = 'publish'") == timedelta(minutes=80)


def test_seed_scenario_one_run_for_the_newest_slot_and_six_skipped_slots_recorded_as_one_range(db):
    """45-minute schedule, 80-minute ttl, max_backfill 1, last success seven slots (5h15m) ago."""
    register(db)
    newest = newest_slot(db)
    last_success = newest - 7 * MIN45
    succeed_slot(db, last_success)
    failures_before = value(db, "SELECT failures FROM ledger.job_counters WHERE job = 'publish'")

    assert due(db) == [newest]
    started = start_due(db)
    assert started["outcome"] == "started" and started["slot"] == newest

    skipped = rows(db, "SELECT * FROM ledger.skipped_slots WHERE job = 'publish'")
    assert len(skipped) == 1
    assert skipped[0]["reason"] == "backfill_limit"
    assert skipped[0]["slot_count"] == 6
    assert skipped[0]["first_slot"] == last_success + MIN45
    assert skipped[0]["last_slot"] == newest - MIN45
    counters = one(db, "SELECT * FROM ledger.job_counters WHERE job = 'publish'")
    assert counters["skipped_backfill"] == 6
    assert counters["failures"] == failures_before == 0

    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    assert start_due(db)["outcome"] == "nothing_due"
    assert value(db, "SELECT skipped_backfill FROM ledger.job_counters WHERE job = 'publish'") == 6


def test_with_max_backfill_3_the_runner_loop_runs_the_newest_three_oldest_first(db):
    register(db, max_backfill=3)
    newest = newest_slot(db)
    succeed_slot(db, newest - 7 * MIN45)
    assert due(db) == [newest - 2 * MIN45, newest - MIN45, newest]
    ran = []
    while (started := start_due(db))["outcome"] == "started":
        ran.append(started["slot"])
        db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    assert started["outcome"] == "nothing_due"
    assert ran == [newest - 2 * MIN45, newest - MIN45, newest]
    skipped = rows(db, "SELECT slot_count FROM ledger.skipped_slots")
    assert [s["slot_count"] for s in skipped] == [4]


def test_a_failed_slot_stays_due_and_its_drop_is_not_counted_twice(db):
    register(db)
    newest = newest_slot(db)
    succeed_slot(db, newest - 3 * MIN45)
    first = start_due(db)
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (first["run_id"], first["token"]))
    assert due(db) == [newest]
    retry = start_due(db)
    assert retry["outcome"] == "started" and retry["slot"] == newest
    assert value(db, "SELECT skipped_backfill FROM ledger.job_counters WHERE job = 'publish'") == 2
    assert value(db, "SELECT count(*) FROM ledger.skipped_slots") == 1


def test_the_slot_of_a_crashed_run_stays_due_and_is_retried_at_once(db):
    register(db, schedule="1 hour")
    crashed = one(db, "SELECT * FROM ledger.start_due_run(job => 'publish', owner => 'host-1', ttl => '50 milliseconds')")
    assert due(db) == []  # its lease is live: the slot is taken
    import time
    time.sleep(0.1)
    assert due(db) == [crashed["slot"]]  # the runner is gone: the slot is due again
    retry = start_due(db, owner="host-2")
    assert (retry["outcome"], retry["slot"]) == ("started", crashed["slot"])
    old = one(db, "SELECT status, failure_reason FROM ledger.job_execution_log WHERE run_id = %s", (crashed["run_id"],))
    assert (old["status"], old["failure_reason"]) == ("failure", "lease_expired")


def test_a_job_that_never_ran_gets_only_its_latest_slot_and_records_no_skip(db):
    register(db, max_backfill=5)
    assert due(db) == [newest_slot(db)]
    assert start_due(db)["slot"] == newest_slot(db)
    assert value(db, "SELECT count(*) FROM ledger.skipped_slots") == 0


def test_due_slots_at_a_given_instant_has_no_side_effects(db):
    register(db, max_backfill=2)
    succeed_slot(db, "2026-01-01 00:00+00")
    before = state(db)
    assert due(db, at="2026-01-01 03:00+00") == [
        value(db, "SELECT '2026-01-01 02:15+00'::timestamptz"), value(db, "SELECT '2026-01-01 03:00+00'::timestamptz")]
    assert due(db, at="2026-01-01 00:44+00") == []
    assert state(db) == before


def test_a_paused_job_has_no_due_slots_and_start_due_run_says_paused(db):
    register(db)
    assert value(db, "SELECT ledger.pause_job(job => 'publish')") is True
    assert value(db, "SELECT ledger.pause_job('publish')") is False
    assert due(db) == []
    assert start_due(db)["outcome"] == "paused"
    assert one(db, "SELECT * FROM ledger.start_run('publish', 'h')")["outcome"] == "paused"
    assert value(db, "SELECT ledger.resume_job(job => 'publish')") is True
    assert value(db, "SELECT ledger.resume_job('publish')") is False
    assert start_due(db)["outcome"] == "started"


def test_a_new_slot_while_the_previous_run_is_live_is_skipped_overlap_not_a_failure(db):
    register(db, schedule="1 minute")
    slow = one(db, "SELECT * FROM ledger.start_run('publish', 'host-1', slot => %s)",
               (newest_slot(db) - timedelta(minutes=1),))
    skipped = start_due(db, owner="host-2")
    assert skipped["outcome"] == "skipped_overlap"
    assert skipped["holder"] == "host-1" and skipped["holder_expires_at"] == slow["expires_at"]
    counters = one(db, "SELECT * FROM ledger.job_counters WHERE job = 'publish'")
    assert (counters["skipped_overlap"], counters["failures"]) == (1, 0)


def test_the_slot_that_is_running_is_not_due_again(db):
    register(db, schedule="1 hour")
    assert start_due(db, owner="host-1")["outcome"] == "started"
    assert start_due(db, owner="host-2")["outcome"] == "nothing_due"


def test_two_runners_racing_for_one_slot_never_both_start(dsn, db):
    register(db, schedule="1 minute")
    for attempt in range(10):
        barrier = threading.Barrier(2)
        outcomes, errors = [], []

        def race(owner):
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    barrier.wait()
                    outcomes.append(conn.execute(
                        "SELECT outcome FROM ledger.start_due_run('publish', %s)", (owner,)).fetchone()[0])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=race, args=(f"host-{i}",)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(outcomes)[0] in ("already_done", "nothing_due", "skipped_overlap", "started")
        assert outcomes.count("started") <= 1, outcomes
        running = rows(db, "SELECT run_id, token FROM ledger.job_execution_log WHERE status = 'running'")
        for run in running:
            db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") >= 1
    assert rows(db, "SELECT * FROM ledger.overlaps") == []


def test_purge_log_keeps_the_newest_success_that_catch_up_starts_from(db):
    register(db, schedule="1 minute")
    for minutes in (30, 20, 10):
        succeed_slot(db, value(db, "SELECT date_trunc('minute', now()) - %s * interval '1 minute'", (minutes,)))
    newest = value(db, "SELECT max(slot) FROM ledger.job_execution_log")
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '100 days', "
               "completed_at = completed_at - interval '100 days'")
    assert value(db, "SELECT ledger.purge_log(older_than => '90 days')") == 2
    assert value(db, "SELECT slot FROM ledger.job_execution_log") == newest
    assert value(db, "SELECT ledger.purge_log('90 days')") == 0


# (call, sqlstate, word the message must contain)
BAD = [
    ("ledger.register_job('j', 'every blue moon')", "22023", "schedule"),
    ("ledger.register_job('j', '61 * * * *')", "22023", "schedule"),
    ("ledger.register_job('j', '* * * *')", "22023", "schedule"),
    ("ledger.register_job('j', '0 0 31 2 *')", "22023", "schedule"),
    ("ledger.register_job('j', '0 * * * *', time_zone => 'Mars/Olympus')", "22023", "time_zone"),
    ("ledger.register_job('j', '45 minutes', max_backfill => 0)", "22023", "max_backfill"),
    # NULL time_zone or max_backfill: "keep what the job has" (0.1.0), not an error
    ("ledger.register_job('j', '45 minutes', late_after => '-1 second')", "22023", "late_after"),
    ("ledger.register_job('j', '45 minutes', pause_after_failures => 1001)", "22023", "pause_after_failures"),
    ("ledger.register_job('j', '45 minutes', ttl => '-1 minute')", "22023", "ttl"),
    ("ledger.register_job('j', '-45 minutes')", "22023", "schedule"),
    ("ledger.register_job(NULL, '45 minutes')", "22004", "job"),
    ("ledger.register_job('', '45 minutes')", "22023", "job"),
    ("ledger.due_slots('nobody')", "LD005", "nobody"),
    ("ledger.start_due_run('nobody', 'h')", "LD005", "nobody"),
    ("ledger.pause_job('nobody')", "LD005", "nobody"),
    ("ledger.resume_job('nobody')", "LD005", "nobody"),
    ("ledger.start_due_run('unscheduled', 'h')", "22023", "job"),
    ("ledger.due_slots('publish', 'infinity')", "22023", "at"),
    ("ledger.start_due_run('publish', NULL)", "22004", "owner"),
    ("ledger.purge_log(NULL)", "22004", "older_than"),
    ("ledger.purge_log('-1 day')", "22023", "older_than"),
]


@pytest.mark.parametrize(("call", "sqlstate", "word"), BAD, ids=[b[0][:60] for b in BAD])
def test_bad_schedule_input_raises_a_documented_sqlstate_and_changes_nothing(db, call, sqlstate, word):
    register(db)
    register(db, job="unscheduled", schedule=None, ttl="1 minute")
    start_due(db)
    before = state(db)
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"SELECT * FROM {call}")
    assert caught.value.sqlstate == sqlstate
    assert word in caught.value.diag.message_primary
    if sqlstate == "LD005":
        assert json.loads(caught.value.diag.message_detail) == {"job": "nobody"}
    assert state(db) == before
