"""What a careless or hostile client sends cannot break the ledger's promises:
a purge never revives a slot or a key, a slot must be a slot, bounded values
keep every view in range, sizes are bounded, and nobody waits on a row that
another client's open transaction holds."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledger.metrics import exposition
from sqlhelp import one, rows, state, value

VIEWS = ["job_status", "alerts", "run_stats", "ttl_advice", "overlaps", "job_counters"]


def start(db, job, owner="host-1", **kwargs):
    args = ", ".join(f"{name} => %({name})s" for name in kwargs)
    return one(db, f"SELECT * FROM ledger.start_run(%(job)s, %(owner)s{', ' + args if args else ''})",
               {"job": job, "owner": owner, **kwargs})


def complete(db, started):
    return one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))


# -- purging never revives a slot or an idempotency key ---------------------

def test_a_purged_idempotency_key_still_answers_already_done(db):
    done = start(db, "invoice", ttl="1 hour", idempotency_key="invoice-42")
    complete(db, done)
    complete(db, start(db, "invoice", ttl="1 hour"))  # a newer success: the key's run is not the newest
    assert value(db, "SELECT ledger.purge_log('1 microsecond')") == 1
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE idempotency_key = 'invoice-42'") == 0
    again = start(db, "invoice", owner="host-2", ttl="1 hour", idempotency_key="invoice-42")
    assert again["outcome"] == "already_done"
    assert rows(db, "SELECT job, idempotency_key, run_id FROM ledger.purged_keys") == [
        {"job": "invoice", "idempotency_key": "invoice-42", "run_id": done["run_id"]}]


def test_a_purged_slot_older_than_the_newest_success_still_answers_already_done(db):
    old, new = "2026-01-01 00:00+00", "2026-01-02 00:00+00"
    complete(db, start(db, "etl", ttl="1 hour", slot=old))
    complete(db, start(db, "etl", ttl="1 hour", slot=new))
    assert value(db, "SELECT ledger.purge_log('1 microsecond')") == 1  # the newest success by slot stays
    assert start(db, "etl", owner="host-2", ttl="1 hour", slot=old)["outcome"] == "already_done"
    assert start(db, "etl", owner="host-2", ttl="1 hour", slot=new)["outcome"] == "already_done"
    # A slot after the purged ones is still free to run.
    assert start(db, "etl", owner="host-2", ttl="1 hour", slot="2026-01-01 12:00+00")["outcome"] == "started"


def test_purging_twice_keeps_the_marks_and_failed_runs_leave_none(db):
    complete(db, start(db, "etl", ttl="1 hour", slot="2026-01-01 00:00+00", idempotency_key="k1"))
    failed = start(db, "etl", ttl="1 hour", slot="2026-01-05 00:00+00", idempotency_key="k2")
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (failed["run_id"], failed["token"]))
    complete(db, start(db, "etl", ttl="1 hour", slot="2026-01-09 00:00+00"))
    db.execute("SELECT ledger.purge_log('1 microsecond')")
    db.execute("SELECT ledger.purge_log('1 microsecond')")
    assert value(db, "SELECT done_through FROM ledger.purged_slots WHERE job = 'etl'") == \
        datetime(2026, 1, 1, tzinfo=timezone.utc)
    assert [r["idempotency_key"] for r in rows(db, "SELECT idempotency_key FROM ledger.purged_keys")] == ["k1"]
    assert start(db, "etl", owner="h2", ttl="1 hour", idempotency_key="k2")["outcome"] == "started"


# -- a slot must be a slot --------------------------------------------------

def test_a_scheduled_job_refuses_a_slot_in_the_future_or_off_its_schedule_and_changes_nothing(db):
    db.execute("SELECT ledger.register_job('hourly', '0 * * * *', ttl => '10 minutes')")
    before = state(db)
    for slot, says in (("200000-01-01", "from"), ("2199-12-31 23:00+00", "future"),
                       ("2026-01-01 00:30+00", "not a slot")):
        with pytest.raises(psycopg.Error) as caught:
            start(db, "hourly", slot=slot)
        assert caught.value.sqlstate == "22023"
        assert "slot" in caught.value.diag.message_primary and says in caught.value.diag.message_primary
    assert state(db) == before
    assert start(db, "hourly", slot="2026-01-01 00:00+00")["outcome"] == "started"


def test_a_forged_far_slot_can_no_longer_silence_a_schedule(db):
    """The attack: succeed '200000-01-01' once, and nothing is ever due again, with no alert."""
    db.execute("SELECT ledger.register_job('tick', '1 minute', ttl => '10 minutes')")
    with pytest.raises(psycopg.Error):
        start(db, "tick", slot="200000-01-01")
    assert len(rows(db, "SELECT * FROM ledger.due_slots('tick')")) == 1
    assert one(db, "SELECT outcome FROM ledger.start_due_run('tick', 'host-1')")["outcome"] == "started"


def test_an_unscheduled_job_takes_any_slot_inside_the_ledgers_time_range(db):
    assert start(db, "adhoc", ttl="1 hour", slot="1970-01-01 00:00+00")["outcome"] == "started"
    with pytest.raises(psycopg.Error) as caught:
        start(db, "adhoc", ttl="1 hour", slot="2200-01-01 00:00+00")
    assert caught.value.sqlstate == "22023"


# -- bounded values: one job can never break the views of all ---------------

def test_a_ledger_holding_a_job_at_every_bound_still_answers_every_view_and_metrics(db, dsn):
    db.execute("SELECT ledger.register_job('slowest', '1 year', ttl => '30 days', max_backfill => 1000, "
               "time_zone => 'Pacific/Kiritimati')")
    db.execute("SELECT ledger.register_job('fastest', '10 milliseconds', ttl => '30 days', max_backfill => 1000)")
    db.execute("SELECT ledger.register_job('cron', '59 23 31 12 *', ttl => '30 days', max_backfill => 1000, "
               "time_zone => 'Pacific/Pago_Pago')")
    db.execute("SELECT ledger.register_job('plain', ttl => '30 days')")
    first = start(db, "plain", slot="1970-01-01 00:00+00", detail=None)
    complete(db, first)
    running = start(db, "slowest")
    assert running["outcome"] == "started"
    assert one(db, "SELECT * FROM ledger.start_due_run('fastest', 'host-1')")["outcome"] == "started"
    db.execute("SELECT ledger.purge_log('100 years')")
    for view in VIEWS:
        rows(db, f"SELECT * FROM ledger.{view}")  # raises on any out-of-range value
    statuses = {r["job"]: r for r in rows(db, "SELECT job, next_slot FROM ledger.job_status")}
    assert set(statuses) == {"slowest", "fastest", "cron", "plain"}
    for job in ("slowest", "fastest", "cron"):
        rows(db, "SELECT * FROM ledger.due_slots(%s, at => '2199-12-31 23:59:59.999999+00')", (job,))
        rows(db, "SELECT * FROM ledger.due_slots(%s, at => '1970-01-01 00:00+00')", (job,))
    text = exposition(lambda: psycopg.connect(dsn, autocommit=True))
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["jobledger_up"] == 1
    jobs = {s.labels.get("job") for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"slowest", "fastest", "cron", "plain"} <= jobs


def test_catch_up_at_the_bound_stays_bounded(db):
    """A 10 ms schedule with the largest catch-up bound walks back at most that many slots."""
    db.execute("SELECT ledger.register_job('fast', '10 milliseconds', ttl => '1 hour', max_backfill => 1000)")
    complete(db, start(db, "fast", slot=value(db, "SELECT min(s) FROM ledger.due_slots('fast') s")))
    db.execute("SELECT pg_sleep(0.05)")
    due = rows(db, "SELECT s FROM ledger.due_slots('fast', at => now() + interval '1 day') s")
    assert len(due) == 1000


# -- bounded sizes ----------------------------------------------------------

def test_an_over_long_error_is_kept_cut_with_a_marker(db):
    started = start(db, "etl", ttl="1 hour")
    ended = one(db, "SELECT * FROM ledger.fail_run(%s, %s, repeat('e', 100000))",
                (started["run_id"], started["token"]))
    assert ended["status"] == "failure"
    assert ended["error"].startswith("e" * 8192)
    assert ended["error"].endswith(" [truncated: 100000 characters in all]")
    assert len(ended["error"]) < 8300
    exact = start(db, "etl", ttl="1 hour")
    kept = one(db, "SELECT * FROM ledger.cancel_run(%s, %s, repeat('c', 8192))", (exact["run_id"], exact["token"]))
    assert kept["error"] == "c" * 8192


def test_the_label_domain_refuses_invisible_characters_even_for_the_owner(db):
    """The backstop behind the functions' own checks: the tables' label domain."""
    for text in ("a\u202eb", "a\u00a0b", "\ufeffa", "a\u2028b"):
        with pytest.raises(psycopg.errors.CheckViolation):
            db.execute("SELECT %s::ledger.label", (text,))
    assert value(db, "SELECT 'nightly backup – Zürich 東京'::ledger.label") == "nightly backup – Zürich 東京"


# -- nobody waits on a held row past a bound --------------------------------

def _answers_while_held(connect, hold_sql, call_sql, params=()):
    """Hold a job's rows in an open transaction; the call must answer while it is still open."""
    holder = connect(autocommit=False)
    holder.execute(hold_sql)
    holder_pid = holder.info.backend_pid
    caller = connect()
    answer: list = []

    def call():
        try:
            answer.append(caller.execute(call_sql, params).fetchall())
        except BaseException as error:  # reported below
            answer.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)  # generous: the bound is one second
    answered_while_held = bool(answer)
    watcher = connect()
    still_open = value(watcher, "SELECT state FROM pg_stat_activity WHERE pid = %s", (holder_pid,))
    holder.rollback()
    thread.join(30)
    assert still_open == "idle in transaction", "the holder's transaction ended before the call answered"
    assert answered_while_held, "the call waited for the holder's transaction to end"
    assert len(answer) == 1 and not isinstance(answer[0], BaseException), answer
    return answer[0]


