"""Every example of examples/ (one per client stack) through one set of scenarios,
on a direct connection and behind a real PgBouncer in transaction mode.

Each example is a separate program in its own language that speaks the
protocol of examples/node/run.mjs (examples/README.md): `run <job> <owner>
[--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]`, `zombie <job> <owner>
<run_id> <token>`, `tokens <job> <owner> [count]`, the DSN in LEDGER_DSN (a
postgres:// URI), one JSON line on stdout. The tests run it as a subprocess on
the test's database and check what it printed and what the ledger's tables say.

An example is found by its examples/<name>/driver.toml:

    name = "python-asyncpg"           # the test id; the folder's name by convention
    argv = ["{python}", "run.py"]     # the command, run in the example's folder
    build = ["go", "build", "-o", "{build}/run", "."]   # optional, once per session
    requires = [                      # each missing one skips the driver, naming the package
        { binary = "psql", package = "postgresql-client (Debian)" },
        { file = "/usr/share/java/postgresql.jar", package = "libpostgresql-jdbc-java (Debian)" },
        { check = ["{python}", "-c", "import asyncpg"], package = "asyncpg (PyPI: the drivers extra)" },
    ]
    env = { KEY = "value" }           # optional, added to the environment of every run

    [pooler]                          # optional: what it needs behind PgBouncer in transaction mode
    env = { LEDGER_STATEMENT_CACHE_SIZE = "0" }     # extra environment
    dsn = { prepareThreshold = "0" }                # extra query parameters of LEDGER_DSN
    default_fails = "__asyncpg_stmt_"               # optional: the text its failure without
                                                    # them shows, proven by a test (deterministic only)

In argv, build and check, `{python}` is the interpreter running this suite
(its venv has the `drivers` extra) and `{build}` a temporary directory of the
driver's, the same for the build and every run. Unknown keys are an error.
A requirement is one of `binary` (on PATH), `file` (exists) or `check` (a
command that must exit 0), each with the `package` that provides it; a
driver that misses one is skipped with the reason "<package> is missing",
so `pytest -rs` sums the skips up per package. A build that fails fails
every test of its driver.

Integers in an error's `detail` may be printed as JSON numbers or as decimal
strings (a language whose JSON numbers are doubles prints the big ones as
strings); they are compared here as integers, so one rounded on the way fails.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from pgbouncer import Bouncer, pgbouncer  # noqa: F401 - the fixture
from psycopg.conninfo import conninfo_to_dict
from repo import ROOT

EXAMPLES = ROOT / "examples"
TIMEOUT = 120  # seconds, per example process
BIG = 2**53  # past it a double (a JavaScript Number, jq 1.6) rounds: 2^53 + 1 becomes 2^53
BIGINT_KEYS = frozenset({"token", "current_token", "run_id", "run_token", "highest_token"})


@dataclass(frozen=True)
class Requirement:
    kind: str  # binary, file or check
    value: str | tuple[str, ...]
    package: str


@dataclass(frozen=True)
class Driver:
    name: str
    folder: Path
    argv: tuple[str, ...]
    build: tuple[str, ...] | None = None
    requires: tuple[Requirement, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    pooler_env: dict[str, str] = field(default_factory=dict)
    pooler_dsn: dict[str, str] = field(default_factory=dict)
    default_fails: str | None = None


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a non-empty list of strings")
    return tuple(value)


def _table(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{where} must be a table of strings")
    return dict(value)


def _requirement(entry: Any, where: str) -> Requirement:
    if not isinstance(entry, dict) or not isinstance(entry.get("package"), str):
        raise ValueError(f"{where}: each requirement needs a package")
    kinds = [k for k in ("binary", "file", "check") if k in entry]
    if len(kinds) != 1 or set(entry) != {kinds[0], "package"}:
        raise ValueError(f"{where}: a requirement is one of binary, file or check, with its package")
    kind = kinds[0]
    value = _strings(entry[kind], where) if kind == "check" else entry[kind]
    if not isinstance(value, (str, tuple)):
        raise ValueError(f"{where}: {kind} must be a string")
    return Requirement(kind, value, entry["package"])


def load_driver(path: Path) -> Driver:
    """One examples/<name>/driver.toml; unknown or ill-typed keys raise ValueError."""
    spec = tomllib.loads(path.read_text())
    where = str(path.relative_to(EXAMPLES.parent))
    unknown = set(spec) - {"name", "argv", "build", "requires", "env", "pooler"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    pooler = spec.get("pooler", {})
    if set(pooler) - {"env", "dsn", "default_fails"}:
        raise ValueError(f"{where}: unknown [pooler] keys {sorted(set(pooler) - {'env', 'dsn', 'default_fails'})}")
    if not isinstance(spec.get("name"), str):
        raise ValueError(f"{where}: name must be a string")
    return Driver(
        name=spec["name"],
        folder=path.parent,
        argv=_strings(spec.get("argv"), f"{where}: argv"),
        build=_strings(spec["build"], f"{where}: build") if "build" in spec else None,
        requires=tuple(_requirement(r, f"{where}: requires") for r in spec.get("requires", [])),
        env=_table(spec.get("env", {}), f"{where}: env"),
        pooler_env=_table(pooler.get("env", {}), f"{where}: [pooler] env"),
        pooler_dsn=_table(pooler.get("dsn", {}), f"{where}: [pooler] dsn"),
        default_fails=pooler.get("default_fails"),
    )


DRIVERS = [load_driver(p) for p in sorted(EXAMPLES.glob("*/driver.toml"))]


def _expand(argv: tuple[str, ...], build_dir: Path) -> list[str]:
    return [a.replace("{python}", sys.executable).replace("{build}", str(build_dir)) for a in argv]


def _missing(driver: Driver, build_dir: Path) -> str | None:
    """The skip reason of the first requirement that is not met, or None."""
    for req in driver.requires:
        if req.kind == "binary":
            ok = shutil.which(_expand((str(req.value),), build_dir)[0]) is not None
            what = f"{req.value} is not on PATH"
        elif req.kind == "file":
            ok = Path(str(req.value)).exists()
            what = f"{req.value} does not exist"
        else:
            command = _expand(tuple(req.value), build_dir)
            try:
                ok = subprocess.run(command, cwd=driver.folder, capture_output=True, timeout=60).returncode == 0
            except OSError:
                ok = False
            what = f"`{' '.join(req.value)}` failed"
        if not ok:
            # Only the package and the check: identical reasons are summed up by `pytest -rs`.
            return f"{req.package} is missing ({what})"
    return None


@dataclass
class Prepared:
    driver: Driver
    build_dir: Path
    skip: str | None = None
    failure: str | None = None


_prepared: dict[str, Prepared] = {}


@pytest.fixture(scope="session")
def _build_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("drivers")


@pytest.fixture(params=DRIVERS, ids=[d.name for d in DRIVERS])
def driver(request: pytest.FixtureRequest, _build_root: Path) -> Prepared:
    """The driver, checked and built once per session; skipped when it misses a package."""
    spec: Driver = request.param
    prepared = _prepared.get(spec.name)
    if prepared is None:
        build_dir = _build_root / spec.name
        build_dir.mkdir()
        prepared = Prepared(spec, build_dir, skip=_missing(spec, build_dir))
        if prepared.skip is None and spec.build is not None:
            proc = subprocess.run(_expand(spec.build, build_dir), cwd=spec.folder, capture_output=True,
                                  text=True, timeout=900)
            if proc.returncode != 0:
                prepared.failure = (f"the build of {spec.name} ({' '.join(spec.build)}) exited "
                                    f"{proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        _prepared[spec.name] = prepared
    if prepared.skip is not None:
        pytest.skip(prepared.skip)
    if prepared.failure is not None:
        pytest.fail(prepared.failure)
    return prepared


@pytest.fixture(params=["direct", "pgbouncer"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _uri(conninfo: str, query: dict[str, str]) -> str:
    """A conninfo string as the postgres:// URI every driver reads, with extra query parameters."""
    info = conninfo_to_dict(conninfo)
    host, port = str(info.get("host", "127.0.0.1")), str(info.get("port", "5432"))
    user, dbname, password = str(info.get("user", "postgres")), str(info["dbname"]), info.get("password")
    auth = quote(user, safe="") + (":" + quote(str(password), safe="") if password else "")
    params = dict(query)
    if host.startswith("/"):  # a Unix socket directory (the embedded server)
        params = {"host": host, "port": port, **params}
        return f"postgres://{auth}@/{quote(dbname)}?{urlencode(params)}"
    return f"postgres://{auth}@{host}:{port}/{quote(dbname)}" + (f"?{urlencode(params)}" if params else "")


