"""What a careless or hostile client sends cannot break the ledger's promises:
a purge never revives a slot or a key, a slot must be a slot, bounded values
keep every view in range, sizes are bounded, and nobody waits on a row that
another client's open transaction holds."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledger.metrics import exposition
from sqlhelp import one, rows, state, value

VIEWS = ["job_status", "alerts", "run_stats", "ttl_advice", "overlaps", "job_counters", "job_health", "duplicates"]


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
    db.execute("SELECT ledger.purge_log('36500 days')")
    db.execute("SELECT ledger.register_job('fastest', late_after => '365 days', down_after => '365 days', "
               "min_runtime => '365 days', max_runtime => '365 days', pause_after_failures => 1000)")
    db.execute("SELECT ledger.register_job('cron', late_after => '1 microsecond', down_after => '1 microsecond')")
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


# -- a time zone is a zone, the same on every host and in every session ------

def refused(db, sql, params=None, sqlstate="22023"):
    """The call raises `sqlstate` and changes nothing; its error."""
    before = state(db)
    with pytest.raises(psycopg.Error) as caught:
        db.execute(sql, params)
    assert caught.value.sqlstate == sqlstate, caught.value
    assert state(db) == before
    return caught.value


@pytest.mark.parametrize("zone", [
    "Mars/Olympus2", "Etc/GMT-15", "Etc/GMT+13", "Asia/Riyadh87", "Europe/Paris3",  # POSIX TZ strings with a slash
    "localtime", "posixrules", "LocalTime", "posix/posixrules",  # the server host's own zone
    "CET", "cet", "EET", "MET", "WET", "EST", "MST", "HST",  # zone files that AT TIME ZONE reads as abbreviations
    "PST", "UTC+3", "abc3",
])
def test_register_job_refuses_a_time_zone_that_is_no_zone_name(db, zone):
    for schedule in (None, "0 2 * * *"):
        error = refused(db, "SELECT ledger.register_job('tz', %s, time_zone => %s)", (schedule, zone))
        assert "time_zone" in error.diag.message_primary
        assert json.loads(error.diag.message_detail) == {"argument": "time_zone", "value": zone}


@pytest.mark.parametrize("zone", ["UTC", "utc", "GMT", "Zulu", "Etc/UTC", "Etc/GMT-14", "Etc/GMT+12", "Etc/GMT0",
                                  "GMT+0", "EST5EDT", "Europe/Berlin", "america/new_york", "Asia/Calcutta",
                                  "America/Argentina/ComodRivadavia", "America/North_Dakota/New_Salem"])
def test_register_job_accepts_zone_names(db, zone):
    assert one(db, "SELECT * FROM ledger.register_job('tz', '0 2 * * *', time_zone => %s)", (zone,))["time_zone"] == zone


def test_an_abbreviation_would_have_made_the_schedule_follow_the_sessions_abbreviations(db):
    """Why 'EST' is refused: AT TIME ZONE reads it by timezone_abbreviations,
    which any session sets (in the Australia set EST is UTC+10)."""
    at = "SELECT (timestamptz '2026-01-01 12:00+00' AT TIME ZONE 'EST')::text"
    assert value(db, at) == "2026-01-01 07:00:00"
    db.execute("SET timezone_abbreviations = 'Australia'")
    assert value(db, at) == "2026-01-01 22:00:00"
    refused(db, "SELECT ledger.register_job('tz', '0 2 * * *', time_zone => 'EST')")


# -- a duration is an exact length of time -------------------------------------

@pytest.mark.parametrize("call", [
    "ledger.acquire('j', 'o', '1 month')",
    "ledger.acquire('j', 'o', '1 mon -2 days')",
    "ledger.start_run('j', 'o', '1 month')",
    "ledger.start_due_run('every', 'o', '1 month')",
    "ledger.renew('every', 'host-1', 1, '1 month')",
    "ledger.heartbeat(1, 1, '1 month')",
    "ledger.register_job('j', ttl => '1 month')",
    "ledger.register_job('j', ttl => '0.9 years')",
    "ledger.register_job('j', ttl => 'P1M')",
])
def test_a_ttl_with_a_month_part_is_refused(db, call):
    """'1 month' compared as 30 days passed the 30-day bound, and lasted 31 days of calendar."""
    db.execute("SELECT ledger.register_job('every', '15 minutes', '10 minutes')")
    db.execute("SELECT ledger.acquire('every', 'host-1')")
    error = refused(db, f"SELECT * FROM {call}")
    assert "ttl" in error.diag.message_primary and "month" in error.diag.message_primary
    assert json.loads(error.diag.message_detail)["argument"] == "ttl"


@pytest.mark.parametrize("older_than", ["1 month", "1 year", "100 years", "1 year -1 day"])
def test_older_than_with_a_month_part_is_refused(db, older_than):
    complete(db, start(db, "etl", ttl="1 hour"))
    error = refused(db, "SELECT ledger.purge_log(%s)", (older_than,))
    assert "older_than" in error.diag.message_primary
    assert value(db, "SELECT ledger.purge_log('36500 days')") == 0
    refused(db, "SELECT ledger.purge_log('36500 days 1 microsecond')")


def test_a_ttl_day_is_24_hours_whatever_the_sessions_time_zone(db):
    """Days are kept as hours, so every expiry is exact: '1 day' added to an
    instant in a session whose TimeZone changes offset that day is 23 or 25
    hours."""
    db.execute("SET TimeZone = 'America/New_York'")
    dst_day = "timestamptz '2026-03-08 00:00 America/New_York'"
    assert value(db, f"SELECT ({dst_day} + interval '1 day') - {dst_day}") == timedelta(hours=23)
    assert value(db, f"SELECT ({dst_day} + ledger._exact('1 day')) - {dst_day}") == timedelta(hours=24)
    job = one(db, "SELECT * FROM ledger.register_job('daily', ttl => '1 day 2 hours')")
    assert job["ttl"] == timedelta(hours=26)
    assert value(db, "SELECT ttl::text FROM ledger.jobs WHERE job = 'daily'") == "26:00:00"
    started = start(db, "daily")
    lease = "SELECT ttl::text, extract(epoch FROM expires_at - acquired_at) FROM ledger.leases WHERE job = 'daily'"
    assert db.execute(lease).fetchone() == ("26:00:00", 93600)
    db.execute("SELECT ledger.heartbeat(%s, %s, '30 days')", (started["run_id"], started["token"]))
    ttl, _ = db.execute(lease).fetchone()
    assert ttl == "720:00:00"
    assert value(db, "SELECT ledger.renew('daily', 'host-1', %s, '2 days')", (started["token"],)) is not None
    assert db.execute(lease).fetchone()[0] == "48:00:00"


# -- the detail a run ends with is bounded as merged ---------------------------

def test_a_merged_detail_over_the_bound_is_refused_and_changes_nothing(db):
    """Each part within 64 kB, the merge over it: refused, like a detail over it."""
    started = start(db, "etl", ttl="1 hour", detail=json.dumps({"a": "x" * 40_000}))
    for end in ("complete_run(%s, %s, %s)", "fail_run(%s, %s, 'boom', %s)"):
        error = refused(db, f"SELECT ledger.{end}",
                        (started["run_id"], started["token"], json.dumps({"b": "y" * 40_000})))
        assert "detail" in error.diag.message_primary
        facts = json.loads(error.diag.message_detail)
        assert facts["argument"] == "detail" and facts["bytes"] > facts["max"] == 65_536
    assert value(db, "SELECT status FROM ledger.job_execution_log WHERE run_id = %s", (started["run_id"],)) == "running"
    # A key given again replaces the started one: the merge stays within the bound.
    ended = one(db, "SELECT * FROM ledger.complete_run(%s, %s, %s)",
                (started["run_id"], started["token"], json.dumps({"a": "z" * 60_000})))
    assert ended["status"] == "success" and ended["detail"] == {"a": "z" * 60_000}


# -- a slot recorded ahead cannot silence a schedule given later ---------------

@pytest.mark.parametrize("ahead", ["2150-01-01 00:00+00", "in an hour"])
def test_register_job_refuses_a_schedule_for_a_job_with_a_slot_done_in_the_future(db, ahead):
    """An unscheduled job takes any slot; given a schedule after a far slot
    succeeded, it would have nothing due until that slot, without an alert."""
    slot = value(db, "SELECT date_trunc('hour', now()) + interval '2 hours'") if ahead == "in an hour" else ahead
    complete(db, start(db, "adhoc", ttl="1 hour", slot=slot))
    error = refused(db, "SELECT ledger.register_job('adhoc', '0 * * * *', '10 minutes')")
    assert "schedule" in error.diag.message_primary
    facts = json.loads(error.diag.message_detail)
    assert facts["argument"] == "schedule" and facts["job"] == "adhoc"
    assert datetime.fromisoformat(facts["slot"]) == (slot if isinstance(slot, datetime) else
                                                     datetime(2150, 1, 1, tzinfo=timezone.utc))
    # Without a schedule it still registers, and the job stays what it was.
    assert one(db, "SELECT * FROM ledger.register_job('adhoc', ttl => '10 minutes')")["schedule"] is None
    # A running run on a future slot counts too; a failed one does not.
    running = start(db, "other", ttl="1 hour", slot="2150-01-01 00:00+00")
    refused(db, "SELECT ledger.register_job('other', '1 hour')")
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (running["run_id"], running["token"]))
    assert one(db, "SELECT * FROM ledger.register_job('other', '1 hour')")["schedule"] == "1 hour"
    assert len(rows(db, "SELECT * FROM ledger.due_slots('other')")) == 1


def test_a_slot_done_in_the_past_leaves_register_job_free_to_schedule(db):
    complete(db, start(db, "adhoc", ttl="1 hour", slot="2026-01-01 00:17+00"))
    db.execute("SELECT ledger.register_job('adhoc', '0 * * * *', '10 minutes')")
    assert len(rows(db, "SELECT * FROM ledger.due_slots('adhoc')")) == 1


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
