"""Fences: the resource side remembers the highest token and refuses lower ones."""

import json

import psycopg
import pytest

from sqlhelp import value


def test_advance_fence_accepts_only_strictly_greater_tokens(db):
    assert value(db, "SELECT ledger.advance_fence(resource => 'reports', token => 5)") is True
    assert value(db, "SELECT ledger.advance_fence('reports', 5)") is False
    assert value(db, "SELECT ledger.advance_fence('reports', 4)") is False
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'reports'") == 5
    assert value(db, "SELECT ledger.advance_fence('reports', 6)") is True
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'reports'") == 6


def test_fence_accepts_equal_and_greater_tokens_and_returns_the_token(db):
    assert value(db, "SELECT ledger.fence(resource => 'reports', token => 3)") == 3
    assert value(db, "SELECT ledger.fence('reports', 3)") == 3
    assert value(db, "SELECT ledger.fence('reports', 7)") == 7
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'reports'") == 7


def test_fence_raises_ld002_with_json_detail_for_a_lower_token(db):
    db.execute("SELECT ledger.fence('reports', 7)")
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.fence('reports', 6)")
    assert caught.value.sqlstate == "LD002"
    facts = json.loads(caught.value.diag.message_detail)
    assert facts == {"resource": "reports", "token": 6, "highest_token": 7}
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'reports'") == 7


def test_fences_are_per_resource(db):
    assert value(db, "SELECT ledger.advance_fence('a', 9)") is True
    assert value(db, "SELECT ledger.advance_fence('b', 1)") is True


def test_a_fence_moves_only_with_the_write_it_guards(connect):
    """Fence and write commit together or not at all: a rolled-back write leaves the fence where it was."""
    conn = connect(autocommit=False)
    conn.execute("CREATE TABLE report (token bigint)")
    conn.commit()
    with pytest.raises(RuntimeError):
        with conn.transaction():
            conn.execute("SELECT ledger.fence('reports', 10)")
            conn.execute("INSERT INTO report VALUES (10)")
            raise RuntimeError("the write failed")
    assert value(conn, "SELECT count(*) FROM ledger.fences") == 0
    assert value(conn, "SELECT count(*) FROM report") == 0


def test_a_zombie_write_is_rejected_by_the_fence_after_a_takeover(db):
    """The whole story: holder 1 is frozen, holder 2 takes over and writes; holder 1 wakes and is refused."""
    import time
    zombie = db.execute("SELECT token FROM ledger.acquire('publish', 'host-1', '50 milliseconds')").fetchone()[0]
    time.sleep(0.1)
    fresh = db.execute("SELECT token FROM ledger.acquire('publish', 'host-2', '1 minute')").fetchone()[0]
    assert value(db, "SELECT ledger.fence('articles', %s)", (fresh,)) == fresh
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.fence('articles', %s)", (zombie,))
    assert caught.value.sqlstate == "LD002"
