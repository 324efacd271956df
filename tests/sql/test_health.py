"""Job health (issue 12): ledger.job_health, the alerts derived from it,
duration bounds, auto-pause, partial re-registration, the duplicate audit."""

from __future__ import annotations

import json
import re
import shlex
import threading
import time
from datetime import timedelta

import psycopg
import pytest

from clihelp import jobledger
from repo import DOCS
from sqlhelp import one, rows, value
from waiting import wait_for


def health(db: psycopg.Connection, job: str) -> dict:
    return one(db, "SELECT * FROM ledger.job_health WHERE job = %s", (job,))


def alerts(db: psycopg.Connection, job: str) -> dict[str, dict]:
    return {r["alert"]: r for r in rows(db, "SELECT * FROM ledger.alerts WHERE job = %s", (job,))}


def run_once(db: psycopg.Connection, job: str, *, fail: str | None = None, ttl: str = "1 minute",
             seconds: float = 0) -> dict:
    started = one(db, "SELECT * FROM ledger.start_run(job => %s, owner => 'h', ttl => %s)", (job, ttl))
    assert started["outcome"] == "started", started
    if seconds:
        time.sleep(seconds)
    if fail is None:
        db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    else:
        db.execute("SELECT ledger.fail_run(%s, %s, %s)", (started["run_id"], started["token"], fail))
    return started


def wait_state(db: psycopg.Connection, job: str, state: str, timeout: float = 30) -> dict:
    """Until ledger.job_health says ``state`` for ``job``; a timeout names the states seen on the way."""
    seen: list[str] = []

    def reached() -> dict | None:
        row = health(db, job)
        if not seen or seen[-1] != row["state"]:
            seen.append(row["state"])
        return row if row["state"] == state else None

    return wait_for(reached, timeout, f"job {job} to become {state}", explain=lambda: f"states seen {seen}")


def test_stopping_every_runner_makes_a_scheduled_job_late_then_down_with_its_alert(db, connect):
    db.execute("SELECT ledger.register_job('beat', '1 second', ttl => '30 seconds', late_after => '1 second')")
    assert health(db, "beat")["state"] == "never_run"
    stop = threading.Event()

    def runner() -> None:  # what `jobledger run` does each second, on two "hosts"
        conn = connect()
        while not stop.is_set():
            for owner in ("host-1", "host-2"):
                started = one(conn, "SELECT * FROM ledger.start_due_run('beat', %s)", (owner,))
                if started["outcome"] == "started":
                    conn.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
            time.sleep(0.05)

    thread = threading.Thread(target=runner)
    thread.start()
    try:
        wait_state(db, "beat", "ok")
        time.sleep(1.5)
        row = health(db, "beat")
        assert row["state"] in ("ok", "running") and row["missed_slots"] == 0
        assert not {"late", "down"} & set(alerts(db, "beat"))
    finally:
        stop.set()
        thread.join()
    stopped_at = value(db, "SELECT now()")
    late = wait_state(db, "beat", "late")
    assert late["missed_slots"] in (1, 2) and late["missed_slots_capped"] is False
    assert "late" in alerts(db, "beat") and alerts(db, "beat")["late"]["since"] == late["since"]
    down = wait_state(db, "beat", "down")
    assert down["missed_slots"] >= 3 and down["last_success_age"] > timedelta(seconds=3)
    assert down["since"] > late["since"] > stopped_at - timedelta(seconds=1)
    found = alerts(db, "beat")
    assert "down" in found and "late" not in found and found["down"]["since"] == down["since"]
    assert "slots missed since the last success" in found["down"]["message"]
    # a runner back: one run catches up (max_backfill 1), and the job is ok again
    started = one(db, "SELECT * FROM ledger.start_due_run('beat', 'host-3')")
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    assert health(db, "beat")["state"] == "ok"
    assert not {"late", "down"} & set(alerts(db, "beat"))


def test_down_after_bounds_the_time_without_a_success(db):
    db.execute("SELECT ledger.register_job('adhoc', ttl => '1 minute', down_after => '1 second')")
    run_once(db, "adhoc")
    assert health(db, "adhoc")["state"] == "ok" and health(db, "adhoc")["missed_slots"] is None
    down = wait_state(db, "adhoc", "down", timeout=10)
    assert down["reason"] == "no success for over 00:00:01"
    assert alerts(db, "adhoc")["down"]["since"] == down["last_success_at"] + timedelta(seconds=1)


