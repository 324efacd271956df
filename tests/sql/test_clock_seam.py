"""The ledger's clock seam (sql/12_clock.sql): the owner of a test database
moves the ledger's time, so a lease expires or a slot comes due without the
test sleeping it out; no client can move it.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest

from sqlhelp import one


def test_advancing_the_clock_expires_a_lease_so_another_owner_takes_over_and_the_old_token_is_fenced_off(
        db, ledger_clock):
    first = one(db, "SELECT * FROM ledger.start_run('nightly', 'host-1', '1 hour')")
    assert one(db, "SELECT outcome FROM ledger.start_run('nightly', 'host-2', '1 hour')")["outcome"] == \
        "skipped_overlap"

    ledger_clock.advance(timedelta(hours=1, seconds=1))

    second = one(db, "SELECT * FROM ledger.start_run('nightly', 'host-2', '1 hour')")
    assert second["outcome"] == "started" and second["token"] > first["token"]
    db.execute("SELECT ledger.fence('nightly', 'reports', %s)", [second["token"]])
    with pytest.raises(psycopg.DatabaseError) as refused:
        db.execute("SELECT ledger.fence('nightly', 'reports', %s)", [first["token"]])
    assert refused.value.sqlstate == "LD001"


def test_the_views_read_the_same_clock_as_the_functions(db, ledger_clock):
    db.execute("SELECT ledger.start_run('nightly', 'host-1', '10 minutes')")
    assert one(db, "SELECT holder FROM ledger.job_status WHERE job = 'nightly'")["holder"] == "host-1"

    ledger_clock.advance(timedelta(minutes=11))

    assert one(db, "SELECT holder FROM ledger.job_status WHERE job = 'nightly'")["holder"] is None
    assert one(db, "SELECT ledger._now() - clock_timestamp() > interval '10 minutes' AS ahead")["ahead"]


def test_a_due_slot_comes_with_the_clock(db, ledger_clock):
    db.execute("SELECT ledger.register_job('hourly', schedule => '1 hour', ttl => '5 minutes')")
    started = one(db, "SELECT * FROM ledger.start_due_run('hourly', 'host-1')")
    db.execute("SELECT ledger.complete_run(%s, %s)", [started["run_id"], started["token"]])
    assert one(db, "SELECT outcome FROM ledger.start_due_run('hourly', 'host-1')")["outcome"] != "started"

    ledger_clock.advance(timedelta(hours=1))

    later = one(db, "SELECT * FROM ledger.start_due_run('hourly', 'host-1')")
    assert later["outcome"] == "started" and later["slot"] > started["slot"]


@pytest.mark.parametrize("attempt", [
    "CREATE OR REPLACE FUNCTION ledger._clock_offset() RETURNS interval LANGUAGE sql STABLE "
    "AS $$ SELECT interval '1 day' $$",
    "ALTER FUNCTION ledger._clock_offset() RENAME TO _old_offset",
    "CREATE FUNCTION ledger._clock_offset(x int) RETURNS interval LANGUAGE sql AS $$ SELECT interval '1 day' $$",
])
def test_a_client_cannot_move_the_clock(db, app_role, attempt):
    db.execute(f"SET ROLE {app_role}")
    assert one(db, "SELECT ledger._now() - clock_timestamp() < interval '1 minute' AS real")["real"]
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute(attempt)
    db.execute("RESET ROLE")
    assert one(db, "SELECT ledger._now() - clock_timestamp() < interval '1 minute' AS real")["real"]
