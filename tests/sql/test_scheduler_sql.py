"""The scheduler's SQL (issue 23): jitter, start deadlines, overlap policies, run now,
the batched start, the schedulers' registry and upkeep election, sync_jobs.

Time moves through the clock seam (ledger_clock), never by sleeping; concurrency
tests use fixed iterations and assert invariants only."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from sqlhelp import one, rows, value

MINUTE = timedelta(minutes=1)


def _to_next_minute(db: psycopg.Connection, clock: Any, into: float = 1.0) -> None:
    """Move the ledger's clock to `into` seconds past the next whole minute."""
    now = value(db, "SELECT ledger._now()")
    past = now.second + now.microsecond / 1e6
    clock.advance(timedelta(seconds=60 - past + into))


def _start(db: psycopg.Connection, jobs: list[str], owner: str = "sched-1") -> list[dict[str, Any]]:
    return rows(db, "SELECT * FROM ledger.start_due_runs(%s, %s)", (jobs, owner))


def _skips(db: psycopg.Connection, job: str) -> list[tuple[Any, ...]]:
    return db.execute("SELECT reason, slot_count FROM ledger.skipped_slots WHERE job = %s ORDER BY first_slot",
                      (job,)).fetchall()


# -- jitter -------------------------------------------------------------------------------------------


def test_jitter_is_within_its_bound_and_the_same_in_every_session(db, connect):
    db.execute("SELECT ledger.register_job('spread', '1 hour', '1 minute', jitter => '10 minutes')")
    other = connect()
    other.execute("SET TimeZone = 'Asia/Kathmandu'")
    query = ("SELECT ledger.slot_jitter('spread', s) FROM generate_series(timestamptz '2026-01-01 00:00Z',"
             " timestamptz '2026-01-05 03:00Z', interval '1 hour') s")
    mine = [r[0] for r in db.execute(query).fetchall()]
    theirs = [r[0] for r in other.execute(query).fetchall()]
    assert mine == theirs
    assert all(timedelta(0) <= j < timedelta(minutes=10) for j in mine)
    assert len(set(mine)) > len(mine) // 2, "offsets spread over the bound"


def test_a_slot_does_not_start_before_its_jitter_has_passed(db, ledger_clock):
    db.execute("SELECT ledger.register_job('j', '1 minute', '30 seconds', jitter => '50 seconds')")
    _to_next_minute(db, ledger_clock, into=59)
    first = _start(db, ["j"])
    assert len(first) == 1
    db.execute("SELECT ledger.complete_run(%s, %s)", (first[0]["run_id"], first[0]["token"]))
    _to_next_minute(db, ledger_clock, into=0.0)
    slot = value(db, "SELECT date_trunc('minute', ledger._now())")
    assert slot == first[0]["slot"] + MINUTE
    offset = value(db, "SELECT ledger.slot_jitter('j', %s)", (slot,))
    assert value(db, "SELECT ledger.next_start(ARRAY['j'])") == slot + offset
    ledger_clock.advance(offset - timedelta(milliseconds=200))
    assert _start(db, ["j"]) == []
    ledger_clock.advance(timedelta(milliseconds=400))
    started = _start(db, ["j"])
    assert [(r["job"], r["slot"]) for r in started] == [("j", slot)]


def test_jitter_at_or_over_the_schedules_gap_is_refused_and_nothing_changes(db):
    db.execute("SELECT ledger.register_job('g', '*/5 * * * *', '1 minute')")
    for bad in ("5 minutes", "1 month", "-1 second", "25 hours"):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
            db.execute("SELECT ledger.register_job('g', jitter => %s::interval)", (bad,))
        assert "jitter" in caught.value.diag.message_primary
    assert value(db, "SELECT jitter FROM ledger.jobs WHERE job = 'g'") is None
    with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
        db.execute("SELECT ledger.register_job('g', overlap_policy => 'forbid')")
    assert "overlap_policy" in caught.value.diag.message_primary
    assert value(db, "SELECT overlap_policy FROM ledger.jobs WHERE job = 'g'") == "catch_up"