def test_a_cron_jobs_missed_slots_are_counted_not_listed_and_capped(db):
    db.execute("SELECT ledger.register_job('cron', '*/5 * * * *', ttl => '1 minute', time_zone => 'Europe/Berlin')")
    db.execute("UPDATE ledger.jobs SET created_at = now() - interval '10 years'")
    started = time.monotonic()
    row = health(db, "cron")
    # Capped, not counted one by one (missed_slots_capped below); a bound for a hang, not a speed: the
    # suite runs in parallel, on machines whose cores are busy.
    assert time.monotonic() - started < 30
    # a cron count is not evaluated by a read: at least the slots that make the job down
    assert row["state"] == "down" and row["missed_slots_capped"] is True
    assert row["missed_slots"] == 3 and row["reason"] == "at least 3 slots missed since the last success"
    db.execute("SELECT ledger.register_job('every', '5 minutes', ttl => '1 minute')")
    db.execute("UPDATE ledger.jobs SET created_at = now() - interval '10 years' WHERE job = 'every'")
    row = health(db, "every")
    assert row["missed_slots_capped"] is False and row["missed_slots"] > 10 * 365 * 288


def test_a_success_shorter_than_min_runtime_raises_too_fast(db):
    db.execute("SELECT ledger.register_job('quick', ttl => '1 minute', min_runtime => '1 hour')")
    run_once(db, "quick")
    found = alerts(db, "quick")
    assert "too_fast" in found and "under its min_runtime 01:00:00" in found["too_fast"]["message"]
    assert found["too_fast"]["since"] == value(db, "SELECT last_success_at FROM ledger.counters WHERE job = 'quick'")
    assert health(db, "quick")["last_success_duration"] < timedelta(hours=1)
    db.execute("SELECT ledger.register_job('quick', min_runtime => '1 millisecond')")
    run_once(db, "quick", seconds=0.01)
    assert "too_fast" not in alerts(db, "quick")


def test_a_run_past_max_runtime_is_overrun_with_its_alert(db):
    db.execute("SELECT ledger.register_job('slow', ttl => '1 minute', max_runtime => '200 milliseconds')")
    started = one(db, "SELECT * FROM ledger.start_run('slow', 'h')")
    assert health(db, "slow")["state"] == "running"
    row = wait_state(db, "slow", "overrun", timeout=10)
    assert row["since"] == value(db, "SELECT started_at FROM ledger.job_execution_log WHERE run_id = %s",
                                 (started["run_id"],)) + timedelta(milliseconds=200)
    assert alerts(db, "slow")["overrun"]["run_id"] == started["run_id"]
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    assert health(db, "slow")["state"] == "ok" and "overrun" not in alerts(db, "slow")


def test_failing_then_pause_after_failures_pauses_the_job_in_the_transaction_of_the_end(db):
    db.execute("SELECT ledger.register_job('flaky', ttl => '1 minute', pause_after_failures => 2)")
    run_once(db, "flaky")
    run_once(db, "flaky", fail="boom")
    row = health(db, "flaky")
    assert row["state"] == "failing" and row["since"] == row["last_success_at"]
    assert alerts(db, "flaky")["failing"]["message"] == "1 failure in a row"
    with db.transaction():
        run_once(db, "flaky", fail="boom")
        assert value(db, "SELECT pause_reason FROM ledger.jobs WHERE job = 'flaky'") == "failures"
    row = health(db, "flaky")
    assert (row["state"], row["pause_reason"], row["reason"]) == ("paused", "failures", "paused after 2 failures in a row")
    assert alerts(db, "flaky")["paused"]["since"] == row["since"]
    assert one(db, "SELECT outcome FROM ledger.start_run('flaky', 'h')")["outcome"] == "paused"
    assert value(db, "SELECT ledger.resume_job('flaky')") is True
    assert health(db, "flaky")["state"] == "failing" and "paused" not in alerts(db, "flaky")
    # an operator's pause is paused too, but no alert
    db.execute("SELECT ledger.pause_job('flaky')")
    assert health(db, "flaky")["pause_reason"] == "operator" and "paused" not in alerts(db, "flaky")


def test_a_lost_lease_counts_toward_pause_after_failures(db):
    db.execute("SELECT ledger.register_job('lost', ttl => '1 minute', pause_after_failures => 1)")
    db.execute("SELECT ledger.start_run('lost', 'h', ttl => '1 millisecond')")
    time.sleep(0.01)
    assert value(db, "SELECT ledger.reap_expired('lost')") == 1
    assert value(db, "SELECT pause_reason FROM ledger.jobs WHERE job = 'lost'") == "failures"


