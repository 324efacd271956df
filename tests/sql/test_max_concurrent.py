"""max_concurrent: up to N live runs of a job at once, each in its own seat with its own token."""

import threading
from datetime import timedelta

import psycopg
import pytest

from sqlhelp import one, rows, state, value

START = "SELECT * FROM ledger.start_run(job => %s, owner => %s, ttl => %s, slot => %s, idempotency_key => %s)"


def start(db, job, owner, ttl="1 minute", slot=None, key=None):
    return one(db, START, (job, owner, ttl, slot, key))


def register(db, job, n, **options):
    args = ", ".join(f"{k} => %({k})s" for k in options)
    return one(db, f"SELECT * FROM ledger.register_job(job => %(job)s, max_concurrent => %(n)s"
                   f"{', ' + args if args else ''})", {"job": job, "n": n, **options})


def running(db, job):
    return value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = %s AND status = 'running'", (job,))


def test_two_seats_admit_two_live_runs_and_skip_the_third(db):
    register(db, "pair", 2)
    a = start(db, "pair", "w1")
    b = start(db, "pair", "w2")
    c = start(db, "pair", "w3")
    assert (a["outcome"], b["outcome"], c["outcome"]) == ("started", "started", "skipped_overlap")
    assert b["token"] > a["token"]
    assert c["holder"] in ("w1", "w2")
    assert running(db, "pair") == 2
    assert value(db, "SELECT array_agg(seat ORDER BY seat) FROM ledger.job_execution_log WHERE job = 'pair'") \
        == [1, 2]
    assert value(db, "SELECT ledger.is_current('pair', %s)", (a["token"],)) is True
    assert value(db, "SELECT ledger.is_current('pair', %s)", (b["token"],)) is True
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'pair'") == "running"
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_the_same_owner_takes_a_second_seat_and_keeps_its_first(db):
    register(db, "pair", 2)
    a = start(db, "pair", "w1")
    b = start(db, "pair", "w1")
    assert b["outcome"] == "started" and running(db, "pair") == 2
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (a["run_id"], a["token"])) is not None


def test_an_ended_run_frees_its_seat_with_a_new_higher_token(db):
    register(db, "pair", 2)
    a = start(db, "pair", "w1")
    b = start(db, "pair", "w2")
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (a["run_id"], a["token"]))
    c = start(db, "pair", "w3")
    assert c["outcome"] == "started" and c["token"] > b["token"]
    assert value(db, "SELECT seat FROM ledger.job_execution_log WHERE run_id = %s", (c["run_id"],)) == 1
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
    # the job's running run is the newest one
    assert value(db, "SELECT running_run_id FROM ledger.counters WHERE job = 'pair'") == c["run_id"]
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (c["run_id"], c["token"]))
    assert value(db, "SELECT running_run_id FROM ledger.counters WHERE job = 'pair'") == b["run_id"]
    one(db, "SELECT * FROM ledger.fail_run(%s, %s, 'x')", (b["run_id"], b["token"]))
    assert value(db, "SELECT running_run_id FROM ledger.counters WHERE job = 'pair'") is None
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_a_slot_and_a_key_succeed_at_most_once_with_two_seats(db):
    register(db, "pair", 2)
    slot = "2026-01-01 00:00+00"
    a = start(db, "pair", "w1", slot=slot)
    assert start(db, "pair", "w2", slot=slot)["outcome"] == "already_done"
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (a["run_id"], a["token"]))
    assert start(db, "pair", "w2", slot=slot)["outcome"] == "already_done"
    k = start(db, "pair", "w1", key="k1")
    assert start(db, "pair", "w2", key="k1")["outcome"] == "already_done"
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (k["run_id"], k["token"]))
    assert start(db, "pair", "w2", key="k1")["outcome"] == "already_done"
    assert rows(db, "SELECT * FROM ledger.duplicates") == []


