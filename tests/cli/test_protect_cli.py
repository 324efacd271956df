"""`jobledger protect` / `unprotect`, the protected tables in `jobledger status`, and
`jobledger run --pgoptions -- psql ...`: a psql that carries the run's token writes a protected
table, one that wakes after a takeover writes nothing (real subprocesses, a real database)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from clihelp import environment, jobledger, start
from waiting import wait_for

from ledger.wrapper import carried_options


@pytest.fixture
def orders(db):
    db.execute("CREATE TABLE orders (id integer, note text)")
    db.execute("SELECT ledger.register_job('nightly', ttl => '1 hour')")


def psql(dsn, *sql):
    """A psql command line that runs each statement and stops at the first error."""
    return ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn] + [arg for s in sql for arg in ("-c", s)]


def test_protect_status_and_unprotect(dsn, db, orders):
    result = jobledger("protect", "orders", "--job", "nightly", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "protected public.orders for job nightly (lenient): a write must carry the job's live token\n"

    status = jobledger("status", dsn=dsn)
    assert "protected table orders: job nightly (lenient)" in status.stdout
    document = json.loads(jobledger("status", "--json", dsn=dsn).stdout)
    assert document["protected_tables"] == [
        {"table_name": "orders", "job": "nightly", "resource": "public.orders", "mode": "lenient", "enabled": True}]
    db.execute("SELECT ledger.register_job('weekly')")
    assert json.loads(jobledger("status", "--json", "weekly", dsn=dsn).stdout)["protected_tables"] == []

    again = jobledger("protect", "orders", "--job", "nightly", "--strict", dsn=dsn)
    assert again.returncode == 1
    assert again.stderr.count("\n") == 1 and "protected already (for job nightly)" in again.stderr

    assert jobledger("unprotect", "orders", dsn=dsn).stdout == "unprotected orders\n"
    assert jobledger("unprotect", "orders", dsn=dsn).stdout == "orders was not protected\n"
    assert json.loads(jobledger("status", "--json", dsn=dsn).stdout)["protected_tables"] == []


def test_protect_strict_and_bad_input_in_one_line(dsn, db, orders):
    assert jobledger("protect", "orders", "--job", "nightly", "--strict", dsn=dsn).returncode == 0
    assert db.execute("SELECT mode FROM ledger.protected_tables").fetchone() == ("strict",)
    for args, said in ((["protect", "no_such_table", "--job", "nightly"], 'relation "no_such_table" does not exist'),
                       (["protect", "orders", "--job", "never-registered"], "job not found: never-registered"),
                       (["unprotect", "no_such_table"], 'relation "no_such_table" does not exist')):
        result = jobledger(*args, dsn=dsn)
        assert result.returncode == 1, result
        assert result.stderr.count("\n") == 1 and said in result.stderr, result.stderr


def test_run_with_pgoptions_lets_psql_write_the_protected_table_and_records_the_fence(dsn, db, orders):
    db.execute("SELECT ledger.protect('orders', 'nightly')")
    result = jobledger("run", "nightly", "--pgoptions", "--", *psql(
        dsn, "INSERT INTO orders VALUES (1, 'psql')", "UPDATE orders SET note = 'psql, updated'"), dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert db.execute("SELECT id, note FROM orders").fetchall() == [(1, "psql, updated")]
    token = db.execute("SELECT token FROM ledger.job_execution_log WHERE job = 'nightly'").fetchone()[0]
    assert db.execute("SELECT token FROM ledger.fences WHERE resource = 'public.orders'").fetchone() == (token,)


def test_run_without_pgoptions_carries_no_token_and_psql_is_refused(dsn, db, orders):
    db.execute("SELECT ledger.protect('orders', 'nightly')")
    result = jobledger("run", "nightly", "--", *psql(dsn, "INSERT INTO orders VALUES (1, 'psql')"), dsn=dsn)
    assert result.returncode != 0
    assert "no fencing token" in result.stderr
    assert db.execute("SELECT count(*) FROM orders").fetchone() == (0,)


def test_a_psql_that_wakes_after_a_takeover_writes_nothing(dsn, db, connect, orders, ledger_clock):
    db.execute("INSERT INTO orders VALUES (1, 'first')")
    db.execute("SELECT ledger.protect('orders', 'nightly')")
    gate = connect()
    gate.execute("SELECT pg_advisory_lock(4243)")  # the zombie's psql waits here: "frozen"
    zombie = start("run", "nightly", "--pgoptions", "--", *psql(
        dsn, "SELECT pg_advisory_lock(4243)", "INSERT INTO orders VALUES (2, 'zombie')",
        "UPDATE orders SET note = 'zombie'", "DELETE FROM orders"), dsn=dsn)
    try:
        wait_for(lambda: db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
                 .fetchone()[0], what="the zombie's psql at the gate")
        ledger_clock.advance(timedelta(hours=1, seconds=1))
        db.execute("SELECT ledger.acquire('nightly', 'successor', '1 hour')")
    finally:
        gate.execute("SELECT pg_advisory_unlock(4243)")
    _, stderr = zombie.communicate(timeout=60)
    assert zombie.returncode != 0
    assert "lease superseded" in stderr, stderr
    assert db.execute("SELECT id, note FROM orders").fetchall() == [(1, "first")]


def test_the_job_name_is_escaped_for_libpq_and_the_callers_pgoptions_are_kept(dsn, db):
    assert carried_options("", "nightly", 7) == "-c ledger.job=nightly -c ledger.token=7"
    assert carried_options("-c work_mem=64MB", "a b\\c", 7) == \
        "-c work_mem=64MB -c ledger.job=a\\ b\\\\c -c ledger.token=7"
    db.execute("CREATE TABLE orders (id integer)")
    db.execute("SELECT ledger.register_job('night shift', ttl => '1 hour')")
    db.execute("SELECT ledger.protect('orders', 'night shift')")
    env = environment(dsn, PGOPTIONS="-c work_mem=64MB")
    result = jobledger("run", "night shift", "--pgoptions", "--", *psql(
        dsn, "INSERT INTO orders SELECT 1 WHERE current_setting('work_mem') = '64MB'"), env=env)
    assert result.returncode == 0, result.stderr
    assert db.execute("SELECT count(*) FROM orders").fetchone() == (1,)
