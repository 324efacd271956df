"""A purge in batches that each commit: the same runs go as with purge_log, every batch is a transaction of
its own, the ends of running jobs never wait for the whole purge, and bad input changes nothing."""

from __future__ import annotations

import psycopg
import pytest

from sqlhelp import one, rows, value

BATCH = 10_000  # run ids per batch (sql/55_schedules.sql)


def ended_run(db, job: str, *, fail: bool = False, days_ago: int = 100, hours: int = 0) -> int:
    """A run of `job` that started and ended `days_ago` days ago and lasted `hours` hours (the test owns the
    tables: clients cannot age the log)."""
    run_id, token = db.execute(
        "SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'w', ttl => '1 minute')", (job,)).fetchone()
    end = "fail_run(run_id => %s, token => %s, error => 'boom')" if fail else "complete_run(run_id => %s, token => %s)"
    db.execute(f"SELECT ledger.{end}", (run_id, token))
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - %s * interval '1 day',"
               " heartbeat_at = heartbeat_at - %s * interval '1 day',"
               " completed_at = completed_at - %s * interval '1 day' + %s * interval '1 hour' WHERE run_id = %s",
               (days_ago, days_ago, days_ago, hours, run_id))
    return int(run_id)


def next_batch(db) -> None:
    """The next run id starts a batch of its own: a gap of a whole batch in the ids."""
    db.execute("SELECT setval(pg_get_serial_sequence('ledger.job_execution_log', 'run_id'),"
               " (SELECT max(run_id) FROM ledger.job_execution_log) + %s)", (BATCH,))


def spread_log(db) -> dict[str, list[int]]:
    """Three jobs, each with two old successes and a newer one, in three batches of run ids."""
    made: dict[str, list[int]] = {}
    for job in ("a", "b", "c"):
        # the first is the job's longest success: purging it recomputes the job's state
        made[job] = [ended_run(db, job, days_ago=100, hours=2), ended_run(db, job, days_ago=99),
                     ended_run(db, job, days_ago=1)]
        next_batch(db)
    return made


STATE = """SELECT job, last_run_id, last_status, last_success_at, done_slot, longest_success, consecutive_failures,
                  next_due, latest_end, overlap_run_id FROM ledger.counters ORDER BY job"""


def test_purge_log_in_batches_removes_what_purge_log_removes_and_keeps_the_state_the_log_gives(db):
    made = spread_log(db)
    [row] = db.execute("CALL ledger.purge_log_in_batches(older_than => '90 days')").fetchall()
    assert row == (6,)
    assert rows(db, "SELECT job, run_id FROM ledger.job_execution_log ORDER BY run_id") == [
        {"job": job, "run_id": ids[2]} for job, ids in made.items()]
    kept = rows(db, STATE)
    db.execute("SELECT ledger._refresh_state(array_agg(job::text)) FROM ledger.counters")
    assert rows(db, STATE) == kept
    # A second call has nothing left to do.
    assert db.execute("CALL ledger.purge_log_in_batches('90 days')").fetchone() == (0,)
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0  # the state rows are the log's


def test_each_batch_of_purge_log_in_batches_commits_by_itself(db):
    """The three jobs' longest success, kept counted by the batch that purged it (ledger.purged_state), was
    written by three transactions (xmin): one per batch of run ids, not one for the whole purge."""
    spread_log(db)
    db.execute("CALL ledger.purge_log_in_batches('90 days')")
    after = rows(db, "SELECT job, xmin::text AS xid FROM ledger.purged_state ORDER BY job")
    assert [c["job"] for c in after] == ["a", "b", "c"]
    assert len({c["xid"] for c in after}) == 3, after


def test_purge_log_batch_walks_the_log_a_batch_at_a_time_skipping_gaps(db):
    made = spread_log(db)
    first = one(db, "SELECT * FROM ledger.purge_log_batch(older_than => '90 days')")
    assert first == {"deleted": 2, "next_run_id": made["b"][0]}  # the gap of a batch is skipped
    second = one(db, "SELECT * FROM ledger.purge_log_batch('90 days', from_run_id => %s)", (first["next_run_id"],))
    assert second == {"deleted": 2, "next_run_id": made["c"][0]}
    last = one(db, "SELECT * FROM ledger.purge_log_batch('90 days', from_run_id => %s)", (second["next_run_id"],))
    assert last == {"deleted": 2, "next_run_id": None}
    past = one(db, "SELECT * FROM ledger.purge_log_batch('90 days', from_run_id => %s)", (made["c"][2] + 1,))
    assert past == {"deleted": 0, "next_run_id": None}


def test_purge_log_in_batches_inside_a_transaction_block_fails_and_removes_nothing(db):
    spread_log(db)
    before = value(db, "SELECT count(*) FROM ledger.job_execution_log")
    with pytest.raises(psycopg.errors.InvalidTransactionTermination):  # 2D000 at its first COMMIT
        with db.transaction():
            db.execute("CALL ledger.purge_log_in_batches('90 days')")
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == before


@pytest.mark.parametrize(("call", "sqlstate", "argument"), [
    ("SELECT ledger.purge_log_batch(older_than => NULL)", "22004", "older_than"),
    ("SELECT ledger.purge_log_batch(older_than => '1 month')", "22023", "older_than"),
    ("SELECT ledger.purge_log_batch(older_than => '1 day', from_run_id => 0)", "22023", "from_run_id"),
    ("SELECT ledger.purge_log_batch(older_than => '1 day', from_run_id => -5)", "22023", "from_run_id"),
    ("CALL ledger.purge_log_in_batches(older_than => NULL)", "22004", "older_than"),
    ("CALL ledger.purge_log_in_batches(older_than => '-1 day')", "22023", "older_than"),
])
def test_bad_input_to_the_batched_purge_names_the_argument_and_changes_nothing(db, call, sqlstate, argument):
    spread_log(db)
    before = value(db, "SELECT count(*) FROM ledger.job_execution_log")
    with pytest.raises(psycopg.Error) as caught:
        db.execute(call)
    assert caught.value.sqlstate == sqlstate
    assert f"argument {argument}" in str(caught.value)
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == before


def purge_touching_a_running_job(db) -> tuple[int, int]:
    """An old, long success of `j` (its longest: a purge must recompute j's state) and a run of j in flight."""
    ended_run(db, "j", days_ago=100, hours=2)
    ended_run(db, "j", days_ago=1)
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run('j', 'w', '1 hour')").fetchone()
    return run_id, token


def test_an_end_of_a_run_never_waits_for_a_purge_log_in_one_transaction(db, connect):
    """A purge writes no state row: a run of a job whose runs it purged ends while the purge's transaction is
    still open (it used to wait for the counters row the purge had recomputed)."""
    run_id, token = purge_touching_a_running_job(db)
    purger, runner = connect(), connect()
    runner.execute("SET lock_timeout = '500ms'")
    with purger.transaction():
        assert value(purger, "SELECT ledger.purge_log('90 days')") == 1
        assert one(runner, "SELECT status FROM ledger.complete_run(%s, %s)", (run_id, token)) == {"status": "success"}
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0