def test_a_crashed_seat_shows_crashed_and_the_next_start_closes_it_as_lease_expired(db, ledger_clock):
    register(db, "pair", 2)
    # the ledger's clock moves past w1's ttl, not w2's: a sleep past a short ttl let a loaded
    # machine start w2 after w1's lease had expired, in w1's seat
    a = start(db, "pair", "w1", ttl="1 minute")
    b = start(db, "pair", "w2", ttl="1 hour")
    ledger_clock.advance(timedelta(minutes=2))
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'pair'") == "crashed"
    assert value(db, "SELECT ledger.is_current('pair', %s)", (a["token"],)) is False
    c = start(db, "pair", "w3")
    assert c["outcome"] == "started"
    assert one(db, "SELECT status, failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
               (a["run_id"],)) == {"status": "failure", "failure_reason": "lease_expired"}
    assert running(db, "pair") == 2
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'pair'") == "running"
    # the zombie: its heartbeat answers NULL, its end LD001 (its seat went to another token)
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (a["run_id"], a["token"])) is None
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT * FROM ledger.complete_run(%s, %s)", (a["run_id"], a["token"]))
    assert e.value.sqlstate == "LD001"
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (b["run_id"], b["token"])) is not None
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_reap_expired_closes_the_expired_seat_only(db, ledger_clock):
    register(db, "pair", 2)
    # the ledger's clock moves past w1's ttl, not w2's: a sleep past a short ttl let a loaded
    # machine start w2 after w1's lease had expired, in w1's seat
    a = start(db, "pair", "w1", ttl="1 minute")
    b = start(db, "pair", "w2", ttl="1 hour")
    ledger_clock.advance(timedelta(minutes=2))
    assert value(db, "SELECT ledger.reap_expired('pair')") == 1
    assert value(db, "SELECT status FROM ledger.job_execution_log WHERE run_id = %s", (a["run_id"],)) == "failure"
    assert value(db, "SELECT status FROM ledger.job_execution_log WHERE run_id = %s", (b["run_id"],)) == "running"
    assert value(db, "SELECT ledger.reap_expired('pair')") == 0
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_bare_acquire_takes_seats_and_renew_release_work_per_seat(db):
    register(db, "pair", 2, ttl="1 minute")
    a = one(db, "SELECT * FROM ledger.acquire('pair', 'h1')")
    b = one(db, "SELECT * FROM ledger.acquire('pair', 'h2')")
    assert a["token"] < b["token"]
    assert rows(db, "SELECT * FROM ledger.acquire('pair', 'h3')") == []
    assert start(db, "pair", "w")["outcome"] == "skipped_overlap"
    assert value(db, "SELECT ledger.renew('pair', 'h1', %s)", (a["token"],)) is not None
    assert value(db, "SELECT ledger.renew('pair', 'h2', %s)", (a["token"],)) is None
    db.execute("SELECT ledger.assert_current('pair', %s)", (a["token"],))
    assert value(db, "SELECT ledger.release('pair', 'h1', %s)", (a["token"],)) is True
    assert value(db, "SELECT ledger.release('pair', 'h1', %s)", (a["token"],)) is False
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT ledger.assert_current('pair', %s)", (a["token"],))
    assert e.value.sqlstate == "LD001"
    c = one(db, "SELECT * FROM ledger.acquire('pair', 'h3')")
    assert c["token"] > b["token"]


def test_with_two_live_holders_the_higher_tokens_write_refuses_the_lower(db):
    register(db, "pair", 2)
    a = start(db, "pair", "w1")
    b = start(db, "pair", "w2")
    assert value(db, "SELECT ledger.fence('pair', 'table', %s)", (a["token"],)) == a["token"]
    assert value(db, "SELECT ledger.fence('pair', 'table', %s)", (b["token"],)) == b["token"]
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT ledger.fence('pair', 'table', %s)", (a["token"],))
    assert e.value.sqlstate == "LD002"
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT ledger.advance_fence('pair', 'table', %s)", (a["token"],))
    assert e.value.sqlstate == "LD002"
    # a resource per seat: each holder its own
    assert value(db, "SELECT ledger.advance_fence('pair', 'table:1', %s)", (a["token"],)) is True
    assert value(db, "SELECT ledger.advance_fence('pair', 'table:2', %s)", (b["token"],)) is True
    # a token that is no live seat's is refused as a stale lease
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (a["run_id"], a["token"]))
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT ledger.fence('pair', 'table:1', %s)", (a["token"],))
    assert e.value.sqlstate == "LD001"


def test_force_release_supersedes_every_seat(db):
    register(db, "pair", 2)
    a = start(db, "pair", "w1")
    b = start(db, "pair", "w2")
    token = value(db, "SELECT ledger.force_release('pair')")
    assert token > b["token"]
    assert running(db, "pair") == 0
    for run in (a, b):
        assert value(db, "SELECT ledger.heartbeat(%s, %s)", (run["run_id"], run["token"])) is None
        with pytest.raises(psycopg.Error) as e:
            db.execute("SELECT * FROM ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
        assert e.value.sqlstate == "LD001"
    c = start(db, "pair", "w3")
    assert c["outcome"] == "started" and c["token"] > token
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_request_cancel_ends_the_seats_run_at_its_heartbeat(db):
    register(db, "pair", 2)
    a = start(db, "pair", "w1")
    b = start(db, "pair", "w2")
    assert value(db, "SELECT ledger.request_cancel(%s)", (a["run_id"],)) is True
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (a["run_id"], a["token"])) is None
    assert value(db, "SELECT failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
                 (a["run_id"],)) == "cancelled"
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (b["run_id"], b["token"])) is not None
    assert start(db, "pair", "w3")["outcome"] == "started"
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_unregister_is_refused_while_a_seat_is_live(db):
    register(db, "pair", 2)
    start(db, "pair", "w1")
    with pytest.raises(psycopg.Error) as e:
        db.execute("SELECT ledger.unregister_job('pair')")
    assert e.value.sqlstate == "22023"


