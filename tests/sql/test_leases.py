"""Leases: compare-and-set on one row, a new fencing token per acquisition."""

import time

import psycopg
import pytest

from sqlhelp import one, rows, value

ACQUIRE = "SELECT * FROM ledger.acquire(job => %s, owner => %s, ttl => %s)"


def test_acquire_returns_a_lease_row_with_token_1_for_a_new_job(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "80 minutes"))
    assert lease["job"] == "nightly"
    assert lease["owner"] == "host-1"
    assert lease["token"] == 1
    assert (lease["expires_at"] - lease["acquired_at"]).total_seconds() == 80 * 60


def test_acquire_result_is_the_declared_composite_type(db):
    assert value(db, "SELECT pg_get_function_result('ledger.acquire(text,text,interval)'::regprocedure)") \
        == "SETOF ledger.lease"
    columns = rows(db, """SELECT attname, format_type(atttypid, atttypmod) AS type FROM pg_attribute
                          WHERE attrelid = 'ledger.lease'::regclass AND attnum > 0 ORDER BY attnum""")
    assert [(c["attname"], c["type"]) for c in columns] == [
        ("job", "text"), ("owner", "text"), ("token", "bigint"),
        ("acquired_at", "timestamp with time zone"), ("expires_at", "timestamp with time zone")]


def test_another_owner_gets_no_row_while_the_lease_is_live(db):
    one(db, ACQUIRE, ("nightly", "host-1", "1 minute"))
    assert rows(db, ACQUIRE, ("nightly", "host-2", "1 minute")) == []
    assert value(db, "SELECT owner FROM ledger.leases WHERE job = 'nightly'") == "host-1"


def test_same_owner_reacquiring_gets_a_new_higher_token(db):
    first = one(db, ACQUIRE, ("nightly", "host-1", "1 minute"))
    second = one(db, ACQUIRE, ("nightly", "host-1", "1 minute"))
    assert second["token"] == first["token"] + 1
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (first["token"],)) is False
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (second["token"],)) is True


def test_an_expired_lease_is_taken_by_another_owner_with_the_next_token(db):
    one(db, ACQUIRE, ("nightly", "host-1", "50 milliseconds"))
    time.sleep(0.1)
    lease = one(db, ACQUIRE, ("nightly", "host-2", "1 minute"))
    assert lease["owner"] == "host-2" and lease["token"] == 2


def test_tokens_count_up_by_one_across_owners_and_releases(db):
    tokens = []
    for i in range(5):
        lease = one(db, ACQUIRE, ("nightly", f"host-{i}", "1 minute"))
        tokens.append(lease["token"])
        assert value(db, "SELECT ledger.release('nightly', %s, %s)", (f"host-{i}", lease["token"])) is True
    assert tokens == [1, 2, 3, 4, 5]


def test_a_rolled_back_acquire_issues_no_token(connect):
    conn = connect(autocommit=False)
    one(conn, ACQUIRE, ("nightly", "host-1", "1 minute"))
    conn.rollback()
    lease = one(conn, ACQUIRE, ("nightly", "host-1", "1 minute"))
    conn.commit()
    assert lease["token"] == 1


def test_ttl_null_uses_the_registered_ttl(db):
    db.execute("INSERT INTO ledger.jobs (job, ttl) VALUES ('nightly', '80 minutes')")
    lease = one(db, "SELECT * FROM ledger.acquire(job => 'nightly', owner => 'host-1')")
    assert (lease["expires_at"] - lease["acquired_at"]).total_seconds() == 80 * 60


def test_ttl_null_for_an_unregistered_job_is_22023_naming_ttl(db):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="ttl"):
        db.execute("SELECT * FROM ledger.acquire(job => 'nightly', owner => 'host-1')")


def test_renew_extends_the_lease_and_returns_the_new_expiry(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "1 minute"))
    expires = value(db, "SELECT ledger.renew(job => 'nightly', owner => 'host-1', token => %s, ttl => '1 hour')",
                    (lease["token"],))
    assert expires > lease["expires_at"]
    assert value(db, "SELECT expires_at FROM ledger.leases WHERE job = 'nightly'") == expires


