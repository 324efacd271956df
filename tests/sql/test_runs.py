"""The execution log: start_run, heartbeat, complete/fail/cancel, reap."""

import json
import time

import psycopg
import pytest

from sqlhelp import one, rows, value

START = "SELECT * FROM ledger.start_run(job => %s, owner => %s, ttl => %s)"


def start(db, job="nightly", owner="host-1", ttl="1 hour", **extra):
    args = ", ".join(f"{name} => %({name})s" for name in extra)
    query = f"SELECT * FROM ledger.start_run(job => %(job)s, owner => %(owner)s, ttl => %(ttl)s{', ' + args if args else ''})"
    return one(db, query, {"job": job, "owner": owner, "ttl": ttl, **extra})


def run_row(db, run_id):
    return one(db, "SELECT * FROM ledger.job_execution_log WHERE run_id = %s", (run_id,))


def counters(db, job="nightly"):
    return one(db, "SELECT * FROM ledger.job_counters WHERE job = %s", (job,))


def sqlstate_of(db, query, params=None):
    with pytest.raises(psycopg.Error) as caught:
        db.execute(query, params)
    return caught.value.sqlstate, json.loads(caught.value.diag.message_detail or "{}")


def test_start_run_result_is_the_declared_composite_type(db):
    assert value(db, "SELECT pg_get_function_result('ledger.start_run(text,text,interval,timestamptz,text,jsonb)'::regprocedure)") \
        == "ledger.run_start"
    columns = rows(db, """SELECT attname FROM pg_attribute
                          WHERE attrelid = 'ledger.run_start'::regclass AND attnum > 0 ORDER BY attnum""")
    assert [c["attname"] for c in columns] == [
        "outcome", "run_id", "token", "expires_at", "slot", "holder", "holder_expires_at"]


def test_start_run_starts_a_run_logs_it_running_and_holds_the_lease(db):
    started = start(db, detail=psycopg.types.json.Jsonb({"trigger": "cron"}))
    assert started["outcome"] == "started"
    assert started["token"] == 1
    run = run_row(db, started["run_id"])
    assert run["status"] == "running"
    assert run["owner"] == "host-1" and run["token"] == 1
    assert run["completed_at"] is None and run["detail"] == {"trigger": "cron"}
    assert value(db, "SELECT ledger.is_current('nightly', 1)") is True
    assert started["expires_at"] == value(db, "SELECT expires_at FROM ledger.leases WHERE job = 'nightly'")
    assert counters(db)["runs_started"] == 1


def test_a_second_owner_is_skipped_for_overlap_with_holder_facts_and_counted_apart(db):
    first = start(db, owner="host-1")
    skipped = start(db, owner="host-2")
    assert skipped["outcome"] == "skipped_overlap"
    assert skipped["run_id"] is None and skipped["token"] is None
    assert skipped["holder"] == "host-1"
    assert skipped["holder_expires_at"] == first["expires_at"]
    c = counters(db)
    assert (c["runs_started"], c["skipped_overlap"], c["failures"]) == (1, 1, 0)
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == 1


def test_a_slot_that_succeeded_is_already_done_even_for_another_owner(db):
    slot = "2026-11-30 02:00+00"
    first = start(db, slot=slot)
    db.execute("SELECT ledger.complete_run(%s, %s)", (first["run_id"], first["token"]))
    again = start(db, owner="host-2", slot=slot)
    assert again["outcome"] == "already_done"
    assert again["run_id"] is None


def test_already_done_wins_over_skipped_overlap_for_a_running_slot(db):
    slot = "2026-11-30 02:00+00"
    start(db, owner="host-1", slot=slot)
    assert start(db, owner="host-2", slot=slot)["outcome"] == "already_done"


def test_an_idempotency_key_that_succeeded_is_already_done(db):
    first = start(db, idempotency_key="invoice-42")
    db.execute("SELECT ledger.complete_run(%s, %s)", (first["run_id"], first["token"]))
    assert start(db, idempotency_key="invoice-42")["outcome"] == "already_done"
    assert start(db, idempotency_key="invoice-43")["outcome"] == "started"


def test_a_failed_slot_may_be_retried(db):
    slot = "2026-11-30 02:00+00"
    first = start(db, slot=slot)
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (first["run_id"], first["token"]))
    retry = start(db, slot=slot)
    assert retry["outcome"] == "started" and retry["token"] == first["token"] + 1


def test_a_paused_job_returns_paused_and_changes_nothing(db):
    db.execute("INSERT INTO ledger.jobs (job, ttl, paused) VALUES ('nightly', '1 hour', true)")
    assert start(db)["outcome"] == "paused"
    assert value(db, "SELECT count(*) FROM ledger.leases") == 0
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == 0


