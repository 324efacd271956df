"""64 clients on one hot job: no deadlock, no serialization error, and a skip is as cheap as the floor's.

Every client does a fixed number of start_run calls (a fixed amount of work,
whatever the machine's speed); a winner fences a write and completes its run.
The assertions are invariants only, never timings: every answer is a
documented outcome, never two holders (``ledger.overlaps`` stays empty, and
the fenced writes carry growing tokens), and the counters add up to exactly
what the clients saw. A second test proves what a skip does not do: it takes
no lease row lock and writes no logged table (so it issues no token and its
commit waits for no WAL flush).
"""

import threading

import psycopg

from sqlhelp import one, rows, value

CLIENTS = 64
CALLS = 15          # start_run calls per client
TIMEOUT = 180.0     # liveness guard: a client not done by then hangs


def test_64_clients_on_one_hot_job_see_only_documented_outcomes_and_the_counters_add_up(connect, db):
    db.execute("SELECT ledger.register_job('hot', ttl => '1 hour')")
    db.execute("CREATE TABLE public.writes (token bigint NOT NULL)")
    conns = [connect() for _ in range(CLIENTS)]
    barrier = threading.Barrier(CLIENTS)
    lock = threading.Lock()
    seen = {"started": 0, "skipped_overlap": 0, "completed": 0}
    errors: list[str] = []

    def client(index, conn):
        owner = f"client-{index}"
        try:
            barrier.wait(TIMEOUT)
            for _ in range(CALLS):
                started = one(conn, "SELECT * FROM ledger.start_run('hot', %s)", (owner,))
                with lock:
                    seen[started["outcome"]] = seen.get(started["outcome"], 0) + 1
                if started["outcome"] != "started":
                    assert started["outcome"] == "skipped_overlap", started
                    assert started["holder"] is not None and started["holder"] != owner
                    continue
                with conn.transaction():
                    conn.execute("INSERT INTO public.writes SELECT ledger.fence('hot', 'hot-table', %s)",
                                 (started["token"],))
                conn.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
                with lock:
                    seen["completed"] += 1
        except (psycopg.Error, AssertionError, threading.BrokenBarrierError) as error:
            with lock:
                errors.append(f"{owner}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=client, args=(i, c)) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a client hangs"
    # No deadlock (40P01), no serialization failure (40001), no other error.
    assert errors == []
    assert seen["started"] + seen["skipped_overlap"] == CLIENTS * CALLS
    assert seen["started"] >= 1 and seen["completed"] == seen["started"]

    # Exactly one holder at a time.
    assert rows(db, "SELECT * FROM ledger.overlaps") == []
    tokens = [r["token"] for r in rows(db, "SELECT token FROM public.writes ORDER BY token")]
    assert len(tokens) == len(set(tokens)) == seen["started"]
    assert [r["token"] for r in rows(db, "SELECT token FROM ledger.job_execution_log ORDER BY run_id")] == tokens

    # The counters add up, the skips not yet folded in included.
    counters = one(db, "SELECT * FROM ledger.job_counters WHERE job = 'hot'")
    assert counters["runs_started"] == seen["started"]
    assert counters["successes"] == seen["completed"]
    assert counters["skipped_overlap"] == seen["skipped_overlap"]
    assert (counters["failures"], counters["leases_lost"]) == (0, 0)
    status = one(db, "SELECT * FROM ledger.job_status WHERE job = 'hot'")
    assert status["skipped_overlap"] == seen["skipped_overlap"]
    assert status["running_run_id"] is None and status["last_status"] == "success"
    assert status["consecutive_failures"] == 0
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0  # the state row is the log's


def test_a_skip_takes_no_lease_row_lock_and_writes_no_logged_table(connect, db):
    db.execute("SELECT ledger.register_job('hot', ttl => '1 hour')")
    holder = one(db, "SELECT * FROM ledger.start_run('hot', 'holder')")
    assert holder["outcome"] == "started"
    before = one(db, "SELECT (SELECT xmin::text FROM ledger.leases WHERE job = 'hot') AS lease,"
                     " (SELECT xmin::text FROM ledger.counters WHERE job = 'hot') AS counters")
    other = connect(autocommit=False)
    pid = other.info.backend_pid
    for _ in range(3):
        skipped = one(other, "SELECT * FROM ledger.start_run('hot', 'other')")
        assert skipped["outcome"] == "skipped_overlap" and skipped["holder"] == "holder"
        # Another client can take the lease row lock at once (NOWAIT): the
        # skip, its transaction still open, holds none.
        with connect(autocommit=False) as probe:
            probe.execute("SELECT FROM ledger.leases WHERE job = 'hot' FOR UPDATE NOWAIT")
            probe.rollback()
        assert value(db, "SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)) == "idle in transaction"
        # The only write of a skip is to the unlogged skip counts: nothing logged.
        assert value(other, "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND mode = 'RowExclusiveLock'"
                            " AND relation IN ('ledger.leases'::regclass, 'ledger.counters'::regclass,"
                            " 'ledger.job_execution_log'::regclass)") == 0
        other.commit()
    after = one(db, "SELECT (SELECT xmin::text FROM ledger.leases WHERE job = 'hot') AS lease,"
                    " (SELECT xmin::text FROM ledger.counters WHERE job = 'hot') AS counters")
    assert after == before
    assert value(db, "SELECT relpersistence FROM pg_class WHERE oid = 'ledger.skip_counts'::regclass") == "u"
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'hot'") == 3
    # The end of the run folds the skips into the durable counters.
    db.execute("SELECT ledger.complete_run(%s, %s)", (holder["run_id"], holder["token"]))
    assert value(db, "SELECT skipped_overlap FROM ledger.counters WHERE job = 'hot'") == 3
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'hot'") == 3


def test_a_skip_whose_count_row_an_end_holds_is_counted_in_a_spare_row(connect, db):
    """An end folds the job's skip rows and holds them until its commit; a skip meanwhile counts in a
    spare row of its shard (ledger._count_skip) instead of waiting out its bound and losing the count."""
    db.execute("SELECT ledger.register_job('hot', ttl => '1 hour')")
    holder = one(db, "SELECT * FROM ledger.start_run('hot', 'holder')")
    skipper = connect(autocommit=True)
    assert one(skipper, "SELECT * FROM ledger.start_run('hot', 'other')")["outcome"] == "skipped_overlap"
    shard = value(skipper, "SELECT (pg_backend_pid() % 16)::smallint")
    assert rows(db, "SELECT shard, skipped_overlap FROM ledger.skip_counts WHERE job = 'hot'") == \
        [{"shard": shard, "skipped_overlap": 1}]
    # What an end's fold holds: every row of the job, until its commit.
    folder = connect(autocommit=False)
    folder.execute("SELECT FROM ledger.skip_counts WHERE job = 'hot' FOR UPDATE")
    for _ in range(2):
        assert one(skipper, "SELECT * FROM ledger.start_run('hot', 'other')")["outcome"] == "skipped_overlap"
    folder.rollback()
    assert rows(db, "SELECT shard, skipped_overlap FROM ledger.skip_counts WHERE job = 'hot' ORDER BY shard") == \
        [{"shard": shard, "skipped_overlap": 1}, {"shard": shard + 16, "skipped_overlap": 2}]
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'hot'") == 3
    # The next end folds the spare row too.
    db.execute("SELECT ledger.complete_run(%s, %s)", (holder["run_id"], holder["token"]))
    assert value(db, "SELECT skipped_overlap FROM ledger.counters WHERE job = 'hot'") == 3
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0


def test_a_skip_whose_shard_row_another_open_skip_holds_is_counted_and_does_not_wait_for_it(connect, db):
    """Another skip of the same shard holds its row (its UPDATE, uncommitted) while this one skips:
    the count goes to a spare row at once. Before, an INSERT ... ON CONFLICT DO NOTHING onto the held
    row waited for its holder's commit, timed out, and dropped the count (the 64-client test then
    counted a skip too few now and then)."""
    db.execute("SELECT ledger.register_job('hot', ttl => '1 hour')")
    holder = one(db, "SELECT * FROM ledger.start_run('hot', 'holder')")
    skipper = connect(autocommit=True)
    assert one(skipper, "SELECT * FROM ledger.start_run('hot', 'other')")["outcome"] == "skipped_overlap"
    shard = value(skipper, "SELECT (pg_backend_pid() % 16)::smallint")
    # What a skip of another backend of the same shard does, its transaction still open.
    other = connect(autocommit=False)
    other.execute("UPDATE ledger.skip_counts SET skipped_overlap = skipped_overlap + 1"
                  " WHERE job = 'hot' AND shard = %s", (shard,))
    skipper.execute("SET lock_timeout = '30s'")  # the caller's own bound, restored after each skip
    for _ in range(2):
        assert one(skipper, "SELECT * FROM ledger.start_run('hot', 'other')")["outcome"] == "skipped_overlap"
        assert value(skipper, "SHOW lock_timeout") == "30s"
    # Both counted in the spare row while the other transaction still holds the shard's row.
    assert rows(db, "SELECT shard, skipped_overlap FROM ledger.skip_counts WHERE job = 'hot' ORDER BY shard") == \
        [{"shard": shard, "skipped_overlap": 1}, {"shard": shard + 16, "skipped_overlap": 2}]
    other.commit()
    assert value(db, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'hot'") == 4
    db.execute("SELECT ledger.complete_run(%s, %s)", (holder["run_id"], holder["token"]))
    assert value(db, "SELECT skipped_overlap FROM ledger.counters WHERE job = 'hot'") == 4
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0
