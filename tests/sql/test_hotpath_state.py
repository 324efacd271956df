"""The jobs' state in ledger.counters, kept by the writing functions, equals its recomputation from the log."""

import time

from sqlhelp import rows

STATE = """SELECT job, last_run_id, last_status, last_started_at, last_completed_at, last_success_started_at,
                  last_success_at, running_run_id, running_token, running_started_at, done_slot, longest_success,
                  consecutive_failures, next_due, latest_end, overlap_run_id FROM ledger.counters
             ORDER BY job"""


def assert_state_is_the_logs(db):
    kept = rows(db, STATE)
    db.execute("SELECT ledger._refresh_state(array_agg(job::text)) FROM ledger.counters")
    assert rows(db, STATE) == kept


def test_state_follows_starts_ends_takeovers_reaps_and_purges(db):
    db.execute("SELECT ledger.register_job('s', '1 minute', ttl => '1 hour', max_backfill => 5)")
    for outcome in ("complete", "fail", "fail", "complete", "cancel"):
        r = db.execute("SELECT run_id, token FROM ledger.start_run('a', 'o', '1 hour')").fetchone()
        db.execute({"complete": "SELECT ledger.complete_run(%s, %s)", "fail": "SELECT ledger.fail_run(%s, %s, 'x')",
                    "cancel": "SELECT ledger.cancel_run(%s, %s)"}[outcome], r)
        assert_state_is_the_logs(db)
    db.execute("SELECT ledger.start_run('a', 'o', '1 hour')")           # running
    db.execute("SELECT ledger.start_run('a', 'o', '1 hour')")           # supersedes it
    assert_state_is_the_logs(db)
    db.execute("SELECT ledger.start_run('b', 'o', '10 milliseconds')")
    time.sleep(0.05)
    db.execute("SELECT ledger.start_run('b', 'p', '1 hour')")           # closes the expired run
    db.execute("SELECT ledger.start_run('c', 'o', '10 milliseconds')")
    time.sleep(0.05)
    db.execute("SELECT ledger.reap_expired()")
    assert_state_is_the_logs(db)
    r = db.execute("SELECT run_id, token FROM ledger.start_due_run('s', 'o')").fetchone()
    db.execute("SELECT ledger.complete_run(%s, %s)", r)
    assert_state_is_the_logs(db)
    # a write past the functions (a superuser's) recomputes through the trigger
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '10 days',"
               " completed_at = completed_at - interval '10 days' WHERE status <> 'running'")
    assert_state_is_the_logs(db)
    assert db.execute("SELECT ledger.purge_log('1 day')").fetchone()[0] > 0
    assert_state_is_the_logs(db)


def test_an_overlap_is_kept_in_the_state_alerted_in_o1_and_agrees_with_the_audit(db):
    def run(job: str) -> int:
        r = db.execute("SELECT run_id, token FROM ledger.start_run(%s, 'o', '1 hour')", (job,)).fetchone()
        db.execute("SELECT ledger.complete_run(%s, %s)", r)
        return r[0]

    first, second = run("j"), run("j")
    assert rows(db, "SELECT * FROM ledger.alerts WHERE alert = 'overlap'") == []
    # A hand edit (the trigger recomputes the state from the log): the first
    # run now ends an hour later, over the second.
    db.execute("UPDATE ledger.job_execution_log SET completed_at = completed_at + interval '1 hour'"
               " WHERE run_id = %s", (first,))
    [alert] = rows(db, "SELECT * FROM ledger.alerts WHERE alert = 'overlap'")
    assert (alert["job"], alert["run_id"]) == ("j", second)
    assert [(o["run_id"], o["other_run_id"]) for o in rows(db, "SELECT * FROM ledger.overlaps")] == [(first, second)]
    assert_state_is_the_logs(db)
    # The writers' own check, as when the server's clock is stepped back: a
    # new run starts before the latest end the job has seen.
    third = run("j")
    [alert] = rows(db, "SELECT * FROM ledger.alerts WHERE alert = 'overlap'")
    assert alert["run_id"] == third and "started before an earlier run" in alert["message"]
    assert {o["other_run_id"] for o in rows(db, "SELECT * FROM ledger.overlaps")} == {second, third}
    assert_state_is_the_logs(db)
    # Undone by hand: the alert goes with it.
    db.execute("UPDATE ledger.job_execution_log SET completed_at = completed_at - interval '1 hour'"
               " WHERE run_id = %s", (first,))
    assert rows(db, "SELECT * FROM ledger.alerts WHERE alert = 'overlap'") == []
    assert rows(db, "SELECT * FROM ledger.overlaps") == []


def test_the_first_slot_after_the_newest_done_one_is_kept_and_job_status_reads_it_as_the_next_slot(db):
    db.execute("SELECT ledger.register_job('hourly', '@hourly', ttl => '10 minutes', time_zone => 'Europe/Berlin')")
    r = db.execute("SELECT run_id, token, slot FROM ledger.start_due_run('hourly', 'o')").fetchone()
    db.execute("SELECT ledger.complete_run(%s, %s)", r[:2])
    kept, direct = db.execute(
        "SELECT c.next_due, ledger._slot_after(j.schedule_spec, j.time_zone, %s) FROM ledger.counters c"
        " JOIN ledger.jobs j USING (job) WHERE job = 'hourly'", (r[2],)).fetchone()
    assert kept == direct and kept > r[2]
    status = db.execute("SELECT s.next_slot, s.overdue, ledger._slot_after(j.schedule_spec, j.time_zone, now())"
                        " FROM ledger.job_status s JOIN ledger.jobs j USING (job) WHERE job = 'hourly'").fetchone()
    assert status[0] == status[2] and status[1] is False
    assert_state_is_the_logs(db)
    # A new schedule: the kept slot follows it (the slot done is one of the old schedule's).
    db.execute("SELECT ledger.register_job('hourly', '*/7 * * * *')")
    kept, direct = db.execute(
        "SELECT c.next_due, ledger._slot_after(j.schedule_spec, j.time_zone, c.done_slot) FROM ledger.counters c"
        " JOIN ledger.jobs j USING (job) WHERE job = 'hourly'").fetchone()
    assert kept == direct and kept.minute % 7 == 0
    # The next slot is the kept one, not evaluated by the read: due already (the job is behind) unless the
    # new schedule's first slot after the done one is still ahead.
    status = db.execute("SELECT s.next_slot, ledger._slot_after(j.schedule_spec, j.time_zone, now())"
                        " FROM ledger.job_status s JOIN ledger.jobs j USING (job) WHERE job = 'hourly'").fetchone()
    assert status[0] == kept and status[0] <= status[1]
    assert_state_is_the_logs(db)