# -- start deadline -----------------------------------------------------------------------------------


def test_a_start_deadline_skips_late_slots_counts_them_and_never_runs_them(db, ledger_clock):
    db.execute("SELECT ledger.register_job('d', '1 minute', '30 seconds', max_backfill => 10,"
               " start_deadline => '20 seconds')")
    _to_next_minute(db, ledger_clock)
    first = _start(db, ["d"])
    assert len(first) == 1
    db.execute("SELECT ledger.complete_run(%s, %s)", (first[0]["run_id"], first[0]["token"]))
    # Five slots pass with no scheduler; the newest is 30 s old: past its deadline too.
    ledger_clock.advance(5 * MINUTE + timedelta(seconds=30))
    assert _start(db, ["d"]) == []
    assert _skips(db, "d") == [("start_deadline", 5)]
    assert value(db, "SELECT skipped_deadline FROM ledger.job_counters WHERE job = 'd'") == 5
    assert value(db, "SELECT skipped_deadline FROM ledger.job_status WHERE job = 'd'") == 5
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'd'") == 1
    # ... and never runs them late: the next slot is the next one on time.
    nxt = value(db, "SELECT ledger.next_start(ARRAY['d'])")
    assert nxt > value(db, "SELECT ledger._now()")
    _to_next_minute(db, ledger_clock, into=5)
    again = _start(db, ["d"])
    assert len(again) == 1 and again[0]["slot"] == nxt


def test_start_due_run_applies_the_deadline_too(db, ledger_clock):
    db.execute("SELECT ledger.register_job('d1', '1 minute', '30 seconds', max_backfill => 3,"
               " start_deadline => '10 seconds')")
    _to_next_minute(db, ledger_clock, into=30)
    assert one(db, "SELECT * FROM ledger.start_due_run('d1', 'cron')")["outcome"] == "nothing_due"
    assert _skips(db, "d1") == [("start_deadline", 1)]


# -- overlap policies ---------------------------------------------------------------------------------


def _running(db: psycopg.Connection, job: str, policy: str, clock: Any) -> dict[str, Any]:
    """A job with the policy and a live run of its slot; then two more slots come due during it."""
    db.execute("SELECT ledger.register_job(%s, '1 minute', '10 minutes', max_backfill => 10, overlap_policy => %s)",
               (job, policy))
    _to_next_minute(db, clock)
    started = _start(db, [job])
    assert len(started) == 1
    clock.advance(2 * MINUTE)
    return started[0]


def test_catch_up_the_default_keeps_0_1_0_behaviour_slots_due_during_a_run_run_after_it(db, ledger_clock):
    run = _running(db, "cu", "catch_up", ledger_clock)
    assert _start(db, ["cu"]) == []  # live: nothing starts, the same owner's run is not superseded
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    after = [_start(db, ["cu"]) for _ in range(3)]
    slots = [r[0]["slot"] for r in after if r]
    assert slots == [run["slot"] + MINUTE, run["slot"] + 2 * MINUTE] or len(slots) == 1
    assert _skips(db, "cu") == []


def test_skip_records_the_slots_and_the_trigger_that_came_due_during_a_live_run(db, ledger_clock):
    run = _running(db, "sk", "skip", ledger_clock)
    trigger = value(db, "SELECT ledger.trigger('sk', 'operator')")
    assert one(db, "SELECT status, skip_reason FROM ledger.triggers WHERE trigger_id = %s", (trigger,)) == {
        "status": "skipped", "skip_reason": "overlap"}
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    assert _start(db, ["sk"]) == []
    assert _skips(db, "sk") == [("overlap", 2)]
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'sk'") == 3  # 2 slots, 1 trigger


