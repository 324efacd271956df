"""Pools and max_concurrent together: each seat of a job in seats mode is a
place of its pool, the job's own limit answers before the pool's, and a
seat's end frees a place for the jobs waiting in the pool."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import psycopg

from sqlhelp import one, rows, value


def _start(db: psycopg.Connection, job: str, owner: str = "w1") -> dict[str, Any]:
    row = one(db, "SELECT * FROM ledger.start_run(%s, %s)", (job, owner))
    assert row is not None
    return row


def _used(db: psycopg.Connection, pool: str) -> int:
    return int(value(db, "SELECT used FROM ledger.pool_status WHERE pool = %s", (pool,)))


def _token(db: psycopg.Connection, job: str) -> int:
    return int(value(db, "SELECT token FROM ledger.leases WHERE job = %s", (job,)))


def test_each_seat_takes_a_place_and_a_full_pool_refuses_a_free_seat_without_a_token(db):
    db.execute("SELECT ledger.register_pool('two', 2)")
    db.execute("SELECT ledger.register_job('trio', ttl => '1 minute', pool => 'two', max_concurrent => 3)")
    a, b = _start(db, "trio", "w1"), _start(db, "trio", "w2")
    assert (a["outcome"], b["outcome"]) == ("started", "started")
    assert _used(db, "two") == 2
    before = _token(db, "trio")
    c = _start(db, "trio", "w3")
    assert c["outcome"] == "skipped_pool_full" and c["token"] is None
    assert _token(db, "trio") == before, "a refused start issues no token"
    assert value(db, "SELECT skipped_pool_full FROM ledger.job_status WHERE job = 'trio'") == 1
    assert value(db, "SELECT skipped_overlap FROM ledger.job_status WHERE job = 'trio'") == 0
    assert value(db, "SELECT count(*) FROM ledger.lease_seats WHERE job = 'trio'"
                     " AND released_at IS NULL AND expires_at > ledger._now()") == 2
    db.execute("SELECT ledger.complete_run(%s, %s)", (a["run_id"], a["token"]))
    d = _start(db, "trio", "w3")
    assert d["outcome"] == "started" and d["token"] > b["token"]
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []


def test_the_jobs_own_limit_answers_before_its_pool(db):
    db.execute("SELECT ledger.register_pool('wide', 5)")
    db.execute("SELECT ledger.register_job('pair', ttl => '1 minute', pool => 'wide', max_concurrent => 2)")
    _start(db, "pair", "w1")
    _start(db, "pair", "w2")
    assert _start(db, "pair", "w3")["outcome"] == "skipped_overlap"
    assert value(db, "SELECT skipped_pool_full FROM ledger.job_status WHERE job = 'pair'") == 0


def test_a_single_holder_and_seats_share_one_pool(db):
    db.execute("SELECT ledger.register_pool('two', 2)")
    db.execute("SELECT ledger.register_job('solo', ttl => '1 minute', pool => 'two')")
    db.execute("SELECT ledger.register_job('pair', ttl => '1 minute', pool => 'two', max_concurrent => 2)")
    assert _start(db, "solo")["outcome"] == "started"
    assert _start(db, "pair", "w1")["outcome"] == "started"
    assert _start(db, "pair", "w2")["outcome"] == "skipped_pool_full"
    # acquire of a seat is refused the same way: no row, counted
    assert rows(db, "SELECT * FROM ledger.acquire('pair', 'w9', '1 minute')") == []
    assert value(db, "SELECT skipped_pool_full FROM ledger.job_status WHERE job = 'pair'") == 2
    assert _used(db, "two") == 2


def test_a_job_entering_seats_mode_keeps_its_pool(db):
    db.execute("SELECT ledger.register_pool('one', 1)")
    # no lease row yet: entering seats makes one, with the job's pool on it
    db.execute("SELECT ledger.register_job('late', ttl => '1 minute', pool => 'one')")
    db.execute("SELECT ledger.register_job('late', max_concurrent => 2)")
    assert value(db, "SELECT pool FROM ledger.leases WHERE job = 'late'") == "one"
    assert value(db, "SELECT multi FROM ledger.leases WHERE job = 'late'") is True
    assert _start(db, "late", "w1")["outcome"] == "started"
    assert _start(db, "late", "w2")["outcome"] == "skipped_pool_full"
    # a live single holder moves into seat 1 and keeps its place
    db.execute("SELECT ledger.register_pool('busy', 1)")
    db.execute("SELECT ledger.register_job('held', ttl => '1 minute', pool => 'busy')")
    run = _start(db, "held", "w1")
    db.execute("SELECT ledger.register_job('held', max_concurrent => 2)")
    assert _used(db, "busy") == 1
    assert _start(db, "held", "w2")["outcome"] == "skipped_pool_full"
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (run["run_id"], run["token"])) is not None


def test_a_seats_end_wakes_the_jobs_waiting_in_its_pool(db, ledger_clock):
    db.execute("SELECT ledger.register_pool('one', 1)")
    db.execute("SELECT ledger.register_job('pair', ttl => '5 minutes', pool => 'one', max_concurrent => 2)")
    db.execute("SELECT ledger.register_job('b', '1 minute', '5 minutes', pool => 'one')")
    run = _start(db, "pair")
    ledger_clock.advance(timedelta(minutes=2))
    assert rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['b'], 'sched')") == []
    assert value(db, "SELECT pool_wait FROM ledger.wakeups WHERE job = 'b'") == "one"
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    assert value(db, "SELECT pool_wait FROM ledger.wakeups WHERE job = 'b'") is None
    assert value(db, "SELECT ledger.next_start(ARRAY['b'])") <= value(db, "SELECT ledger._now()")
    started = rows(db, "SELECT * FROM ledger.start_due_runs(ARRAY['b'], 'sched')")
    assert [(r["job"], r["outcome"]) for r in started] == [("b", "started")]


WORKERS = 6
ITERATIONS = 40


def test_a_pool_of_three_over_seats_and_single_holders_never_has_four_live_places(db, connect):
    db.execute("SELECT ledger.register_pool('three', 3)")
    jobs = ["s1", "s2", "u1", "u2"]
    for job in jobs:
        db.execute("SELECT ledger.register_job(%s, ttl => '1 minute', pool => 'three', max_concurrent => %s)",
                   (job, 2 if job.startswith("s") else 1))
    skipped = [0] * WORKERS
    errors: list[BaseException] = []
    over: list[int] = []
    done = threading.Event()

    def worker(n: int) -> None:
        conn = connect(autocommit=True)
        rng = random.Random(n)
        try:
            for _ in range(ITERATIONS):
                row = conn.execute("SELECT outcome, run_id, token FROM ledger.start_run(%s, %s)",
                                   (rng.choice(jobs), f"w{n}")).fetchone()
                assert row is not None
                if row[0] == "started":
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
            used = conn.execute("SELECT used FROM ledger.pool_status WHERE pool = 'three'").fetchone()
            assert used is not None
            if used[0] > 3:
                over.append(used[0])

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
    assert not over, f"more live places than the pool's size: {over[:5]}"
    events = db.execute("SELECT t, d FROM (SELECT started_at AS t, 1 AS d FROM ledger.job_execution_log"
                        " UNION ALL SELECT completed_at, -1 FROM ledger.job_execution_log) e"
                        " ORDER BY t, d").fetchall()
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 3
    assert sum(skipped) == value(db, "SELECT skipped_pool_full FROM ledger.pool_status WHERE pool = 'three'")
    tokens = db.execute("SELECT job, token FROM ledger.job_execution_log ORDER BY job, run_id").fetchall()
    for job in jobs:
        mine = [t for j, t in tokens if j == job]
        assert mine == sorted(set(mine)), f"{job}: a token reissued or out of order"
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
