"""Static analysis of every PL/pgSQL function in schema ledger with plpgsql_check.

Errors (a column or variable that does not exist, a wrong type, a statement
that cannot run) and security findings (SQL injection through EXECUTE: these
functions are SECURITY DEFINER) fail the test; every other warning is
reported, not failed.
"""

from __future__ import annotations

import warnings
from typing import Any

import psycopg
import pytest

from sqlhelp import PlpgsqlCheckWarning

FAILING_LEVELS = {"error", "security"}

CHECK = """
SELECT p.oid::regprocedure::text, r.lineno, r.level, r.sqlstate, r.message, r.detail, r.hint
  FROM pg_proc p
  JOIN pg_language l ON l.oid = p.prolang AND l.lanname = 'plpgsql'
 CROSS JOIN LATERAL plpgsql_check_function_tb(
           p.oid,
           -- a trigger function is checked against the table it fires on
           relid => coalesce((SELECT t.tgrelid FROM pg_trigger t WHERE t.tgfoid = p.oid LIMIT 1), 0)::regclass,
           fatal_errors => false, other_warnings => true, extra_warnings => true,
           performance_warnings => true, security_warnings => true,
           compatibility_warnings => true) r
 WHERE p.pronamespace = %(schema)s::regnamespace
 ORDER BY 1, 2
"""


def findings(conn: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    return conn.execute(CHECK, {"schema": schema}).fetchall()


def describe(rows: list[tuple[Any, ...]]) -> str:
    return "\n".join(
        f"{function} line {lineno}: {level} {sqlstate} {message}"
        + (f" ({detail})" if detail else "") + (f" hint: {hint}" if hint else "")
        for function, lineno, level, sqlstate, message, detail, hint in rows)


@pytest.fixture
def checked_db(db: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """A fresh ledger database with the plpgsql_check extension, or a skip saying why not."""
    if db.execute("SELECT FROM pg_available_extensions WHERE name = 'plpgsql_check'").fetchone() is None:
        major = db.info.server_version // 10000
        pytest.skip(f"needs plpgsql_check (apt-get install postgresql-{major}-plpgsql-check): on the server")
    try:
        db.execute("CREATE EXTENSION plpgsql_check")
    except psycopg.errors.InsufficientPrivilege as error:
        pytest.skip(f"needs plpgsql_check (a superuser to CREATE EXTENSION it): {error}")
    return db


def test_plpgsql_functions_have_no_errors_or_security_findings(checked_db):
    # A trigger function is checked against a table it fires on: ledger._protect fires on users' tables only.
    checked_db.execute("CREATE TABLE public.protected (id integer)")
    checked_db.execute("SELECT ledger.register_job('protecting')")
    checked_db.execute("SELECT ledger.protect('public.protected', 'protecting')")
    checked = checked_db.execute(
        """SELECT count(*) FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
            WHERE p.pronamespace = 'ledger'::regnamespace AND l.lanname = 'plpgsql'""").fetchone()[0]
    assert checked >= 10, "expected the ledger's PL/pgSQL functions in schema ledger"

    rows = findings(checked_db, "ledger")
    failing = [row for row in rows if row[2] in FAILING_LEVELS]
    reported = [row for row in rows if row[2] not in FAILING_LEVELS]
    if reported:
        warnings.warn(PlpgsqlCheckWarning(
            f"plpgsql_check: {len(reported)} warnings in schema ledger:\n{describe(reported)}"))
    assert not failing, f"plpgsql_check found {len(failing)} problems:\n{describe(failing)}"


def test_the_check_catches_a_broken_function(checked_db):
    # The canary: the query above must see what plpgsql_check reports.
    checked_db.execute("CREATE SCHEMA canary")
    checked_db.execute("""
        CREATE FUNCTION canary.broken(name text) RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER AS $$
        DECLARE n bigint;
        BEGIN
            EXECUTE 'SELECT count(*) FROM pg_class WHERE relname = ''' || name || '''' INTO n;
            SELECT no_such_column INTO n FROM pg_class;
            RETURN n;
        END $$""")
    levels = {row[2] for row in findings(checked_db, "canary")}
    assert FAILING_LEVELS <= levels
