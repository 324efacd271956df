"""register_job's scheduling options in the Python client (sync and asyncio): jitter, start_deadline,
overlap_policy reach ledger.register_job; None keeps what the job has, 0 clears; a bad value is
the SQL's 22023 (InvalidArgument) naming the argument, and changes nothing."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

from ledger import AsyncLedger
from ledger.client import Ledger
from ledger.errors import InvalidArgument


def test_client_register_job_passes_the_scheduling_options(db: psycopg.Connection) -> None:
    ledger = Ledger(db)
    job = ledger.register_job("every-minute", schedule="1 minute", ttl=timedelta(seconds=50),
                              jitter=timedelta(seconds=5), start_deadline=timedelta(seconds=20),
                              overlap_policy="replace")
    assert (job.jitter, job.start_deadline, job.overlap_policy) == (timedelta(seconds=5), timedelta(seconds=20),
                                                                    "replace")
    kept = ledger.register_job("every-minute", ttl=timedelta(seconds=40))
    assert (kept.jitter, kept.start_deadline, kept.overlap_policy) == (timedelta(seconds=5), timedelta(seconds=20),
                                                                       "replace")
    with pytest.raises(InvalidArgument) as refused:
        ledger.register_job("every-minute", overlap_policy="sometimes")
    assert refused.value.sqlstate == "22023" and "overlap_policy" in str(refused.value)
    with pytest.raises(InvalidArgument):
        ledger.register_job("every-minute", jitter=timedelta(minutes=2))
    cleared = ledger.register_job("every-minute", jitter=timedelta(0), start_deadline=timedelta(0))
    assert cleared.jitter is None and cleared.start_deadline is None and cleared.overlap_policy == "replace"



def test_the_async_client_passes_them_too(dsn: str) -> None:
    async def scenario() -> None:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        try:
            ledger = AsyncLedger(conn)
            job = await ledger.register_job("nightly", schedule="1 hour", ttl=timedelta(minutes=5),
                                            jitter=timedelta(minutes=1), start_deadline=timedelta(minutes=15),
                                            overlap_policy="skip")
            assert (job.jitter, job.start_deadline, job.overlap_policy) == (
                timedelta(minutes=1), timedelta(minutes=15), "skip")
            with pytest.raises(InvalidArgument) as refused:
                await ledger.register_job("nightly", overlap_policy="allow_all")
            assert "overlap_policy" in str(refused.value)
            kept = await ledger.register_job("nightly")
            assert kept.overlap_policy == "skip" and kept.jitter == timedelta(minutes=1)
        finally:
            await conn.close()

    asyncio.run(scenario())