class Example:
    """Runs one driver's example on the test database, directly or through the bouncer."""

    def __init__(self, prepared: Prepared, transport: str, dsn: str, bouncer: Bouncer | None) -> None:
        self.driver = prepared.driver
        self.name = prepared.driver.name
        self.transport = transport
        self._build_dir = prepared.build_dir
        self._dsn = dsn
        self._bouncer = bouncer

    def env(self, pooler_settings: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "LEDGER_DSN"}
        env.update(self.driver.env)
        if self._bouncer is None:
            env["LEDGER_DSN"] = _uri(self._dsn, {})
            return env
        settings = pooler_settings
        env["LEDGER_DSN"] = _uri(self._bouncer(self._dsn), self.driver.pooler_dsn if settings else {})
        if settings:
            env.update(self.driver.pooler_env)
        return env

    def spawn(self, *args: str, pooler_settings: bool = True) -> subprocess.Popen[str]:
        return subprocess.Popen(_expand(self.driver.argv, self._build_dir) + list(args), cwd=self.driver.folder,
                                env=self.env(pooler_settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    @staticmethod
    def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
        """The one JSON line a finished process printed (it must exit 0)."""
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()  # the process we started
            stdout, stderr = proc.communicate()
            pytest.fail(f"the example ran past {TIMEOUT} s:\n{stdout}\n{stderr}")
        assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr}"
        lines = stdout.splitlines()
        assert len(lines) == 1, f"not one JSON line:\n{stdout}\n{stderr}"
        result: dict[str, Any] = json.loads(lines[0])
        for key in ("error", "end_error"):
            if isinstance(result.get(key), dict) and isinstance(result[key].get("detail"), dict):
                result[key]["detail"] = _exact(result[key]["detail"])
        return result

    def __call__(self, *args: str) -> dict[str, Any]:
        return self.result(self.spawn(*args))


def _exact(detail: dict[str, Any]) -> dict[str, Any]:
    """A DETAIL's bigint facts as Python ints, whether printed as numbers or as decimal strings."""
    out = dict(detail)
    for key in BIGINT_KEYS & set(out):
        value = out[key]
        if isinstance(value, str) and value.lstrip("-").isdigit():
            out[key] = int(value)
    return out


@pytest.fixture
def example(driver: Prepared, transport: str, request: pytest.FixtureRequest, dsn: str,
            db: psycopg.Connection) -> Example:
    """`example(ARGS...)`: the driver's one JSON line for ARGS, on the test database."""
    bouncer = request.getfixturevalue("pgbouncer") if transport == "pgbouncer" else None
    db.execute("CREATE TABLE fenced_writes (token bigint, written_by text)")
    return Example(driver, transport, dsn, bouncer)


Run = Callable[..., dict[str, Any]]


def _start(db: psycopg.Connection, job: str, owner: str, ttl: str) -> tuple[Any, ...]:
    row = db.execute("SELECT outcome, run_id, token, expires_at FROM ledger.start_run("
                     "job => %s, owner => %s, ttl => %s::interval)", (job, owner, ttl)).fetchone()
    assert row is not None and row[0] == "started"
    return tuple(row)


def _writes(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    return db.execute("SELECT token, written_by FROM fenced_writes ORDER BY token").fetchall()


def _instant(text: str) -> datetime:
    """An ISO 8601 instant as printed by any of the examples (Z or +00:00, ms or µs)."""
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _expire(db: psycopg.Connection, job: str, token: int) -> None:
    deadline = time.monotonic() + 30
    while db.execute("SELECT ledger.is_current(job => %s, token => %s)", (job, token)).fetchone() == (True,):
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.01)


def test_a_run_heartbeats_writes_through_the_fence_and_completes(example, db):
    # The work (2.5 s) outlasts the ttl (2 s): only the heartbeats keep the lease.
    out = example("run", "nightly", "host-1", "--ttl=2", "--work-ms=2500")
    assert out["outcome"] == "started" and out["error"] is None and "end_error" not in out
    assert out["token"] == "1" and isinstance(out["run_id"], str)  # bigints printed as strings
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


def test_a_second_process_is_skipped_while_the_first_holds_the_lease(example, db):
    _, run_id, token, expires_at = _start(db, "nightly", "python-holder", "5 minutes")

    out = example("run", "nightly", "host-2")
    assert out["outcome"] == "skipped_overlap" and out["holder"] == "python-holder"
    # The holder's expiry, to the millisecond at least (a JavaScript Date keeps no more).
    assert abs(_instant(out["holder_expires_at"]) - expires_at) < timedelta(milliseconds=1)
    assert out["wrote"] is False and out["token"] is None and out["error"] is None
    assert _writes(db) == []
    assert db.execute("SELECT skipped_overlap, failures FROM ledger.job_counters "
                      "WHERE job = 'nightly'").fetchone() == (1, 0)

    # Once the holder ends its run, the next start gets the next token.
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    out = example("run", "nightly", "host-2")
    assert (out["outcome"], out["token"], out["wrote"]) == ("started", "2", True)
    assert _writes(db) == [(2, "host-2")]


def test_a_racing_worker_of_the_same_stack_skips_while_the_first_works(example, db):
    # The first worker's start_run must be committed when it returns: a driver that opens a
    # transaction by itself (psycopg2, SQLAlchemy) and leaves it open would hide the run from
    # everybody (never visible below) and make the racer wait on the lease row, then skip
    # against a holder that is not there.
    first = example.spawn("run", "nightly", "worker-1", "--work-ms=4000")
    deadline = time.monotonic() + 30
    while db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'nightly' "
                     "AND status = 'running'").fetchone() != (1,):
        if first.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the first worker's run never became visible:\n{Example.result(first)}")
        time.sleep(0.02)

    racer = example("run", "nightly", "worker-2")
    won = Example.result(first)
    assert (racer["outcome"], racer["holder"], racer["wrote"]) == ("skipped_overlap", "worker-1", False)
    assert racer["holder_expires_at"] is not None
    assert (won["outcome"], won["token"], won["wrote"], won["error"]) == ("started", "1", True, None)
    assert _writes(db) == [(1, "worker-1")]
    assert db.execute("SELECT skipped_overlap, successes FROM ledger.job_counters "
                      "WHERE job = 'nightly'").fetchone() == (1, 1)


