"""Reporting views: job_status, job_counters, run_stats, ttl_advice, alerts."""

import time
from datetime import timedelta

from sqlhelp import one, rows, value


def run(db, job, owner="h", ttl="1 hour", fail=None, slot=None):
    started = one(db, "SELECT * FROM ledger.start_run(job => %s, owner => %s, ttl => %s, slot => %s)",
                  (job, owner, ttl, slot))
    if fail is None:
        db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    else:
        db.execute("SELECT ledger.fail_run(%s, %s, %s)", (started["run_id"], started["token"], fail))
    return started


def backdate(db, run_id, seconds):
    """Make a finished run last `seconds` (as superuser: tests only)."""
    db.execute("UPDATE ledger.job_execution_log SET started_at = completed_at - %s * interval '1 second' "
               "WHERE run_id = %s", (seconds, run_id))


def test_job_status_shows_lease_last_run_success_running_run_and_counters(db):
    db.execute("SELECT ledger.register_job('report', '1 hour', ttl => '10 minutes')")
    run(db, "report")
    run(db, "report", fail="boom")
    running = one(db, "SELECT * FROM ledger.start_run('report', 'host-9')")
    status = one(db, "SELECT * FROM ledger.job_status WHERE job = 'report'")
    assert status["holder"] == "host-9" and status["token"] == running["token"]
    assert status["running_run_id"] == running["run_id"] and status["running_for"] >= timedelta(0)
    assert status["last_run_id"] == running["run_id"] and status["last_status"] == "running"
    assert status["last_success_at"] is not None
    assert status["consecutive_failures"] == 1
    assert status["next_slot"] > value(db, "SELECT now()")
    assert status["overdue"] is False
    assert (status["runs_started"], status["successes"], status["failures"]) == (3, 1, 1)


def test_job_status_lists_unregistered_jobs_that_hold_leases(db):
    db.execute("SELECT ledger.acquire('adhoc', 'h', '1 minute')")
    status = one(db, "SELECT * FROM ledger.job_status WHERE job = 'adhoc'")
    assert status["holder"] == "h" and status["schedule"] is None and status["overdue"] is False


def test_a_scheduled_job_whose_slots_are_missed_is_overdue_and_alerted_once_by_its_state(db):
    db.execute("SELECT ledger.register_job('nightly', '1 minute', ttl => '1 minute')")
    # registered long ago, never ran since
    db.execute("UPDATE ledger.jobs SET created_at = now() - interval '1 hour'")
    assert value(db, "SELECT overdue FROM ledger.job_status WHERE job = 'nightly'") is True
    # one alert, its state (overdue is no alert of its own: it is late or down)
    assert [(r["alert"]) for r in rows(db, "SELECT alert FROM ledger.alerts WHERE job = 'nightly'")] == ["down"]
    # a run that crashed (its lease expired) is no progress: the crash is the job's state now
    db.execute("SELECT ledger.start_due_run('nightly', 'h', ttl => '10 milliseconds')")
    time.sleep(0.05)
    assert value(db, "SELECT state FROM ledger.job_status WHERE job = 'nightly'") == "crashed"
    # a live run is progress
    db.execute("SELECT ledger.start_due_run('nightly', 'h2')")
    assert value(db, "SELECT overdue FROM ledger.job_status WHERE job = 'nightly'") is False
    db.execute("SELECT ledger.pause_job('nightly')")
    assert value(db, "SELECT overdue FROM ledger.job_status WHERE job = 'nightly'") is False


def test_run_stats_counts_runs_and_duration_percentiles_of_successes(db):
    for seconds in (10, 20, 30, 40):
        backdate(db, run(db, "etl")["run_id"], seconds)
    run(db, "etl", fail="x")
    stats = one(db, "SELECT * FROM ledger.run_stats WHERE job = 'etl'")
    assert (stats["runs"], stats["successes"], stats["failures"]) == (5, 4, 1)
    assert float(stats["failure_rate"]) == 0.2
    assert stats["p50_duration"] == timedelta(seconds=25)
    assert stats["max_duration"] == timedelta(seconds=40)


def test_ttl_advice_verdicts(db):
    cases = {"short": ("1 minute", 60), "long": ("1 hour", 60), "fine": ("100 seconds", 60)}
    for job, (ttl, seconds) in cases.items():
        db.execute("SELECT ledger.register_job(%s, ttl => %s)", (job, ttl))
        for _ in range(5):  # no advice before 5 successes
            backdate(db, run(db, job, ttl=ttl)["run_id"], seconds)
    db.execute("SELECT ledger.register_job('fresh', ttl => '1 minute')")
    advice = {r["job"]: r for r in rows(db, "SELECT * FROM ledger.ttl_advice")}
    assert {job: advice[job]["verdict"] for job in advice} == {
        "short": "too_short", "long": "too_long", "fine": "ok", "fresh": "no_data"}
    assert advice["fine"]["recommended_min"] == timedelta(seconds=90)
    assert advice["fine"]["recommended_max"] == timedelta(seconds=120)
    assert advice["fine"]["renew_every"] == timedelta(seconds=100 / 3)
    assert value(db, "SELECT count(*) FROM ledger.alerts WHERE alert = 'ttl_too_short'") == 1


def test_alerts_report_failures_in_a_row_and_long_runs(db):
    for _ in range(3):
        run(db, "flaky", fail="boom")
    done = run(db, "slow")["run_id"]
    backdate(db, done, 1)
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '1 hour', "
               "completed_at = completed_at - interval '1 hour' WHERE run_id = %s", (done,))
    one(db, "SELECT * FROM ledger.start_run('slow', 'h', '1 hour')")
    db.execute("UPDATE ledger.job_execution_log SET started_at = now() - interval '10 seconds' "
               "WHERE job = 'slow' AND status = 'running'")
    alerts = {(r["alert"], r["job"]) for r in rows(db, "SELECT * FROM ledger.alerts")}
    assert ("failing", "flaky") in alerts  # its state; no second alert for the same failures
    assert not any(alert == "consecutive_failures" for alert, _ in alerts)
    assert ("long_running", "slow") in alerts
    assert not any(alert == "overlap" for alert, _ in alerts)


def test_views_are_readable_by_the_reader_role(db):
    db.execute("SELECT ledger.register_job('r', '5 minutes', ttl => '1 minute')")
    run(db, "r")
    db.execute("SET ROLE ledger_reader")
    for view in ("job_status", "job_counters", "run_stats", "ttl_advice", "alerts", "overlaps"):
        db.execute(f"SELECT * FROM ledger.{view}").fetchall()
