"""Real concurrency: connections in threads contend for one job, a fixed amount of work each.

Every worker does a fixed number of holds (or runs), so the amount of work is
the same on a fast and on a busy machine; only its duration varies. The
assertions are invariants (never two holders, tokens unique and counting up,
fenced writes in token order, zombie writes refused, no overlaps), never
counts of work done in a given time. ``TIMEOUT`` is a liveness guard: a worker
that cannot finish its share in that long reports a hang, not slowness.
"""

import random
import threading
import time
from collections import Counter

import psycopg

from sqlhelp import rows, value

WORKERS = 6             # the machine may have 2 cores: enough threads to contend, not to thrash
HOLDS = 80              # per worker, in the acquire test
RUNS = 12               # started runs per worker, in the run test
FREEZE_EVERY = 4        # each worker's 4th, 8th, 12th run freezes past its ttl: a zombie
TTL = 0.15              # seconds, the run test's lease
FREEZE = 2 * TTL        # a frozen run sleeps this long, so its lease has surely expired
TIMEOUT = 120.0         # seconds; a worker not done by then is stuck, whatever the machine


def _start_together(workers):
    threads = [threading.Thread(target=target, args=args) for target, args in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    assert not any(t.is_alive() for t in threads), "a worker hangs"


def _hammer(dsn, worker, barrier, deadline, record, inside, guard, errors):
    rng = random.Random(worker)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait(TIMEOUT)
            held = 0
            while held < HOLDS:
                assert time.monotonic() < deadline, f"worker {worker} stuck after {held} holds"
                lease = conn.execute("SELECT token FROM ledger.acquire('hot', %s, '10 seconds')",
                                     (f"w{worker}",)).fetchone()
                if lease is None:
                    continue  # another worker holds it: try again at once, that is the contention
                held += 1
                token = lease[0]
                with guard:
                    inside.append(token)
                    record.append((token, len(inside)))
                time.sleep(rng.random() / 500)  # the work under the lease
                with guard:
                    inside.remove(token)
                assert conn.execute("SELECT ledger.release('hot', %s, %s)", (f"w{worker}", token)).fetchone()[0]
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def test_acquire_under_contention_never_has_two_holders_and_tokens_count_up(dsn, db):
    record, inside, errors = [], [], []
    guard = threading.Lock()
    barrier = threading.Barrier(WORKERS)
    deadline = time.monotonic() + TIMEOUT
    _start_together([(_hammer, (dsn, i, barrier, deadline, record, inside, guard, errors))
                     for i in range(WORKERS)])
    assert errors == []
    tokens = [token for token, _ in record]
    assert max(holders for _, holders in record) == 1               # never two holders at once
    assert sorted(tokens) == list(range(1, WORKERS * HOLDS + 1))    # unique, counting up by one, none lost
    assert tokens == sorted(tokens)                                 # issued in increasing order
    lease = rows(db, "SELECT token, released_at FROM ledger.leases WHERE job = 'hot'")[0]
    assert lease["token"] == WORKERS * HOLDS and lease["released_at"] is not None
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0  # the lease's job has its state row


def _run_worker(dsn, worker, barrier, deadline, outcomes, frozen, rejected, errors):
    rng = random.Random(1000 + worker)
    owner = f"w{worker}"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            barrier.wait(TIMEOUT)
            started_runs = 0
            while started_runs < RUNS:
                assert time.monotonic() < deadline, f"worker {worker} stuck after {started_runs} runs"
                started = conn.execute(
                    "SELECT outcome, run_id, token FROM ledger.start_run(job => 'hot', owner => %s, ttl => %s)",
                    (owner, f"{TTL * 1000:g} milliseconds")).fetchone()
                outcomes[started[0]] += 1
                if started[0] != "started":
                    time.sleep(0.001)
                    continue
                started_runs += 1
                _, run_id, token = started
                if started_runs % FREEZE_EVERY == 0:
                    # Frozen past its ttl (no heartbeat): a zombie that later tries to write.
                    frozen.append(token)
                    time.sleep(FREEZE)
                else:
                    time.sleep(rng.random() / 100)  # the work
                wrote = True
                try:
                    with conn.transaction():
                        conn.execute("SELECT ledger.fence(job => 'hot', resource => 'sink', token => %s)",
                                     (token,))
                        conn.execute("INSERT INTO sink (token, owner) VALUES (%s, %s)", (token, owner))
                except psycopg.Error as exc:
                    # LD001: the lease expired or was taken over; LD002: a takeover wrote first.
                    assert exc.sqlstate in ("LD001", "LD002"), exc
                    rejected.append(token)
                    wrote = False
                try:
                    if wrote:
                        conn.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
                    else:
                        conn.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => 'fence refused')",
                                     (run_id, token))
                except psycopg.Error as exc:
                    assert exc.sqlstate in ("LD001", "LD003"), exc  # closed by a takeover already
    except BaseException as exc:
        errors.append(exc)


