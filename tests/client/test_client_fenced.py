"""The Python client names the resources a run fenced to complete_run (issue 21, point 3): a fenced
write whose transaction did not commit makes the run a failure, and a normal exit raises
FenceNotCommitted (LD007) once that failure is committed; a committed fenced write is a success."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

from ledger import AsyncLedger, FenceNotCommitted, Ledger
from ledger import queries
from ledger.calls import end_call


@pytest.fixture
def exports(db):
    db.execute("CREATE TABLE exports (token bigint)")


def logged(db, run_id):
    return db.execute("SELECT status, failure_reason, error FROM ledger.job_execution_log WHERE run_id = %s",
                      (run_id,)).fetchone()


def test_a_fenced_write_that_did_not_commit_fails_the_run_and_raises(db, connect, exports):
    writer = connect(autocommit=False)
    with Ledger(connect(), owner="host-1") as ledger, pytest.raises(FenceNotCommitted) as raised:
        with ledger.run("export", ttl=timedelta(minutes=10)) as run:
            run.fence(writer, "exports")
            writer.execute("INSERT INTO exports VALUES (%s)", (run.token,))
            writer.rollback()  # the COMMIT a pooler lost: nothing of the write, nor of its fence, exists
            assert run.fenced == ("exports",)
    error = raised.value
    assert error.sqlstate == "LD007"
    assert error.resources == ["exports"] and error.fence_tokens == {"exports": None}
    assert run.result is not None and error.run == run.result
    status, reason, text = logged(db, run.run_id)
    assert (status, reason) == ("failure", "error") and text.startswith("fence not committed: exports")
    assert db.execute("SELECT released_at IS NOT NULL FROM ledger.leases WHERE job = 'export'").fetchone() == (True,)


def test_a_committed_fenced_write_is_a_success(db, connect, exports):
    writer = connect(autocommit=False)
    with Ledger(connect(), owner="host-1") as ledger:
        with ledger.run("export", ttl=timedelta(minutes=10)) as run:
            run.fence(writer, "exports")
            writer.execute("INSERT INTO exports VALUES (%s)", (run.token,))
            writer.commit()
            run.advance_fence(writer, "second")
            writer.commit()
    assert run.fenced == ("exports", "second")
    assert run.result is not None and run.result.status == "success"


def test_a_protected_table_named_with_add_fenced_is_checked_too(db, connect):
    db.execute("CREATE TABLE orders (id integer)")
    db.execute("SELECT ledger.register_job('nightly', ttl => '10 minutes')")
    assert Ledger(db).protect("orders", "nightly") == "public.orders"
    conn = connect()
    with Ledger(connect(), owner="host-1") as ledger, pytest.raises(FenceNotCommitted):
        with ledger.run("nightly") as run:
            run.add_fenced("public.orders")
            with pytest.raises(RuntimeError), run.transaction(conn):
                conn.execute("INSERT INTO orders VALUES (1)")
                raise RuntimeError("the write's transaction rolls back")
    assert logged(db, run.run_id)[0] == "failure"
    with Ledger(connect(), owner="host-1") as ledger, ledger.run("nightly") as run:
        run.add_fenced("public.orders")
        with run.transaction(conn):
            conn.execute("INSERT INTO orders VALUES (2)")
    assert run.result is not None and run.result.status == "success"


def test_the_async_client_raises_it_too(db, dsn, exports):
    async def scenario() -> int | None:
        writer = await psycopg.AsyncConnection.connect(dsn)
        try:
            async with AsyncLedger(await psycopg.AsyncConnection.connect(dsn, autocommit=True),
                                   owner="host-1") as ledger:
                with pytest.raises(FenceNotCommitted):
                    async with ledger.run("export", ttl=timedelta(minutes=10)) as run:
                        await run.fence(writer, "exports")
                        await writer.rollback()
                return run.run_id
        finally:
            await writer.close()

    run_id = asyncio.run(scenario())
    assert logged(db, run_id)[0] == "failure"


def test_complete_run_passes_fenced_and_returns_the_failed_row(db, exports):
    ledger = Ledger(db, owner="host-1")
    start = ledger.start_run("export", ttl=timedelta(minutes=10))
    assert start.run_id is not None and start.token is not None
    row = ledger.complete_run(start.run_id, start.token, fenced=["exports"])
    assert (row.status, row.detail) == ("failure", {"fence_not_committed": ["exports"],
                                                    "fence_tokens": {"exports": None}})


def test_a_run_that_fenced_nothing_sends_the_complete_run_of_before():
    """So a client newer than its ledger (before the upgrade) completes as it did."""
    assert end_call(1, 2, None, None, None, {}, ())[0] == queries.COMPLETE_RUN
    query, params = end_call(1, 2, None, None, None, {}, ("a", "b"))
    assert query == queries.COMPLETE_FENCED_RUN and params["fenced"] == ["a", "b"]