def test_re_registering_changes_only_the_options_given(db):
    first = one(db, "SELECT * FROM ledger.register_job('etl', '30 2 * * *', '1 hour', 5, 'Europe/Berlin', "
                    "late_after => '10 minutes', max_runtime => '2 hours', pause_after_failures => 3)")
    db.execute("SELECT ledger.pause_job('etl')")
    run_at = value(db, "SELECT created_at FROM ledger.jobs WHERE job = 'etl'")
    again = one(db, "SELECT * FROM ledger.register_job('etl', max_backfill => 2)")
    assert again["max_backfill"] == 2 and again["updated_at"] > first["updated_at"]
    for column in ("schedule", "ttl", "time_zone", "late_after", "max_runtime", "pause_after_failures",
                   "schedule_spec", "created_at"):
        assert again[column] == first[column], column
    assert again["paused"] is True and again["pause_reason"] == "operator" and again["created_at"] == run_at
    # 0 clears a bound; a new zone re-reads the kept schedule
    cleared = one(db, "SELECT * FROM ledger.register_job('etl', max_runtime => '0', pause_after_failures => 0, "
                      "time_zone => 'America/New_York')")
    assert cleared["max_runtime"] is None and cleared["pause_after_failures"] is None
    assert cleared["late_after"] == timedelta(minutes=10) and cleared["schedule"] == "30 2 * * *"
    assert cleared["schedule_spec"] != first["schedule_spec"] or cleared["time_zone"] == "America/New_York"
    assert value(db, "SELECT ledger._slot_at_or_before(schedule_spec, time_zone, '2026-06-02 12:00+00') "
                     "FROM ledger.jobs WHERE job = 'etl'").isoformat() == "2026-06-02T06:30:00+00:00"
    # a first registration's defaults
    fresh = one(db, "SELECT * FROM ledger.register_job('fresh')")
    assert (fresh["max_backfill"], fresh["time_zone"], fresh["schedule"], fresh["ttl"]) == (1, "UTC", None, None)


@pytest.mark.parametrize("argument, bad", [
    ("late_after", "-1 second"), ("down_after", "1 month"), ("min_runtime", "366 days"),
    ("max_runtime", "1 day -1 hour"), ("pause_after_failures", -1), ("pause_after_failures", 1001)])
def test_bad_bounds_are_refused_naming_the_argument_and_change_nothing(db, argument, bad):
    db.execute("SELECT ledger.register_job('b', ttl => '1 minute')")
    before = one(db, "SELECT * FROM ledger.jobs WHERE job = 'b'")
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"SELECT ledger.register_job('b', {argument} => %s)", (bad,))
    assert caught.value.sqlstate == "22023"
    assert json.loads(caught.value.diag.message_detail or "{}")["argument"] == argument
    assert one(db, "SELECT * FROM ledger.jobs WHERE job = 'b'") == before


def test_ttl_advice_has_a_floor_and_waits_for_five_successes(db):
    db.execute("SELECT ledger.register_job('tiny', ttl => '1 minute')")
    for n in range(5):
        run_once(db, "tiny")
        advice = one(db, "SELECT * FROM ledger.ttl_advice WHERE job = 'tiny'")
        assert advice["successes"] == n + 1
        if n < 4:
            assert advice["verdict"] == "no_data" and advice["recommended_min"] is None
    assert advice["recommended_min"] == timedelta(seconds=1) and advice["recommended_max"] == timedelta(seconds=1)
    assert advice["verdict"] == "too_long"


def test_the_duplicate_audit_is_empty_and_would_show_a_slot_or_key_that_succeeded_twice(db):
    db.execute("SELECT ledger.register_job('d', ttl => '1 minute')")
    started = one(db, "SELECT * FROM ledger.start_run('d', 'h', slot => '2026-01-01', idempotency_key => 'k')")
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    assert rows(db, "SELECT * FROM ledger.duplicates") == []
    with db.transaction(force_rollback=True):
        db.execute("DROP INDEX ledger.job_execution_log_one_per_slot")
        db.execute("DROP INDEX ledger.job_execution_log_one_per_key")
        db.execute("ALTER TABLE ledger.job_execution_log DROP CONSTRAINT log_one_run_per_token")
        db.execute("INSERT INTO ledger.job_execution_log (job, owner, token, slot, idempotency_key, status, "
                   "started_at, completed_at) SELECT job, owner, token, slot, idempotency_key, status, started_at, "
                   "completed_at FROM ledger.job_execution_log WHERE run_id = %s", (started["run_id"],))
        found = {(r["kind"], r["value"]) for r in rows(db, "SELECT * FROM ledger.duplicates")}
        assert found == {("slot", "2026-01-01 00:00:00+00"), ("idempotency_key", "k")}


def test_job_health_reads_per_job_not_per_log_row(db):
    plan = "\n".join(r[0] for r in db.execute("EXPLAIN SELECT * FROM ledger.job_health").fetchall())
    assert "job_execution_log" not in plan