def test_a_lost_lease_stops_the_work_and_nothing_is_written(example, db):
    # The lease is taken over while the work (20 s) runs: the next heartbeat (ttl/3 = 1 s)
    # returns NULL, the work stops early, nothing is written and ending the run is refused.
    began = time.monotonic()
    worker = example.spawn("run", "nightly", "worker-1", "--ttl=3", "--work-ms=20000")
    deadline = time.monotonic() + 30
    while db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'nightly'").fetchone() != (1,):
        if worker.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the worker's run never became visible:\n{Example.result(worker)}")
        time.sleep(0.02)
    db.execute("UPDATE ledger.leases SET expires_at = clock_timestamp() - interval '1 second' WHERE job = 'nightly'")
    _start(db, "nightly", "thief", "1 minute")

    out = Example.result(worker)
    assert time.monotonic() - began < 15, "the work was not stopped when the lease was lost"
    assert (out["outcome"], out["wrote"]) == ("started", False)
    assert out["error"]["code"] is None and "lease lost" in out["error"]["message"]
    assert out["end_error"]["code"] == "LD001"
    assert _writes(db) == []
    assert db.execute("SELECT owner, status, failure_reason FROM ledger.job_execution_log "
                      "ORDER BY run_id").fetchall() == [
        ("worker-1", "failure", "lease_expired"), ("thief", "running", None)]


