"""Clients write only through the functions: no role can forge or rewind a token."""

import os
from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from sqlhelp import one, value

TABLES = ["jobs", "leases", "fences", "job_execution_log", "counters"]
WRITES = {
    "INSERT": "INSERT INTO ledger.{t} DEFAULT VALUES",
    "UPDATE": "UPDATE ledger.{t} SET {c} = {c}",
    "DELETE": "DELETE FROM ledger.{t}",
    "TRUNCATE": "TRUNCATE ledger.{t}",
}
KEY = {"jobs": "job", "leases": "token", "fences": "token", "job_execution_log": "status", "counters": "failures"}


@pytest.fixture
def app_role(db):
    """A role of the application, member of ledger_client (roles are cluster-wide: unique name)."""
    name = f"ledger_app_{os.getpid()}"
    db.execute(f"DROP ROLE IF EXISTS {name}")
    db.execute(f"CREATE ROLE {name} NOLOGIN IN ROLE ledger_client")
    yield name
    db.execute("RESET ROLE")
    db.execute(f"DROP OWNED BY {name}")
    db.execute(f"DROP ROLE {name}")


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_client_role_cannot_write_ledger_tables(db, app_role, table, write):
    db.execute("SELECT ledger.start_run('nightly', 'host-1', '1 hour')")
    db.execute(f"SET ROLE {app_role}")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute(WRITES[write].format(t=table, c=KEY[table]))


def test_a_client_role_uses_the_api_and_reads_the_tables(db, app_role):
    db.execute(f"SET ROLE {app_role}")
    started = one(db, "SELECT * FROM ledger.start_run('nightly', 'host-1', '1 hour')")
    assert started["outcome"] == "started"
    assert value(db, "SELECT ledger.fence('reports', %s)", (started["token"],)) == started["token"]
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == 1
    assert value(db, "SELECT count(*) FROM ledger.job_counters") == 1
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))


def test_a_client_role_cannot_call_internal_helpers_that_touch_tables(db, app_role):
    db.execute(f"SET ROLE {app_role}")
    for call in ("ledger._count('nightly', failures => 1)", "ledger._close_run(1, 'superseded', now())",
                 "ledger._newest_done_slot('nightly')", "ledger._make_durable()"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute(f"SELECT {call}")


def test_only_pure_immutable_helpers_are_granted_to_the_roles(db):
    granted = db.execute("""
        SELECT p.oid::regprocedure::text FROM pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace AND p.proname LIKE E'\\\\_%'
           AND has_function_privilege('ledger_reader', p.oid, 'EXECUTE')
           AND p.provolatile <> 'i'""").fetchall()
    assert granted == []


def test_the_reader_role_reads_but_cannot_call_the_api(db):
    db.execute("SELECT ledger.acquire('nightly', 'host-1', '1 hour')")
    db.execute("SET ROLE ledger_reader")
    assert value(db, "SELECT count(*) FROM ledger.leases") == 1
    assert value(db, "SELECT count(*) FROM ledger.overlaps") == 0
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SELECT ledger.acquire('nightly', 'host-2', '1 hour')")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SELECT ledger.fence('reports', 1)")


def test_public_has_no_access_to_the_schema(db):
    assert value(db, "SELECT has_schema_privilege('public', 'ledger', 'USAGE')") is False
    assert value(db, "SELECT has_function_privilege('public', 'ledger.acquire(text,text,interval)', 'EXECUTE')") is False


def test_every_public_function_is_security_definer_with_a_fixed_search_path(db):
    bad = db.execute("""
        SELECT p.proname FROM pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
           AND (NOT p.prosecdef AND p.proname NOT LIKE E'\\\\_%'
                OR p.proconfig IS NULL
                OR NOT 'search_path=pg_catalog, pg_temp' = ANY (p.proconfig))""").fetchall()
    assert bad == []


def test_a_schema_earlier_in_search_path_defining_now_and_clock_timestamp_changes_nothing(db, app_role):
    db.execute("CREATE SCHEMA evil")
    for fn in ("now", "clock_timestamp", "statement_timestamp", "transaction_timestamp"):
        db.execute(f"CREATE FUNCTION evil.{fn}() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2000-01-01'::timestamptz $$")
    db.execute("CREATE FUNCTION evil.char_length(text) RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$")
    db.execute("GRANT USAGE ON SCHEMA evil TO PUBLIC")
    db.execute(f"SET ROLE {app_role}")
    db.execute("SET search_path = evil, pg_catalog, public")
    assert value(db, "SELECT clock_timestamp()").year == 2000  # the trap is armed
    lease = one(db, "SELECT * FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    real_now = datetime.now(timezone.utc)
    assert abs(lease["acquired_at"] - real_now) < timedelta(minutes=5)
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (lease["token"],)) is True
    started = one(db, "SELECT * FROM ledger.start_run('other', 'host-1', '1 hour')")
    assert abs(started["expires_at"] - real_now - timedelta(hours=1)) < timedelta(minutes=5)