def test_jobledger_register_changes_only_the_options_given(dsn):
    done = jobledger("register", "cli-job", "--schedule", "15 minutes", "--ttl", "5m", "--max-runtime", "1h",
                     "--pause-after-failures", "3", "--late-after", "2m", dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert "max runtime 1h" in done.stdout and "pause after 3 failures" in done.stdout
    done = jobledger("register", "cli-job", "--down-after", "1d", "--json", dsn=dsn)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)
    assert job["schedule"] == "15 minutes" and job["pause_after_failures"] == 3 and job["max_backfill"] == 1
    assert job["down_after"] is not None and job["max_runtime"] is not None
    done = jobledger("register", "cli-job", "--max-runtime", "0", "--json", dsn=dsn)
    assert json.loads(done.stdout)["max_runtime"] is None
    help_text = jobledger("register", "--help").stdout
    for option in ("--late-after", "--down-after", "--min-runtime", "--max-runtime", "--pause-after-failures"):
        assert option in help_text


def test_the_cli_page_example_runs_and_prints_what_it_shows(dsn):
    page = (DOCS / "cli.md").read_text()
    [block] = re.findall(r"<!-- executed by tests/sql/test_health\.py[^>]*-->\n```console\n(.*?)```", page, re.S)
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line.rstrip())
    for command, shown in steps:
        words = shlex.split(command)
        assert words[0] == "jobledger"
        result = jobledger(*words[1:], dsn=dsn)
        if "--json" in words:  # a registered job that never ran: its one row
            assert result.returncode == 0, result.stderr
            [row] = json.loads(result.stdout)
            assert (row["job"], row["state"], row["late_after"]) == ("backup", "never_run", 900)
            continue
        assert result.returncode == 0, (command, result.stderr)
        assert [line.rstrip() for line in result.stdout.splitlines()] == shown, command


def test_jobledger_health_exits_1_for_a_job_in_trouble(dsn, db):
    db.execute("SELECT ledger.register_job('fine', ttl => '1 minute')")
    db.execute("SELECT ledger.register_job('sick', ttl => '1 minute')")
    run_once(db, "fine")
    run_once(db, "sick", fail="boom")
    result = jobledger("health", "fine", dsn=dsn)
    assert result.returncode == 0 and "fine" in result.stdout and "ok" in result.stdout, result.stderr
    result = jobledger("health", dsn=dsn)
    assert result.returncode == 1 and "failing" in result.stdout and "1 failure in a row" in result.stdout
    result = jobledger("health", "nope", dsn=dsn)
    assert result.returncode == 1 and "nope" in result.stderr


def test_jobledger_run_stops_cmd_at_the_jobs_max_runtime_the_smaller_bound_winning(dsn, db):
    db.execute("SELECT ledger.register_job('capped', ttl => '1 minute', max_runtime => '1 second')")
    result = jobledger("run", "capped", "--timeout", "1m", "--grace", "0.5s", "--", "sleep", "30", dsn=dsn)
    assert result.returncode == 123, result.stderr
    assert "ran longer than 1s (the job's max_runtime): stopping it" in result.stderr
    [run] = rows(db, "SELECT * FROM ledger.job_execution_log WHERE job = 'capped'")
    assert run["status"] == "failure" and "(the job's max_runtime)" in run["error"]
    assert run["detail"]["timeout_from"] == "max_runtime" and run["detail"]["timeout_seconds"] == 1.0
    # --timeout smaller than max_runtime: --timeout wins
    db.execute("SELECT ledger.register_job('capped', max_runtime => '1 hour')")
    result = jobledger("run", "capped", "--timeout", "1s", "--grace", "0.5s", "--", "sleep", "30", dsn=dsn)
    assert result.returncode == 123 and "ran longer than 1s: stopping it" in result.stderr, result.stderr


def test_the_duplicates_metric_counts_what_the_audit_would_show(dsn, db):
    from ledger.connect import connect as open_connection
    from ledger.metrics import read_snapshot

    db.execute("SELECT ledger.register_job('d', ttl => '1 minute')")
    started = one(db, "SELECT * FROM ledger.start_run('d', 'h', slot => '2026-01-01')")
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    with open_connection(dsn) as conn:
        assert read_snapshot(conn, audit=True).duplicates == 0  # an audit: read when asked
    from ledger import queries
    with db.transaction(force_rollback=True):
        db.execute("DROP INDEX ledger.job_execution_log_one_per_slot")
        db.execute("ALTER TABLE ledger.job_execution_log DROP CONSTRAINT log_one_run_per_token")
        db.execute("INSERT INTO ledger.job_execution_log (job, owner, token, slot, status, started_at, completed_at) "
                   "SELECT job, owner, token, slot, status, started_at, completed_at FROM ledger.job_execution_log")
        assert value(db, queries.DUPLICATE_COUNT) == 1