def test_a_zombie_write_after_a_takeover_gets_ld001_and_never_commits(example, db):
    _, old_run, old_token, _ = _start(db, "nightly", "old-host", "50 milliseconds")
    _expire(db, "nightly", old_token)

    successor = example("run", "nightly", "new-host")  # takes the expired lease over
    assert (successor["outcome"], successor["token"], successor["wrote"]) == ("started", "2", True)

    zombie = example("zombie", "nightly", "old-host", str(old_run), str(old_token))
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


def test_tokens_past_2_53_go_through_fence_and_detail_unrounded(example, db):
    # As after 2^21 promotions: the job's next token is 2^53 + 1, which a double rounds to 2^53.
    db.execute("SELECT ledger.acquire(job => 'nightly', owner => 'setup', ttl => '1 minute')")
    db.execute("UPDATE ledger.leases SET token = %s, released_at = expires_at WHERE job = 'nightly'", (BIG,))
    _, old_run, old_token, _ = _start(db, "nightly", "old-host", "50 milliseconds")
    assert old_token == BIG + 1
    _expire(db, "nightly", old_token)

    successor = example("run", "nightly", "new-host")
    assert (successor["token"], successor["wrote"]) == (str(BIG + 2), True)
    zombie = example("zombie", "nightly", "old-host", str(old_run), str(old_token))
    assert zombie["error"]["code"] == "LD001" and zombie["wrote"] is False
    detail = zombie["error"]["detail"]
    assert (detail["token"], detail["current_token"]) == (BIG + 1, BIG + 2)  # exact, as ints
    assert zombie["end_error"]["detail"]["current_token"] == BIG + 2

    assert _writes(db) == [(BIG + 2, "new-host")]
    assert db.execute("SELECT token FROM ledger.fences").fetchall() == [(BIG + 2,)]


