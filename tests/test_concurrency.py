"""Real concurrency: 16 connections in threads hammer one job for seconds."""

import random
import threading
import time
from collections import Counter

import psycopg
import pytest

from sqlhelp import rows, value

WORKERS = 16
SECONDS = 4.0


def _hammer(dsn, worker, deadline, record, inside, guard, errors):
    rng = random.Random(worker)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                lease = conn.execute("SELECT token FROM ledger.acquire('hot', %s, '10 seconds')",
                                     (f"w{worker}",)).fetchone()
                if lease is None:
                    continue
                token = lease[0]
                with guard:
                    inside.append(token)
                    holders = len(inside)
                record.append((token, holders))
                time.sleep(rng.random() / 500)
                with guard:
                    inside.remove(token)
                assert conn.execute("SELECT ledger.release('hot', %s, %s)", (f"w{worker}", token)).fetchone()[0]
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def test_acquire_under_contention_never_has_two_holders_and_tokens_count_up(dsn):
    record, inside, errors = [], [], []
    guard = threading.Lock()
    deadline = time.monotonic() + SECONDS
    threads = [threading.Thread(target=_hammer, args=(dsn, i, deadline, record, inside, guard, errors))
               for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tokens = [token for token, _ in record]
    assert len(tokens) > 100, "too little contention to prove anything"
    assert max(holders for _, holders in record) == 1          # never two holders at once
    assert sorted(tokens) == list(range(1, len(tokens) + 1))   # unique, counting up by one
    assert tokens == sorted(tokens)                            # issued in increasing order


def _run_worker(dsn, worker, deadline, outcomes, writes_rejected, errors):
    rng = random.Random(1000 + worker)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                started = conn.execute(
                    "SELECT outcome, run_id, token FROM ledger.start_run('hot', %s, '150 milliseconds')",
                    (f"w{worker}",)).fetchone()
                outcomes[started[0]] += 1
                if started[0] != "started":
                    time.sleep(0.001)
                    continue
                _, run_id, token = started
                # One in five runs freezes past its ttl: a zombie that later tries to write.
                time.sleep(0.3 if rng.random() < 0.2 else rng.random() / 100)
                try:
                    with conn.transaction():
                        conn.execute("SELECT ledger.fence('sink', %s)", (token,))
                        conn.execute("INSERT INTO sink (token, owner) VALUES (%s, %s)", (token, f"w{worker}"))
                except psycopg.Error as exc:
                    assert exc.sqlstate == "LD002", exc
                    writes_rejected.append(token)
                try:
                    conn.execute("SELECT ledger.complete_run(%s, %s)", (run_id, token))
                except psycopg.Error as exc:
                    assert exc.sqlstate in ("LD001", "LD003"), exc
    except BaseException as exc:
        errors.append(exc)


def test_runs_under_contention_stay_exclusive_fenced_in_token_order_and_audited(dsn, db):
    db.execute("CREATE TABLE sink (id bigserial PRIMARY KEY, token bigint NOT NULL, owner text NOT NULL)")
    outcomes, rejected, errors = Counter(), [], []
    deadline = time.monotonic() + SECONDS
    threads = [threading.Thread(target=_run_worker, args=(dsn, i, deadline, outcomes, rejected, errors))
               for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert outcomes["started"] > 50 and outcomes["skipped_overlap"] > 0
    db.execute("SELECT ledger.reap_expired()")

    # The fence row lock orders commits: sink ids follow commit order, so the
    # tokens of committed writes never go backwards.
    sink = [r["token"] for r in rows(db, "SELECT token FROM sink ORDER BY id")]
    assert sink == sorted(sink)
    assert len(sink) == len(set(sink))  # one write per run, none replayed
    # Zombies were there, and the fence refused them.
    assert len(rejected) > 0
    assert not set(rejected) & set(sink)

    # The log: tokens unique and counting up, at most one running, no overlaps.
    log = rows(db, "SELECT token, status FROM ledger.job_execution_log ORDER BY token")
    tokens = [r["token"] for r in log]
    assert tokens == list(range(1, len(tokens) + 1))
    assert len(tokens) == outcomes["started"]
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'running'") == 0
    overlaps = rows(db, "SELECT * FROM ledger.overlaps")
    assert overlaps == [], overlaps[:3]
    counters = rows(db, "SELECT * FROM ledger.job_counters WHERE job = 'hot'")[0]
    assert counters["runs_started"] == outcomes["started"]
    assert counters["skipped_overlap"] == outcomes["skipped_overlap"]
    assert counters["successes"] + counters["failures"] == outcomes["started"]
    assert counters["leases_lost"] > 0


def _reaper(dsn, deadline, closed, errors):
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                closed.append(conn.execute("SELECT ledger.reap_expired()").fetchone()[0])
    except BaseException as exc:
        errors.append(exc)


def test_concurrent_reapers_and_starters_do_not_deadlock_or_double_close(dsn, db):
    for i in range(20):
        db.execute("SELECT ledger.start_run(%s, 'crashed', '10 milliseconds')", (f"job-{i}",))
    time.sleep(0.05)
    closed, errors = [], []
    deadline = time.monotonic() + 1.0
    threads = [threading.Thread(target=_reaper, args=(dsn, deadline, closed, errors)) for _ in range(4)]
    for t in threads:
        t.start()
    for i in range(20):
        db.execute("SELECT ledger.start_run(%s, 'fresh', '1 hour')", (f"job-{i}",))
    for t in threads:
        t.join()
    assert errors == []
    failed = value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE failure_reason = 'lease_expired'")
    assert failed == 20
    assert sum(closed) <= 20  # each crashed run closed once, by a reaper or by its job's next start
    assert value(db, "SELECT sum(leases_lost) FROM ledger.counters") == 20
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'running'") == 20
