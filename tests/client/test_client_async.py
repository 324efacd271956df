"""The asyncio Python client against a real PostgreSQL: run and lease contexts,
heartbeats, lease loss, fencing, errors, and no leaks."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from ledger import (
    AsyncLedger,
    FenceOfAnotherJob,
    InvalidArgument,
    LeaseLost,
    LeaseSuperseded,
    RunNotFound,
    StaleToken,
    default_owner,
)
from ledger._acompat import ASYNC, await_event, parked
from ledger.aio import advance_fence, fence
from ledger.errors import translate

if ASYNC:
    # This file is the one source of the client's behaviour tests: tools/async_to_sync.py
    # writes tests/client/test_client.py from it ('make sync'), as it writes ledger/client.py
    # from ledger/aio.py. `if ASYNC:` blocks hold what only the asyncio client does,
    # their `else:` what only the sync client does (so each file has exactly its
    # flavour's tests); the async fixtures below are the twins of conftest.py's
    # (aconnect is connect, adb is db: the generator's NAMES table).
    import asyncio
    from asyncio import sleep as asleep
else:
    from time import sleep

SECOND = timedelta(seconds=1)

BACKENDS = (  # the clients connected to the test database but the probe (no autovacuum worker)
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
    "AND backend_type = 'client backend'")


if ASYNC:
    pytestmark = pytest.mark.anyio  # the async tests run on anyio's pytest plugin (the test extra)

    @pytest.fixture
    def anyio_backend() -> str:
        return "asyncio"  # psycopg's async connections need asyncio (not trio, even where it is installed)

    @pytest.fixture
    async def aconnect(dsn):
        """conftest.py's connect for the asyncio client: more async connections, all closed at teardown."""
        opened: list[psycopg.AsyncConnection] = []

        async def _connect(autocommit: bool = True, **kwargs: object) -> psycopg.AsyncConnection:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit, **kwargs)
            opened.append(conn)
            return conn

        yield _connect
        for conn in opened:
            await conn.close()

    @pytest.fixture
    async def adb(aconnect) -> psycopg.AsyncConnection:
        """conftest.py's db for the asyncio client: an autocommit async connection to a fresh ledger database."""
        return await aconnect()

    def workers() -> tuple[int, int]:
        """What runs beside the test: the threads that hold something (not the parked ones), the loop's tasks."""
        return threading.active_count() - parked(), len(asyncio.all_tasks())

    def start(target: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run ``target`` beside the test: a task of the loop."""
        return asyncio.get_running_loop().create_task(target())

    def running(writer: asyncio.Task[None]) -> bool:
        return not writer.done()

    async def finish(writer: asyncio.Task[None], timeout: float) -> None:
        """Wait up to ``timeout`` seconds for ``writer`` to end."""
        await asyncio.wait([writer], timeout=timeout)
else:
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
async def aledger(adb):
    await adb.execute("CREATE TABLE reports (writer text, token bigint)")
    aledger = AsyncLedger(adb, owner="worker-1")
    yield aledger
    await aledger.close()  # the spare connections of its contexts


async def one(adb, query, params=None):
    """The first row ``query`` returns on ``adb``."""
    cur = await adb.execute(query, params)
    return await cur.fetchone()


async def log_row(adb, run_id):
    async with adb.cursor(row_factory=psycopg.rows.dict_row) as cur:
        await cur.execute("SELECT * FROM ledger.job_execution_log WHERE run_id = %s", (run_id,))
        return await cur.fetchone()


async def other_start(adb, job, owner="intruder", ttl="30 seconds"):
    return await one(adb, "SELECT outcome, holder FROM ledger.start_run(job => %s, owner => %s, ttl => %s)",
                     (job, owner, ttl))


async def backends(adb) -> int:
    return (await one(adb, BACKENDS))[0]


async def fence_row(adb, resource):
    return await one(adb, "SELECT job, token FROM ledger.fences WHERE resource = %s", (resource,))


async def wait_until_blocked(adb, pid, writer, timeout=30):
    """Poll until backend ``pid`` waits for a lock (while ``writer`` still runs)."""
    deadline = time.monotonic() + timeout
    while (await one(adb, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)))[0] != "Lock":
        assert running(writer) and time.monotonic() < deadline, "the fence never waited for the lock"
        await asleep(0.01)


async def settle_workers(expected):
    """``workers()`` once it is ``expected``, or after 10 s (a thread parks a moment after its target returned)."""
    deadline = time.monotonic() + 10
    while (now := workers()) != expected and time.monotonic() < deadline:
        await asleep(0.01)
    return now


async def settle(adb, expected: int) -> int:
    # A backend leaves pg_stat_activity a moment after its client closed (a long moment on a busy machine).
    deadline = time.monotonic() + 30
    while (count := await backends(adb)) != expected and time.monotonic() < deadline:
        await asleep(0.05)
    return count


async def test_a_run_logs_success_with_its_detail_and_a_fencing_token(aledger, adb):
    async with aledger.run("nightly", ttl=timedelta(minutes=80), detail={"batch": 7}) as run:
        assert (run.started, run.outcome, run.token) == (True, "started", 1)
        async with adb.transaction():
            assert await run.fence(adb, "reports") == 1
            await adb.execute("INSERT INTO reports VALUES ('worker-1', %s)", (run.token,))
        run.detail["rows"] = 1
    assert run.result is not None and run.result.status == "success"
    assert run.result.detail == {"batch": 7, "rows": 1}
    assert run.result.owner == "worker-1" and run.result.run_id == run.run_id
    assert not run.lost.is_set()
    assert await fence_row(adb, "reports") == ("nightly", 1)  # bound to the run's job


async def test_a_skip_is_not_an_exception_and_says_who_holds_the_job(aledger, adb):
    assert (await other_start(adb, "nightly", ttl="1 minute"))[0] == "started"
    before = workers()
    async with aledger.run("nightly", ttl=timedelta(minutes=80)) as run:
        assert not run.started
        assert run.outcome == "skipped_overlap"
        assert run.holder == "intruder" and run.holder_expires_at is not None
        assert await settle_workers(before) == before  # no heartbeat for a run that did not start
        with pytest.raises(RuntimeError, match="skipped_overlap"):
            await run.fence(adb, "reports")
    assert run.result is None
    assert await one(adb, "SELECT skipped_overlap, failures FROM ledger.job_counters WHERE job = 'nightly'") == (1, 0)


async def test_an_exception_in_the_body_fails_the_run_with_its_message_and_propagates(aledger, adb):
    with pytest.raises(ValueError, match="disk full"):
        async with aledger.run("nightly", ttl=timedelta(minutes=80)) as run:
            raise ValueError("disk full")
    row = await log_row(adb, run.run_id)
    assert (row["status"], row["failure_reason"]) == ("failure", "error")
    assert row["error"] == "ValueError: disk full"
    assert run.result is not None and run.result.error == "ValueError: disk full"


# What only one flavour of the client does.
if ASYNC:
    async def test_cancelling_the_task_cancels_the_run_and_propagates(dsn, adb):
        async with AsyncLedger(dsn, owner="worker-1") as ledger:
            entered = asyncio.Event()
            holder = {}

            async def body():
                async with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
                    holder["run"] = run
                    entered.set()
                    await asyncio.sleep(60)

            task = asyncio.create_task(body())
            await entered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        row = await log_row(adb, holder["run"].run_id)
        assert (row["status"], row["failure_reason"], row["error"]) == ("failure", "cancelled", "CancelledError")


    async def test_lease_loss_sets_the_event_and_awaits_an_async_callback(dsn, adb):
        called = asyncio.Event()
        errors = []

        async def on_lost(error):
            errors.append(error)
            called.set()

        async with AsyncLedger(dsn, owner="worker-1") as ledger:
            with pytest.raises(LeaseLost) as at_exit:
                async with ledger.run("nightly", ttl=timedelta(seconds=30),
                                      heartbeat_interval=timedelta(milliseconds=100), on_lost=on_lost) as run:
                    assert await ledger.release("nightly", run.token)
                    assert (await other_start(adb, "nightly"))[0] == "started"
                    await asyncio.wait_for(run.lost.wait(), 5)
                    await asyncio.wait_for(called.wait(), 5)
                    with pytest.raises(LeaseLost):
                        await run.check()
            assert isinstance(at_exit.value.__cause__, LeaseSuperseded)
        assert len(errors) == 1 and errors[0].run_id == run.run_id
        assert (await log_row(adb, run.run_id))["failure_reason"] == "lease_expired"
else:
    async def test_keyboard_interrupt_cancels_the_run_and_propagates(aledger, adb):
        with pytest.raises(KeyboardInterrupt):
            async with aledger.run("nightly", ttl=timedelta(minutes=80)) as run:
                raise KeyboardInterrupt
        row = await log_row(adb, run.run_id)
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
async def test_a_one_second_ttl_run_survives_a_five_second_body_while_the_caller_holds_a_transaction(
        over, aledger, adb, aconnect, dsn):
    # The caller's connection stays inside one open transaction for the whole
    # body: the heartbeats must commit elsewhere (on the context's own
    # connection, or the one it holds from the pool), or the lease would look
    # expired to everyone else after one second.
    user = await aconnect(autocommit=False)
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as apool, \
            AsyncLedger(user if over == "connection" else apool, owner="worker-1") as user_ledger:
        probes = []
        async with user_ledger.run("slow", ttl=SECOND) as run:
            assert run.started
            async with user.transaction():
                await user.execute("SELECT 1")
                for _ in range(2):
                    await asleep(2.55)
                    probes.append(await other_start(adb, "slow", ttl="1 second"))
                await run.fence(user, "reports")
                await user.execute("INSERT INTO reports VALUES ('worker-1', %s)", (run.token,))
            await run.check(remote=True)
    assert probes == [("skipped_overlap", "worker-1")] * 2
    assert not run.lost.is_set()
    assert run.result is not None and run.result.status == "success"
    assert run.result.heartbeat_at is not None
    assert run.result.heartbeat_at - run.result.started_at > timedelta(seconds=4)
    assert (await one(adb, "SELECT count(*) FROM reports"))[0] == 1


async def test_the_heartbeat_finding_the_lease_gone_marks_the_run_lost_at_once(aledger, adb):
    reports = []
    with pytest.raises(LeaseLost) as at_exit:
        async with aledger.run("nightly", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=100),
                               on_lost=reports.append) as run:
            # Someone ends the lease and another owner takes the job over.
            assert (await one(adb, "SELECT ledger.release(job => 'nightly', owner => %s, token => %s)",
                              (run.owner, run.token)))[0]
            assert (await other_start(adb, "nightly"))[0] == "started"
            assert await await_event(run.lost, 5)
            assert len(reports) == 1 and isinstance(reports[0], LeaseLost)
            assert reports[0].run_id == run.run_id and reports[0].job == "nightly"
            with pytest.raises(LeaseLost):
                await run.check()
            with pytest.raises(LeaseLost):
                async with adb.transaction():
                    await run.fence(adb, "reports")
    # Completing was refused (LD001): the normal exit says so.
    assert isinstance(at_exit.value.__cause__, LeaseSuperseded)
    assert len(reports) == 1
    assert (await log_row(adb, run.run_id))["failure_reason"] == "lease_expired"


async def test_the_fence_rejects_a_holder_whose_lease_was_taken_before_it_noticed(aledger, adb):
    # The server expires the lease early (its local deadline is a minute away)
    # and another owner takes over: the run itself does not know it lost the lease.
    with pytest.raises(LeaseLost):
        async with aledger.run("nightly", ttl=timedelta(minutes=1), heartbeat_interval=timedelta(hours=1)) as run:
            await adb.execute(
                "UPDATE ledger.leases SET expires_at = clock_timestamp() - interval '1 second' WHERE job = 'nightly'")
            assert (await other_start(adb, "nightly"))[0] == "started"
            assert not run.lost.is_set()
            with pytest.raises(LeaseLost) as rejected:
                async with adb.transaction():
                    await run.fence(adb, "reports")
                    await adb.execute("INSERT INTO reports VALUES ('zombie', %s)", (run.token,))
            assert isinstance(rejected.value.__cause__, LeaseSuperseded)  # LD001 from the fence itself
            assert rejected.value.current_token == run.token + 1 and rejected.value.holder == "intruder"
            assert run.lost.is_set()
            with pytest.raises(LeaseLost):
                async with adb.transaction():
                    await run.advance_fence(adb, "reports")
    assert (await one(adb, "SELECT count(*) FROM reports"))[0] == 0
    assert await fence_row(adb, "reports") is None


async def test_a_takeover_that_wrote_between_the_fences_check_and_its_lock_marks_the_run_lost(
        aledger, adb, aconnect):
    # LD002: the token was still current when the fence checked it, but the
    # takeover (open transaction, fence row locked) wrote first and committed.
    with pytest.raises(LeaseLost):
        async with aledger.run("nightly", ttl=timedelta(minutes=1), heartbeat_interval=timedelta(hours=1)) as run:
            async with adb.transaction():
                await run.fence(adb, "reports")
            takeover = await aconnect(autocommit=False)
            assert (await one(takeover, "SELECT ledger.release(job => 'nightly', owner => 'worker-1', token => %s)",
                              (run.token,)))[0]
            steal = "SELECT token FROM ledger.start_run(job => 'nightly', owner => 'thief', ttl => '1 minute')"
            new = (await one(takeover, steal))[0]
            await takeover.execute("SELECT ledger.fence(job => 'nightly', resource => 'reports', token => %s)",
                                   (new,))
            zombie = await aconnect()
            outcome: list[BaseException] = []

            async def write() -> None:
                try:
                    async with zombie.transaction():
                        await run.fence(zombie, "reports")
                        await zombie.execute("INSERT INTO reports VALUES ('zombie', %s)", (run.token,))
                except BaseException as error:
                    outcome.append(error)

            writer = start(write)
            await wait_until_blocked(adb, zombie.info.backend_pid, writer)
            await takeover.commit()
            await finish(writer, 30)
            [error] = outcome
            assert isinstance(error, LeaseLost) and isinstance(error.__cause__, StaleToken)
            assert error.__cause__.highest_token == new and error.__cause__.token == run.token
            assert run.lost.is_set()
            with pytest.raises(LeaseLost):
                await run.fence(adb, "reports")
    assert (await one(adb, "SELECT count(*) FROM reports"))[0] == 0
    assert await fence_row(adb, "reports") == ("nightly", new)


async def test_a_resource_of_another_job_is_fence_of_another_job_not_a_lost_lease(aledger, adb):
    indexer = await aledger.acquire("indexer", timedelta(minutes=1), owner="indexer-host")
    assert indexer is not None
    assert await fence(adb, "indexer", "reports", indexer.token) == indexer.token  # "reports" is the indexer's now
    async with aledger.run("nightly", ttl=timedelta(minutes=1)) as run:
        assert run.token == 1 and indexer.token == 1  # tokens of two jobs: numbers that mean nothing to each other
        with pytest.raises(FenceOfAnotherJob) as theirs:
            async with adb.transaction():
                await run.fence(adb, "reports")
                await adb.execute("INSERT INTO reports VALUES ('nightly', %s)", (run.token,))
        assert theirs.value.sqlstate == "LD006" and isinstance(theirs.value.__cause__, psycopg.Error)
        assert theirs.value.facts == {"resource": "reports", "job": "nightly", "bound_job": "indexer",
                                      "token": run.token}
        assert theirs.value.bound_job == "indexer"
        assert not run.lost.is_set()  # a programming error, not a lost lease
        with pytest.raises(FenceOfAnotherJob):
            async with adb.transaction():
                await run.advance_fence(adb, "reports")
        async with adb.transaction():
            assert await run.advance_fence(adb, "other") is True
            assert await run.advance_fence(adb, "other") is False
        # The module-level helpers: the job is an argument, the ledger's errors come as they are.
        with pytest.raises(FenceOfAnotherJob):
            await advance_fence(adb, "nightly", "reports", run.token)
        assert not run.lost.is_set()
    with pytest.raises(LeaseSuperseded):  # the run ended: its token fences nothing any more
        await fence(adb, "nightly", "other", run.token)
    assert run.result is not None and run.result.status == "success"
    assert (await one(adb, "SELECT count(*) FROM reports"))[0] == 0
    assert await fence_row(adb, "reports") == ("indexer", indexer.token)
    assert await fence_row(adb, "other") == ("nightly", run.token)


async def test_the_module_level_fences_take_the_job_and_raise_the_ledger_errors_as_they_come(aledger, adb):
    lease = await aledger.acquire("indexer", timedelta(minutes=1))
    assert lease is not None
    async with adb.transaction():
        assert await fence(adb, "indexer", "index", lease.token) == lease.token
        assert await fence(adb, "indexer", "index", lease.token) == lease.token  # lenient: again with one token
        assert await advance_fence(adb, "indexer", "once", lease.token) is True
        assert await advance_fence(adb, "indexer", "once", lease.token) is False  # strict: one write per token
    assert await fence_row(adb, "index") == ("indexer", lease.token)
    other = await aledger.acquire("nightly", timedelta(minutes=1))
    assert other is not None
    with pytest.raises(FenceOfAnotherJob) as theirs:
        await fence(adb, "nightly", "index", other.token)
    assert (theirs.value.job, theirs.value.bound_job, theirs.value.resource) == ("nightly", "indexer", "index")
    # Without a context nothing is marked: the zombie gets the ledger's LD001 itself.
    assert await aledger.release("indexer", lease.token)
    for call in (fence, advance_fence):
        with pytest.raises(LeaseSuperseded) as zombie:
            await call(adb, "indexer", "index", lease.token)
        assert (zombie.value.job, zombie.value.token, zombie.value.released) == ("indexer", lease.token, True)
    assert await fence_row(adb, "index") == ("indexer", lease.token)


async def test_a_plain_lease_is_renewed_past_its_ttl_and_released_on_exit(aledger, adb):
    async with aledger.lease("singleton", ttl=SECOND) as lease:
        assert lease.acquired and lease.token == 1
        await asleep(1.5)
        assert await aledger.acquire("singleton", SECOND, owner="other") is None
        async with adb.transaction():
            assert await lease.fence(adb, "reports") == 1
    assert lease.released is True and not lease.lost.is_set()
    assert await fence_row(adb, "reports") == ("singleton", 1)  # the lease's own job
    async with AsyncLedger(adb, owner="other").lease("singleton", ttl=SECOND) as taken:
        assert taken.acquired and taken.token == lease.token + 1
    again = await aledger.acquire("singleton", SECOND, owner="other")
    assert again is not None and again.token > lease.token


async def test_a_lease_held_by_another_owner_is_not_acquired(aledger):
    assert await aledger.acquire("singleton", timedelta(minutes=1), owner="other") is not None
    async with aledger.lease("singleton", ttl=SECOND) as lease:
        assert not lease.acquired
        with pytest.raises(RuntimeError, match="not acquired"):
            await lease.check()
    assert lease.released is None


async def test_a_plain_lease_that_was_taken_over_raises_lease_lost_on_normal_exit(aledger, adb):
    with pytest.raises(LeaseLost):
        async with aledger.lease("singleton", ttl=SECOND, renew_interval=timedelta(hours=1)) as lease:
            await asleep(1.2)
            assert await aledger.acquire("singleton", SECOND, owner="other") is not None
    assert lease.released is False and lease.lost.is_set()


async def test_ledger_errors_carry_the_sqlstate_class_and_detail_facts(aledger):
    with pytest.raises(RunNotFound) as missing:
        await aledger.complete_run(424242, 1)
    assert missing.value.run_id == 424242
    assert isinstance(missing.value.__cause__, psycopg.Error)
    assert translate(missing.value.__cause__) is not None
    with pytest.raises(InvalidArgument):
        await aledger.acquire("", SECOND)
    lease = await aledger.acquire("j", SECOND)
    assert lease is not None
    with pytest.raises(LeaseSuperseded) as superseded:
        await aledger.assert_current("j", lease.token + 1)
    assert superseded.value.current_token == lease.token


async def test_the_plain_sql_api_round_trips_typed_rows(aledger):
    start = await aledger.start_run("api", ttl=timedelta(minutes=1), idempotency_key="k1")
    assert start.started and start.run_id is not None and start.token is not None
    assert await aledger.heartbeat(start.run_id, start.token) is not None
    assert await aledger.is_current("api", start.token)
    done = await aledger.complete_run(start.run_id, start.token, {"n": 1})
    assert (done.status, done.idempotency_key, done.detail) == ("success", "k1", {"n": 1})
    assert (await aledger.start_run("api", ttl=timedelta(minutes=1), idempotency_key="k1")).outcome == "already_done"
    assert await aledger.get_run(start.run_id) == done
    again = await aledger.start_run("api", ttl=timedelta(minutes=1))
    assert again.run_id is not None and again.token is not None
    cancelled = await aledger.cancel_run(again.run_id, again.token, "shutdown")
    assert (cancelled.failure_reason, cancelled.error) == ("cancelled", "shutdown")
    assert await aledger.reap_expired() == 0


async def _runs(aledger, *ends: tuple[str, str | None]) -> None:
    """A run of each job, in turn, ended with success or (an error) failure."""
    for job, error in ends:
        start = await aledger.start_run(job, ttl=timedelta(minutes=1))
        assert start.run_id is not None and start.token is not None
        if error is None:
            await aledger.complete_run(start.run_id, start.token)
        else:
            await aledger.fail_run(start.run_id, start.token, error)


async def test_the_events_are_read_newest_first_or_after_one_by_job_and_kind(aledger):
    await _runs(aledger, ("backup", None), ("report", "boom"), ("backup", None))
    every = await aledger.events()
    assert [(e.kind, e.job) for e in every] == [
        ("run_started", "backup"), ("run_ended", "backup"), ("run_started", "report"), ("run_ended", "report"),
        ("run_started", "backup"), ("run_ended", "backup")]
    assert [e.event_id for e in every] == sorted(e.event_id for e in every)
    assert (every[3].detail["status"], every[3].detail["error"]) == ("failure", "boom")
    assert (every[1].detail["status"], every[1].detail["owner"]) == ("success", "worker-1")
    assert await aledger.events(limit=2) == every[-2:]  # the newest, oldest first
    assert await aledger.events(every[1].event_id, limit=2) == every[2:4]  # the first after one
    assert await aledger.events(job="report") == every[2:4]
    assert await aledger.events(kinds=["run_ended"], job="backup") == [every[1], every[5]]
    assert await aledger.events(every[-1].event_id) == []


async def test_the_event_settings_change_as_given_the_alerts_sync_once_and_old_events_purge(aledger, adb):
    assert await aledger.event_settings() == await aledger.configure_events()  # no option: as they are
    changed = await aledger.configure_events(run_events=False, retention=timedelta(days=30))
    assert (changed.run_events, changed.notify, changed.retention, changed.max_events) == \
        (False, False, timedelta(days=30), 1000000)
    assert await aledger.event_settings() == changed
    await _runs(aledger, ("quiet", "boom"))  # no run events now; the alert is the sync's
    [raised] = await aledger.sync_alerts()
    assert (raised.kind, raised.job, raised.detail["alert"]) == ("alert_raised", "quiet", "failing")
    assert await aledger.sync_alerts() == []  # recorded once
    assert await aledger.events() == [raised]
    assert await aledger.purge_events() == 0  # within the retention
    await adb.execute("UPDATE ledger.events SET at = at - interval '31 days'")  # the test owns the table
    assert await aledger.purge_events() == 1
    assert await aledger.events() == []


async def _aged_runs(aledger, adb, job, count):
    """`count` successes of `job`, 100 days old, each in a batch of run ids of its own (a gap of 10,000)."""
    for _ in range(count):
        async with aledger.run(job, ttl=timedelta(minutes=1)):
            pass
        await adb.execute("SELECT setval(pg_get_serial_sequence('ledger.job_execution_log', 'run_id'),"
                          " (SELECT max(run_id) FROM ledger.job_execution_log) + 10000)")
    await adb.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '100 days',"
                      " heartbeat_at = heartbeat_at - interval '100 days',"
                      " completed_at = completed_at - interval '100 days'")  # the test owns the table


@pytest.mark.parametrize("in_transaction", [False, True])
async def test_purge_log_in_batches_deletes_what_purge_log_would_a_batch_at_a_time(aledger, adb, in_transaction):
    await _aged_runs(aledger, adb, "old", 4)
    if in_transaction:  # over the caller's transaction: a savepoint per batch, the caller commits
        async with adb.transaction():
            assert await aledger.purge_log_in_batches(timedelta(days=90)) == 3
    else:
        assert await aledger.purge_log_in_batches(timedelta(days=90)) == 3
    assert (await one(adb, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'old'"))[0] == 1
    assert await aledger.purge_log_in_batches(timedelta(days=90)) == 0
    assert await aledger.purge_log(timedelta(days=90)) == 0  # the newest success stays


async def test_heartbeats_use_their_own_connection_from_heartbeat_conninfo(adb, dsn):
    conninfo = dsn + " application_name=ledger-heartbeat"
    async with AsyncLedger(adb, owner="worker-1", heartbeat_conninfo=conninfo) as ledger, \
            ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
        cur = await adb.execute("SELECT application_name FROM pg_stat_activity WHERE datname = current_database()")
        assert ("ledger-heartbeat",) in await cur.fetchall()
    assert run.result is not None and run.result.status == "success"


async def test_a_ledger_over_a_pool_or_a_dsn_runs_the_same(dsn, adb):
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}) as apool:
        async with AsyncLedger(apool, owner="pooled").run("nightly", ttl=timedelta(minutes=1)) as run:
            assert run.started
        assert run.result is not None and run.result.status == "success"
        assert not apool.closed
    async with AsyncLedger(dsn, owner="owned") as ledger:
        async with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
            assert run.started and run.token == 2
    assert await settle(adb, 0) == 0  # the pool the ledger opened is closed


async def test_runs_open_together_hold_no_pool_connection_between_their_calls(dsn, adb):
    # 20 runs open at once over a pool of 2: each call (start, heartbeats,
    # end) borrows a connection and gives it back, so no run waits for
    # another to end (holding one per run, the third would wait for ever).
    many = 20
    open_runs: list[int] = []
    failures: list[BaseException] = []
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False, kwargs={"autocommit": True}) as apool:
        ledger = AsyncLedger(apool, owner="many")

        async def worker(n: int) -> None:
            try:
                async with ledger.run(f"many-{n}", ttl=timedelta(seconds=30),
                                      heartbeat_interval=timedelta(milliseconds=100)) as run:
                    open_runs.append(n)
                    deadline = time.monotonic() + 60
                    while len(open_runs) < many or not await heartbeated(run.run_id):
                        assert time.monotonic() < deadline, f"{len(open_runs)} of {many} runs open"
                        await asleep(0.05)
                assert run.result is not None and run.result.status == "success"
            except BaseException as error:
                failures.append(error)

        async def heartbeated(run_id: int | None) -> bool:
            row = await one(adb, "SELECT heartbeat_at > started_at FROM ledger.job_execution_log WHERE run_id = %s",
                            (run_id,))
            return bool(row[0])

        if ASYNC:
            await asyncio.gather(*(worker(n) for n in range(many)))
        else:
            threads = [threading.Thread(target=worker, args=(n,)) for n in range(many)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
        assert not failures, failures[0]
        assert apool.get_stats()["pool_size"] <= 2
    assert (await one(adb, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'"))[0] == many


async def test_no_task_thread_or_connection_leaks_after_1000_runs(dsn, adb):
    fast = timedelta(milliseconds=1)  # heartbeats do happen during the short bodies
    async with AsyncConnectionPool(dsn, min_size=2, max_size=2, open=False, kwargs={"autocommit": True}) as apool:
        await apool.wait()
        before_workers = workers()  # the pool's own workers included
        before = await settle(adb, 2)
        ledger = AsyncLedger(apool, owner="pooled")
        for i in range(1000):
            async with ledger.run("busy", ttl=timedelta(seconds=30), heartbeat_interval=fast) as run:
                if i % 100 == 0:
                    await asleep(0.01)
        assert run.token == 1000 and run.result is not None and run.result.status == "success"
        assert await settle_workers(before_workers) == before_workers
        assert await settle(adb, before) == before
    assert await settle(adb, 0) == 0  # the pool's connections are closed
    # Over a plain connection a run's own connection is kept for the next run
    # (one after another here: one spare), until the ledger closes.
    before_workers = workers()
    async with AsyncLedger(adb, owner="direct") as ledger:
        for _ in range(100):
            async with ledger.run("busy", ttl=timedelta(seconds=30), heartbeat_interval=fast):
                pass
        assert await settle_workers(before_workers) == before_workers
        assert await settle(adb, 1) == 1
    assert await settle(adb, 0) == 0
    assert (await one(adb, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'"))[0] == 1100


async def test_runs_shorter_than_their_heartbeat_interval_start_no_heartbeat_and_no_watchdog_of_their_own(
        aledger, adb):
    """A heartbeat's task (its thread, in the sync client) starts when its first beat is due, and the sync
    client's watchdogs keep their times on one timer thread for the process: three runs open at once, none
    of them a minute old, add no task and no thread but that one timer (busy while they are open)."""
    async with aledger.run("warm", ttl=timedelta(minutes=3)):  # the ledger's own connections, the timer
        pass
    before = await settle_workers(workers())
    async with aledger.run("a", ttl=timedelta(minutes=3)) as a, aledger.run("b", ttl=timedelta(minutes=3)) as b, \
            aledger.run("c", ttl=timedelta(minutes=3)) as c:
        assert a.started and b.started and c.started
        if ASYNC:
            assert workers() == before  # the loop's timers: no thread and no task
        else:
            assert before <= workers() <= before + 1  # at most the timer's thread, which holds their times
    assert await settle_workers(before) == before
    # A longer body still beats: its heartbeat starts when the first beat is due.
    async with aledger.run("slow", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=50)) as slow:
        query = "SELECT heartbeat_at FROM ledger.job_execution_log WHERE run_id = %s"
        first = (await one(adb, query, (slow.run_id,)))[0]
        deadline = time.monotonic() + 30
        while (await one(adb, query, (slow.run_id,)))[0] == first:
            assert time.monotonic() < deadline, "no heartbeat in 30 s"
            await asleep(0.05)


async def test_the_heartbeat_conninfo_keeps_the_password_that_info_dsn_drops(dsn):
    from ledger.aio import conninfo_of

    # Trust auth ignores the password; libpq keeps it.
    async with await psycopg.AsyncConnection.connect(dsn + " password=s3cret") as aconn:
        assert "s3cret" not in aconn.info.dsn
        assert psycopg.conninfo.conninfo_to_dict(conninfo_of(aconn))["password"] == "s3cret"


async def test_a_ledger_refuses_what_it_cannot_drive(adb):
    # Either flavour's refusal names both clients.
    with pytest.raises(TypeError, match=r"ledger\.Ledger takes sync ones, ledger\.AsyncLedger async ones"):
        AsyncLedger(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="heartbeat_conninfo"):
        AsyncLedger("dbname=x", heartbeat_conninfo="dbname=y")


async def test_the_client_needs_nothing_but_the_ledger_client_role(adb, dsn):
    role = f"test_app_{os.getpid()}"
    await adb.execute(f"CREATE ROLE {role} LOGIN IN ROLE ledger_client")
    try:
        await adb.execute("CREATE TABLE reports (writer text, token bigint)")
        await adb.execute(f"GRANT INSERT ON reports TO {role}")
        async with await psycopg.AsyncConnection.connect(dsn + f" user={role}", autocommit=True) as aconn:
            async with AsyncLedger(aconn, owner="app") as ledger:
                async with ledger.run("nightly", ttl=SECOND, heartbeat_interval=timedelta(milliseconds=100)) as run:
                    await asleep(0.3)
                    async with aconn.transaction():
                        await run.fence(aconn, "reports")
                        await aconn.execute("INSERT INTO reports VALUES ('app', %s)", (run.token,))
                    await run.check(remote=True)
                assert run.result is not None and run.result.status == "success"
                assert await ledger.get_run(run.result.run_id) == run.result
                async with ledger.lease("singleton", ttl=SECOND) as lease:
                    assert lease.acquired
    finally:
        await settle(adb, 0)
        await adb.execute(f"DROP OWNED BY {role}")
        await adb.execute(f"DROP ROLE {role}")