def test_ld006_is_reported_with_its_json_detail_when_the_resource_is_another_jobs(example, db):
    # Job 'other' binds the resource 'shared' by fencing it first.
    _, run_id, token, _ = _start(db, "other", "someone", "1 minute")
    with db.transaction():
        db.execute("SELECT ledger.fence(job => 'other', resource => 'shared', token => %s)", (token,))
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))

    out = example("run", "nightly", "host-1", "--resource=shared")
    assert out["outcome"] == "started" and out["wrote"] is False and "end_error" not in out
    assert out["error"]["code"] == "LD006"
    assert out["error"]["detail"] == {"resource": "shared", "job": "nightly", "bound_job": "other", "token": 1}

    assert _writes(db) == []
    status, reason, error = db.execute("SELECT status, failure_reason, error FROM ledger.job_execution_log "
                                       "WHERE job = 'nightly'").fetchone()
    assert (status, reason) == ("failure", "error") and error.startswith("LD006: fence of another job")
    assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'shared'").fetchone() == ("other", 1)


def test_bigint_tokens_compare_as_numbers_past_9(example, db):
    out = example("tokens", "nightly", "host-1", "10")
    assert out["tokens"] == [str(n) for n in range(1, 11)]
    assert out["newest"] == "10" and out["newest_was_current"] is True
    assert out["naive_string_newest"] == "9"  # what comparing the strings gets wrong
    # 2^53 + 1 read as a 64-bit integer, and what a double makes of it.
    assert out["beyond_2_53"] == {"bigint": str(BIG + 1), "number": str(BIG)}
    assert db.execute("SELECT token, released_at IS NOT NULL FROM ledger.leases "
                      "WHERE job = 'nightly'").fetchone() == (10, True)

    # Token 11 goes back through the fence as a parameter and is compared there.
    out = example("run", "nightly", "host-1")
    assert (out["token"], out["wrote"]) == ("11", True)
    assert _writes(db) == [(11, "host-1")]
    assert db.execute("SELECT token FROM ledger.fences").fetchall() == [(11,)]


def test_already_done_and_paused_write_nothing(example, db):
    db.execute("SELECT ledger.register_job(job => 'nightly', ttl => '1 minute')")
    first = example("run", "nightly", "host-1", "--key=2024-06-01")
    again = example("run", "nightly", "host-2", "--key=2024-06-01")
    assert (first["outcome"], first["wrote"]) == ("started", True)
    assert (again["outcome"], again["wrote"], again["token"]) == ("already_done", False, None)

    db.execute("SELECT ledger.pause_job(job => 'nightly')")
    paused = example("run", "nightly", "host-1")
    assert (paused["outcome"], paused["wrote"]) == ("paused", False)
    assert _writes(db) == [(1, "host-1")]


FAILING_DEFAULTS = [d for d in DRIVERS if d.default_fails is not None]


