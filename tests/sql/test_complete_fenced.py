"""complete_run's safety net for a write that did not commit (issue 21, point 3).

A run names the resources it fenced (``fenced``); complete_run records
success only when each of those fences holds the run's token, that is, when
the fenced write committed. Otherwise the run is recorded as failure (the call
commits) and a WARNING of SQLSTATE LD007 says why: the pgjdbc-behind-PgBouncer
case, whose COMMIT ran as another client's ROLLBACK without an error, would
otherwise record a success whose write and fence do not exist.
"""

import json

import psycopg
import pytest

from sqlhelp import one, state, value


def start(db, job="export", owner="host-1", ttl="1 hour"):
    row = one(db, "SELECT run_id, token FROM ledger.start_run(%s, %s, %s::interval)", (job, owner, ttl))
    assert row is not None and row["run_id"] is not None
    return row["run_id"], row["token"]


def warnings_of(conn):
    """The (sqlstate, message, detail) of every notice ``conn`` receives from now on."""
    seen = []
    conn.add_notice_handler(lambda diag: seen.append((diag.sqlstate, diag.message_primary, diag.message_detail)))
    return seen


def raised(db, call, params=None):
    with pytest.raises(psycopg.Error) as caught:
        db.execute(call, params)
    return caught.value


@pytest.fixture
def exports(db):
    db.execute("CREATE TABLE exports (token bigint)")


def test_a_fenced_write_that_rolled_back_is_recorded_as_failure_not_success(connect, db, exports):
    """Fence + INSERT, then the transaction rolls back: complete_run with the resource records failure."""
    run_id, token = start(db)
    writer = connect(autocommit=False)
    writer.execute("SELECT ledger.fence('export', 'exports', %s)", (token,))
    writer.execute("INSERT INTO exports VALUES (%s)", (token,))
    writer.rollback()
    seen = warnings_of(db)
    row = one(db, "SELECT * FROM ledger.complete_run(run_id => %s, token => %s, fenced => ARRAY['exports'])",
              (run_id, token))
    assert row is not None
    assert (row["status"], row["failure_reason"]) == ("failure", "error")
    assert row["error"].startswith("fence not committed: exports holds no token, not the run's token")
    assert row["detail"]["fence_not_committed"] == ["exports"]
    assert row["detail"]["fence_tokens"] == {"exports": None}
    # The failure is committed (the call did not raise), the lease released.
    assert value(db, "SELECT status FROM ledger.job_execution_log WHERE run_id = %s", (run_id,)) == "failure"
    assert value(db, "SELECT released_at IS NOT NULL FROM ledger.leases WHERE job = 'export'") is True
    assert value(db, "SELECT failures FROM ledger.counters WHERE job = 'export'") == 1
    [(sqlstate, message, detail)] = seen
    assert sqlstate == "LD007"
    assert f"run {run_id} of job export is recorded as failure" in message
    assert json.loads(detail) == {"run_id": run_id, "job": "export", "token": token, "resources": ["exports"],
                                  "fence_tokens": {"exports": None}}


def test_a_lost_commit_leaves_the_earlier_runs_token_on_the_fence_and_fails_the_run(connect, db, exports):
    """pgjdbc's case: the fence row exists from an earlier run; this run's COMMIT became a ROLLBACK."""
    first_run, first = start(db)
    db.execute("SELECT ledger.fence('export', 'exports', %s)", (first,))
    db.execute("SELECT ledger.complete_run(%s, %s, fenced => ARRAY['exports'])", (first_run, first))
    run_id, token = start(db)
    writer = connect(autocommit=True)
    writer.execute("BEGIN")
    writer.execute("SELECT ledger.fence('export', 'exports', %s)", (token,))
    writer.execute("INSERT INTO exports VALUES (%s)", (token,))
    writer.execute("ROLLBACK")  # what the pooler's server connection ran under the client's COMMIT
    row = one(db, "SELECT * FROM ledger.complete_run(%s, %s, NULL, ARRAY['exports'])", (run_id, token))
    assert row is not None and row["status"] == "failure"
    assert row["error"].startswith(f"fence not committed: exports holds token {first}, not the run's token {token}")
    assert row["detail"]["fence_tokens"] == {"exports": first}
    assert value(db, "SELECT count(*) FROM exports") == 0


def test_a_committed_fenced_write_records_success(connect, db, exports):
    run_id, token = start(db, ttl="1 hour")
    writer = connect(autocommit=False)
    writer.execute("SELECT ledger.fence('export', 'exports', %s)", (token,))
    writer.execute("INSERT INTO exports VALUES (%s)", (token,))
    writer.commit()
    seen = warnings_of(db)
    row = one(db, "SELECT * FROM ledger.complete_run(%s, %s, '{\"rows\": 1}', ARRAY['exports', 'exports'])",
              (run_id, token))
    assert row is not None and (row["status"], row["failure_reason"], row["error"]) == ("success", None, None)
    assert row["detail"] == {"rows": 1}
    assert seen == []


def test_the_fence_may_have_moved_in_an_earlier_transaction_of_the_run(db, exports):
    """Each named resource needs one committed write of the run's token, not the last transaction's."""
    run_id, token = start(db)
    db.execute("SELECT ledger.advance_fence('export', 'exports', %s)", (token,))
    row = one(db, "SELECT * FROM ledger.complete_run(%s, %s, fenced => ARRAY['exports'])", (run_id, token))
    assert row is not None and row["status"] == "success"


