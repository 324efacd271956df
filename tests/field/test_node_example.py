"""The Node.js example (examples/node/run.mjs, node-postgres) against a real
ledger: each test runs the script as a subprocess on the test's database and
checks what it printed and what the ledger tables say.

Skipped when Node.js 18+ or npm is not installed. The example's dependencies
are installed once (`npm ci`), and not again while examples/node/node_modules
holds the pinned `pg`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from repo import ROOT
from waiting import wait_for

EXAMPLE = ROOT / "examples" / "node"
NODE = shutil.which("node")
NPM = shutil.which("npm")


def _node_major() -> int:
    if NODE is None:
        return 0
    out = subprocess.run([NODE, "--version"], capture_output=True, text=True, timeout=30).stdout
    return int(out.strip().lstrip("v").split(".")[0] or 0)


pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None or _node_major() < 18,
    reason="needs Node.js 18+ and npm (apt-get install nodejs npm): the example examples/node")

Run = Callable[..., dict[str, Any]]


@pytest.fixture(scope="session")
def node_example() -> Path:
    """examples/node with its dependencies installed (`npm ci`, once)."""
    pinned = json.loads((EXAMPLE / "package.json").read_text())["dependencies"]["pg"]
    installed = EXAMPLE / "node_modules" / "pg" / "package.json"
    if not installed.exists() or json.loads(installed.read_text())["version"] != pinned:
        assert NPM is not None
        proc = subprocess.run([NPM, "ci", "--no-audit", "--no-fund"], cwd=EXAMPLE,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"npm ci in {EXAMPLE} failed:\n{proc.stdout}\n{proc.stderr}")
    return EXAMPLE


def _env(dsn: str, style: str) -> dict[str, str]:
    """The environment for the script: LEDGER_DSN as a postgres:// URI, or the
    PG* variables that `pg` reads by itself."""
    info = conninfo_to_dict(dsn)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "LEDGER_DSN"}
    host, port = str(info.get("host", "127.0.0.1")), str(info.get("port", "5432"))
    user, dbname, password = str(info.get("user", "postgres")), str(info["dbname"]), info.get("password")
    if style == "pgenv":
        env.update(PGHOST=host, PGPORT=port, PGUSER=user, PGDATABASE=dbname)
        if password:
            env["PGPASSWORD"] = str(password)
        return env
    auth = quote(user, safe="") + (":" + quote(str(password), safe="") if password else "")
    if host.startswith("/"):  # a Unix socket directory (the embedded server)
        env["LEDGER_DSN"] = f"postgres://{auth}@/{quote(dbname)}?host={quote(host, safe='')}&port={port}"
    else:
        env["LEDGER_DSN"] = f"postgres://{auth}@{host}:{port}/{quote(dbname)}"
    return env


@pytest.fixture
def node(node_example: Path, dsn: str, db: psycopg.Connection) -> Run:
    """Run `node run.mjs ARGS...` on the test database; its one JSON line."""
    db.execute("CREATE TABLE fenced_writes (token bigint, written_by text)")
    assert NODE is not None

    def _run(*args: str, style: str = "uri") -> dict[str, Any]:
        proc = subprocess.run([NODE, "run.mjs", *args], cwd=node_example, env=_env(dsn, style),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) == 1, proc.stdout
        result: dict[str, Any] = json.loads(lines[0])
        return result

    return _run


def _start(db: psycopg.Connection, job: str, owner: str, ttl: str) -> tuple[Any, ...]:
    row = db.execute("SELECT outcome, run_id, token, expires_at FROM ledger.start_run("
                     "job => %s, owner => %s, ttl => %s::interval)", (job, owner, ttl)).fetchone()
    assert row is not None and row[0] == "started"
    return tuple(row)


def _writes(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    return db.execute("SELECT token, written_by FROM fenced_writes ORDER BY token").fetchall()


def test_a_run_heartbeats_writes_through_the_fence_and_completes(node, db):
    # The work (2.5 s) outlasts the ttl (2 s): only the heartbeats keep the lease.
    out = node("run", "nightly", "host-1", "--ttl=2", "--work-ms=2500")
    assert out["outcome"] == "started" and out["error"] is None and "end_error" not in out
    assert out["token"] == "1" and out["run_id"] is not None  # bigints printed as strings
    assert out["wrote"] is True and out["heartbeats"] >= 2

    assert _writes(db) == [(1, "host-1")]
    run = db.execute("SELECT run_id::text, owner, token, status, failure_reason, "
                     "heartbeat_at > started_at, completed_at IS NOT NULL "
                     "FROM ledger.job_execution_log WHERE job = 'nightly'").fetchall()
    assert run == [(out["run_id"], "host-1", 1, "success", None, True, True)]
    assert db.execute("SELECT resource, job, token FROM ledger.fences").fetchall() == [
        ("fenced_writes:nightly", "nightly", 1)]
    assert db.execute("SELECT released_at IS NOT NULL FROM ledger.leases "
                      "WHERE job = 'nightly'").fetchone() == (True,)


def test_a_second_process_is_skipped_while_the_first_holds_the_lease(node, db):
    _, run_id, token, expires_at = _start(db, "nightly", "python-holder", "5 minutes")

    out = node("run", "nightly", "host-2", style="pgenv")  # PG* variables, no LEDGER_DSN
    assert out["outcome"] == "skipped_overlap" and out["holder"] == "python-holder"
    # A JS Date keeps milliseconds; timestamptz has microseconds.
    seen = datetime.fromisoformat(out["holder_expires_at"].replace("Z", "+00:00"))
    assert abs(seen - expires_at) < timedelta(milliseconds=1)
    assert out["wrote"] is False and out["token"] is None and out["error"] is None
    assert _writes(db) == []
    assert db.execute("SELECT skipped_overlap, failures FROM ledger.job_counters "
                      "WHERE job = 'nightly'").fetchone() == (1, 0)

    # Once the holder ends its run, the next start gets the next token.
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    out = node("run", "nightly", "host-2")
    assert (out["outcome"], out["token"], out["wrote"]) == ("started", "2", True)
    assert _writes(db) == [(2, "host-2")]


def test_a_zombie_write_after_a_takeover_gets_ld001_and_never_commits(node, db):
    _, old_run, old_token, _ = _start(db, "nightly", "old-host", "50 milliseconds")
    wait_for(lambda: db.execute("SELECT NOT ledger.is_current(job => 'nightly', token => %s)",
                                (old_token,)).fetchone() == (True,), 30, "the 50 ms lease to expire", interval=0.01)

    successor = node("run", "nightly", "new-host")  # takes the expired lease over
    assert (successor["outcome"], successor["token"], successor["wrote"]) == ("started", "2", True)

    zombie = node("zombie", "nightly", "old-host", str(old_run), str(old_token))
    assert zombie["wrote"] is False
    assert zombie["error"]["code"] == "LD001"
    assert zombie["error"]["detail"] | {"expires_at": None} == {
        "job": "nightly", "token": 1, "current_token": 2, "holder": "new-host",
        "released": True, "expires_at": None}
    # Ending the old run is refused as well; the row keeps the takeover's verdict.
    assert zombie["end_error"]["code"] == "LD001"
    assert zombie["end_error"]["detail"]["verdict"] == "lease_expired"

    assert _writes(db) == [(2, "new-host")]  # nothing from old-host ever committed
    assert db.execute("SELECT run_id, status, failure_reason FROM ledger.job_execution_log "
                      "ORDER BY run_id").fetchall() == [
        (old_run, "failure", "lease_expired"), (old_run + 1, "success", None)]
    assert db.execute("SELECT token FROM ledger.fences WHERE resource = 'fenced_writes:nightly'").fetchone() == (2,)


def test_ld006_is_reported_with_its_json_detail_when_the_resource_is_another_jobs(node, db):
    # Job 'other' binds the resource 'shared' by fencing it first.
    _, run_id, token, _ = _start(db, "other", "someone", "1 minute")
    with db.transaction():
        db.execute("SELECT ledger.fence(job => 'other', resource => 'shared', token => %s)", (token,))
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))

    out = node("run", "nightly", "host-1", "--resource=shared")
    assert out["outcome"] == "started" and out["wrote"] is False and "end_error" not in out
    assert out["error"]["code"] == "LD006"
    assert out["error"]["detail"] == {"resource": "shared", "job": "nightly", "bound_job": "other", "token": 1}

    assert _writes(db) == []
    status, reason, error = db.execute("SELECT status, failure_reason, error FROM ledger.job_execution_log "
                                       "WHERE job = 'nightly'").fetchone()
    assert (status, reason) == ("failure", "error") and error.startswith("LD006: fence of another job")
    assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'shared'").fetchone() == ("other", 1)


def test_bigint_tokens_compare_as_numbers_past_9(node, db):
    out = node("tokens", "nightly", "host-1", "10")
    assert out["tokens"] == [str(n) for n in range(1, 11)]
    assert out["newest"] == "10" and out["newest_was_current"] is True
    assert out["naive_string_newest"] == "9"  # what comparing the strings gets wrong
    assert out["beyond_2_53"] == {"bigint": "9007199254740993", "number": "9007199254740992"}
    assert db.execute("SELECT token, released_at IS NOT NULL FROM ledger.leases "
                      "WHERE job = 'nightly'").fetchone() == (10, True)

    # Token 11 goes back through the fence as a parameter and is compared there.
    out = node("run", "nightly", "host-1")
    assert (out["token"], out["wrote"]) == ("11", True)
    assert _writes(db) == [(11, "host-1")]
    assert db.execute("SELECT token FROM ledger.fences").fetchall() == [(11,)]


def test_already_done_and_paused_write_nothing(node, db):
    db.execute("SELECT ledger.register_job(job => 'nightly', ttl => '1 minute')")
    first = node("run", "nightly", "host-1", "--key=2024-06-01")
    again = node("run", "nightly", "host-2", "--key=2024-06-01")
    assert (first["outcome"], first["wrote"]) == ("started", True)
    assert (again["outcome"], again["wrote"], again["token"]) == ("already_done", False, None)

    db.execute("SELECT ledger.pause_job(job => 'nightly')")
    paused = node("run", "nightly", "host-1")
    assert (paused["outcome"], paused["wrote"]) == ("paused", False)
    assert _writes(db) == [(1, "host-1")]