@pytest.mark.parametrize("transport", ["pgbouncer"])
@pytest.mark.parametrize("driver", FAILING_DEFAULTS, ids=[d.name for d in FAILING_DEFAULTS], indirect=True)
def test_without_its_pooler_settings_the_driver_fails_behind_the_bouncer(example, db):
    # What the [pooler] settings are for. The test database's pool starts empty, so the
    # first client runs alone on one server connection and leaves its prepared statements
    # there; the second, on that same connection, names its own statements the same way.
    first = example.spawn("tokens", "job-1", "host", "10", pooler_settings=False)
    first_out = first.communicate(timeout=TIMEOUT)
    second = example.spawn("tokens", "job-2", "host", "10", pooler_settings=False)
    stdout, stderr = second.communicate(timeout=TIMEOUT)
    assert first.returncode == 0, first_out
    assert second.returncode != 0, f"the second client worked without the pooler settings:\n{stdout}"
    assert example.driver.default_fails in stderr, stderr


def _open_transaction_psycopg2(dsn: str) -> Callable[[], None]:
    psycopg2 = pytest.importorskip("psycopg2", reason="psycopg2-binary (PyPI: pip install -e '.[drivers]') is missing")
    conn = psycopg2.connect(dsn)  # the default: a transaction opened by the first statement
    conn.cursor().execute("SELECT * FROM ledger.start_run(job => 'nightly', owner => 'worker-1', ttl => '1 minute')")
    return conn.close


def _open_transaction_sqlalchemy(dsn: str) -> Callable[[], None]:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    engine = sqlalchemy.create_engine(sqlalchemy.make_url(_uri(dsn, {})).set(drivername="postgresql+psycopg"))
    conn = engine.connect()  # the default: SQLAlchemy begins at the first statement
    conn.execute(sqlalchemy.text("SELECT * FROM ledger.start_run(job => 'nightly', owner => 'worker-1', "
                                 "ttl => '1 minute')"))

    def close() -> None:
        conn.close()
        engine.dispose()

    return close


@pytest.mark.parametrize("open_transaction", [_open_transaction_psycopg2, _open_transaction_sqlalchemy],
                         ids=["psycopg2", "sqlalchemy"])
def test_a_start_run_left_in_the_drivers_own_transaction_hides_the_run(open_transaction, dsn, db):
    # Why the Python examples use autocommit: with the driver's default, start_run's run and
    # lease stay uncommitted, so a racing worker waits on the lease row (1 s), then skips
    # against a holder it cannot name, and the log shows no run at all.
    close = open_transaction(dsn)
    try:
        began = time.monotonic()
        racer = db.execute("SELECT outcome, holder FROM ledger.start_run(job => 'nightly', owner => 'worker-2', "
                           "ttl => '1 minute')").fetchone()
        assert racer == ("skipped_overlap", None) and time.monotonic() - began >= 0.9
        assert db.execute("SELECT count(*) FROM ledger.job_execution_log").fetchone() == (0,)
    finally:
        close()


DOCS = EXAMPLES.parent / "docs" / "sql-clients.md"
EXCERPT = re.compile(r"^<!-- executed by tests/drivers/test_drivers\.py \(an excerpt of (?P<file>examples/\S+)\) -->$")


def _excerpts() -> list[tuple[int, str, list[str]]]:
    """docs/sql-clients.md's blocks marked as excerpts of an example: (line, file, the block's lines)."""
    lines = DOCS.read_text().splitlines()
    found = []
    for number, line in enumerate(lines):
        marker = EXCERPT.match(line.strip())
        if marker:
            start = next(n for n in range(number + 1, len(lines)) if lines[n].strip())
            end = next(n for n in range(start + 1, len(lines)) if lines[n].strip().startswith("```"))
            found.append((number + 1, marker["file"], lines[start + 1:end]))
    return found


def test_the_excerpts_in_sql_clients_md_are_the_tested_examples_code():
    # The code docs/sql-clients.md shows is the code this file runs: every line of an excerpt,
    # in order, is a line of the example it names (indentation aside).
    excerpts = _excerpts()
    assert len(excerpts) >= 8
    for line, name, block in excerpts:
        source = [text.strip() for text in (EXAMPLES.parent / name).read_text().splitlines()]
        position = 0
        for text in (t.strip() for t in block if t.strip()):
            assert text in source[position:], f"docs/sql-clients.md:{line}: not in {name} (in order): {text}"
            position = source.index(text, position) + 1