def test_complete_in_the_writes_own_transaction_sees_its_fence_and_rolls_back_with_it(connect, db, exports):
    run_id, token = start(db)
    writer = connect(autocommit=False)
    writer.execute("SELECT ledger.fence('export', 'exports', %s)", (token,))
    writer.execute("INSERT INTO exports VALUES (%s)", (token,))
    row = one(writer, "SELECT * FROM ledger.complete_run(%s, %s, fenced => ARRAY['exports'])", (run_id, token))
    assert row is not None and row["status"] == "success"
    writer.rollback()  # the lost COMMIT takes the success with it: the run is still running, never a false success
    assert value(db, "SELECT status FROM ledger.job_execution_log WHERE run_id = %s", (run_id,)) == "running"


def test_a_protected_table_is_a_fenced_resource_under_its_name(connect, db):
    db.execute("CREATE TABLE orders (id integer)")
    run_id, token = start(db, job="nightly")
    assert value(db, "SELECT ledger.protect('orders', 'nightly')") == "public.orders"
    writer = connect(autocommit=False)
    writer.execute("SELECT set_config('ledger.token', %s, true)", (str(token),))
    writer.execute("INSERT INTO orders VALUES (1)")
    writer.rollback()
    lost = one(db, "SELECT * FROM ledger.complete_run(%s, %s, fenced => ARRAY['public.orders'])", (run_id, token))
    assert lost is not None and lost["status"] == "failure"
    run_id, token = start(db, job="nightly")
    writer.execute("SELECT set_config('ledger.token', %s, true)", (str(token),))
    writer.execute("INSERT INTO orders VALUES (2)")
    writer.commit()
    done = one(db, "SELECT * FROM ledger.complete_run(%s, %s, fenced => ARRAY['public.orders'])", (run_id, token))
    assert done is not None and done["status"] == "success"


def test_an_unknown_resource_is_a_write_that_never_committed(db):
    """No row in ledger.fences: the first fence of a resource inserts it, so nothing of it committed."""
    run_id, token = start(db)
    row = one(db, "SELECT * FROM ledger.complete_run(%s, %s, fenced => ARRAY['no such resource'])", (run_id, token))
    assert row is not None and row["status"] == "failure"
    assert row["detail"]["fence_not_committed"] == ["no such resource"]


def test_no_resource_named_is_the_complete_run_of_before(db):
    for fenced in (None, []):
        run_id, token = start(db)
        row = one(db, "SELECT * FROM ledger.complete_run(%s, %s, fenced => %s::text[])", (run_id, token, fenced))
        assert row is not None and row["status"] == "success"


def test_the_calls_of_before_still_resolve_to_the_one_complete_run(db):
    """0.1.0's clients call complete_run(run_id, token[, detail]), by position or by name: one signature."""
    assert value(db, "SELECT count(*) FROM pg_proc WHERE proname = 'complete_run'"
                     " AND pronamespace = 'ledger'::regnamespace") == 1
    for call in ("ledger.complete_run(%s, %s)", "ledger.complete_run(%s, %s, NULL)",
                 "ledger.complete_run(run_id => %s, token => %s, detail => NULL)"):
        run_id, token = start(db)
        row = one(db, f"SELECT * FROM {call}", (run_id, token))
        assert row is not None and row["status"] == "success"


def test_a_zombie_naming_its_fences_is_still_refused_with_ld001(db, exports):
    """The run's own checks come first: a run taken over answers LD001, the takeover's verdict kept."""
    run_id, token = start(db, ttl="50 milliseconds")
    db.execute("SELECT pg_sleep(0.1)")
    start(db, owner="host-2")
    error = raised(db, "SELECT ledger.complete_run(%s, %s, fenced => ARRAY['exports'])", (run_id, token))
    assert error.sqlstate == "LD001"
    assert value(db, "SELECT failure_reason FROM ledger.job_execution_log WHERE run_id = %s",
                 (run_id,)) == "lease_expired"


@pytest.mark.parametrize(("fenced", "sqlstate", "message"), [
    ("ARRAY['exports', NULL]", "22023", "argument fenced must not contain null (element 2)"),
    ("ARRAY['']", "22023", "argument fenced must be 1 to 200 characters"),
    ("ARRAY[repeat('x', 201)]", "22023", "argument fenced must be 1 to 200 characters"),
    ("ARRAY[E'bad\\u200bname']", "22023", "argument fenced must be 1 to 200 characters"),
    ("ARRAY[ARRAY['a'], ARRAY['b']]", "22023", "argument fenced must be a list of at most 100 resources"),
    ("(SELECT array_agg(i::text) FROM generate_series(1, 101) i)", "22023",
     "argument fenced must be a list of at most 100 resources"),
])
def test_bad_fenced_is_refused_naming_the_argument_and_changes_nothing(db, fenced, sqlstate, message):
    run_id, token = start(db)
    before = state(db)
    error = raised(db, f"SELECT ledger.complete_run(%s, %s, fenced => {fenced})", (run_id, token))
    assert error.sqlstate == sqlstate
    assert error.diag.message_primary is not None and error.diag.message_primary.startswith(message)
    assert json.loads(error.diag.message_detail or "{}").get("argument") == "fenced"
    assert state(db) == before


def test_another_jobs_resource_is_ld006_and_changes_nothing(db):
    other = value(db, "SELECT token FROM ledger.acquire('other', 'host-9', '1 hour')")
    db.execute("SELECT ledger.fence('other', 'theirs', %s)", (other,))
    run_id, token = start(db)
    before = state(db)
    error = raised(db, "SELECT ledger.complete_run(%s, %s, fenced => ARRAY['theirs'])", (run_id, token))
    assert error.sqlstate == "LD006"
    assert json.loads(error.diag.message_detail or "{}") == {
        "resource": "theirs", "job": "export", "bound_job": "other", "token": token, "argument": "fenced"}
    assert state(db) == before