def test_the_schedulers_overlap_skips_are_counted_without_waiting_for_a_transaction_holding_the_count_row(
        db, connect, ledger_clock):
    """The skips of a slot and of a trigger count as a start's skip does (ledger._count_skips): past a
    row another transaction holds (an end's fold, an open skip), in a spare row. Before, they wrote the
    row with ON CONFLICT DO UPDATE and waited for that transaction, without a bound."""
    run = _running(db, "sk", "skip", ledger_clock)
    assert one(db, "SELECT * FROM ledger.start_run('sk', 'other')")["outcome"] == "skipped_overlap"
    shard = value(db, "SELECT (pg_backend_pid() % 16)::smallint")
    holder = connect(autocommit=False)
    assert holder.execute("SELECT shard FROM ledger.skip_counts WHERE job = 'sk' FOR UPDATE").fetchall() == [(shard,)]
    db.execute("SET statement_timeout = '30s'")  # a wait for the holder fails the test instead of hanging it
    trigger = value(db, "SELECT ledger.trigger('sk', 'operator')")
    assert value(db, "SELECT skip_reason FROM ledger.triggers WHERE trigger_id = %s", (trigger,)) == "overlap"
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    assert _start(db, ["sk"]) == []
    assert _skips(db, "sk") == [("overlap", 2)]
    holder.rollback()
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'sk'") == 4  # 1 start, 1 trigger, 2 slots
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0
    # The next slot runs on time.
    _to_next_minute(db, ledger_clock)
    assert len(_start(db, ["sk"])) == 1


def test_buffer_one_starts_the_newest_slot_due_during_the_run_right_after_it(db, ledger_clock):
    run = _running(db, "b1", "buffer_one", ledger_clock)
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    started = _start(db, ["b1"])
    assert [r["slot"] for r in started] == [run["slot"] + 2 * MINUTE]
    assert _skips(db, "b1") == [("overlap", 1)]


def test_buffer_one_runs_a_trigger_during_a_live_run_once_it_ends(db, ledger_clock):
    db.execute("SELECT ledger.register_job('bt', '1 hour', '10 minutes', overlap_policy => 'buffer_one')")
    manual = value(db, "SELECT ledger.trigger('bt')")
    first = _start(db, ["bt"])
    assert [r["trigger_id"] for r in first] == [manual]
    second = value(db, "SELECT ledger.trigger('bt', 'ops')")
    assert _start(db, ["bt"]) == []
    assert value(db, "SELECT status FROM ledger.triggers WHERE trigger_id = %s", (second,)) == "pending"
    db.execute("SELECT ledger.complete_run(%s, %s)", (first[0]["run_id"], first[0]["token"]))
    assert value(db, "SELECT ledger.next_start(ARRAY['bt'])") <= value(db, "SELECT ledger._now()")
    started = _start(db, ["bt"])
    assert [r["trigger_id"] for r in started] == [second]
    detail = value(db, "SELECT detail FROM ledger.job_execution_log WHERE run_id = %s", (started[0]["run_id"],))
    assert detail == {"trigger": "manual", "trigger_id": second, "requested_by": "ops"}


def test_replace_supersedes_the_live_run_its_token_is_refused_and_it_is_no_failure(db, ledger_clock):
    db.execute("SELECT ledger.register_job('rp', '1 hour', '10 minutes', overlap_policy => 'replace')")
    db.execute("SELECT ledger.trigger('rp')")
    old = _start(db, ["rp"], owner="host-a")[0]
    assert value(db, "SELECT ledger.fence('rp', 'target', %s)", (old["token"],)) == old["token"]
    db.execute("SELECT ledger.trigger('rp', 'ops')")
    new = _start(db, ["rp"], owner="host-b")
    assert len(new) == 1 and new[0]["token"] > old["token"]
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.fence('rp', 'target', %s)", (old["token"],))
    assert caught.value.sqlstate == "LD001"
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (old["run_id"], old["token"])) is None
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.complete_run(%s, %s)", (old["run_id"], old["token"]))
    assert caught.value.sqlstate == "LD001"
    assert one(db, "SELECT status, failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
               (old["run_id"],)) == {"status": "failure", "failure_reason": "cancelled"}
    health = one(db, "SELECT state, consecutive_failures FROM ledger.job_health WHERE job = 'rp'")
    assert health == {"state": "running", "consecutive_failures": 0}
    assert value(db, "SELECT ledger.fence('rp', 'target', %s)", (new[0]["token"],)) == new[0]["token"]
    assert value(db, "SELECT count(*) FROM ledger.overlaps") == 0


