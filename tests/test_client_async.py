"""AsyncLedger parity: the scenarios of test_client.py through the asyncio client.

Each test drives its own event loop with asyncio.run (no pytest-asyncio needed).
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from ledger import AsyncLedger, FenceOfAnotherJob, LeaseLost, LeaseSuperseded, RunNotFound, StaleToken
from ledger.aio import advance_fence, fence

SECOND = timedelta(seconds=1)


@pytest.fixture
def reports(db):
    db.execute("CREATE TABLE reports (writer text, token bigint)")
    return db


def log_row(db, run_id):
    return db.execute("SELECT status, failure_reason, error FROM ledger.job_execution_log WHERE run_id = %s",
                      (run_id,)).fetchone()


async def aconnect(dsn, autocommit=True) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit)


def fence_row(db, resource):
    return db.execute("SELECT job, token FROM ledger.fences WHERE resource = %s", (resource,)).fetchone()


async def other_start(dsn, job, owner="intruder", ttl="30 seconds"):
    async with await aconnect(dsn) as conn:
        cur = await conn.execute("SELECT outcome, holder FROM ledger.start_run(job => %s, owner => %s, ttl => %s)",
                                 (job, owner, ttl))
        return await cur.fetchone()


def test_a_one_second_ttl_run_survives_a_five_second_body(dsn, reports):
    async def main():
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
            ledger = AsyncLedger(pool, owner="worker-1")
            probes = []
            async with await aconnect(dsn, autocommit=False) as user:
                async with ledger.run("slow", ttl=SECOND) as run:
                    assert run.started
                    async with user.transaction():  # held open for the whole body
                        for _ in range(2):
                            await asyncio.sleep(2.55)
                            probes.append(await other_start(dsn, "slow", ttl="1 second"))
                        await run.fence(user, "reports")
                        await user.execute("INSERT INTO reports VALUES ('worker-1', %s)", (run.token,))
                    await run.check(remote=True)
            return run, probes

    run, probes = asyncio.run(main())
    assert probes == [("skipped_overlap", "worker-1")] * 2
    assert not run.lost.is_set()
    assert run.result is not None and run.result.status == "success"
    assert run.result.heartbeat_at - run.result.started_at > timedelta(seconds=4)
    assert reports.execute("SELECT count(*) FROM reports").fetchone()[0] == 1


def test_an_exception_in_the_body_fails_the_run_with_its_message(dsn, db):
    async def main():
        async with AsyncLedger(dsn, owner="worker-1") as ledger:
            with pytest.raises(ValueError, match="disk full"):
                async with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
                    raise ValueError("disk full")
            return run

    run = asyncio.run(main())
    assert log_row(db, run.run_id) == ("failure", "error", "ValueError: disk full")


def test_cancelling_the_task_cancels_the_run_and_propagates(dsn, db):
    async def main():
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
            return holder["run"]

    run = asyncio.run(main())
    assert log_row(db, run.run_id) == ("failure", "cancelled", "CancelledError")


def test_a_skip_is_not_an_exception(dsn, db):
    async def main():
        assert (await other_start(dsn, "nightly", ttl="1 minute"))[0] == "started"
        async with AsyncLedger(dsn, owner="worker-1") as ledger:
            async with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
                assert (run.started, run.outcome, run.holder) == (False, "skipped_overlap", "intruder")
        return run

    assert asyncio.run(main()).result is None


def test_lease_loss_sets_the_event_and_awaits_an_async_callback(dsn, db):
    async def main():
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
                    assert (await other_start(dsn, "nightly"))[0] == "started"
                    await asyncio.wait_for(run.lost.wait(), 5)
                    await asyncio.wait_for(called.wait(), 5)
                    with pytest.raises(LeaseLost):
                        await run.check()
            assert isinstance(at_exit.value.__cause__, LeaseSuperseded)
            return run, errors

    run, errors = asyncio.run(main())
    assert len(errors) == 1 and errors[0].run_id == run.run_id
    assert log_row(db, run.run_id)[1] == "lease_expired"


def test_the_fence_rejects_a_holder_whose_lease_was_taken_before_it_noticed(dsn, reports):
    async def main():
        async with AsyncLedger(dsn, owner="worker-1") as ledger, await aconnect(dsn) as conn:
            with pytest.raises(LeaseLost):
                async with ledger.run("nightly", ttl=timedelta(minutes=1),
                                      heartbeat_interval=timedelta(hours=1)) as run:
                    # Expired early on the server (the local deadline is a minute away), then taken over.
                    reports.execute("UPDATE ledger.leases SET expires_at = clock_timestamp() - interval '1 second' "
                                    "WHERE job = 'nightly'")
                    assert (await other_start(dsn, "nightly"))[0] == "started"
                    with pytest.raises(LeaseLost) as rejected:
                        async with conn.transaction():
                            await run.fence(conn, "reports")
                            await conn.execute("INSERT INTO reports VALUES ('zombie', 1)")
                    assert isinstance(rejected.value.__cause__, LeaseSuperseded)  # LD001 from the fence itself
                    assert rejected.value.current_token == run.token + 1
                    assert run.lost.is_set()
                    with pytest.raises(LeaseLost):
                        async with conn.transaction():
                            await run.advance_fence(conn, "reports")

    asyncio.run(main())
    assert reports.execute("SELECT count(*) FROM reports").fetchone()[0] == 0
    assert fence_row(reports, "reports") is None


def test_a_takeover_that_wrote_between_the_fences_check_and_its_lock_marks_the_run_lost(dsn, reports):
    # LD002, as in the sync test: the takeover's open transaction holds the fence row.
    async def main():
        async with AsyncLedger(dsn, owner="worker-1") as ledger, await aconnect(dsn) as zombie, \
                await aconnect(dsn, autocommit=False) as takeover, await aconnect(dsn) as probe:
            with pytest.raises(LeaseLost):
                async with ledger.run("nightly", ttl=timedelta(minutes=1),
                                      heartbeat_interval=timedelta(hours=1)) as run:
                    async with zombie.transaction():
                        await run.fence(zombie, "reports")
                    await takeover.execute("SELECT ledger.release(job => 'nightly', owner => 'worker-1', "
                                           "token => %s)", (run.token,))
                    cur = await takeover.execute("SELECT token FROM ledger.start_run(job => 'nightly', "
                                                 "owner => 'thief', ttl => '1 minute')")
                    new = (await cur.fetchone())[0]
                    await takeover.execute("SELECT ledger.fence(job => 'nightly', resource => 'reports', "
                                           "token => %s)", (new,))

                    async def write():
                        async with zombie.transaction():
                            await run.fence(zombie, "reports")
                            await zombie.execute("INSERT INTO reports VALUES ('zombie', %s)", (run.token,))

                    writer = asyncio.create_task(write())
                    deadline = time.monotonic() + 30
                    while True:
                        cur = await probe.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                                  (zombie.info.backend_pid,))
                        if (await cur.fetchone())[0] == "Lock":
                            break
                        assert not writer.done() and time.monotonic() < deadline, "the fence never waited"
                        await asyncio.sleep(0.01)
                    await takeover.commit()
                    with pytest.raises(LeaseLost) as rejected:
                        await asyncio.wait_for(writer, 30)
                    assert isinstance(rejected.value.__cause__, StaleToken)
                    assert rejected.value.__cause__.highest_token == new
                    assert run.lost.is_set()
            return new

    new = asyncio.run(main())
    assert reports.execute("SELECT count(*) FROM reports").fetchone()[0] == 0
    assert fence_row(reports, "reports") == ("nightly", new)


def test_a_resource_of_another_job_is_fence_of_another_job_not_a_lost_lease(dsn, reports):
    async def main():
        async with AsyncLedger(dsn, owner="worker-1") as ledger, await aconnect(dsn) as conn:
            indexer = await ledger.acquire("indexer", timedelta(minutes=1), owner="indexer-host")
            assert indexer is not None
            assert await fence(conn, "indexer", "reports", indexer.token) == indexer.token
            async with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
                with pytest.raises(FenceOfAnotherJob) as theirs:
                    async with conn.transaction():
                        await run.fence(conn, "reports")
                        await conn.execute("INSERT INTO reports VALUES ('nightly', %s)", (run.token,))
                assert theirs.value.facts == {"resource": "reports", "job": "nightly", "bound_job": "indexer",
                                              "token": run.token}
                assert not run.lost.is_set()
                with pytest.raises(FenceOfAnotherJob):
                    async with conn.transaction():
                        await run.advance_fence(conn, "reports")
                async with conn.transaction():
                    assert await run.advance_fence(conn, "other") is True
                    assert await run.advance_fence(conn, "other") is False
                # The module-level helpers: the job is an argument, the ledger's errors come as they are.
                with pytest.raises(FenceOfAnotherJob):
                    await advance_fence(conn, "nightly", "reports", run.token)
                assert not run.lost.is_set()
            with pytest.raises(LeaseSuperseded):  # the run ended: its token fences nothing any more
                await fence(conn, "nightly", "other", run.token)
            return indexer, run

    indexer, run = asyncio.run(main())
    assert run.result is not None and run.result.status == "success"
    assert reports.execute("SELECT count(*) FROM reports").fetchone()[0] == 0
    assert fence_row(reports, "reports") == ("indexer", indexer.token)
    assert fence_row(reports, "other") == ("nightly", run.token)


def test_a_plain_lease_is_renewed_and_released(dsn, db):
    async def main():
        async with await aconnect(dsn) as conn:
            ledger = AsyncLedger(conn, owner="worker-1")
            async with ledger.lease("singleton", ttl=SECOND) as lease:
                assert lease.acquired
                await asyncio.sleep(1.5)
                assert await ledger.acquire("singleton", SECOND, owner="other") is None
                async with conn.transaction():
                    assert await lease.fence(conn, "inventory") == lease.token
            assert lease.released is True
            assert fence_row(db, "inventory") == ("singleton", lease.token)  # the lease's own job
            async with AsyncLedger(conn, owner="other").lease("singleton", ttl=SECOND) as taken:
                assert taken.acquired and taken.token == lease.token + 1
            with pytest.raises(RunNotFound):
                await ledger.complete_run(424242, 1)

    asyncio.run(main())


def test_no_task_thread_or_connection_leaks_after_1000_runs(dsn, db):
    def backends():
        return db.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                          "AND pid <> pg_backend_pid()").fetchone()[0]

    async def main():
        async with AsyncConnectionPool(dsn, min_size=2, max_size=2, open=False,
                                       kwargs={"autocommit": True}) as pool:
            await pool.wait()
            threads, tasks, before = threading.active_count(), len(asyncio.all_tasks()), backends()
            ledger = AsyncLedger(pool, owner="pooled")
            for i in range(1000):
                async with ledger.run("busy", ttl=timedelta(seconds=30),
                                      heartbeat_interval=timedelta(milliseconds=1)) as run:
                    if i % 100 == 0:
                        await asyncio.sleep(0.01)
            assert run.token == 1000 and run.result is not None and run.result.status == "success"
            assert (threading.active_count(), len(asyncio.all_tasks()), backends()) == (threads, tasks, before)

    asyncio.run(main())
    deadline = time.monotonic() + 3
    while backends() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backends() == 0
