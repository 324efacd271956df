"""Bad input: NULL for a required argument is 22004, an invalid value 22023;
the message names the argument, and the call changes nothing."""

import json

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
    ("ledger.advance_fence('held', NULL, 1)", "22004", "resource"),
    ("ledger.advance_fence(NULL, 'r', 1)", "22004", "job"),
    ("ledger.advance_fence('held', 'r', NULL)", "22004", "token"),
    ("ledger.advance_fence('held', 'r', 0)", "22023", "token"),
    (f"ledger.fence('held', '{LONG}', 1)", "22023", "resource"),
    ("ledger.fence('held', 'r', NULL)", "22004", "token"),
    ("ledger.fence('', 'r', 1)", "22023", "job"),
    ("ledger.start_run(NULL, 'o', '1 minute')", "22004", "job"),
    ("ledger.start_run('j', '', '1 minute')", "22023", "owner"),
    ("ledger.start_run('j', 'o', '0 minutes')", "22023", "ttl"),
    ("ledger.start_run('unregistered', 'o')", "22023", "ttl"),
    ("ledger.start_run('j', 'o', '1 minute', slot => 'infinity')", "22023", "slot"),
    ("ledger.start_run('j', 'o', '1 minute', idempotency_key => '')", "22023", "idempotency_key"),
    ("ledger.start_run('j', 'o', '1 minute', detail => '[1, 2]')", "22023", "detail"),
    ("ledger.register_job('j', 'bogus')", "22023", "schedule"),
    ("ledger.register_job('j', '61 * * * *')", "22023", "schedule"),
    ("ledger.register_job('j', '0 0 31 2 *')", "22023", "schedule"),
    ("ledger.register_job('j', '1 hour', time_zone => 'Mars/Olympus')", "22023", "time_zone"),
    ("ledger.register_job('j', '1 hour', time_zone => 'PST')", "22023", "time_zone"),
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
    # Invisible and bidirectional characters: look-alike names.
    *[(f"ledger.acquire(U&'nightly\\{cp}', 'o', '1 minute')", "22023", "job")
      for cp in ("200F", "202E", "FEFF", "2028", "2029", "00A0", "200B", "00AD", "061C")],
    ("ledger.start_run('j', U&'host\\202E1', '1 minute')", "22023", "owner"),
    ("ledger.start_run('j', 'o', '1 minute', idempotency_key => U&'key\\2066')", "22023", "idempotency_key"),
    ("ledger.fence('held', U&'\\FEFFr', 1)", "22023", "resource"),
    # Bounded values: every view and function stays in range.
    ("ledger.acquire('j', 'o', '100000 years')", "22023", "ttl"),
    ("ledger.acquire('j', 'o', '300000 years')", "22023", "ttl"),
    ("ledger.acquire('j', 'o', '31 days')", "22023", "ttl"),
    ("ledger.acquire('j', 'o', '-1 year 361 days')", "22023", "ttl"),
    ("ledger.acquire('j', 'o', '1 day -1 second')", "22023", "ttl"),
    ("ledger.start_run('j', 'o', '100000 years')", "22023", "ttl"),
    ("ledger.renew('held', 'host-1', 1, '100000 years')", "22023", "ttl"),
    ("ledger.heartbeat(1, 1, '-1 year 361 days')", "22023", "ttl"),
    ("ledger.register_job('poison', ttl => '100000 years')", "22023", "ttl"),
    ("ledger.register_job('poison', '178000000 years')", "22023", "schedule"),
    ("ledger.register_job('poison', '1 microsecond')", "22023", "schedule"),
    ("ledger.register_job('poison', '13 months')", "22023", "schedule"),
    (f"ledger.register_job('poison', '{'1' * 201}')", "22023", "schedule"),
    ("ledger.register_job('poison', '1 minute', max_backfill => 1001)", "22023", "max_backfill"),
    ("ledger.register_job('poison', '1 minute', max_backfill => 2147483647)", "22023", "max_backfill"),
    ("ledger.purge_log('100000 years')", "22023", "older_than"),
    ("ledger.purge_log('-1 year 361 days')", "22023", "older_than"),
    ("ledger.due_slots('held', at => '294276-12-31')", "22023", "at"),
    ("ledger.due_slots('held', at => '1900-01-01')", "22023", "at"),
    ("ledger.start_run('j', 'o', '1 minute', slot => '200000-01-01')", "22023", "slot"),
    ("ledger.start_run('j', 'o', '1 minute', slot => '1969-12-31 23:59:59+00')", "22023", "slot"),
    # Bounded sizes.
    ("ledger.start_run('j', 'o', '1 minute', detail => jsonb_build_object('x', repeat('a', 70000)))",
     "22023", "detail"),
    ("ledger.complete_run(1, 1, jsonb_build_object('x', repeat('a', 70000)))", "22023", "detail"),
]


@pytest.mark.parametrize(("call", "sqlstate", "argument"), CASES, ids=[c[0][:60] for c in CASES])
def test_bad_input_raises_a_documented_sqlstate_naming_the_argument_and_changes_nothing(db, call, sqlstate, argument):
    # Something to change: a held lease (token 1), a running run, a fence.
    db.execute("SELECT ledger.start_run('held', 'host-1', '1 hour')")
    db.execute("SELECT ledger.fence('held', 'r', 1)")
    before = state(db)
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"SELECT {call}")
    assert caught.value.sqlstate == sqlstate
    assert argument in caught.value.diag.message_primary
    if sqlstate == "22023":  # an invalid value carries the facts as JSON, the argument first
        assert json.loads(caught.value.diag.message_detail)["argument"] == argument
    assert state(db) == before