@pytest.mark.parametrize("bad", [0, -1, 1001])
def test_max_concurrent_out_of_bounds_is_22023_naming_it_and_changes_nothing(db, bad):
    register(db, "pair", 1)
    before = state(db)
    with pytest.raises(psycopg.Error) as e:
        register(db, "pair", bad)
    assert e.value.sqlstate == "22023"
    assert "max_concurrent" in e.value.diag.message_primary
    assert state(db) == before
    with pytest.raises(psycopg.Error) as e:
        register(db, "fresh", bad)
    assert e.value.sqlstate == "22023"
    assert value(db, "SELECT count(*) FROM ledger.jobs WHERE job = 'fresh'") == 0


def test_the_bound_is_ledger_max_concurrent(db):
    assert value(db, "SELECT ledger._max_concurrent()") == 1000
    assert register(db, "wide", 1000)["max_concurrent"] == 1000


@pytest.mark.parametrize("policy", ["replace", "buffer_one"])
def test_replace_and_buffer_one_need_max_concurrent_1(db, policy):
    register(db, "pair", 2)
    before = state(db)
    with pytest.raises(psycopg.Error) as e:
        one(db, "SELECT * FROM ledger.register_job('pair', overlap_policy => %s)", (policy,))
    assert e.value.sqlstate == "22023" and "overlap_policy" in e.value.diag.message_primary
    assert state(db) == before
    one(db, "SELECT * FROM ledger.register_job('solo', overlap_policy => %s)", (policy,))
    with pytest.raises(psycopg.Error) as e:
        register(db, "solo", 2)
    assert e.value.sqlstate == "22023" and "max_concurrent" in e.value.diag.message_primary


def test_register_without_max_concurrent_keeps_it(db):
    register(db, "pair", 3)
    assert one(db, "SELECT * FROM ledger.register_job('pair', ttl => '5 minutes')")["max_concurrent"] == 3
    assert one(db, "SELECT * FROM ledger.register_job('solo')")["max_concurrent"] == 1


def test_a_single_holder_job_is_not_in_seats_mode(db):
    one(db, "SELECT * FROM ledger.register_job('solo')")
    a = start(db, "solo", "w1")
    assert value(db, "SELECT multi FROM ledger.leases WHERE job = 'solo'") is False
    assert value(db, "SELECT count(*) FROM ledger.lease_seats") == 0
    assert start(db, "solo", "w2")["outcome"] == "skipped_overlap"
    assert value(db, "SELECT seat FROM ledger.job_execution_log WHERE run_id = %s", (a["run_id"],)) == 1


def test_1_to_2_to_1_with_live_runs(db):
    one(db, "SELECT * FROM ledger.register_job('job')")
    a = start(db, "job", "w1")
    # 1 -> 2: the live holder moves into seat 1 and keeps its lease
    register(db, "job", 2)
    assert value(db, "SELECT multi FROM ledger.leases WHERE job = 'job'") is True
    assert value(db, "SELECT ledger.is_current('job', %s)", (a["token"],)) is True
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (a["run_id"], a["token"])) is not None
    b = start(db, "job", "w2")
    assert b["outcome"] == "started" and b["token"] > a["token"]
    assert start(db, "job", "w3")["outcome"] == "skipped_overlap"
    # 2 -> 1 with two live runs: both keep their seats, no third is admitted,
    # and one seat is admitted again once both ended
    register(db, "job", 1)
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (b["run_id"], b["token"])) is not None
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (a["run_id"], a["token"]))
    assert start(db, "job", "w3")["outcome"] == "skipped_overlap"
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (b["run_id"], b["token"]))
    c = start(db, "job", "w3")
    assert c["outcome"] == "started" and c["token"] > b["token"]
    assert start(db, "job", "w4")["outcome"] == "skipped_overlap"
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
    # in seats mode for good: replace and buffer_one stay refused at max_concurrent 1
    with pytest.raises(psycopg.Error) as e:
        one(db, "SELECT * FROM ledger.register_job('job', overlap_policy => 'replace')")
    assert e.value.sqlstate == "22023" and "overlap_policy" in e.value.diag.message_primary


