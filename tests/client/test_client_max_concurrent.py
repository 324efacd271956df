"""max_concurrent in the Python client (sync and asyncio): it reaches ledger.register_job, None keeps
it, a bad value is InvalidArgument naming it; two runs of a two-seat job hold their own tokens."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

from ledger import AsyncLedger
from ledger.client import Ledger
from ledger.errors import InvalidArgument


def test_client_register_job_passes_max_concurrent(db: psycopg.Connection) -> None:
    ledger = Ledger(db)
    job = ledger.register_job("pair", ttl=timedelta(minutes=1), max_concurrent=2)
    assert job.max_concurrent == 2
    assert ledger.register_job("pair", ttl=timedelta(minutes=2)).max_concurrent == 2
    assert ledger.register_job("solo").max_concurrent == 1
    with pytest.raises(InvalidArgument) as refused:
        ledger.register_job("pair", max_concurrent=0)
    assert refused.value.sqlstate == "22023" and "max_concurrent" in str(refused.value)
    with pytest.raises(InvalidArgument) as refused:
        ledger.register_job("pair", overlap_policy="replace")
    assert "overlap_policy" in str(refused.value)
    first = ledger.start_run("pair", owner="w1")
    second = ledger.start_run("pair", owner="w2")
    third = ledger.start_run("pair", owner="w3")
    assert (first.outcome, second.outcome, third.outcome) == ("started", "started", "skipped_overlap")
    assert second.token > first.token


def test_the_async_client_passes_it_too(dsn: str) -> None:
    async def scenario() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            ledger = AsyncLedger(conn)
            job = await ledger.register_job("pair", ttl=timedelta(minutes=1), max_concurrent=3)
            assert job.max_concurrent == 3
            with pytest.raises(InvalidArgument):
                await ledger.register_job("pair", max_concurrent=1001)
        finally:
            await conn.close()
    asyncio.run(scenario())