def test_a_crashed_run_whose_lease_expired_is_closed_as_lease_expired_by_the_next_start(db):
    crashed = start(db, owner="host-1", ttl="50 milliseconds")
    time.sleep(0.1)
    nxt = start(db, owner="host-2")
    assert nxt["outcome"] == "started" and nxt["token"] == crashed["token"] + 1
    old = run_row(db, crashed["run_id"])
    assert (old["status"], old["failure_reason"]) == ("failure", "lease_expired")
    assert old["completed_at"] == run_row(db, nxt["run_id"])["started_at"]
    c = counters(db)
    assert (c["runs_started"], c["failures"], c["leases_lost"]) == (2, 1, 1)


def test_a_run_the_same_owner_still_holds_is_superseded_by_its_new_start(db):
    first = start(db, owner="host-1")
    second = start(db, owner="host-1")
    assert second["outcome"] == "started" and second["token"] == first["token"] + 1
    old = run_row(db, first["run_id"])
    assert (old["status"], old["failure_reason"]) == ("failure", "superseded")


def test_heartbeat_renews_the_lease_and_stamps_the_run(db):
    started = start(db, ttl="1 second")
    expires = value(db, "SELECT ledger.heartbeat(run_id => %s, token => %s, ttl => '1 hour')",
                    (started["run_id"], started["token"]))
    assert expires > started["expires_at"]
    run = run_row(db, started["run_id"])
    assert run["heartbeat_at"] > run["started_at"]
    # without ttl: the lease's current ttl again
    later = value(db, "SELECT ledger.heartbeat(%s, %s) - now()", (started["run_id"], started["token"]))
    assert later.total_seconds() > 3500


def test_heartbeat_returns_null_when_the_lease_was_lost(db):
    zombie = start(db, owner="host-1", ttl="50 milliseconds")
    time.sleep(0.1)
    start(db, owner="host-2")
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (zombie["run_id"], zombie["token"])) is None


def test_heartbeat_on_an_ended_run_is_ld003_and_on_an_unknown_run_ld004(db):
    started = start(db)
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    code, facts = sqlstate_of(db, "SELECT ledger.heartbeat(%s, %s)", (started["run_id"], started["token"]))
    assert code == "LD003" and facts["status"] == "success"
    code, facts = sqlstate_of(db, "SELECT ledger.heartbeat(999, 1)")
    assert code == "LD004" and facts == {"run_id": 999}


def test_complete_run_ends_the_run_releases_the_lease_and_merges_detail(db):
    started = start(db, detail=psycopg.types.json.Jsonb({"a": 1}))
    ended = one(db, "SELECT * FROM ledger.complete_run(run_id => %s, token => %s, detail => %s)",
                (started["run_id"], started["token"], psycopg.types.json.Jsonb({"rows": 5})))
    assert ended["status"] == "success" and ended["completed_at"] is not None
    assert ended["failure_reason"] is None and ended["detail"] == {"a": 1, "rows": 5}
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (started["token"],)) is False
    assert start(db, owner="host-2")["outcome"] == "started"
    assert counters(db)["successes"] == 1


def test_fail_run_records_the_error_with_reason_error(db):
    started = start(db)
    ended = one(db, "SELECT * FROM ledger.fail_run(run_id => %s, token => %s, error => 'disk full')",
                (started["run_id"], started["token"]))
    assert (ended["status"], ended["failure_reason"], ended["error"]) == ("failure", "error", "disk full")
    assert counters(db)["failures"] == 1


def test_cancel_run_records_reason_cancelled(db):
    started = start(db)
    ended = one(db, "SELECT * FROM ledger.cancel_run(run_id => %s, token => %s, error => 'SIGTERM')",
                (started["run_id"], started["token"]))
    assert (ended["status"], ended["failure_reason"], ended["error"]) == ("failure", "cancelled", "SIGTERM")
    again = start(db)
    ended = one(db, "SELECT * FROM ledger.cancel_run(%s, %s)", (again["run_id"], again["token"]))
    assert ended["failure_reason"] == "cancelled" and ended["error"] is None


def test_a_zombie_completing_after_a_takeover_gets_ld001_and_the_row_keeps_the_verdict(db):
    zombie = start(db, owner="host-1", ttl="50 milliseconds")
    time.sleep(0.1)
    fresh = start(db, owner="host-2")
    code, facts = sqlstate_of(db, "SELECT ledger.complete_run(%s, %s)", (zombie["run_id"], zombie["token"]))
    assert code == "LD001"
    assert facts["current_token"] == fresh["token"] and facts["holder"] == "host-2"
    assert run_row(db, zombie["run_id"])["failure_reason"] == "lease_expired"
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (fresh["token"],)) is True


def test_ending_an_ended_run_is_ld003_and_changes_nothing(db):
    started = start(db)
    db.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    for call in ("complete_run(%s, %s)", "fail_run(%s, %s, 'x')", "cancel_run(%s, %s)"):
        code, _ = sqlstate_of(db, f"SELECT ledger.{call}", (started["run_id"], started["token"]))
        assert code == "LD003"
    assert run_row(db, started["run_id"])["status"] == "success"


def test_ending_with_the_wrong_token_is_ld001_and_an_unknown_run_ld004(db):
    started = start(db)
    code, facts = sqlstate_of(db, "SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"] + 7))
    assert code == "LD001" and facts["run_token"] == started["token"]
    code, _ = sqlstate_of(db, "SELECT ledger.fail_run(424242, 1, 'x')")
    assert code == "LD004"
    assert run_row(db, started["run_id"])["status"] == "running"