def test_renew_without_ttl_reuses_the_lease_ttl(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "10 minutes"))
    expires = value(db, "SELECT ledger.renew('nightly', 'host-1', %s) - now()", (lease["token"],))
    assert 599 < expires.total_seconds() <= 601


def test_renew_by_the_wrong_owner_or_token_returns_null_and_changes_nothing(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "1 minute"))
    assert value(db, "SELECT ledger.renew('nightly', 'host-2', %s, '1 hour')", (lease["token"],)) is None
    assert value(db, "SELECT ledger.renew('nightly', 'host-1', %s, '1 hour')", (lease["token"] + 1,)) is None
    assert value(db, "SELECT expires_at FROM ledger.leases WHERE job = 'nightly'") == lease["expires_at"]


def test_a_holder_whose_expired_lease_was_not_taken_may_renew_it(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "50 milliseconds"))
    time.sleep(0.1)
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (lease["token"],)) is False
    assert value(db, "SELECT ledger.renew('nightly', 'host-1', %s, '1 minute')", (lease["token"],)) is not None
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (lease["token"],)) is True


def test_a_holder_whose_expired_lease_was_taken_cannot_renew_it(db):
    old = one(db, ACQUIRE, ("nightly", "host-1", "50 milliseconds"))
    time.sleep(0.1)
    one(db, ACQUIRE, ("nightly", "host-2", "1 minute"))
    assert value(db, "SELECT ledger.renew('nightly', 'host-1', %s, '1 minute')", (old["token"],)) is None
    assert value(db, "SELECT owner FROM ledger.leases WHERE job = 'nightly'") == "host-2"


def test_release_ends_the_lease_now_and_keeps_the_token(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "1 hour"))
    assert value(db, "SELECT ledger.release(job => 'nightly', owner => 'host-1', token => %s)",
                 (lease["token"],)) is True
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (lease["token"],)) is False
    assert value(db, "SELECT token FROM ledger.leases WHERE job = 'nightly'") == lease["token"]
    # released: another owner may take it at once, with the next token
    assert one(db, ACQUIRE, ("nightly", "host-2", "1 hour"))["token"] == lease["token"] + 1


def test_release_by_a_non_holder_or_twice_returns_false(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "1 hour"))
    assert value(db, "SELECT ledger.release('nightly', 'host-2', %s)", (lease["token"],)) is False
    assert value(db, "SELECT ledger.release('nightly', 'host-1', %s)", (lease["token"] + 1,)) is False
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (lease["token"],)) is True
    assert value(db, "SELECT ledger.release('nightly', 'host-1', %s)", (lease["token"],)) is True
    assert value(db, "SELECT ledger.release('nightly', 'host-1', %s)", (lease["token"],)) is False


def test_a_released_lease_cannot_be_renewed(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "1 hour"))
    db.execute("SELECT ledger.release('nightly', 'host-1', %s)", (lease["token"],))
    assert value(db, "SELECT ledger.renew('nightly', 'host-1', %s)", (lease["token"],)) is None


def test_is_current_is_false_for_an_unknown_job(db):
    assert value(db, "SELECT ledger.is_current(job => 'never', token => 1)") is False


def test_assert_current_passes_for_the_holder_and_raises_ld001_with_json_detail_after_takeover(db):
    old = one(db, ACQUIRE, ("nightly", "host-1", "50 milliseconds"))
    db.execute("SELECT ledger.assert_current(job => 'nightly', token => %s)", (old["token"],))
    time.sleep(0.1)
    new = one(db, ACQUIRE, ("nightly", "host-2", "1 minute"))
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.assert_current('nightly', %s)", (old["token"],))
    assert caught.value.sqlstate == "LD001"
    import json
    facts = json.loads(caught.value.diag.message_detail)
    assert facts["job"] == "nightly"
    assert facts["token"] == old["token"]
    assert facts["current_token"] == new["token"]
    assert facts["holder"] == "host-2"


def test_assert_current_raises_ld001_once_the_lease_expired(db):
    lease = one(db, ACQUIRE, ("nightly", "host-1", "50 milliseconds"))
    time.sleep(0.1)
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.assert_current('nightly', %s)", (lease["token"],))
    assert caught.value.sqlstate == "LD001"