def test_a_job_with_no_lease_yet_enters_seats_mode_at_registration(db):
    register(db, "fresh", 2)
    assert value(db, "SELECT multi FROM ledger.leases WHERE job = 'fresh'") is True
    a = start(db, "fresh", "w1")
    assert a["outcome"] == "started" and a["token"] >= 2
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def _to_next_minute(db, clock, into=1.0):
    from datetime import timedelta
    now = value(db, "SELECT ledger._now()")
    clock.advance(timedelta(seconds=60 - (now.second + now.microsecond / 1e6) + into))


def test_the_scheduler_starts_due_slots_in_free_seats_and_skips_when_all_are_live(db, ledger_clock):
    from datetime import timedelta
    one(db, "SELECT * FROM ledger.register_job('sched', '1 minute', '10 minutes', max_backfill => 5, "
            "max_concurrent => 2)")
    _to_next_minute(db, ledger_clock)
    first = rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['sched'], 'o')")
    assert [r["outcome"] for r in first] == ["started"]
    # the next slot comes due while the first runs: the second seat takes it
    assert value(db, "SELECT ledger.next_start(ARRAY['sched'])") <= value(db, "SELECT ledger._now()") \
        + timedelta(minutes=1)
    ledger_clock.advance(timedelta(minutes=1))
    second = rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['sched'], 'o')")
    assert [r["outcome"] for r in second] == ["started"]
    assert running(db, "sched") == 2
    # both seats live: the next start is when the first seat frees, and a round starts nothing
    expires = value(db, "SELECT min(expires_at) FROM ledger.lease_seats WHERE job = 'sched'")
    assert value(db, "SELECT ledger.next_start(ARRAY['sched'])") == expires
    ledger_clock.advance(timedelta(minutes=1))
    assert rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['sched'], 'o')") == []
    assert running(db, "sched") == 2
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (first[0]["run_id"], first[0]["token"]))
    third = rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['sched'], 'o')")
    assert [r["outcome"] for r in third] == ["started"]
    assert third[0]["token"] > second[0]["token"]
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
    assert rows(db, "SELECT * FROM ledger.overlaps") == []


def test_job_health_still_reads_no_log_row_with_seats(db):
    plan = "\n".join(r[0] for r in db.execute("EXPLAIN SELECT * FROM ledger.job_health").fetchall())
    assert "job_execution_log" not in plan


def test_an_acquire_that_takes_a_crashed_seat_closes_its_run_first(db, ledger_clock):
    register(db, "pair", 2, ttl="1 minute")
    a = start(db, "pair", "w1", ttl="1 minute")
    start(db, "pair", "w2", ttl="1 hour")
    ledger_clock.advance(timedelta(minutes=2))
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'pair'") == "crashed"
    assert one(db, "SELECT * FROM ledger.acquire('pair', 'h1')") is not None
    assert one(db, "SELECT status, failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
               (a["run_id"],)) == {"status": "failure", "failure_reason": "lease_expired"}
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'pair'") == "running"
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


@pytest.mark.parametrize("write", ["INSERT INTO ledger.lease_seats DEFAULT VALUES",
                                   "UPDATE ledger.lease_seats SET token = token", "DELETE FROM ledger.lease_seats"])
def test_a_client_role_cannot_write_the_seats_but_reads_them(db, app_role, write):
    register(db, "pair", 2)
    start(db, "pair", "w1")
    db.execute(f"SET ROLE {app_role}")
    assert value(db, "SELECT count(*) FROM ledger.lease_seats") == 1
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute(write)


def test_the_jobs_file_key_max_concurrent(db):
    one(db, """SELECT * FROM ledger.sync_jobs(source => 'file-a', definitions => '{"pair": {"schedule": "1 hour", "ttl": "5 minutes",
                                                                 "max_concurrent": 3}}'::jsonb)""")
    assert value(db, "SELECT max_concurrent FROM ledger.jobs WHERE job = 'pair'") == 3
    # a definition is the whole of it: left out, the key stands for 1
    one(db, """SELECT * FROM ledger.sync_jobs(source => 'file-a', definitions => '{"pair": {"schedule": "1 hour", "ttl": "5 minutes"}}'::jsonb)""")
    assert value(db, "SELECT max_concurrent FROM ledger.jobs WHERE job = 'pair'") == 1
    with pytest.raises(psycopg.Error) as e:
        one(db, """SELECT * FROM ledger.sync_jobs(source => 'file-a', definitions => '{"pair": {"schedule": "1 hour", "ttl": "5 minutes",
                                                                     "max_concurrent": 0}}'::jsonb)""")
    assert e.value.sqlstate == "22023" and "max_concurrent" in e.value.diag.message_primary