def test_a_run_whose_lease_expired_but_was_not_taken_may_still_complete(db):
    started = start(db, ttl="50 milliseconds")
    time.sleep(0.1)
    ended = one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    assert ended["status"] == "success"


def test_reap_expired_closes_runs_whose_lease_expired_and_leaves_live_ones(db):
    dead = start(db, job="a", ttl="50 milliseconds")
    live = start(db, job="b", ttl="1 hour")
    time.sleep(0.1)
    assert value(db, "SELECT ledger.reap_expired()") == 1
    assert run_row(db, dead["run_id"])["failure_reason"] == "lease_expired"
    assert run_row(db, live["run_id"])["status"] == "running"
    assert (counters(db, "a")["failures"], counters(db, "a")["leases_lost"]) == (1, 1)
    assert value(db, "SELECT ledger.reap_expired()") == 0
    # a reaped lease is over: its late holder can neither renew nor heartbeat it
    assert value(db, "SELECT ledger.renew('a', 'host-1', %s)", (dead["token"],)) is None
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (dead["run_id"], dead["token"])) is None


def test_reap_expired_for_one_job_leaves_the_others(db):
    a = start(db, job="a", ttl="50 milliseconds")
    b = start(db, job="b", ttl="50 milliseconds")
    time.sleep(0.1)
    assert value(db, "SELECT ledger.reap_expired(job => 'a')") == 1
    assert run_row(db, a["run_id"])["status"] == "failure"
    assert run_row(db, b["run_id"])["status"] == "running"


def test_the_database_allows_one_running_run_per_job_whatever_the_writer(db):
    start(db)
    with pytest.raises(psycopg.errors.UniqueViolation):
        db.execute("""INSERT INTO ledger.job_execution_log (job, owner, token, status, started_at)
                      VALUES ('nightly', 'forger', 99, 'running', now())""")


def test_the_database_allows_one_running_or_successful_run_per_slot_and_per_key(db):
    slot_run = start(db, slot="2026-11-30 02:00+00", idempotency_key="k")
    db.execute("SELECT ledger.complete_run(%s, %s)", (slot_run["run_id"], slot_run["token"]))
    for column, val in (("slot", "2026-11-30 02:00+00"), ("idempotency_key", "k")):
        with pytest.raises(psycopg.errors.UniqueViolation):
            db.execute(f"""INSERT INTO ledger.job_execution_log (job, owner, token, status, started_at, completed_at, {column})
                           VALUES ('nightly', 'forger', 99, 'success', now(), now(), %s)""", (val,))
    # a failed one for the same slot is allowed: failed slots may be retried
    db.execute("""INSERT INTO ledger.job_execution_log (job, owner, token, status, started_at, completed_at, failure_reason, slot)
                  VALUES ('nightly', 'forger', 99, 'failure', now(), now(), 'error', '2026-11-30 02:00+00')""")


def test_the_database_rejects_inconsistent_run_rows(db):
    start(db)
    bad_rows = [
        "('nightly', 'x', 50, 'done', now(), now(), NULL)",          # unknown status
        "('nightly', 'x', 51, 'failure', now(), now(), NULL)",       # failure without reason
        "('nightly', 'x', 52, 'success', now(), NULL, NULL)",        # ended without completed_at
        "('nightly', 'x', 53, 'failure', now(), now(), 'oops')",     # unknown reason
    ]
    for row in bad_rows:
        with pytest.raises(psycopg.errors.CheckViolation):
            db.execute("INSERT INTO ledger.job_execution_log (job, owner, token, status, started_at, completed_at, failure_reason) "
                       f"VALUES {row}")


def test_runs_of_one_job_never_overlap_in_the_audit(db):
    for owner in ("a", "b", "a", "c"):
        started = start(db, owner=owner, ttl="20 milliseconds")
        time.sleep(0.03)
    assert start(db, owner="d")["outcome"] == "started"
    db.execute("SELECT ledger.reap_expired()")
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == 5


def test_the_overlap_audit_reports_forged_overlapping_runs(db):
    """The audit can fail: rows forged past the functions (as superuser) show up as a pair."""
    db.execute("INSERT INTO ledger.leases VALUES ('j', 'x', 3, '1 hour', now(), now(), NULL, 1)")
    db.execute("""INSERT INTO ledger.job_execution_log (job, owner, token, status, started_at, completed_at) VALUES
                  ('j', 'x', 1, 'success', '2026-01-01 00:00+00', '2026-01-01 01:00+00'),
                  ('j', 'y', 2, 'success', '2026-01-01 00:30+00', '2026-01-01 00:40+00'),
                  ('j', 'z', 3, 'success', '2026-01-01 01:00+00', '2026-01-01 02:00+00')""")
    pairs = rows(db, "SELECT owner, other_owner FROM ledger.overlaps")
    assert pairs == [{"owner": "x", "other_owner": "y"}]