def test_start_run_answers_while_another_transaction_holds_the_jobs_lease_row(connect):
    """BEGIN; acquire('blk', 'a', '1 second'); ... must not make a concurrent start_run hang."""
    db = connect()
    db.execute("SELECT ledger.acquire('blk', 'a', '1 second')")  # the row exists
    db.execute("SELECT ledger.release('blk', 'a', 1)")
    answer = _answers_while_held(connect, "SELECT ledger.acquire('blk', 'a', '1 second')",
                                 "SELECT outcome, holder FROM ledger.start_run('blk', 'b', '1 minute')")
    assert answer == [("skipped_overlap", "a")]
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'blk'") == 1


def test_acquire_answers_no_row_while_another_transaction_holds_the_row(connect):
    db = connect()
    db.execute("SELECT ledger.acquire('blk', 'a', '1 second')")
    db.execute("SELECT ledger.release('blk', 'a', 1)")
    answer = _answers_while_held(connect, "SELECT ledger.start_run('blk', 'a', '1 second')",
                                 "SELECT token FROM ledger.acquire('blk', 'b', '1 minute')")
    assert answer == []


def test_a_first_start_answers_while_another_transaction_is_creating_the_job(connect):
    """The row does not exist yet: the insert would wait on the other's uncommitted insert."""
    answer = _answers_while_held(connect, "SELECT ledger.acquire('new-job', 'a', '1 minute')",
                                 "SELECT outcome FROM ledger.start_run('new-job', 'b', '1 minute')")
    assert answer == [("skipped_overlap",)]