def test_replace_supersedes_a_live_run_when_a_slot_comes_due(db, ledger_clock):
    run = _running(db, "rs", "replace", ledger_clock)
    new = _start(db, ["rs"])
    assert [r["slot"] for r in new] == [run["slot"] + 2 * MINUTE]
    assert value(db, "SELECT failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
                 (run["run_id"],)) == "cancelled"


# -- run now ------------------------------------------------------------------------------------------


def test_trigger_is_logged_as_manual_notifies_and_a_second_one_while_pending_is_the_same(db, connect):
    db.execute("SELECT ledger.register_job('t', '1 day', '1 minute')")
    listener = connect()
    listener.execute("LISTEN ledger_scheduler")
    first = value(db, "SELECT ledger.trigger('t', 'me', '{\"why\": \"test\"}')")
    assert value(db, "SELECT ledger.trigger('t')") == first
    payloads = [n.payload for n in listener.notifies(timeout=5, stop_after=2)]
    assert payloads == ["t", "t"]
    assert value(db, "SELECT ledger.next_start(ARRAY['t'])") <= value(db, "SELECT ledger._now()")
    started = one(db, "SELECT * FROM ledger.start_due_run('t', 'cron')")
    assert started["outcome"] == "started" and started["slot"] is None
    assert value(db, "SELECT run_id FROM ledger.triggers WHERE trigger_id = %s", (first,)) == started["run_id"]
    assert value(db, "SELECT runs_started FROM ledger.job_counters WHERE job = 't'") == 1


def test_trigger_bad_input_names_the_argument_and_changes_nothing(db):
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.trigger('nobody')")
    assert caught.value.sqlstate == "LD005"
    db.execute("SELECT ledger.register_job('t2', '1 day', '1 minute')")
    with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
        db.execute("SELECT ledger.trigger('t2', detail => '[1]')")
    assert "detail" in caught.value.diag.message_primary
    assert value(db, "SELECT count(*) FROM ledger.triggers") == 0


# -- the batched start --------------------------------------------------------------------------------


