"""The Python client and protected tables: ``run.transaction(conn)`` carries the run's token, so
a protected table takes the live holder's writes and refuses a zombie's (LeaseLost, the context
marked lost), with no fence call in the writer's code. Leases expire through the clock seam."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from ledger import AsyncLedger, LeaseLost, Ledger, StaleToken

WRITES = {
    "INSERT": "INSERT INTO orders VALUES (2, 'zombie')",
    "UPDATE": "UPDATE orders SET note = 'zombie'",
    "DELETE": "DELETE FROM orders",
}


@pytest.fixture
def orders(db):
    db.execute("CREATE TABLE orders (id integer, note text)")
    db.execute("INSERT INTO orders VALUES (1, 'first')")
    db.execute("SELECT ledger.register_job('nightly', ttl => '10 minutes')")
    assert Ledger(db).protect("orders", "nightly") == "public.orders"


def table_rows(db):
    return db.execute("SELECT id, note FROM orders ORDER BY id").fetchall()


def test_the_live_run_writes_through_its_transaction_and_the_fence_records_it(db, connect, orders):
    conn = connect()
    with Ledger(conn, owner="host-1") as ledger, ledger.run("nightly") as run:
        with run.transaction(conn):
            conn.execute("INSERT INTO orders VALUES (2, 'run')")
            conn.execute("UPDATE orders SET note = 'run' WHERE id = 1")
        with conn.transaction(), run.transaction(conn):  # inside a transaction of the caller: a savepoint
            conn.execute("DELETE FROM orders WHERE id = 2")
        token = run.token
    assert table_rows(db) == [(1, "run")]
    assert db.execute("SELECT token FROM ledger.fences WHERE resource = 'public.orders'").fetchone() == (token,)
    # The settings were the transaction's only.
    assert conn.execute("SELECT current_setting('ledger.token', true)").fetchone() in ((None,), ("",))


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_zombie_run_is_refused_and_learns_it_lost_the_lease(db, connect, orders, ledger_clock, write):
    conn = connect()
    with Ledger(conn, owner="zombie") as ledger, pytest.raises(LeaseLost) as lost:
        with ledger.run("nightly") as run:
            ledger_clock.advance(timedelta(minutes=11))
            db.execute("SELECT ledger.start_run('nightly', 'successor')")
            try:
                with run.transaction(conn):
                    conn.execute(WRITES[write])
            finally:
                assert run.is_lost()
    assert lost.value.__cause__ is not None and lost.value.__cause__.sqlstate == "LD001"
    assert table_rows(db) == [(1, "first")]


def test_a_write_outside_the_runs_transaction_carries_no_token_and_is_refused(db, connect, orders):
    conn = connect()
    with Ledger(conn, owner="host-1") as ledger, ledger.run("nightly"):
        with pytest.raises(psycopg.DatabaseError) as error:
            conn.execute("INSERT INTO orders VALUES (2, 'forgot the transaction')")
    assert error.value.sqlstate == "LD001"
    assert table_rows(db) == [(1, "first")]


def test_strict_a_second_transaction_of_one_run_raises_stale_token_and_the_run_is_not_lost(db, connect):
    db.execute("CREATE TABLE ledgerlines (id integer)")
    db.execute("SELECT ledger.register_job('nightly', ttl => '10 minutes')")
    Ledger(db).protect("ledgerlines", "nightly", mode="strict")
    conn = connect()
    with Ledger(conn, owner="host-1") as ledger, ledger.run("nightly") as run:
        with run.transaction(conn):
            conn.execute("INSERT INTO ledgerlines VALUES (1)")
            conn.execute("INSERT INTO ledgerlines VALUES (2)")
        with pytest.raises(StaleToken):
            with run.transaction(conn):
                conn.execute("INSERT INTO ledgerlines VALUES (3)")
        assert not run.is_lost()
    assert db.execute("SELECT array_agg(id ORDER BY id) FROM ledgerlines").fetchone() == ([1, 2],)
    assert Ledger(db).unprotect("ledgerlines") is True
    assert Ledger(db).unprotect("ledgerlines") is False


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_async_client_carries_the_token_too(db, dsn, orders, ledger_clock, anyio_backend):
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        async with AsyncLedger(conn, owner="host-1") as ledger, ledger.run("nightly") as run:
            async with run.transaction(conn):
                await conn.execute("INSERT INTO orders VALUES (2, 'async')")
        async with AsyncLedger(conn, owner="zombie") as ledger:
            with pytest.raises(LeaseLost):
                async with ledger.run("nightly") as zombie:
                    ledger_clock.advance(timedelta(minutes=11))
                    db.execute("SELECT ledger.start_run('nightly', 'successor')")
                    async with zombie.transaction(conn):
                        await conn.execute("DELETE FROM orders")
    assert table_rows(db) == [(1, "first"), (2, "async")]
