# Generated from tests/client/test_client_async.py by tools/async_to_sync.py ('make sync'): do not edit.
# Edit tests/client/test_client_async.py and run 'make sync'; CI fails when this file is stale.
"""The sync Python client against a real PostgreSQL: run and lease contexts,
heartbeats, lease loss, fencing, errors, and no leaks."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from ledger import (FenceOfAnotherJob, InvalidArgument, LeaseLost, LeaseSuperseded, Ledger, RunNotFound,
                    StaleToken, default_owner)
from ledger._acompat import parked, wait_event
from ledger.client import advance_fence, fence
from ledger.errors import translate

from time import sleep

SECOND = timedelta(seconds=1)

BACKENDS = (  # the clients connected to the test database but the probe (no autovacuum worker)
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND backend_type = 'client backend'")


def workers() -> int:
    """What runs beside the test: the threads that hold something (not the parked ones)."""
    return threading.active_count() - parked()


def start(target: Callable[[], None]) -> threading.Thread:
    """Run ``target`` beside the test: a thread."""
    thread = threading.Thread(target=target)
    thread.start()
    return thread


def running(writer: threading.Thread) -> bool:
    return writer.is_alive()


def finish(writer: threading.Thread, timeout: float) -> None:
    writer.join(timeout)


@pytest.fixture
def ledger(db):
    db.execute("CREATE TABLE reports (writer text, token bigint)")
    ledger = Ledger(db, owner="worker-1")
    yield ledger
    ledger.close()  # the spare connections of its contexts


def one(db, query, params=None):
    """The first row ``query`` returns on ``db``."""
    cur = db.execute(query, params)
    return cur.fetchone()


def log_row(db, run_id):
    with db.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute("SELECT * FROM ledger.job_execution_log WHERE run_id = %s", (run_id,))
        return cur.fetchone()


def other_start(db, job, owner="intruder", ttl="30 seconds"):
    return one(db, "SELECT outcome, holder FROM ledger.start_run(job => %s, owner => %s, ttl => %s)",
               (job, owner, ttl))


def backends(db) -> int:
    return one(db, BACKENDS)[0]


def fence_row(db, resource):
    return one(db, "SELECT job, token FROM ledger.fences WHERE resource = %s", (resource,))


def wait_until_blocked(db, pid, writer, timeout=30):
    """Poll until backend ``pid`` waits for a lock (while ``writer`` still runs)."""
    deadline = time.monotonic() + timeout
    while one(db, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,))[0] != "Lock":
        assert running(writer) and time.monotonic() < deadline, "the fence never waited for the lock"
        sleep(0.01)


def settle_workers(expected):
    """``workers()`` once it is ``expected``, or after 10 s (a thread parks a moment after its target returned)."""
    deadline = time.monotonic() + 10
    while (now := workers()) != expected and time.monotonic() < deadline:
        sleep(0.01)
    return now


def settle(db, expected: int) -> int:
    # A backend leaves pg_stat_activity a moment after its client closed (a long moment on a busy machine).
    deadline = time.monotonic() + 30
    while (count := backends(db)) != expected and time.monotonic() < deadline:
        sleep(0.05)
    return count


def test_a_run_logs_success_with_its_detail_and_a_fencing_token(ledger, db):
    with ledger.run("nightly", ttl=timedelta(minutes=80), detail={"batch": 7}) as run:
        assert (run.started, run.outcome, run.token) == (True, "started", 1)
        with db.transaction():
            assert run.fence(db, "reports") == 1
            db.execute("INSERT INTO reports VALUES ('worker-1', %s)", (run.token,))
        run.detail["rows"] = 1
    assert run.result is not None and run.result.status == "success"
    assert run.result.detail == {"batch": 7, "rows": 1}
    assert run.result.owner == "worker-1" and run.result.run_id == run.run_id
    assert not run.lost.is_set()
    assert fence_row(db, "reports") == ("nightly", 1)  # bound to the run's job


def test_a_skip_is_not_an_exception_and_says_who_holds_the_job(ledger, db):
    assert other_start(db, "nightly", ttl="1 minute")[0] == "started"
    before = workers()
    with ledger.run("nightly", ttl=timedelta(minutes=80)) as run:
        assert not run.started
        assert run.outcome == "skipped_overlap"
        assert run.holder == "intruder" and run.holder_expires_at is not None
        assert settle_workers(before) == before  # no heartbeat for a run that did not start
        with pytest.raises(RuntimeError, match="skipped_overlap"):
            run.fence(db, "reports")
    assert run.result is None
    assert one(db, "SELECT skipped_overlap, failures FROM ledger.job_counters WHERE job = 'nightly'") == (1, 0)


def test_an_exception_in_the_body_fails_the_run_with_its_message_and_propagates(ledger, db):
    with pytest.raises(ValueError, match="disk full"):
        with ledger.run("nightly", ttl=timedelta(minutes=80)) as run:
            raise ValueError("disk full")
    row = log_row(db, run.run_id)
    assert (row["status"], row["failure_reason"]) == ("failure", "error")
    assert row["error"] == "ValueError: disk full"
    assert run.result is not None and run.result.error == "ValueError: disk full"


# What only one flavour of the client does.
def test_keyboard_interrupt_cancels_the_run_and_propagates(ledger, db):
    with pytest.raises(KeyboardInterrupt):
        with ledger.run("nightly", ttl=timedelta(minutes=80)) as run:
            raise KeyboardInterrupt
    row = log_row(db, run.run_id)
    assert (row["status"], row["failure_reason"], row["error"]) == ("failure", "cancelled", "KeyboardInterrupt")


def test_the_default_owner_is_hostname_pid_random_and_new_in_a_forked_child():
    owner = default_owner()
    assert re.fullmatch(rf".+:{os.getpid()}:[0-9a-f]{{8}}", owner)
    assert default_owner() == owner
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.write(write, default_owner().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 300).decode()
    os.close(read)
    os.close(write)
    assert child != owner and child.split(":")[1] == str(pid)


@pytest.mark.parametrize("over", ["connection", "pool"])
def test_a_one_second_ttl_run_survives_a_five_second_body_while_the_caller_holds_a_transaction(
        over, ledger, db, connect, dsn):
    # The caller's connection stays inside one open transaction for the whole
    # body: the heartbeats must commit elsewhere (on the context's own
    # connection, or the one it holds from the pool), or the lease would look
    # expired to everyone else after one second.
    user = connect(autocommit=False)
    with ConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool, \
            Ledger(user if over == "connection" else pool, owner="worker-1") as user_ledger:
        probes = []
        with user_ledger.run("slow", ttl=SECOND) as run:
            assert run.started
            with user.transaction():
                user.execute("SELECT 1")
                for _ in range(2):
                    sleep(2.55)
                    probes.append(other_start(db, "slow", ttl="1 second"))
                run.fence(user, "reports")
                user.execute("INSERT INTO reports VALUES ('worker-1', %s)", (run.token,))
            run.check(remote=True)
    assert probes == [("skipped_overlap", "worker-1")] * 2
    assert not run.lost.is_set()
    assert run.result is not None and run.result.status == "success"
    assert run.result.heartbeat_at is not None
    assert run.result.heartbeat_at - run.result.started_at > timedelta(seconds=4)
    assert one(db, "SELECT count(*) FROM reports")[0] == 1


def test_the_heartbeat_finding_the_lease_gone_marks_the_run_lost_at_once(ledger, db):
    reports = []
    with pytest.raises(LeaseLost) as at_exit:
        with ledger.run("nightly", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=100),
                        on_lost=reports.append) as run:
            # Someone ends the lease and another owner takes the job over.
            assert one(db, "SELECT ledger.release(job => 'nightly', owner => %s, token => %s)",
                       (run.owner, run.token))[0]
            assert other_start(db, "nightly")[0] == "started"
            assert wait_event(run.lost, 5)
            assert len(reports) == 1 and isinstance(reports[0], LeaseLost)
            assert reports[0].run_id == run.run_id and reports[0].job == "nightly"
            with pytest.raises(LeaseLost):
                run.check()
            with pytest.raises(LeaseLost):
                with db.transaction():
                    run.fence(db, "reports")
    # Completing was refused (LD001): the normal exit says so.
    assert isinstance(at_exit.value.__cause__, LeaseSuperseded)
    assert len(reports) == 1
    assert log_row(db, run.run_id)["failure_reason"] == "lease_expired"


def test_the_fence_rejects_a_holder_whose_lease_was_taken_before_it_noticed(ledger, db):
    # The server expires the lease early (its local deadline is a minute away)
    # and another owner takes over: the run itself does not know it lost the lease.
    with pytest.raises(LeaseLost):
        with ledger.run("nightly", ttl=timedelta(minutes=1), heartbeat_interval=timedelta(hours=1)) as run:
            db.execute(
                "UPDATE ledger.leases SET expires_at = clock_timestamp() - interval '1 second' WHERE job = 'nightly'")
            assert other_start(db, "nightly")[0] == "started"
            assert not run.lost.is_set()
            with pytest.raises(LeaseLost) as rejected:
                with db.transaction():
                    run.fence(db, "reports")
                    db.execute("INSERT INTO reports VALUES ('zombie', %s)", (run.token,))
            assert isinstance(rejected.value.__cause__, LeaseSuperseded)  # LD001 from the fence itself
            assert rejected.value.current_token == run.token + 1 and rejected.value.holder == "intruder"
            assert run.lost.is_set()
            with pytest.raises(LeaseLost):
                with db.transaction():
                    run.advance_fence(db, "reports")
    assert one(db, "SELECT count(*) FROM reports")[0] == 0
    assert fence_row(db, "reports") is None


def test_a_takeover_that_wrote_between_the_fences_check_and_its_lock_marks_the_run_lost(
        ledger, db, connect):
    # LD002: the token was still current when the fence checked it, but the
    # takeover (open transaction, fence row locked) wrote first and committed.
    with pytest.raises(LeaseLost):
        with ledger.run("nightly", ttl=timedelta(minutes=1), heartbeat_interval=timedelta(hours=1)) as run:
            with db.transaction():
                run.fence(db, "reports")
            takeover = connect(autocommit=False)
            assert one(takeover, "SELECT ledger.release(job => 'nightly', owner => 'worker-1', token => %s)",
                       (run.token,))[0]
            steal = "SELECT token FROM ledger.start_run(job => 'nightly', owner => 'thief', ttl => '1 minute')"
            new = one(takeover, steal)[0]
            takeover.execute("SELECT ledger.fence(job => 'nightly', resource => 'reports', token => %s)",
                             (new,))
            zombie = connect()
            outcome: list[BaseException] = []

            def write() -> None:
                try:
                    with zombie.transaction():
                        run.fence(zombie, "reports")
                        zombie.execute("INSERT INTO reports VALUES ('zombie', %s)", (run.token,))
                except BaseException as error:
                    outcome.append(error)

            writer = start(write)
            wait_until_blocked(db, zombie.info.backend_pid, writer)
            takeover.commit()
            finish(writer, 30)
            [error] = outcome
            assert isinstance(error, LeaseLost) and isinstance(error.__cause__, StaleToken)
            assert error.__cause__.highest_token == new and error.__cause__.token == run.token
            assert run.lost.is_set()
            with pytest.raises(LeaseLost):
                run.fence(db, "reports")
    assert one(db, "SELECT count(*) FROM reports")[0] == 0
    assert fence_row(db, "reports") == ("nightly", new)


def test_a_resource_of_another_job_is_fence_of_another_job_not_a_lost_lease(ledger, db):
    indexer = ledger.acquire("indexer", timedelta(minutes=1), owner="indexer-host")
    assert indexer is not None
    assert fence(db, "indexer", "reports", indexer.token) == indexer.token  # "reports" is the indexer's now
    with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
        assert run.token == 1 and indexer.token == 1  # tokens of two jobs: numbers that mean nothing to each other
        with pytest.raises(FenceOfAnotherJob) as theirs:
            with db.transaction():
                run.fence(db, "reports")
                db.execute("INSERT INTO reports VALUES ('nightly', %s)", (run.token,))
        assert theirs.value.sqlstate == "LD006" and isinstance(theirs.value.__cause__, psycopg.Error)
        assert theirs.value.facts == {"resource": "reports", "job": "nightly", "bound_job": "indexer",
                                      "token": run.token}
        assert theirs.value.bound_job == "indexer"
        assert not run.lost.is_set()  # a programming error, not a lost lease
        with pytest.raises(FenceOfAnotherJob):
            with db.transaction():
                run.advance_fence(db, "reports")
        with db.transaction():
            assert run.advance_fence(db, "other") is True
            assert run.advance_fence(db, "other") is False
        # The module-level helpers: the job is an argument, the ledger's errors come as they are.
        with pytest.raises(FenceOfAnotherJob):
            advance_fence(db, "nightly", "reports", run.token)
        assert not run.lost.is_set()
    with pytest.raises(LeaseSuperseded):  # the run ended: its token fences nothing any more
        fence(db, "nightly", "other", run.token)
    assert run.result is not None and run.result.status == "success"
    assert one(db, "SELECT count(*) FROM reports")[0] == 0
    assert fence_row(db, "reports") == ("indexer", indexer.token)
    assert fence_row(db, "other") == ("nightly", run.token)


def test_the_module_level_fences_take_the_job_and_raise_the_ledger_errors_as_they_come(ledger, db):
    lease = ledger.acquire("indexer", timedelta(minutes=1))
    assert lease is not None
    with db.transaction():
        assert fence(db, "indexer", "index", lease.token) == lease.token
        assert fence(db, "indexer", "index", lease.token) == lease.token  # lenient: again with one token
        assert advance_fence(db, "indexer", "once", lease.token) is True
        assert advance_fence(db, "indexer", "once", lease.token) is False  # strict: one write per token
    assert fence_row(db, "index") == ("indexer", lease.token)
    other = ledger.acquire("nightly", timedelta(minutes=1))
    assert other is not None
    with pytest.raises(FenceOfAnotherJob) as theirs:
        fence(db, "nightly", "index", other.token)
    assert (theirs.value.job, theirs.value.bound_job, theirs.value.resource) == ("nightly", "indexer", "index")
    # Without a context nothing is marked: the zombie gets the ledger's LD001 itself.
    assert ledger.release("indexer", lease.token)
    for call in (fence, advance_fence):
        with pytest.raises(LeaseSuperseded) as zombie:
            call(db, "indexer", "index", lease.token)
        assert (zombie.value.job, zombie.value.token, zombie.value.released) == ("indexer", lease.token, True)
    assert fence_row(db, "index") == ("indexer", lease.token)


def test_a_plain_lease_is_renewed_past_its_ttl_and_released_on_exit(ledger, db):
    with ledger.lease("singleton", ttl=SECOND) as lease:
        assert lease.acquired and lease.token == 1
        sleep(1.5)
        assert ledger.acquire("singleton", SECOND, owner="other") is None
        with db.transaction():
            assert lease.fence(db, "reports") == 1
    assert lease.released is True and not lease.lost.is_set()
    assert fence_row(db, "reports") == ("singleton", 1)  # the lease's own job
    with Ledger(db, owner="other").lease("singleton", ttl=SECOND) as taken:
        assert taken.acquired and taken.token == lease.token + 1
    again = ledger.acquire("singleton", SECOND, owner="other")
    assert again is not None and again.token > lease.token


def test_a_lease_held_by_another_owner_is_not_acquired(ledger):
    assert ledger.acquire("singleton", timedelta(minutes=1), owner="other") is not None
    with ledger.lease("singleton", ttl=SECOND) as lease:
        assert not lease.acquired
        with pytest.raises(RuntimeError, match="not acquired"):
            lease.check()
    assert lease.released is None


def test_a_plain_lease_that_was_taken_over_raises_lease_lost_on_normal_exit(ledger, db):
    with pytest.raises(LeaseLost):
        with ledger.lease("singleton", ttl=SECOND, renew_interval=timedelta(hours=1)) as lease:
            sleep(1.2)
            assert ledger.acquire("singleton", SECOND, owner="other") is not None
    assert lease.released is False and lease.lost.is_set()


def test_ledger_errors_carry_the_sqlstate_class_and_detail_facts(ledger):
    with pytest.raises(RunNotFound) as missing:
        ledger.complete_run(424242, 1)
    assert missing.value.run_id == 424242
    assert isinstance(missing.value.__cause__, psycopg.Error)
    assert translate(missing.value.__cause__) is not None
    with pytest.raises(InvalidArgument):
        ledger.acquire("", SECOND)
    lease = ledger.acquire("j", SECOND)
    assert lease is not None
    with pytest.raises(LeaseSuperseded) as superseded:
        ledger.assert_current("j", lease.token + 1)
    assert superseded.value.current_token == lease.token


def test_the_plain_sql_api_round_trips_typed_rows(ledger):
    start = ledger.start_run("api", ttl=timedelta(minutes=1), idempotency_key="k1")
    assert start.started and start.run_id is not None and start.token is not None
    assert ledger.heartbeat(start.run_id, start.token) is not None
    assert ledger.is_current("api", start.token)
    done = ledger.complete_run(start.run_id, start.token, {"n": 1})
    assert (done.status, done.idempotency_key, done.detail) == ("success", "k1", {"n": 1})
    assert ledger.start_run("api", ttl=timedelta(minutes=1), idempotency_key="k1").outcome == "already_done"
    assert ledger.get_run(start.run_id) == done
    again = ledger.start_run("api", ttl=timedelta(minutes=1))
    assert again.run_id is not None and again.token is not None
    cancelled = ledger.cancel_run(again.run_id, again.token, "shutdown")
    assert (cancelled.failure_reason, cancelled.error) == ("cancelled", "shutdown")
    assert ledger.reap_expired() == 0


def _runs(ledger, *ends: tuple[str, str | None]) -> None:
    """A run of each job, in turn, ended with success or (an error) failure."""
    for job, error in ends:
        start = ledger.start_run(job, ttl=timedelta(minutes=1))
        assert start.run_id is not None and start.token is not None
        if error is None:
            ledger.complete_run(start.run_id, start.token)
        else:
            ledger.fail_run(start.run_id, start.token, error)


def test_the_events_are_read_newest_first_or_after_one_by_job_and_kind(ledger):
    _runs(ledger, ("backup", None), ("report", "boom"), ("backup", None))
    every = ledger.events()
    assert [(e.kind, e.job) for e in every] == [
        ("run_started", "backup"), ("run_ended", "backup"), ("run_started", "report"), ("run_ended", "report"),
        ("run_started", "backup"), ("run_ended", "backup")]
    assert [e.event_id for e in every] == sorted(e.event_id for e in every)
    assert (every[3].detail["status"], every[3].detail["error"]) == ("failure", "boom")
    assert (every[1].detail["status"], every[1].detail["owner"]) == ("success", "worker-1")
    assert ledger.events(limit=2) == every[-2:]  # the newest, oldest first
    assert ledger.events(every[1].event_id, limit=2) == every[2:4]  # the first after one
    assert ledger.events(job="report") == every[2:4]
    assert ledger.events(kinds=["run_ended"], job="backup") == [every[1], every[5]]
    assert ledger.events(every[-1].event_id) == []


def test_the_event_settings_change_as_given_the_alerts_sync_once_and_old_events_purge(ledger, db):
    assert ledger.event_settings() == ledger.configure_events()  # no option: as they are
    changed = ledger.configure_events(run_events=False, retention=timedelta(days=30))
    assert (changed.run_events, changed.notify, changed.retention, changed.max_events) == \
        (False, False, timedelta(days=30), 1000000)
    assert ledger.event_settings() == changed
    _runs(ledger, ("quiet", "boom"))  # no run events now; the alert is the sync's
    [raised] = ledger.sync_alerts()
    assert (raised.kind, raised.job, raised.detail["alert"]) == ("alert_raised", "quiet", "failing")
    assert ledger.sync_alerts() == []  # recorded once
    assert ledger.events() == [raised]
    assert ledger.purge_events() == 0  # within the retention
    db.execute("UPDATE ledger.events SET at = at - interval '31 days'")  # the test owns the table
    assert ledger.purge_events() == 1
    assert ledger.events() == []


def _aged_runs(ledger, db, job, count):
    """`count` successes of `job`, 100 days old, each in a batch of run ids of its own (a gap of 10,000)."""
    for _ in range(count):
        with ledger.run(job, ttl=timedelta(minutes=1)):
            pass
        db.execute("SELECT setval(pg_get_serial_sequence('ledger.job_execution_log', 'run_id'),"
                   " (SELECT max(run_id) FROM ledger.job_execution_log) + 10000)")
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '100 days',"
               " heartbeat_at = heartbeat_at - interval '100 days',"
               " completed_at = completed_at - interval '100 days'")  # the test owns the table


@pytest.mark.parametrize("in_transaction", [False, True])
def test_purge_log_in_batches_deletes_what_purge_log_would_a_batch_at_a_time(ledger, db, in_transaction):
    _aged_runs(ledger, db, "old", 4)
    if in_transaction:  # over the caller's transaction: a savepoint per batch, the caller commits
        with db.transaction():
            assert ledger.purge_log_in_batches(timedelta(days=90)) == 3
    else:
        assert ledger.purge_log_in_batches(timedelta(days=90)) == 3
    assert one(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'old'")[0] == 1
    assert ledger.purge_log_in_batches(timedelta(days=90)) == 0
    assert ledger.purge_log(timedelta(days=90)) == 0  # the newest success stays


def test_heartbeats_use_their_own_connection_from_heartbeat_conninfo(db, dsn):
    conninfo = dsn + " application_name=ledger-heartbeat"
    with Ledger(db, owner="worker-1", heartbeat_conninfo=conninfo) as ledger, \
            ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
        cur = db.execute("SELECT application_name FROM pg_stat_activity WHERE datname = current_database()")
        assert ("ledger-heartbeat",) in cur.fetchall()
    assert run.result is not None and run.result.status == "success"


def test_a_ledger_over_a_pool_or_a_dsn_runs_the_same(dsn, db):
    with ConnectionPool(dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}) as pool:
        with Ledger(pool, owner="pooled").run("nightly", ttl=timedelta(minutes=1)) as run:
            assert run.started
        assert run.result is not None and run.result.status == "success"
        assert not pool.closed
    with Ledger(dsn, owner="owned") as ledger:
        with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
            assert run.started and run.token == 2
    assert settle(db, 0) == 0  # the pool the ledger opened is closed


def test_runs_open_together_hold_no_pool_connection_between_their_calls(dsn, db):
    # 20 runs open at once over a pool of 2: each call (start, heartbeats,
    # end) borrows a connection and gives it back, so no run waits for
    # another to end (holding one per run, the third would wait for ever).
    many = 20
    open_runs: list[int] = []
    failures: list[BaseException] = []
    with ConnectionPool(dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}) as pool:
        ledger = Ledger(pool, owner="many")

        def worker(n: int) -> None:
            try:
                with ledger.run(f"many-{n}", ttl=timedelta(seconds=30),
                                heartbeat_interval=timedelta(milliseconds=100)) as run:
                    open_runs.append(n)
                    deadline = time.monotonic() + 60
                    while len(open_runs) < many or not heartbeated(run.run_id):
                        assert time.monotonic() < deadline, f"{len(open_runs)} of {many} runs open"
                        sleep(0.05)
                assert run.result is not None and run.result.status == "success"
            except BaseException as error:
                failures.append(error)

        def heartbeated(run_id: int | None) -> bool:
            row = one(db, "SELECT heartbeat_at > started_at FROM ledger.job_execution_log WHERE run_id = %s",
                      (run_id,))
            return bool(row[0])

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(many)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures, failures[0]
        assert pool.get_stats()["pool_size"] <= 2
    assert one(db, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'")[0] == many


def test_no_thread_or_connection_leaks_after_1000_runs(dsn, db):
    fast = timedelta(milliseconds=1)  # heartbeats do happen during the short bodies
    with ConnectionPool(dsn, min_size=2, max_size=2, open=False, kwargs={"autocommit": True}) as pool:
        pool.wait()
        before_workers = workers()  # the pool's own workers included
        before = settle(db, 2)
        ledger = Ledger(pool, owner="pooled")
        for i in range(1000):
            with ledger.run("busy", ttl=timedelta(seconds=30), heartbeat_interval=fast) as run:
                if i % 100 == 0:
                    sleep(0.01)
        assert run.token == 1000 and run.result is not None and run.result.status == "success"
        assert settle_workers(before_workers) == before_workers
        assert settle(db, before) == before
    assert settle(db, 0) == 0  # the pool's connections are closed
    # Over a plain connection a run's own connection is kept for the next run
    # (one after another here: one spare), until the ledger closes.
    before_workers = workers()
    with Ledger(db, owner="direct") as ledger:
        for _ in range(100):
            with ledger.run("busy", ttl=timedelta(seconds=30), heartbeat_interval=fast):
                pass
        assert settle_workers(before_workers) == before_workers
        assert settle(db, 1) == 1
    assert settle(db, 0) == 0
    assert one(db, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'")[0] == 1100


def test_runs_shorter_than_their_heartbeat_interval_start_no_heartbeat_and_no_watchdog_of_their_own(
        ledger, db):
    """A heartbeat's task (its thread, in the sync client) starts when its first beat is due, and the sync
    client's watchdogs keep their times on one timer thread for the process: three runs open at once, none
    of them a minute old, add no task and no thread but that one timer (busy while they are open)."""
    with ledger.run("warm", ttl=timedelta(minutes=3)):  # the ledger's own connections, the timer
        pass
    before = settle_workers(workers())
    with ledger.run("a", ttl=timedelta(minutes=3)) as a, ledger.run("b", ttl=timedelta(minutes=3)) as b, \
            ledger.run("c", ttl=timedelta(minutes=3)) as c:
        assert a.started and b.started and c.started
        assert before <= workers() <= before + 1  # at most the timer's thread, which holds their times
    assert settle_workers(before) == before
    # A longer body still beats: its heartbeat starts when the first beat is due.
    with ledger.run("slow", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=50)) as slow:
        query = "SELECT heartbeat_at FROM ledger.job_execution_log WHERE run_id = %s"
        first = one(db, query, (slow.run_id,))[0]
        deadline = time.monotonic() + 30
        while one(db, query, (slow.run_id,))[0] == first:
            assert time.monotonic() < deadline, "no heartbeat in 30 s"
            sleep(0.05)


def test_the_heartbeat_conninfo_keeps_the_password_that_info_dsn_drops(dsn):
    from ledger.client import conninfo_of

    # Trust auth ignores the password; libpq keeps it.
    with psycopg.Connection.connect(dsn + " password=s3cret") as conn:
        assert "s3cret" not in conn.info.dsn
        assert psycopg.conninfo.conninfo_to_dict(conninfo_of(conn))["password"] == "s3cret"


def test_a_ledger_refuses_what_it_cannot_drive(db):
    # Either flavour's refusal names both clients.
    with pytest.raises(TypeError, match=r"ledger\.Ledger takes sync ones, ledger\.AsyncLedger async ones"):
        Ledger(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="heartbeat_conninfo"):
        Ledger("dbname=x", heartbeat_conninfo="dbname=y")


def test_the_client_needs_nothing_but_the_ledger_client_role(db, dsn):
    role = f"test_app_{os.getpid()}"
    db.execute(f"CREATE ROLE {role} LOGIN IN ROLE ledger_client")
    try:
        db.execute("CREATE TABLE reports (writer text, token bigint)")
        db.execute(f"GRANT INSERT ON reports TO {role}")
        with psycopg.Connection.connect(dsn + f" user={role}", autocommit=True) as conn:
            with Ledger(conn, owner="app") as ledger:
                with ledger.run("nightly", ttl=SECOND, heartbeat_interval=timedelta(milliseconds=100)) as run:
                    sleep(0.3)
                    with conn.transaction():
                        run.fence(conn, "reports")
                        conn.execute("INSERT INTO reports VALUES ('app', %s)", (run.token,))
                    run.check(remote=True)
                assert run.result is not None and run.result.status == "success"
                assert ledger.get_run(run.result.run_id) == run.result
                with ledger.lease("singleton", ttl=SECOND) as lease:
                    assert lease.acquired
    finally:
        settle(db, 0)
        db.execute(f"DROP OWNED BY {role}")
        db.execute(f"DROP ROLE {role}")