def test_start_due_run_answers_while_another_transaction_holds_the_row(connect):
    db = connect()
    db.execute("SELECT ledger.register_job('due', '1 minute', ttl => '1 minute')")
    db.execute("SELECT ledger.acquire('due', 'a', '1 second')")
    db.execute("SELECT ledger.release('due', 'a', 1)")
    answer = _answers_while_held(connect, "SELECT ledger.acquire('due', 'a', '1 minute')",
                                 "SELECT outcome FROM ledger.start_due_run('due', 'b')")
    assert answer == [("skipped_overlap",)]


def test_a_skip_answers_while_another_transaction_holds_the_jobs_counters(connect):
    """A committed live lease, and an open transaction of its holder holding the counters row."""
    db = connect()
    start(db, "busy", owner="a", ttl="1 hour")
    answer = _answers_while_held(connect, "SELECT ledger.start_run('busy', 'a', '1 hour')",
                                 "SELECT outcome, holder FROM ledger.start_run('busy', 'b', '1 minute')")
    assert answer == [("skipped_overlap", "a")]


def test_the_lock_bound_leaves_the_callers_lock_timeout_as_it_was(connect):
    db = connect(autocommit=False)
    db.execute("SET LOCAL lock_timeout = '7s'")
    holder = connect(autocommit=False)
    holder.execute("SELECT ledger.acquire('blk', 'a', '1 minute')")
    assert value(db, "SELECT outcome FROM ledger.start_run('blk', 'b', '1 minute')") == "skipped_overlap"
    assert value(db, "SHOW lock_timeout") == "7s"
    holder.rollback()
    assert value(db, "SELECT outcome FROM ledger.start_run('fresh', 'b', '1 minute')") == "started"
    assert value(db, "SHOW lock_timeout") == "7s"
    db.rollback()