def test_start_due_runs_from_three_connections_starts_each_due_slot_exactly_once(db, connect, ledger_clock):
    jobs = [f"batch-{i:02d}" for i in range(50)]
    for job in jobs:
        db.execute("SELECT ledger.register_job(%s, '1 minute', '10 minutes')", (job,))
    conns = [connect() for _ in range(3)]
    started: list[tuple[str, Any, int]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def scheduler(conn: psycopg.Connection, name: str) -> None:
        try:
            for _ in range(3):
                for r in rows(conn, "SELECT * FROM ledger.start_due_runs(%s, %s)", (jobs, name)):
                    with lock:
                        started.append((r["job"], r["slot"], r["token"]))
                    conn.execute("SELECT ledger.complete_run(%s, %s)", (r["run_id"], r["token"]))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    for round_ in range(3):
        _to_next_minute(db, ledger_clock)
        threads = [threading.Thread(target=scheduler, args=(c, f"sched-{i}")) for i, c in enumerate(conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(started) == 50 * (round_ + 1)
    assert len({(job, slot) for job, slot, _ in started}) == len(started), "a slot started twice"
    assert len({(job, token) for job, _, token in started}) == len(started), "a token issued twice"
    assert value(db, "SELECT count(*) FROM ledger.overlaps") == 0
    assert value(db, "SELECT count(*) FROM ledger.duplicates") == 0


def test_start_due_runs_caps_its_starts_and_never_retries_a_failed_slot(db, ledger_clock):
    for job in ("c1", "c2", "c3"):
        db.execute("SELECT ledger.register_job(%s, '1 minute', '10 minutes')", (job,))
    _to_next_minute(db, ledger_clock)
    first = rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['c1', 'c2', 'c3'], 'o', max_runs => 2)")
    assert len(first) == 2
    for r in first:
        db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (r["run_id"], r["token"]))
    rest = _start(db, ["c1", "c2", "c3"], owner="o")
    assert [r["job"] for r in rest] == sorted({"c1", "c2", "c3"} - {r["job"] for r in first})
    assert value(db, "SELECT ledger.next_start(%s)", ([r["job"] for r in first],)) > value(db, "SELECT ledger._now()")


def test_start_due_runs_bad_input_is_refused_naming_the_argument(db):
    for call, argument in (("ARRAY['ok', '']::text[], 'o'", "jobs"), ("ARRAY['ok'], ''", "owner"),
                           ("ARRAY['ok'], 'o', 0", "max_runs"), ("ARRAY['ok'], 'o', NULL, '1 month'", "ttl")):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
            db.execute(f"SELECT * FROM ledger.start_due_runs({call})")
        assert argument in caught.value.diag.message_primary
    with pytest.raises(psycopg.errors.NullValueNotAllowed):
        db.execute("SELECT * FROM ledger.start_due_runs(NULL, 'o')")


# -- schedulers and the upkeep leader -----------------------------------------------------------------


def test_scheduler_heartbeat_elects_exactly_one_leader_among_concurrent_callers(connect):
    conns = [connect() for _ in range(3)]
    barrier = threading.Barrier(3)
    results: list[list[bool]] = [[] for _ in range(3)]

    def beat(i: int) -> None:
        for _ in range(40):
            barrier.wait()
            results[i].append(value(conns[i], "SELECT ledger.scheduler_heartbeat(%s, 'h', %s, '0.2', ARRAY['x'],"
                                               " '1 minute')", (f"s{i}", i)))

    threads = [threading.Thread(target=beat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for round_ in range(40):
        assert sum(results[i][round_] for i in range(3)) == 1, f"round {round_}"
    assert value(conns[0], "SELECT term FROM ledger.upkeep_leader") == 1


def test_a_new_leader_after_the_old_ones_ttl_and_after_a_stop(db, ledger_clock):
    beat = "SELECT ledger.scheduler_heartbeat(%s, 'h', 1, '0.2', ARRAY['x'], '30 seconds')"
    assert value(db, beat, ("a",)) is True
    assert value(db, beat, ("b",)) is False
    ledger_clock.advance(timedelta(seconds=31))
    assert value(db, beat, ("b",)) is True
    assert value(db, beat, ("a",)) is False
    db.execute("SELECT ledger.scheduler_stop('b')")
    assert value(db, beat, ("a",)) is True
    assert value(db, "SELECT array_agg(scheduler::text ORDER BY scheduler) FROM ledger.schedulers") == ["a"]


def test_a_job_whose_every_scheduler_expired_is_down_with_that_reason(db, ledger_clock):
    db.execute("SELECT ledger.register_job('served', '1 hour', '1 minute')")
    for name in ("s1", "s2"):
        db.execute("SELECT ledger.scheduler_heartbeat(%s, 'h', 1, '0.2', ARRAY['served'], '1 minute')", (name,))
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'served'") == "never_run"
    ledger_clock.advance(timedelta(seconds=61))
    health = one(db, "SELECT state, reason FROM ledger.job_health WHERE job = 'served'")
    assert health == {"state": "down", "reason": "no live scheduler serves it"}
    assert value(db, "SELECT count(*) FROM ledger.alerts WHERE job = 'served' AND alert = 'down'") == 1
    db.execute("SELECT ledger.scheduler_heartbeat('s2', 'h', 1, '0.2', ARRAY['served'], '1 minute')")
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'served'") == "never_run"


# -- sync_jobs ----------------------------------------------------------------------------------------


def _sync(db: psycopg.Connection, definitions: dict[str, Any], source: str = "a.toml",
          removed: str = "pause") -> dict[str, str]:
    return {r["job"]: r["action"] for r in rows(db, "SELECT * FROM ledger.sync_jobs(%s, %s, %s)",
                                                 (Jsonb(definitions), source, removed))}


def test_sync_jobs_creates_changes_pauses_and_resumes(db):
    one_ = {"schedule": "*/5 * * * *", "ttl": "1 minute"}
    assert _sync(db, {"x": one_, "y": one_}) == {"x": "created", "y": "created"}
    assert _sync(db, {"x": one_, "y": {**one_, "jitter": "1 minute"}}) == {"x": "unchanged", "y": "changed"}
    assert _sync(db, {"x": one_}) == {"x": "unchanged", "y": "paused"}
    assert one(db, "SELECT paused, pause_reason FROM ledger.jobs WHERE job = 'y'") == {
        "paused": True, "pause_reason": "removed"}
    assert _sync(db, {"x": one_, "y": one_}) == {"x": "unchanged", "y": "changed"}
    assert value(db, "SELECT paused FROM ledger.jobs WHERE job = 'y'") is False
    assert value(db, "SELECT jitter FROM ledger.jobs WHERE job = 'y'") is None  # a key left out: its default
    assert _sync(db, {"x": one_}, removed="unregister") == {"x": "unchanged", "y": "unregistered"}
    assert value(db, "SELECT count(*) FROM ledger.jobs WHERE job = 'y'") == 0


@pytest.mark.parametrize("bad, key", [
    ({"schedule": "61 * * * *"}, "schedule"),
    ({"schedule": "1 hour", "time_zone": "Mars/Olympus"}, "time_zone"),
    ({"schedule": "1 hour", "ttl": "soon"}, "ttl"),
    ({"schedule": "1 hour", "command": ["echo"]}, "command"),
    ({"schedule": "1 hour", "max_backfill": 0}, "max_backfill"),
    ({"schedule": "1 hour", "overlap_policy": "allow_all"}, "overlap_policy"),
])
def test_sync_jobs_refuses_a_bad_file_whole_naming_the_job_and_the_key(db, bad, key):
    assert _sync(db, {"good": {"schedule": "1 hour", "ttl": "1 minute"}}) == {"good": "created"}
    before = db.execute("SELECT to_jsonb(j) - 'updated_at' FROM ledger.jobs j ORDER BY job").fetchall()
    with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
        _sync(db, {"good": {"schedule": "2 hours", "ttl": "1 minute"}, "bad": bad, "new": {"schedule": "1 hour"}})
    message = caught.value.diag.message_primary
    assert "job bad" in message and f"key {key}" in message, message
    assert db.execute("SELECT to_jsonb(j) - 'updated_at' FROM ledger.jobs j ORDER BY job").fetchall() == before


def test_two_sources_last_writer_wins_loudly(db):
    assert _sync(db, {"shared": {"schedule": "1 hour", "ttl": "1 minute"}}, source="a.toml") == {"shared": "created"}
    assert _sync(db, {"shared": {"schedule": "1 hour", "ttl": "1 minute"}}, source="b.toml") == {
        "shared": "unchanged"}
    assert _sync(db, {"shared": {"schedule": "2 hours", "ttl": "1 minute"}}, source="a.toml") == {
        "shared": "overridden"}
    event = one(db, "SELECT kind, detail FROM ledger.events WHERE kind = 'job_redefined'")
    assert event is not None and event["detail"]["source"] == "a.toml"
    assert event["detail"]["previous_source"] == "b.toml"
    assert value(db, "SELECT defined_by FROM ledger.jobs WHERE job = 'shared'") == "a.toml"
    assert value(db, "SELECT schedule FROM ledger.jobs WHERE job = 'shared'") == "2 hours"


def test_a_job_a_scheduler_stops_serving_is_no_longer_down_for_it(db, ledger_clock):
    db.execute("SELECT ledger.register_job('moved', '1 hour', '1 minute')")
    beat = "SELECT ledger.scheduler_heartbeat('s1', 'h', 1, '0.2', %s, '1 minute')"
    db.execute(beat, (["moved", "other"],))
    db.execute(beat, (["other"],))
    assert value(db, "SELECT count(*) FROM ledger.scheduler_jobs WHERE job = 'moved'") == 0
    ledger_clock.advance(timedelta(seconds=61))
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'moved'") == "never_run"
    db.execute("SELECT ledger.scheduler_stop('s1')")
    assert value(db, "SELECT count(*) FROM ledger.scheduler_jobs") == 0