def test_runs_under_contention_stay_exclusive_fenced_in_token_order_and_audited(dsn, db):
    db.execute("CREATE TABLE sink (id bigserial PRIMARY KEY, token bigint NOT NULL, owner text NOT NULL)")
    outcomes, frozen, rejected, errors = Counter(), [], [], []
    barrier = threading.Barrier(WORKERS)
    deadline = time.monotonic() + TIMEOUT
    _start_together([(_run_worker, (dsn, i, barrier, deadline, outcomes, frozen, rejected, errors))
                     for i in range(WORKERS)])
    assert errors == []
    assert outcomes["started"] == WORKERS * RUNS
    db.execute("SELECT ledger.reap_expired()")

    # The fence row lock orders commits: sink ids follow commit order, so the
    # tokens of committed writes never go backwards.
    sink = [r["token"] for r in rows(db, "SELECT token FROM sink ORDER BY id")]
    assert sink == sorted(sink)
    assert len(sink) == len(set(sink))  # one write per run, none replayed
    # Every zombie (frozen past its ttl) was refused by the fence, and no refused write landed.
    assert len(frozen) == WORKERS * (RUNS // FREEZE_EVERY)
    assert set(frozen) <= set(rejected)
    assert not set(rejected) & set(sink)
    assert len(sink) + len(rejected) == WORKERS * RUNS  # every run either wrote or was refused
    if sink:  # the fence remembers the last write's job and token
        assert value(db, "SELECT (job, token)::text FROM ledger.fences WHERE resource = 'sink'") == \
            f"(hot,{max(sink)})"

    # The log: tokens unique and counting up, none running, no overlaps.
    log = rows(db, "SELECT token, status, failure_reason FROM ledger.job_execution_log ORDER BY token")
    tokens = [r["token"] for r in log]
    assert tokens == list(range(1, WORKERS * RUNS + 1))
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'running'") == 0
    # A success is a run whose fenced write committed (the converse need not hold: a
    # takeover may close a run between its write and its complete_run).
    assert {r["token"] for r in log if r["status"] == "success"} <= set(sink)
    assert not {r["token"] for r in log if r["status"] == "success"} & set(frozen)
    overlaps = rows(db, "SELECT * FROM ledger.overlaps")
    assert overlaps == [], overlaps[:3]
    counters = rows(db, "SELECT * FROM ledger.job_counters WHERE job = 'hot'")[0]
    assert counters["runs_started"] == outcomes["started"]
    assert counters["skipped_overlap"] == outcomes["skipped_overlap"]
    assert counters["successes"] + counters["failures"] == outcomes["started"]
    assert counters["successes"] == sum(r["status"] == "success" for r in log)
    assert counters["leases_lost"] == sum(r["failure_reason"] in ("lease_expired", "superseded") for r in log)
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0  # the state row is the log's


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
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0  # every state row is its log's
