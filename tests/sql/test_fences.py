"""Fences: the resource side remembers the highest token of the job it belongs
to, accepts only that job's current live token, and refuses everything else."""

import json

import psycopg
import pytest

from sqlhelp import state, value
from waiting import wait_for


def lease(db, job="publish", owner="host-1", ttl="1 hour"):
    return value(db, "SELECT token FROM ledger.acquire(%s, %s, %s)", (job, owner, ttl))


def raised(db, call, params=None):
    with pytest.raises(psycopg.Error) as caught:
        db.execute(call, params)
    return caught.value


def test_advance_fence_accepts_each_current_token_once(db):
    first = lease(db)
    assert value(db, "SELECT ledger.advance_fence(job => 'publish', resource => 'reports', token => %s)",
                 (first,)) is True
    assert value(db, "SELECT ledger.advance_fence('publish', 'reports', %s)", (first,)) is False
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'reports'") == first
    second = lease(db)
    assert value(db, "SELECT ledger.advance_fence('publish', 'reports', %s)", (second,)) is True
    assert value(db, "SELECT (job, token)::text FROM ledger.fences WHERE resource = 'reports'") == \
        f"(publish,{second})"


def test_fence_accepts_the_current_token_many_times_and_returns_it(db):
    token = lease(db)
    assert value(db, "SELECT ledger.fence(job => 'publish', resource => 'reports', token => %s)", (token,)) == token
    assert value(db, "SELECT ledger.fence('publish', 'reports', %s)", (token,)) == token
    newer = lease(db)
    assert value(db, "SELECT ledger.fence('publish', 'reports', %s)", (newer,)) == newer
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'reports'") == newer


def test_a_token_the_job_was_never_issued_is_refused_so_no_resource_can_be_poisoned(db):
    """The attack: fence a resource with the largest bigint, and every honest writer fails for ever."""
    lease(db)
    before = state(db)
    for call in ("SELECT ledger.fence('publish', 'victim', 9223372036854775807)",
                 "SELECT ledger.advance_fence('publish', 'victim', 9223372036854775807)",
                 "SELECT ledger.fence('never-leased', 'victim', 1)"):
        assert raised(db, call).sqlstate == "LD001"
    assert state(db) == before
    honest = lease(db, owner="host-1")
    assert value(db, "SELECT ledger.fence('publish', 'victim', %s)", (honest,)) == honest


def test_a_stale_token_is_refused_with_ld001_and_the_facts(db):
    old = lease(db, ttl="1 hour")
    assert value(db, "SELECT ledger.release('publish', 'host-1', %s)", (old,)) is True
    new = lease(db, owner="host-2")
    error = raised(db, "SELECT ledger.fence('publish', 'articles', %s)", (old,))
    assert error.sqlstate == "LD001"
    facts = json.loads(error.diag.message_detail)
    assert facts["job"] == "publish" and facts["token"] == old and facts["current_token"] == new
    assert facts["holder"] == "host-2"
    assert value(db, "SELECT count(*) FROM ledger.fences") == 0


def test_an_expired_lease_nobody_took_cannot_fence_any_more(db):
    token = lease(db, ttl="1 millisecond")
    db.execute("SELECT pg_sleep(0.01)")
    assert raised(db, "SELECT ledger.fence('publish', 'articles', %s)", (token,)).sqlstate == "LD001"


def test_a_resource_belongs_to_the_job_that_first_fenced_it(db):
    """Tokens are counted per job: another job's token means nothing to this fence (LD006)."""
    mine = lease(db, job="publish")
    theirs = lease(db, job="reindex")
    assert value(db, "SELECT ledger.fence('publish', 'articles', %s)", (mine,)) == mine
    before = state(db)
    for call in ("SELECT ledger.fence('reindex', 'articles', %s)",
                 "SELECT ledger.advance_fence('reindex', 'articles', %s)"):
        error = raised(db, call, (theirs,))
        assert error.sqlstate == "LD006"
        assert json.loads(error.diag.message_detail) == {
            "resource": "articles", "job": "reindex", "bound_job": "publish", "token": theirs}
        assert "articles" in error.diag.message_primary and "publish" in error.diag.message_primary
    assert state(db) == before
    assert value(db, "SELECT ledger.fence('reindex', 'index', %s)", (theirs,)) == theirs


def test_fences_are_per_resource(db):
    token = lease(db)
    assert value(db, "SELECT ledger.advance_fence('publish', 'a', %s)", (token,)) is True
    assert value(db, "SELECT ledger.advance_fence('publish', 'b', %s)", (token,)) is True


def test_a_fence_moves_only_with_the_write_it_guards(connect):
    """Fence and write commit together or not at all: a rolled-back write leaves the fence where it was."""
    conn = connect(autocommit=False)
    conn.execute("CREATE TABLE report (token bigint)")
    token = lease(conn)
    conn.commit()
    with pytest.raises(RuntimeError):
        with conn.transaction():
            conn.execute("SELECT ledger.fence('publish', 'reports', %s)", (token,))
            conn.execute("INSERT INTO report VALUES (%s)", (token,))
            raise RuntimeError("the write failed")
    assert value(conn, "SELECT count(*) FROM ledger.fences") == 0
    assert value(conn, "SELECT count(*) FROM report") == 0


def test_a_zombie_write_is_rejected_by_the_fence_after_a_takeover(db):
    """The whole story: holder 1 is frozen, holder 2 takes over and writes; holder 1 wakes and is refused."""
    zombie = lease(db, owner="host-1", ttl="50 milliseconds")
    db.execute("SELECT pg_sleep(0.1)")
    fresh = lease(db, owner="host-2", ttl="1 minute")
    assert value(db, "SELECT ledger.fence('publish', 'articles', %s)", (fresh,)) == fresh
    error = raised(db, "SELECT ledger.fence('publish', 'articles', %s)", (zombie,))
    assert error.sqlstate == "LD001"
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'articles'") == fresh


@pytest.mark.parametrize("function", ["fence", "advance_fence"])
def test_a_takeover_that_fenced_between_the_check_and_the_write_makes_the_old_token_stale(connect, function):
    """LD002 is the race's verdict: the token was current when checked, yet a newer one wrote first."""
    import threading

    db = connect()
    old = lease(db)
    db.execute("SELECT ledger.fence('publish', 'articles', %s)", (old,))
    takeover = connect(autocommit=False)
    new = value(takeover, "SELECT token FROM ledger.acquire('publish', 'host-1', '1 hour')")
    takeover.execute("SELECT ledger.fence('publish', 'articles', %s)", (new,))  # open: the row stays locked
    zombie = connect()
    zombie_pid = zombie.info.backend_pid
    outcome = []

    def write():
        try:
            zombie.execute(f"SELECT ledger.{function}('publish', 'articles', %s)", (old,))
            outcome.append("accepted")
        except psycopg.Error as error:
            outcome.append(error.sqlstate)

    writer = threading.Thread(target=write)
    writer.start()

    def blocked() -> bool:
        assert writer.is_alive(), outcome
        return value(db, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (zombie_pid,)) == "Lock"

    wait_for(blocked, 30, "the zombie's write to wait on the takeover's lock", interval=0.01)
    takeover.commit()
    writer.join(30)
    assert outcome == ["LD002"]
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'articles'") == new
