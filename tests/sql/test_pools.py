"""Pools (issue 20): a named limit of live leases shared by jobs.

Registration and its bad input, the admission in every start (start_run,
acquire, start_due_runs), the count kept apart from the other skips, the
scheduler's waiting marks (the oldest due waits least), and a race of real
connections that never has more live leases in a pool than its size."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from sqlhelp import one, rows, value


def _pool(db: psycopg.Connection, pool: str = "heavy", size: int = 2, jobs: tuple[str, ...] = ("a", "b", "c"),
          schedule: str | None = None) -> None:
    db.execute("SELECT ledger.register_pool(%s, %s)", (pool, size))
    for job in jobs:
        db.execute("SELECT ledger.register_job(%s, %s, '1 minute', pool => %s)", (job, schedule, pool))


def _start(db: psycopg.Connection, job: str, owner: str = "w1", **named: Any) -> dict[str, Any]:
    params = "".join(f", {k} => %s" for k in named)
    row = one(db, f"SELECT * FROM ledger.start_run(%s, %s{params})", (job, owner, *named.values()))
    assert row is not None
    return row


def _end(db: psycopg.Connection, run: dict[str, Any]) -> None:
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))


def _status(db: psycopg.Connection, pool: str = "heavy") -> dict[str, Any]:
    row = one(db, "SELECT * FROM ledger.pool_status WHERE pool = %s", (pool,))
    assert row is not None
    return row


# -- registration and bad input -------------------------------------------------------------------


def test_a_pool_is_registered_resized_and_dropped(db):
    row = one(db, "SELECT * FROM ledger.register_pool('heavy', 3)")
    assert row is not None and (row["pool"], row["size"]) == ("heavy", 3)
    assert value(db, "SELECT size FROM ledger.resize_pool('heavy', 5)") == 5
    assert value(db, "SELECT size FROM ledger.register_pool('heavy', 4)") == 4  # register changes the size too
    assert value(db, "SELECT ledger.drop_pool('heavy')") is True
    assert value(db, "SELECT ledger.drop_pool('heavy')") is False
    assert value(db, "SELECT count(*) FROM ledger.pools") == 0


@pytest.mark.parametrize("size", [0, -1, 100_001])
def test_a_size_out_of_bounds_is_refused_naming_size_and_changes_nothing(db, size):
    db.execute("SELECT ledger.register_pool('heavy', 2)")
    for call in ("register_pool", "resize_pool"):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
            db.execute(f"SELECT ledger.{call}('heavy', %s)", (size,))
        assert "argument size" in caught.value.diag.message_primary
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("SELECT ledger.register_pool('fresh', %s)", (size,))
    assert rows(db, "SELECT pool, size FROM ledger.pools") == [{"pool": "heavy", "size": 2}]


def test_null_arguments_are_refused_with_22004(db):
    for call in ("SELECT ledger.register_pool(NULL, 1)", "SELECT ledger.register_pool('p', NULL)",
                 "SELECT ledger.resize_pool(NULL, 1)", "SELECT ledger.drop_pool(NULL)",
                 "SELECT ledger.drop_pool('p', NULL)"):
        with pytest.raises(psycopg.errors.NullValueNotAllowed):
            db.execute(call)


def test_a_pool_name_that_is_no_label_is_refused_naming_pool(db):
    for bad in ("", "x" * 201, "a\u200bb"):
        with pytest.raises(psycopg.errors.InvalidParameterValue) as caught:
            db.execute("SELECT ledger.register_pool(%s, 1)", (bad,))
        assert "pool" in caught.value.diag.message_primary
    db.execute("SELECT ledger.register_job('j', ttl => '1 minute')")
    with pytest.raises(psycopg.errors.InvalidParameterValue):
        db.execute("SELECT ledger.register_job('j', pool => %s)", ("x" * 201,))
    assert value(db, "SELECT pool FROM ledger.jobs WHERE job = 'j'") is None


def test_an_unknown_pool_is_ld008_naming_the_pool_and_changes_nothing(db):
    db.execute("SELECT ledger.register_job('j', ttl => '1 minute')")
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.register_job('j', schedule => '1 hour', pool => 'nope')")
    assert caught.value.sqlstate == "LD008"
    assert "nope" in caught.value.diag.message_primary
    assert one(db, "SELECT schedule, pool FROM ledger.jobs WHERE job = 'j'") == {"schedule": None, "pool": None}
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.resize_pool('nope', 3)")
    assert caught.value.sqlstate == "LD008"


def test_a_pool_with_jobs_is_not_dropped_unless_detached(db):
    _pool(db, jobs=("a", "b"))
    run = _start(db, "a")
    with pytest.raises(psycopg.errors.DependentObjectsStillExist) as caught:
        db.execute("SELECT ledger.drop_pool('heavy')")
    assert "a, b" in caught.value.diag.message_primary
    assert value(db, "SELECT count(*) FROM ledger.jobs WHERE pool = 'heavy'") == 2
    assert value(db, "SELECT ledger.drop_pool('heavy', detach => true)") is True
    assert value(db, "SELECT count(*) FROM ledger.jobs WHERE pool IS NOT NULL") == 0
    assert value(db, "SELECT count(*) FROM ledger.leases WHERE pool IS NOT NULL") == 0
    _end(db, run)  # the run goes on, in no pool


def test_a_job_leaves_its_pool_with_an_empty_name_and_keeps_it_when_left_out(db):
    _pool(db, jobs=("a",))
    _start(db, "a")
    db.execute("SELECT ledger.register_job('a', max_backfill => 2)")
    assert value(db, "SELECT pool FROM ledger.jobs WHERE job = 'a'") == "heavy"
    db.execute("SELECT ledger.register_job('a', pool => '')")
    assert one(db, "SELECT j.pool AS registered, l.pool AS leased FROM ledger.jobs j JOIN ledger.leases l USING (job)"
                   " WHERE job = 'a'") == {"registered": None, "leased": None}
    assert _status(db)["used"] == 0


# -- the admission --------------------------------------------------------------------------------


def test_a_start_over_the_size_is_skipped_pool_full_counted_apart_and_issues_no_token(db):
    _pool(db, size=2)
    a, b = _start(db, "a"), _start(db, "b")
    assert (a["outcome"], b["outcome"]) == ("started", "started")
    c = _start(db, "c")
    assert c["outcome"] == "skipped_pool_full" and c["token"] is None and c["run_id"] is None
    again = _start(db, "c", owner="w2")
    assert again["outcome"] == "skipped_pool_full"
    status = one(db, "SELECT skipped_pool_full, skipped_overlap, failures, state FROM ledger.job_status WHERE job = 'c'")
    assert status == {"skipped_pool_full": 2, "skipped_overlap": 0, "failures": 0, "state": "never_run"}
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'c'") == 0
    assert value(db, "SELECT skipped_pool_full FROM ledger.job_counters WHERE job = 'c'") == 2
    assert _status(db) | {"created_at": None, "updated_at": None} == {
        "pool": "heavy", "size": 2, "used": 2, "running": 2, "jobs": 3, "waiting": 0, "skipped_pool_full": 2,
        "created_at": None, "updated_at": None}
    _end(db, a)
    c = _start(db, "c")
    assert c["outcome"] == "started"
    assert c["token"] > 0


def test_the_same_owner_retaking_its_own_lease_is_not_refused_by_its_own_place(db):
    _pool(db, size=1, jobs=("a", "b"))
    first = _start(db, "a")
    again = _start(db, "a")  # the same owner: the new token wins, the place is the same
    assert again["outcome"] == "started" and again["token"] > first["token"]
    assert _start(db, "b")["outcome"] == "skipped_pool_full"


def test_already_done_wins_over_pool_full(db):
    _pool(db, size=1, jobs=("a", "b"))
    run = _start(db, "b", idempotency_key="k1")
    _end(db, run)
    _start(db, "a")
    assert _start(db, "b", idempotency_key="k1")["outcome"] == "already_done"
    assert _start(db, "b", idempotency_key="k2")["outcome"] == "skipped_pool_full"


def test_acquire_counts_against_the_pool_and_answers_no_row_when_full(db):
    _pool(db, size=1, jobs=("a", "b"))
    lease = one(db, "SELECT * FROM ledger.acquire('a', 'w1')")
    assert lease is not None
    assert rows(db, "SELECT * FROM ledger.acquire('b', 'w1')") == []
    assert _start(db, "b")["outcome"] == "skipped_pool_full"
    assert value(db, "SELECT skipped_pool_full FROM ledger.job_status WHERE job = 'b'") == 2
    # b's first lease row, made while the pool was full, is gone again: no token was handed out
    assert value(db, "SELECT count(*) FROM ledger.leases WHERE job = 'b'") == 0
    db.execute("SELECT ledger.release('a', 'w1', %s)", (lease["token"],))
    assert len(rows(db, "SELECT * FROM ledger.acquire('b', 'w1')")) == 1


def test_an_expired_lease_frees_its_place(db, ledger_clock):
    _pool(db, size=1, jobs=("a", "b"))
    _start(db, "a")  # its runner dies: the lease expires after 1 minute
    assert _start(db, "b")["outcome"] == "skipped_pool_full"
    ledger_clock.advance(timedelta(minutes=1, seconds=1))
    assert _status(db)["used"] == 0
    assert _start(db, "b")["outcome"] == "started"


def test_a_smaller_size_stops_nothing_that_runs_and_admits_nothing_until_under_it(db):
    _pool(db, size=3)
    runs = [_start(db, j) for j in ("a", "b", "c")]
    db.execute("SELECT ledger.resize_pool('heavy', 1)")
    assert all(value(db, "SELECT status FROM ledger.job_execution_log WHERE run_id = %s", (r["run_id"],)) == "running"
               for r in runs)
    _end(db, runs[0])
    assert _start(db, "a")["outcome"] == "skipped_pool_full"  # still 2 live, size 1
    _end(db, runs[1])
    _end(db, runs[2])
    assert _start(db, "a")["outcome"] == "started"


def test_jobs_of_no_pool_and_of_other_pools_are_not_counted(db):
    _pool(db, "p1", 1, ("a",))
    _pool(db, "p2", 1, ("b",))
    db.execute("SELECT ledger.register_job('free', ttl => '1 minute')")
    assert [_start(db, j)["outcome"] for j in ("a", "b", "free")] == ["started"] * 3


def test_unregistering_a_job_takes_its_lease_out_of_the_pool(db):
    _pool(db, size=1, jobs=("a", "b"))
    lease = one(db, "SELECT * FROM ledger.acquire('a', 'w1')")
    assert lease is not None
    db.execute("SELECT ledger.unregister_job('a')")
    assert value(db, "SELECT pool FROM ledger.leases WHERE job = 'a'") is None
    assert _start(db, "b")["outcome"] == "started"


def test_run_guarded_notices_a_full_pool_and_runs_nothing(db, connect):
    _pool(db, size=1, jobs=("a", "b"))
    _start(db, "a")
    guarded = connect(autocommit=True)
    notices: list[str] = []
    guarded.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    guarded.execute("CREATE TABLE touched (n int)")
    guarded.execute("CALL ledger.run_guarded('b', 'INSERT INTO touched VALUES (1)')")
    assert any("skipped_pool_full" in n for n in notices), notices
    assert value(guarded, "SELECT count(*) FROM touched") == 0


# -- the scheduler --------------------------------------------------------------------------------


def _due(db: psycopg.Connection, jobs: list[str], owner: str = "sched-1") -> list[dict[str, Any]]:
    return rows(db, "SELECT * FROM ledger.start_due_runs(%s, %s)", (jobs, owner))


def test_the_scheduler_keeps_a_job_of_a_full_pool_waiting_and_starts_the_oldest_due_first(db, ledger_clock):
    db.execute("SELECT ledger.register_pool('one', 1)")
    # staggered schedules: c came due first, then a, then b
    for job, schedule in (("c", "1 minute"), ("a", "2 minutes"), ("b", "3 minutes")):
        db.execute("SELECT ledger.register_job(%s, %s, '5 minutes', pool => 'one')", (job, schedule))
    ledger_clock.advance(timedelta(minutes=7))
    marks = {r["job"]: r["at"] for r in rows(db, "SELECT job, at FROM ledger.wakeups")}
    first = _due(db, ["a", "b", "c"])
    assert len(first) == 1
    started = first[0]["job"]
    assert started == min(marks, key=lambda j: (marks[j], j))
    waiting = rows(db, "SELECT job, pool_wait, waiting_since, at FROM ledger.wakeups WHERE pool_wait IS NOT NULL"
                       " ORDER BY job")
    assert [w["job"] for w in waiting] == sorted({"a", "b", "c"} - {started})
    assert _status(db, "one")["waiting"] == 2
    # not a busy loop: the next start is when the pool's live lease expires
    # (or 10 s, whichever first), not now
    now = value(db, "SELECT ledger._now()")
    assert value(db, "SELECT ledger.next_start(ARRAY['a','b','c'])") > now
    assert _due(db, ["a", "b", "c"]) == []
    # the run's end wakes the waiting jobs, and the oldest due of them starts
    db.execute("SELECT ledger.complete_run(%s, %s)", (first[0]["run_id"], first[0]["token"]))
    assert value(db, "SELECT count(*) FROM ledger.wakeups WHERE pool_wait IS NOT NULL") == 0
    assert value(db, "SELECT ledger.next_start(ARRAY['a','b','c'])") <= value(db, "SELECT ledger._now()")
    second = _due(db, ["a", "b", "c"])
    oldest = min(waiting, key=lambda w: (w["waiting_since"], w["job"]))["job"]
    assert [r["job"] for r in second] == [oldest]
    assert value(db, "SELECT count(*) FROM ledger.skipped_slots") == 0, "a slot the pool held back is not skipped"


def test_a_pending_trigger_waits_for_a_place(db, ledger_clock):
    _pool(db, size=1, jobs=("a", "b"))
    run = _start(db, "a")
    db.execute("SELECT ledger.trigger('b', 'operator')")
    assert _due(db, ["b"]) == []
    assert value(db, "SELECT status FROM ledger.triggers WHERE job = 'b'") == "pending"
    _end(db, run)
    started = _due(db, ["b"])
    assert [r["job"] for r in started] == ["b"] and started[0]["trigger_id"] is not None


def test_a_larger_size_wakes_the_waiting_jobs(db, ledger_clock):
    db.execute("SELECT ledger.register_pool('one', 1)")
    for job in ("a", "b"):
        db.execute("SELECT ledger.register_job(%s, '1 minute', '5 minutes', pool => 'one')", (job,))
    ledger_clock.advance(timedelta(minutes=2))
    assert len(_due(db, ["a", "b"])) == 1
    assert value(db, "SELECT count(*) FROM ledger.wakeups WHERE pool_wait IS NOT NULL") == 1
    db.execute("SELECT ledger.resize_pool('one', 2)")
    assert value(db, "SELECT count(*) FROM ledger.wakeups WHERE pool_wait IS NOT NULL") == 0
    assert len(_due(db, ["a", "b"])) == 1


# -- under concurrency ----------------------------------------------------------------------------

WORKERS = 6
ITERATIONS = 40


def test_a_pool_of_three_over_five_jobs_never_has_four_live_leases_and_counts_every_skip(db, connect):
    jobs = [f"j{i}" for i in range(5)]
    _pool(db, "three", 3, tuple(jobs))
    skipped: list[int] = [0] * WORKERS
    started: list[int] = [0] * WORKERS
    errors: list[BaseException] = []
    over: list[int] = []
    done = threading.Event()

    def worker(n: int) -> None:
        conn = connect(autocommit=True)
        rng = random.Random(n)
        try:
            for _ in range(ITERATIONS):
                job = rng.choice(jobs)
                row = conn.execute("SELECT outcome, run_id, token FROM ledger.start_run(%s, %s)",
                                   (job, f"w{n}")).fetchone()
                assert row is not None
                if row[0] == "started":
                    started[n] += 1
                    # the admission is committed: the pool must hold it now
                    live = conn.execute("SELECT count(*) FROM ledger.leases WHERE pool = 'three'"
                                        " AND released_at IS NULL AND expires_at > ledger._now()").fetchone()
                    assert live is not None
                    if live[0] > 3:
                        over.append(live[0])
                    conn.execute("SELECT ledger.complete_run(%s, %s)", (row[1], row[2]))
                elif row[0] == "skipped_pool_full":
                    skipped[n] += 1
                else:
                    assert row[0] == "skipped_overlap", row
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def sampler() -> None:
        conn = connect(autocommit=True)
        while not done.is_set():
            live = conn.execute("SELECT count(*) FROM ledger.leases WHERE pool = 'three'"
                                " AND released_at IS NULL AND expires_at > ledger._now()").fetchone()
            assert live is not None
            if live[0] > 3:
                over.append(live[0])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
    watch = threading.Thread(target=sampler)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    done.set()
    watch.join(timeout=60)
    assert not errors, errors
    assert not over, f"more live leases than the pool's size: {over[:5]}"
    # The log agrees: at no instant more than 3 runs of the pool between start and end.
    events = db.execute("SELECT t, d FROM (SELECT started_at AS t, 1 AS d FROM ledger.job_execution_log"
                        " UNION ALL SELECT completed_at, -1 FROM ledger.job_execution_log) e"
                        " ORDER BY t, d").fetchall()
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 3
    assert sum(started) == value(db, "SELECT count(*) FROM ledger.job_execution_log") > 0
    assert sum(skipped) == value(db, "SELECT sum(skipped_pool_full) FROM ledger.job_status") > 0
    assert sum(skipped) == _status(db, "three")["skipped_pool_full"]
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
