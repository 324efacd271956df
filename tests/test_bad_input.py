"""Bad input: NULL for a required argument is 22004, an invalid value 22023;
the message names the argument, and the call changes nothing."""

import pytest
import psycopg

from sqlhelp import state

LONG = "x" * 201

# (call, sqlstate, argument the message must name)
CASES = [
    ("ledger.acquire(NULL, 'o', '1 minute')", "22004", "job"),
    ("ledger.acquire('j', NULL, '1 minute')", "22004", "owner"),
    ("ledger.acquire('', 'o', '1 minute')", "22023", "job"),
    (f"ledger.acquire('{LONG}', 'o', '1 minute')", "22023", "job"),
    ("ledger.acquire(E'j\\n', 'o', '1 minute')", "22023", "job"),
    ("ledger.acquire('j', E'o\\t', '1 minute')", "22023", "owner"),
    ("ledger.acquire('j', 'o', '0 seconds')", "22023", "ttl"),
    ("ledger.acquire('j', 'o', '-5 minutes')", "22023", "ttl"),
    ("ledger.acquire('unregistered', 'o')", "22023", "ttl"),
    ("ledger.renew(NULL, 'o', 1)", "22004", "job"),
    ("ledger.renew('held', 'o', NULL)", "22004", "token"),
    ("ledger.renew('held', 'o', 0)", "22023", "token"),
    ("ledger.renew('held', 'host-1', 1, '-1 second')", "22023", "ttl"),
    ("ledger.release('held', NULL, 1)", "22004", "owner"),
    ("ledger.release('held', 'host-1', -1)", "22023", "token"),
    ("ledger.is_current(NULL, 1)", "22004", "job"),
    ("ledger.is_current('held', NULL)", "22004", "token"),
    ("ledger.assert_current('', 1)", "22023", "job"),
    ("ledger.advance_fence(NULL, 1)", "22004", "resource"),
    ("ledger.advance_fence('r', NULL)", "22004", "token"),
    ("ledger.advance_fence('r', 0)", "22023", "token"),
    (f"ledger.fence('{LONG}', 1)", "22023", "resource"),
    ("ledger.fence('r', NULL)", "22004", "token"),
    ("ledger.start_run(NULL, 'o', '1 minute')", "22004", "job"),
    ("ledger.start_run('j', '', '1 minute')", "22023", "owner"),
    ("ledger.start_run('j', 'o', '0 minutes')", "22023", "ttl"),
    ("ledger.start_run('unregistered', 'o')", "22023", "ttl"),
    ("ledger.start_run('j', 'o', '1 minute', slot => 'infinity')", "22023", "slot"),
    ("ledger.start_run('j', 'o', '1 minute', idempotency_key => '')", "22023", "idempotency_key"),
    ("ledger.start_run('j', 'o', '1 minute', detail => '[1, 2]')", "22023", "detail"),
    ("ledger.heartbeat(NULL, 1)", "22004", "run_id"),
    ("ledger.heartbeat(1, NULL)", "22004", "token"),
    ("ledger.heartbeat(1, 1, '0 seconds')", "22023", "ttl"),
    ("ledger.complete_run(NULL, 1)", "22004", "run_id"),
    ("ledger.complete_run(1, NULL)", "22004", "token"),
    ("ledger.complete_run(1, 1, '\"text\"')", "22023", "detail"),
    ("ledger.fail_run(1, 1, NULL)", "22004", "error"),
    ("ledger.fail_run(1, 0, 'e')", "22023", "token"),
    ("ledger.cancel_run(NULL, 1)", "22004", "run_id"),
    ("ledger.reap_expired('')", "22023", "job"),
]


@pytest.mark.parametrize(("call", "sqlstate", "argument"), CASES, ids=[c[0][:60] for c in CASES])
def test_bad_input_raises_a_documented_sqlstate_naming_the_argument_and_changes_nothing(db, call, sqlstate, argument):
    # Something to change: a held lease (token 1), a running run, a fence.
    db.execute("SELECT ledger.start_run('held', 'host-1', '1 hour')")
    db.execute("SELECT ledger.fence('r', 5)")
    before = state(db)
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"SELECT {call}")
    assert caught.value.sqlstate == sqlstate
    assert argument in caught.value.diag.message_primary
    assert state(db) == before
