"""pgjdbc with its defaults behind PgBouncer in transaction mode: a fenced write is
lost and every call reports success. Deterministic, and the fix proven.

pgjdbc (42.5, Debian 12's) prepares COMMIT as a *named* server-side statement at
its first use (PgConnection.executeTransactionCommand: unnamed only with
prepareThreshold=0), as S_<n> from a per-connection counter, and afterwards sends
only Bind/Execute of that name. Behind a transaction pooler the server
connection is another client's between two transactions, and there S_1 may be
that client's ROLLBACK: the "commit" rolls back the fence and the write,
PostgreSQL answers with the command tag ROLLBACK and no error, and pgjdbc does
not look at the tag. commit() returns, complete_run succeeds, nothing was written.

The test drives that by hand, with PgBouncer's pool of two server connections
for the test database (X and Y), instead of waiting for the race:

1. A long-lived worker (examples/java-pgjdbc `worker`: one run per line on
   stdin, on the same two connections) runs once: its COMMIT becomes S_1 on the
   server connection its transaction had, X.
2. Two psycopg clients pin X and Y (an open transaction each) and read
   pg_prepared_statements to tell them apart; Y is let go.
3. Another pgjdbc client (the example's `zombie`, refused with LD001) rolls back
   its transaction: its first named statement, S_1, is ROLLBACK, on Y, the only
   free server connection.
4. With X still pinned, the worker runs again: everything it sends goes to Y,
   and its "COMMIT" executes the other client's S_1.

With prepareThreshold=0 (the example's [pooler] setting) the same steps keep
the write: no statement is named, nothing stays behind on a server connection.
"""

from __future__ import annotations

import json
import select
import subprocess
import time
from typing import Any

import psycopg
import pytest
from pgbouncer import Bouncer, pgbouncer  # noqa: F401 - the fixture
from test_drivers import (  # noqa: F401 - fixtures
    DRIVERS,
    TIMEOUT,
    Example,
    _build_root,
    _expand,
    _start,
    _writes,
    driver,
    example,
)

JAVA = [d for d in DRIVERS if d.name == "java-pgjdbc"]


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The worker's next JSON line (one run), within TIMEOUT seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], TIMEOUT)
    if not ready:
        proc.kill()  # the process we started
        pytest.fail(f"the worker printed nothing in {TIMEOUT} s:\n{proc.communicate()}")
    line = proc.stdout.readline()
    assert line, f"the worker exited:\n{proc.communicate()}"
    result: dict[str, Any] = json.loads(line)
    return result


def _pin(conninfo: str) -> tuple[psycopg.Connection, int, dict[str, str]]:
    """A client through the bouncer holding one server connection (an open transaction):
    the connection, the server backend's pid, and the named statements it has."""
    conn = psycopg.connect(conninfo, autocommit=False, prepare_threshold=None)
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    rows = conn.execute("SELECT name, statement FROM pg_prepared_statements").fetchall()
    return conn, int(row[0]), {str(name): str(statement) for name, statement in rows}


@pytest.mark.parametrize("transport", ["pgbouncer"])
@pytest.mark.parametrize("driver", JAVA, ids=[d.name for d in JAVA], indirect=True)
@pytest.mark.parametrize("settings", ["default", "prepareThreshold=0"])
def test_pgjdbc_commit_runs_another_clients_rollback_unless_prepare_threshold_is_0(
        example: Example, db: psycopg.Connection, pgbouncer: Bouncer, dsn: str, settings: str) -> None:
    safe = settings != "default"
    through_bouncer = pgbouncer(dsn)
    # The stale run of step 3: job 'other', its 50 ms lease expired.
    _, stale_run, stale_token, _ = _start(db, "other", "old-host", "50 milliseconds")
    deadline = time.monotonic() + 30
    while db.execute("SELECT ledger.is_current(job => 'other', token => %s)", (stale_token,)).fetchone() == (True,):
        assert time.monotonic() < deadline
        time.sleep(0.01)

    worker = subprocess.Popen(
        _expand(example.driver.argv, example._build_dir) + ["worker", "nightly", "worker-1"],
        cwd=example.driver.folder, env=example.env(pooler_settings=safe), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pins: list[psycopg.Connection] = []
    try:
        assert worker.stdin is not None
        # 1. The first run: S_1 = COMMIT on the server connection of its transaction.
        worker.stdin.write("run\n")
        worker.stdin.flush()
        first = _line(worker)
        assert (first["outcome"], first["token"], first["wrote"], first["error"]) == ("started", "1", True, None)

        # 2. Pin both server connections; keep X (the one with S_1), let Y go.
        a, a_pid, a_statements = _pin(through_bouncer)
        b, b_pid, b_statements = _pin(through_bouncer)
        pins += [a, b]
        assert a_pid != b_pid
        if safe:
            assert a_statements == b_statements == {}  # nothing named, nothing left behind
            y, y_pid = b, b_pid
        else:
            assert sorted([a_statements, b_statements], key=len) == [{}, {"S_1": "COMMIT"}]
            y, y_pid = (b, b_pid) if a_statements else (a, a_pid)  # the other one is X, pinned till the end
        y.rollback()  # then close: a client that leaves in a transaction costs its server connection
        y.close()
        pins.remove(y)

        # 3. Another pgjdbc client, on Y: its write is refused and rolled back.
        zombie = Example.result(subprocess.Popen(
            _expand(example.driver.argv, example._build_dir)
            + ["zombie", "other", "old-host", str(stale_run), str(stale_token)],
            cwd=example.driver.folder, env=example.env(pooler_settings=safe), text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        assert zombie["error"]["code"] == "LD001" and zombie["wrote"] is False
        y, again, y_statements = _pin(through_bouncer)
        y.rollback()
        y.close()
        assert again == y_pid  # X is pinned: this is Y
        assert y_statements == ({} if safe else {"S_1": "ROLLBACK"})

        # 4. The worker's second run, on Y only (X stays pinned).
        worker.stdin.write("run\n")
        worker.stdin.flush()
        second = _line(worker)
    finally:
        for conn in pins:
            conn.close()
        if worker.stdin is not None:
            worker.stdin.close()
        try:
            worker.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            worker.kill()  # the process we started
            worker.wait()

    # What the worker was told, either way: its write went through the fence and committed.
    assert (second["outcome"], second["token"], second["wrote"], second["error"]) == ("started", "2", True, None)
    assert "end_error" not in second
    runs = db.execute("SELECT token, status FROM ledger.job_execution_log WHERE job = 'nightly' "
                      "ORDER BY run_id").fetchall()
    assert runs == [(1, "success"), (2, "success")]
    fence = db.execute("SELECT token FROM ledger.fences WHERE resource = 'fenced_writes:nightly'").fetchone()
    if safe:
        assert _writes(db) == [(1, "worker-1"), (2, "worker-1")]
        assert fence == (2,)
    else:
        # The lost write: run 2 "succeeded", its fenced write does not exist, and
        # neither does its fence (rolled back with it).
        assert _writes(db) == [(1, "worker-1")]
        assert fence == (1,)
