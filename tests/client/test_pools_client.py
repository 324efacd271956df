"""The Python client and pools: register_pool/resize_pool/drop_pool/pool_status(es), register_job's
``pool`` (PoolNotFound for a pool never registered, ``""`` leaves it), and a start refused by a full
pool surfaced as the outcome ``skipped_pool_full``: not started, no token, nothing failed, told
apart from ``skipped_overlap``, counted in the job's ``skipped_pool_full``."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from ledger import AsyncLedger, InvalidArgument, Ledger, Pool, PoolNotFound, PoolStatus

TTL = timedelta(minutes=5)


def test_pools_are_registered_resized_listed_and_dropped(db):
    ledger = Ledger(db)
    pool = ledger.register_pool("heavy", 3)
    assert isinstance(pool, Pool) and (pool.pool, pool.size, pool.admitted_at) == ("heavy", 3, None)
    assert ledger.resize_pool("heavy", 2).size == 2
    assert ledger.register_pool("heavy", 4).size == 4  # register changes a registered pool's size
    job = ledger.register_job("report", pool="heavy")
    assert job.pool == "heavy"
    assert ledger.register_job("report", max_backfill=2).pool == "heavy"  # None keeps it
    [status] = ledger.pool_statuses()
    assert isinstance(status, PoolStatus)
    assert (status.pool, status.size, status.used, status.running, status.jobs, status.waiting,
            status.skipped_pool_full) == ("heavy", 4, 0, 0, 1, 0, 0)
    assert ledger.pool_status("heavy") == status and ledger.pool_status("nope") is None

    with pytest.raises(psycopg.errors.DependentObjectsStillExist) as refused:
        ledger.drop_pool("heavy")
    assert "report" in str(refused.value)
    assert ledger.register_job("report", pool="").pool is None  # '' leaves the pool
    assert ledger.drop_pool("heavy") is True
    assert ledger.drop_pool("heavy") is False
    assert ledger.pool_statuses() == []


def test_detach_takes_the_jobs_out(db):
    ledger = Ledger(db)
    ledger.register_pool("heavy", 1)
    ledger.register_job("a", pool="heavy")
    assert ledger.drop_pool("heavy", detach=True) is True
    status = ledger.job_status("a")
    assert status is not None and status.pool is None


def test_an_unknown_pool_and_a_bad_size_raise_and_change_nothing(db):
    ledger = Ledger(db)
    with pytest.raises(PoolNotFound) as unknown:
        ledger.register_job("report", pool="nope")
    assert unknown.value.sqlstate == "LD008"
    assert (unknown.value.pool, unknown.value.argument) == ("nope", "pool")  # the DETAIL's facts
    assert ledger.job_status("report") is None
    with pytest.raises(PoolNotFound):
        ledger.resize_pool("nope", 2)
    for size in (0, 100_001):
        with pytest.raises(InvalidArgument) as bad:
            ledger.register_pool("heavy", size)
        assert bad.value.argument == "size" and "argument size" in str(bad.value)
    assert ledger.pool_statuses() == []


def test_a_full_pool_is_the_outcome_skipped_pool_full(db, connect):
    ledger = Ledger(db)
    ledger.register_pool("heavy", 1)
    ledger.register_job("a", pool="heavy")
    ledger.register_job("b", schedule="1 minute", pool="heavy")  # a slot due: the catch-up below starts one
    with Ledger(connect(), owner="host-1") as one, Ledger(connect(), owner="host-2") as two:
        with one.run("a", ttl=TTL) as held:
            assert held.started
            with two.run("b", ttl=TTL) as refused:
                assert not refused.started
                assert refused.outcome == "skipped_pool_full" != "skipped_overlap"
                assert refused.token is None and refused.run_id is None and refused.holder is None
            assert refused.result is None  # nothing to end: nothing recorded as failed
            start = two.start_run("b", ttl=TTL)
            assert (start.outcome, start.started, start.token) == ("skipped_pool_full", False, None)
            assert two.acquire("b", TTL) is None  # acquire: no row
            # the catch-up loop ends at the full pool, running nothing
            assert list(two.catch_up("b", ttl=TTL)) == []
            status = ledger.pool_status("heavy")
            assert status is not None and status.used == 1 and status.skipped_pool_full >= 3
        with two.run("b", ttl=TTL) as admitted:  # the place freed
            assert admitted.started
    b = ledger.job_status("b")
    assert b is not None and b.pool == "heavy"
    assert (b.skipped_pool_full, b.skipped_overlap, b.failures, b.successes) == (4, 0, 0, 1)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_async_client_says_the_same(dsn, db, anyio_backend):
    Ledger(db).register_pool("heavy", 1)
    async with AsyncLedger(dsn, owner="host-1") as one, AsyncLedger(dsn, owner="host-2") as two:
        assert (await one.register_job("a", pool="heavy")).pool == "heavy"
        await one.register_job("b", pool="heavy")
        async with one.run("a", ttl=TTL) as held, two.run("b", ttl=TTL) as refused:
            assert held.started and not refused.started
            assert refused.outcome == "skipped_pool_full"
        with pytest.raises(PoolNotFound):
            await two.resize_pool("nope", 1)
        status = await two.pool_status("heavy")
        assert status is not None and (status.used, status.skipped_pool_full) == (0, 1)
        b = await two.job_status("b")
        assert b is not None and (b.pool, b.skipped_pool_full) == ("heavy", 1)
