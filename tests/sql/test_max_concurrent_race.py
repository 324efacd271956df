"""Real concurrency on a max_concurrent => 2 job: workers in threads, a fixed amount of work each.

Invariants only (never three live runs, tokens never reissued and increasing in
issue order, a slot succeeds once, the state rows agree with the log), never
counts of work done in a given time. TIMEOUT is a liveness guard.
"""

import random
import threading
import time

import psycopg

from sqlhelp import rows, value

WORKERS = 6
RUNS = 10               # started runs per worker
ZOMBIE_EVERY = 4        # each worker's 4th, 8th run freezes past its ttl
TTL = 0.5               # seconds
TIMEOUT = 120.0


def _worker(dsn, worker, barrier, deadline, issued, guard, errors):
    rng = random.Random(worker)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait(TIMEOUT)
            started = 0
            while started < RUNS:
                assert time.monotonic() < deadline, f"worker {worker} stuck after {started} runs"
                # issue order: the token is issued under the job's lease row lock, and
                # appended while that start's transaction is committed, so tokens
                # appended later by the same worker are later in issue order
                row = conn.execute(
                    "SELECT outcome, run_id, token FROM ledger.start_run('pair', %s, %s::interval)",
                    (f"w{worker}", f"{TTL} seconds")).fetchone()
                if row[0] != "started":
                    assert row[0] == "skipped_overlap", row
                    time.sleep(rng.random() / 200)
                    continue
                started += 1
                _, run_id, token = row
                with guard:
                    issued.append((worker, token))
                if started % ZOMBIE_EVERY == 0:
                    time.sleep(2.5 * TTL)  # a zombie: its seat expires under it
                    # its end: LD001 when its seat went to another token, LD003 when a
                    # start closed its run; a seat nobody took still ends
                    try:
                        conn.execute("SELECT * FROM ledger.complete_run(%s, %s)", (run_id, token))
                    except psycopg.Error as exc:
                        assert exc.sqlstate in ("LD001", "LD003"), exc
                    continue
                time.sleep(rng.random() / 100)
                try:
                    conn.execute("SELECT * FROM ledger.complete_run(%s, %s)", (run_id, token))
                except psycopg.Error as exc:
                    # a busy machine may let even a short run's seat expire and be taken
                    assert exc.sqlstate in ("LD001", "LD003"), exc
    except BaseException as exc:
        errors.append(exc)


def _sampler(dsn, stop, samples, errors):
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                samples.append(conn.execute(
                    "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'pair' AND status = 'running'"
                ).fetchone()[0])
                samples.append(conn.execute(
                    "SELECT count(*) FROM ledger.lease_seats WHERE job = 'pair' AND released_at IS NULL "
                    "AND expires_at > ledger._now()").fetchone()[0])
    except BaseException as exc:
        errors.append(exc)


def test_six_workers_on_a_two_seat_job_never_have_three_live_runs_nor_reuse_a_token(db, dsn):
    db.execute("SELECT ledger.register_job('pair', max_concurrent => 2)")
    barrier = threading.Barrier(WORKERS)
    deadline = time.monotonic() + TIMEOUT
    issued, guard, errors, samples = [], threading.Lock(), [], []
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(dsn, stop, samples, errors))
    sampler.start()
    threads = [threading.Thread(target=_worker, args=(dsn, w, barrier, deadline, issued, guard, errors))
               for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    stop.set()
    sampler.join(30)
    assert not any(t.is_alive() for t in threads), "a worker hangs"
    assert not errors, errors
    assert len(issued) == WORKERS * RUNS
    tokens = [t for _, t in issued]
    assert len(set(tokens)) == len(tokens), "a token was issued twice"
    for w in range(WORKERS):
        mine = [t for worker, t in issued if worker == w]
        assert mine == sorted(mine), "a worker's tokens went down"
    # the lock-free sampler never saw three running runs nor three live seats
    assert samples and max(samples) <= 2
    # and the database says the same: one running run per seat, seats 1 and 2 only
    assert value(db, "SELECT array_agg(DISTINCT seat ORDER BY seat) FROM ledger.job_execution_log "
                     "WHERE job = 'pair'") in ([1, 2], [1])
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
    log_tokens = [r["token"] for r in rows(db, "SELECT token FROM ledger.job_execution_log WHERE job = 'pair' "
                                               "ORDER BY run_id")]
    assert log_tokens == sorted(log_tokens) and len(set(log_tokens)) == len(log_tokens)
    assert value(db, "SELECT token FROM ledger.leases WHERE job = 'pair'") >= max(log_tokens)
    time.sleep(2 * TTL)
    db.execute("SELECT ledger.reap_expired('pair')")
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'pair' AND status = 'running'") == 0
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
    assert rows(db, "SELECT * FROM ledger.duplicates") == []


def _slot_worker(dsn, worker, barrier, outcomes, errors):
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait(TIMEOUT)
            for i in range(20):
                row = conn.execute(
                    "SELECT outcome, run_id, token FROM ledger.start_run('pair', %s, '1 minute', "
                    "slot => timestamptz '2026-01-01 00:00+00' + %s * interval '1 minute')",
                    (f"w{worker}", i % 5)).fetchone()
                outcomes.append(row[0])
                if row[0] == "started":
                    conn.execute("SELECT * FROM ledger.complete_run(%s, %s)", (row[1], row[2]))
    except BaseException as exc:
        errors.append(exc)


def test_racing_workers_on_two_seats_succeed_each_slot_once(db, dsn):
    db.execute("SELECT ledger.register_job('pair', max_concurrent => 2)")
    barrier = threading.Barrier(WORKERS)
    outcomes, errors = [], []
    threads = [threading.Thread(target=_slot_worker, args=(dsn, w, barrier, outcomes, errors))
               for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    assert not any(t.is_alive() for t in threads), "a worker hangs"
    assert not errors, errors
    assert outcomes.count("started") == 5
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'pair' AND status = 'success'") == 5
    assert rows(db, "SELECT * FROM ledger.duplicates") == []
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
