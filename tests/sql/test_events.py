"""Events (issue 12, point 8) in SQL: ledger.events written by triggers for
every state change of a run or a job, alert changes recorded by
ledger.sync_alerts, configure_events switching the run events and
pg_notify, and the bounded retention."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import psycopg
import pytest

from sqlhelp import one, rows, value


def events(db: psycopg.Connection, job: str | None = None) -> list[dict]:
    if job is None:
        return rows(db, "SELECT * FROM ledger.events ORDER BY event_id")
    return rows(db, "SELECT * FROM ledger.events WHERE job = %s ORDER BY event_id", (job,))


def kinds(db: psycopg.Connection, job: str) -> list[str]:
    return [e["kind"] for e in events(db, job)]


def started(db: psycopg.Connection, job: str, owner: str = "h", ttl: str = "1 hour", **named: str) -> dict:
    extra = "".join(f", {k} => %({k})s" for k in named)
    row = one(db, f"SELECT * FROM ledger.start_run(job => %(job)s, owner => %(owner)s, ttl => %(ttl)s{extra})",
              {"job": job, "owner": owner, "ttl": ttl, **named})
    assert row["outcome"] == "started", row
    return row


def triggers_enabled(db: psycopg.Connection) -> dict[str, bool]:
    return {r["tgname"]: r["tgenabled"] != "D" for r in rows(
        db, "SELECT tgname, tgenabled FROM pg_trigger WHERE tgname IN "
            "('job_execution_log_started_event', 'job_execution_log_ended_event', 'events_notify')")}


# ------------------------------------------------------------------ what is recorded


def test_a_run_records_started_then_ended_with_its_owner_token_and_duration(db):
    run = started(db, "nightly", owner="host-1", slot=None, idempotency_key="2026-12-01")
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    first, last = events(db, "nightly")
    assert (first["kind"], first["run_id"]) == ("run_started", run["run_id"])
    assert first["detail"] == {"owner": "host-1", "token": run["token"], "idempotency_key": "2026-12-01"}
    assert (last["kind"], last["run_id"], last["detail"]["status"]) == ("run_ended", run["run_id"], "success")
    assert last["event_id"] > first["event_id"] and "error" not in last["detail"]
    log = one(db, "SELECT * FROM ledger.job_execution_log WHERE run_id = %s", (run["run_id"],))
    # the events are dated as the log dates the run
    assert (first["at"], last["at"]) == (log["started_at"], log["completed_at"])
    assert last["detail"]["seconds"] == pytest.approx((log["completed_at"] - log["started_at"]).total_seconds(),
                                                      abs=0.001)


def test_a_failure_a_cancel_a_loss_and_a_supersession_each_have_their_kind(db):
    run = started(db, "j")
    db.execute("SELECT ledger.fail_run(%s, %s, %s)", (run["run_id"], run["token"], "x" * 500))
    ended = events(db, "j")[-1]
    assert (ended["kind"], ended["detail"]["status"], ended["detail"]["reason"]) == ("run_ended", "failure", "error")
    assert ended["detail"]["error"] == "x" * 200  # bounded: the log has the whole error

    run = started(db, "j")
    db.execute("SELECT ledger.cancel_run(%s, %s, 'stopped by hand')", (run["run_id"], run["token"]))
    assert events(db, "j")[-1]["kind"] == "run_cancelled"

    run = started(db, "j")
    assert value(db, "SELECT ledger.request_cancel(%s)", (run["run_id"],)) is True
    asked = events(db, "j")[-1]
    assert (asked["kind"], asked["run_id"]) == ("cancel_requested", run["run_id"])
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (run["run_id"], run["token"])) is None
    assert events(db, "j")[-1]["kind"] == "run_cancelled"

    run = started(db, "j")
    db.execute("SELECT ledger.force_release('j')")
    lost = events(db, "j")[-1]
    assert (lost["kind"], lost["run_id"], lost["detail"]["reason"]) == ("run_lost", run["run_id"], "superseded")

    run = started(db, "j", ttl="1 millisecond")
    time.sleep(0.01)
    assert value(db, "SELECT ledger.reap_expired('j')") == 1
    lost = events(db, "j")[-1]
    assert (lost["kind"], lost["run_id"], lost["detail"]["reason"]) == ("run_lost", run["run_id"], "lease_expired")


def test_a_pause_and_a_resume_say_why_also_when_failures_paused_the_job(db):
    db.execute("SELECT ledger.register_job('flaky', ttl => '1 hour', pause_after_failures => 2)")
    db.execute("SELECT ledger.pause_job('flaky')")
    db.execute("SELECT ledger.pause_job('flaky')")  # already paused: no change, no event
    db.execute("SELECT ledger.resume_job('flaky')")
    for _ in range(2):
        run = started(db, "flaky")
        db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (run["run_id"], run["token"]))
    pauses = [(e["kind"], e["detail"]) for e in events(db, "flaky") if e["kind"].startswith("job_")]
    assert pauses == [("job_paused", {"reason": "operator"}), ("job_resumed", {"pause_reason": "operator"}),
                      ("job_paused", {"reason": "failures"})]
    # in the transaction of the end that paused it: right after its run_ended
    assert kinds(db, "flaky")[-2:] == ["run_ended", "job_paused"]


def test_a_change_that_rolls_back_leaves_no_event(connect):
    db = connect()
    tx = connect(autocommit=False)
    started(tx, "j")
    tx.execute("SELECT ledger.register_job('k', ttl => '1 hour')")
    tx.execute("SELECT ledger.pause_job('k')")
    assert kinds(tx, "j") == ["run_started"]  # visible inside
    tx.rollback()
    assert events(db) == []


def test_a_write_that_bypasses_the_functions_still_records_its_event(db):
    run = started(db, "j")
    # a superuser's hand edit (the test's role is one): the trigger sees it too
    db.execute("UPDATE ledger.job_execution_log SET status = 'success', completed_at = clock_timestamp() "
               "WHERE run_id = %s", (run["run_id"],))
    assert kinds(db, "j") == ["run_started", "run_ended"]


def test_events_outlive_the_jobs_registration_and_history(db):
    db.execute("SELECT ledger.register_job('gone', ttl => '1 hour')")
    run = started(db, "gone")
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    assert value(db, "SELECT ledger.unregister_job('gone', with_history => true)") is True
    assert kinds(db, "gone") == ["run_started", "run_ended"]


# ------------------------------------------------------------------ configure_events


def test_switching_run_events_off_stops_the_two_run_events_only_and_disables_their_triggers(db):
    assert triggers_enabled(db) == {"job_execution_log_started_event": True,
                                    "job_execution_log_ended_event": True, "events_notify": False}
    settings = one(db, "SELECT * FROM ledger.configure_events(run_events => false)")
    assert (settings["run_events"], settings["notify"], settings["retention"], settings["max_events"]) == (
        False, False, timedelta(days=7), 1_000_000)
    assert triggers_enabled(db) == {"job_execution_log_started_event": False,
                                    "job_execution_log_ended_event": False, "events_notify": False}
    run = started(db, "j")
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    run = started(db, "j")
    db.execute("SELECT ledger.force_release('j')")
    assert kinds(db, "j") == ["run_lost"]  # the rare events stay
    # the options not given stay as they were
    settings = one(db, "SELECT * FROM ledger.configure_events(retention => '2 days')")
    assert (settings["run_events"], settings["retention"]) == (False, timedelta(hours=48))
    one(db, "SELECT * FROM ledger.configure_events(run_events => true)")
    started(db, "j")
    assert kinds(db, "j")[-1] == "run_started"


def test_configure_events_with_no_arguments_brings_the_triggers_back_in_line_with_the_table(db):
    # a restore of the table from a dump, or a hand edit, leaves them apart
    db.execute("UPDATE ledger.event_settings SET notify = true, run_events = false")
    assert triggers_enabled(db)["events_notify"] is False
    before = value(db, "SELECT updated_at FROM ledger.event_settings")
    settings = one(db, "SELECT * FROM ledger.configure_events()")
    assert settings["updated_at"] == before  # nothing was changed, only applied
    assert triggers_enabled(db) == {"job_execution_log_started_event": False,
                                    "job_execution_log_ended_event": False, "events_notify": True}


@pytest.mark.parametrize(("argument", "bad"), [
    ("retention", "1 month"), ("retention", "-1 hour"), ("retention", "0"), ("retention", "36501 days"),
    ("max_events", 999), ("max_events", 1_000_000_001),
])
def test_bad_settings_are_refused_naming_the_argument_and_change_nothing(db, argument, bad):
    before = one(db, "SELECT * FROM ledger.event_settings")
    cast = "interval" if argument == "retention" else "bigint"
    with pytest.raises(psycopg.errors.InvalidParameterValue) as raised:
        db.execute(f"SELECT ledger.configure_events(notify => true, {argument} => %s::{cast})", (bad,))
    assert f"argument {argument}" in raised.value.diag.message_primary
    assert json.loads(raised.value.diag.message_detail)["argument"] == argument
    assert one(db, "SELECT * FROM ledger.event_settings") == before
    assert triggers_enabled(db)["events_notify"] is False


def test_with_notify_on_each_event_is_notified_at_commit_with_its_id(db, connect):
    listener = connect()
    listener.execute("LISTEN ledger_events")
    run = started(db, "quiet")  # notify is off by default
    one(db, "SELECT * FROM ledger.configure_events(notify => true)")
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    ended = events(db, "quiet")[-1]
    got = next(listener.notifies(timeout=30, stop_after=1))
    assert got.channel == "ledger_events"
    # the first notification is the end's: the start, with notify off, sent none
    assert json.loads(got.payload) == {"event_id": ended["event_id"], "kind": "run_ended", "job": "quiet",
                                       "run_id": run["run_id"]}
    tx = connect(autocommit=False)
    started(tx, "later")
    tx.rollback()
    db.execute("SELECT ledger.register_job('marker', ttl => '1 hour')")
    db.execute("SELECT ledger.pause_job('marker')")
    got = next(listener.notifies(timeout=30, stop_after=1))
    assert json.loads(got.payload)["job"] == "marker"  # the rolled-back start notified nothing


# ------------------------------------------------------------------ retention


def test_the_inserts_themselves_keep_the_table_within_max_events(db):
    one(db, "SELECT * FROM ledger.configure_events(max_events => 1000)")
    db.execute("SELECT ledger.register_job('toggle', ttl => '1 hour')")
    db.execute("""DO $$ BEGIN FOR i IN 1..1500 LOOP
                    PERFORM ledger.pause_job('toggle'); PERFORM ledger.resume_job('toggle');
                  END LOOP; END $$""")
    newest, count, oldest = one(db, "SELECT max(event_id), count(*), min(event_id) FROM ledger.events").values()
    assert newest == 3000
    # at most max_events, plus what arrived since the last purge (< 500)
    assert 1000 <= count < 1500 and oldest > newest - 1500


def test_purge_events_deletes_what_is_past_the_retention_and_keeps_the_rest(db):
    one(db, "SELECT * FROM ledger.configure_events(retention => '1 hour')")
    for _ in range(3):
        run = started(db, "j")
        db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    db.execute("UPDATE ledger.events SET at = at - interval '2 hours' WHERE event_id <= 4")
    assert value(db, "SELECT ledger.purge_events()") == 4
    assert [e["event_id"] for e in events(db)] == [5, 6]
    assert value(db, "SELECT ledger.purge_events()") == 0


# ------------------------------------------------------------------ sync_alerts


def alert_events(db: psycopg.Connection) -> list[tuple[str, str, str]]:
    return [(e["kind"], e["job"], e["detail"]["alert"]) for e in rows(
        db, "SELECT * FROM ledger.sync_alerts()")]


def test_sync_alerts_records_an_alert_once_when_raised_and_once_when_cleared(db):
    db.execute("SELECT ledger.register_job('flaky', ttl => '1 hour', pause_after_failures => 3)")
    run = started(db, "flaky")
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (run["run_id"], run["token"]))
    raised = rows(db, "SELECT * FROM ledger.sync_alerts()")
    assert [(e["kind"], e["detail"]["alert"]) for e in raised] == [("alert_raised", "failing")]
    assert raised[0]["detail"]["message"] == "1 failure in a row"
    assert alert_events(db) == []  # nothing changed since
    # the message moves on: still the same alert
    run = started(db, "flaky")
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (run["run_id"], run["token"]))
    assert alert_events(db) == []
    run = started(db, "flaky")
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    cleared = rows(db, "SELECT * FROM ledger.sync_alerts()")
    assert [(e["kind"], e["detail"]["alert"]) for e in cleared] == [("alert_cleared", "failing")]
    assert cleared[0]["detail"]["raised_event"] == raised[0]["event_id"]
    assert cleared[0]["detail"]["message"] == "1 failure in a row"
    # sync's events are events like the others, in the table
    assert [e["kind"] for e in events(db, "flaky") if e["kind"].startswith("alert")] == [
        "alert_raised", "alert_cleared"]
    assert value(db, "SELECT count(*) FROM ledger.alert_state") == 0


def test_stopping_every_runner_records_late_then_down_then_cleared_with_no_pinger(db):
    db.execute("SELECT ledger.register_job('beat', '1 second', ttl => '30 seconds', late_after => '1 second')")
    for _ in range(2):  # two slots run, then every runner stops
        deadline = time.monotonic() + 30
        while True:
            run = one(db, "SELECT * FROM ledger.start_due_run('beat', 'host-1')")
            if run["outcome"] == "started":
                db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
                break
            assert time.monotonic() < deadline, run
            time.sleep(0.05)
    seen: list[tuple[str, str]] = []
    deadline = time.monotonic() + 60
    while ("alert_raised", "down") not in seen:
        assert time.monotonic() < deadline, f"no down alert recorded; events so far {seen}"
        seen += [(e["kind"], e["detail"]["alert"]) for e in rows(db, "SELECT * FROM ledger.sync_alerts()")
                 if e["detail"]["alert"] in ("late", "down")]
        time.sleep(0.1)
    # late was raised first; down replaced it (a job has one health state)
    assert seen[0] == ("alert_raised", "late")
    assert seen.index(("alert_cleared", "late")) < seen.index(("alert_raised", "down"))
    run = one(db, "SELECT * FROM ledger.start_due_run('beat', 'host-2')")
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    assert ("alert_cleared", "beat", "down") in alert_events(db)


def test_concurrent_syncs_record_each_change_exactly_once(db, connect):
    db.execute("SELECT ledger.register_job('flaky', ttl => '1 hour')")
    barrier = threading.Barrier(4)
    found: list[list[str]] = []

    def sync() -> None:
        conn = connect()
        barrier.wait()
        found.append([e["kind"] for e in rows(conn, "SELECT * FROM ledger.sync_alerts()")])

    for round_ in range(10):  # a fixed number of races: raise, then clear
        run = started(db, "flaky")
        if round_ % 2 == 0:
            db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (run["run_id"], run["token"]))
        else:
            db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
        found.clear()
        threads = [threading.Thread(target=sync) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(map(tuple, found)) == [(), (), (), ("alert_raised" if round_ % 2 == 0 else "alert_cleared",)]
    assert [e["kind"] for e in events(db, "flaky") if e["kind"].startswith("alert")] == [
        "alert_raised", "alert_cleared"] * 5


def test_an_alert_about_a_run_is_told_apart_by_its_run(db):
    # two overrun runs of two jobs, and the overlap alert keyed per run: use overrun
    db.execute("SELECT ledger.register_job('slow', ttl => '1 hour', max_runtime => '1 millisecond')")
    run = started(db, "slow")
    time.sleep(0.01)
    [raised] = rows(db, "SELECT * FROM ledger.sync_alerts()")
    assert (raised["kind"], raised["detail"]["alert"], raised["run_id"]) == ("alert_raised", "overrun", run["run_id"])
    db.execute("SELECT ledger.force_release('slow')")
    second = started(db, "slow")
    time.sleep(0.01)
    changes = {(e["kind"], e["run_id"]) for e in rows(db, "SELECT * FROM ledger.sync_alerts()")
               if e["detail"]["alert"] == "overrun"}
    assert changes == {("alert_cleared", run["run_id"]), ("alert_raised", second["run_id"])}


def test_a_reader_may_read_the_events_but_not_sync_or_configure(db):
    run = started(db, "j")
    db.execute("SET ROLE ledger_reader")
    assert value(db, "SELECT count(*) FROM ledger.events WHERE run_id = %s", (run["run_id"],)) == 1
    for call in ("ledger.sync_alerts()", "ledger.configure_events(notify => true)", "ledger.purge_events()"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute(f"SELECT * FROM {call}")
