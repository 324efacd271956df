"""The jobs' state in ledger.counters, kept by the writing functions, equals its recomputation from the log."""

import time

from sqlhelp import rows

STATE = """SELECT job, last_run_id, last_status, last_started_at, last_completed_at, last_success_started_at,
                  last_success_at, running_run_id, running_token, running_started_at, done_slot, longest_success,
                  consecutive_failures FROM ledger.counters ORDER BY job"""


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
