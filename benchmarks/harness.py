"""The side-by-side benchmark of issue 14: the ledger against the raw SQL floor.

Driven by benchmarks/run.py (`make bench`, `make bench-smoke`). Every ratio
compares two sides measured in the same run, alternated (raw, ledger, raw,
ledger, ...): pgbench ``-M prepared`` scripts in benchmarks/pgbench/ for the
SQL rows, psycopg / redis-py loops for the Python rows. Medians per side,
ratio = ledger / raw in throughput (for ms per run: raw ms / ledger ms).

The scratch database (``ledger_bench``; the smoke mode's has the pid in its
name) is created fresh, the ledger installed into it the way a psql user does
(``python -m ledger sql | psql``), then benchmarks/pgbench/setup.sql; it is
dropped at the end unless ``keep_db``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import hashlib
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = HERE / "pgbench"
MARK_START = "<!-- bench:start -->"
MARK_END = "<!-- bench:end -->"


class HarnessError(RuntimeError):
    """A script or a step of the harness failed: its numbers would mean nothing."""


# -- what is measured ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pair:
    """One row of the issue's table: a raw script against a ledger script, at `clients`."""

    id: str
    operation: str
    raw: str           # pgbench script (benchmarks/pgbench/NAME.sql)
    ledger: str
    clients: int
    target: float | None
    issue_ratio: float | None  # the ratio the issue measured when it was filed
    issue_raw: str             # the raw floor the issue measured
    hot: bool = False          # one hot job instead of the N jobs
    note: str = ""
    # ledger.configure_events before the ledger side: None keeps the
    # defaults (run events on, notify off); "off" switches run events off,
    # "notify" switches pg_notify on. The raw side always runs on the defaults.
    events: str | None = None

    @property
    def ceiling(self) -> str:
        """The raw script's statements, each in a PL/pgSQL SECURITY DEFINER function with a fixed search_path."""
        return CEILINGS[self.raw]


# The ceiling of each raw floor (pgbench/ceil_*.sql, functions in setup.sql): what a
# function-based API costs at the very least. ../shared/bench-ceiling/run.sh compares the kinds of function.
CEILINGS = {"raw_acquire": "ceil_acquire", "raw_cycle": "ceil_cycle", "raw_insert": "ceil_insert",
            "raw_hot": "ceil_hot"}


PAIRS: list[Pair] = [
    Pair("acquire-1", "`acquire` vs one CAS `UPDATE`", "raw_acquire", "ledger_acquire", 1, 0.85, 0.65, "~3,100 tps"),
    Pair("cycle-1", "`start_run` + `complete_run` vs the raw two-commit cycle", "raw_cycle", "ledger_cycle", 1,
         0.8, 0.72, "~1,050 tps"),
    Pair("fence-1", "`fence` + app INSERT vs the bare INSERT (BEGIN/COMMIT)", "raw_insert", "ledger_fence", 1,
         0.8, 0.60, "~2,600 tps"),
    Pair("fence-folded-1", "fence folded into the INSERT (`INSERT ... SELECT ledger.fence(...)`) vs the bare INSERT",
         "raw_insert", "ledger_fence_folded", 1, None, None, "", note="informational: no target in the issue"),
    Pair("acquire-8", "`acquire` vs CAS", "raw_acquire", "ledger_acquire", 8, 0.85, 0.48, "~5,800 tps"),
    Pair("cycle-8", "start + complete vs the raw cycle", "raw_cycle", "ledger_cycle", 8, 0.7, 0.45, "~1,350 tps"),
    Pair("fence-8", "fenced INSERT vs bare INSERT", "raw_insert", "ledger_fence", 8, 0.85, 0.61, "~4,300 tps"),
    Pair("fence-folded-8", "fence folded into the INSERT vs bare INSERT", "raw_insert", "ledger_fence_folded", 8,
         None, None, "", note="informational: no target in the issue"),
    Pair("hot-8", "one hot job, looping start + complete (mostly skips) vs the raw floor's loop", "raw_hot",
         "ledger_hot", 8, 0.7, 0.48, "~3,900 tps", hot=True),
    # What ledger.events costs on the hot path: the cycle-8 row again with
    # the run events off, and with pg_notify on (no listener).
    Pair("cycle-8-no-events", "start + complete with run events off (`configure_events(run_events => false)`)",
         "raw_cycle", "ledger_cycle", 8, None, None, "", events="off",
         note="informational: the cost of the run events is cycle-8 against this row"),
    Pair("cycle-8-notify", "start + complete with pg_notify on (`configure_events(notify => true)`)",
         "raw_cycle", "ledger_cycle", 8, None, None, "", events="notify",
         note="informational: the cost of pg_notify is this row against cycle-8"),
]

EVENT_SETTINGS = {
    None: "SELECT ledger.configure_events(run_events => true, notify => false)",
    "off": "SELECT ledger.configure_events(run_events => false, notify => false)",
    "notify": "SELECT ledger.configure_events(run_events => true, notify => true)",
}


@dataclasses.dataclass(frozen=True)
class Reference:
    id: str
    operation: str
    script: str | None  # pgbench script, or None for the Python-driven Redis row
    clients: int
    durable: bool
    client: str


REFERENCES: list[Reference] = [
    Reference("shedlock-1", "ShedLock's upsert lock + unlock (two commits)", "ref_shedlock", 1, True, "pgbench"),
    Reference("shedlock-8", "ShedLock's upsert lock + unlock (two commits)", "ref_shedlock", 8, True, "pgbench"),
    Reference("advisory-1", "`pg_try_advisory_lock` + `pg_advisory_unlock`", "ref_advisory", 1, False, "pgbench"),
    Reference("advisory-8", "`pg_try_advisory_lock` + `pg_advisory_unlock`", "ref_advisory", 8, False, "pgbench"),
    Reference("redis-1", "Redis `SET key val NX EX ttl` + `DEL` (local Redis)", None, 1, False, "redis-py"),
    Reference("redis-8", "Redis `SET key val NX EX ttl` + `DEL` (local Redis)", None, 8, False,
              "redis-py, 8 processes"),
]

PYTHON_ROWS = [
    # id, operation, target, issue ratio
    ("py-conn", "`with ledger.run(...)` over the caller's connection vs raw psycopg calling "
                "`start_run` + `complete_run`", 0.9, 0.86),
    ("py-pool", "the same over the client's own pool (`Ledger(dsn)`) vs raw psycopg", 0.9, 0.77),
]

ROW_IDS = [p.id for p in PAIRS] + [r for r, *_ in PYTHON_ROWS] + [r.id for r in REFERENCES]


@dataclasses.dataclass
class Config:
    admin_dsn: str
    smoke: bool = False
    duration: int = 10            # pgbench -T per side and round (full mode)
    transactions: int | None = None  # pgbench -t per client instead (smoke mode)
    rounds: int = 2
    jobs: int = 10_000
    python_runs: int = 200        # runs per side and round of the Python rows
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_seconds: float = 5.0    # the 8-process Redis row's window
    keep_db: bool = False
    dbname: str = "ledger_bench"
    only: tuple[str, ...] = ()    # row ids to run (all when empty)

    @classmethod
    def smoke_mode(cls, admin_dsn: str, **overrides: Any) -> Config:
        values: dict[str, Any] = dict(admin_dsn=admin_dsn, smoke=True, transactions=20, rounds=1, jobs=200,
                                      python_runs=10, redis_seconds=0.5, dbname=f"ledger_bench_smoke_{os.getpid()}")
        values.update(overrides)
        return cls(**values)


def log(message: str) -> None:
    print(message, flush=True)


# -- the machine ----------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - not installed
        return None


def machine_info() -> dict[str, Any]:
    cpu = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.M)
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.M)
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 1
    return {
        "nproc": usable,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu.group(1).strip() if cpu else platform.processor() or "unknown",
        "ram_gib": round(int(mem.group(1)) / 1024 / 1024, 1) if mem else None,
        "kernel": platform.release(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


def software_info(conn: psycopg.Connection[Any], pgbench: str) -> dict[str, Any]:
    settings = {}
    for name in ("shared_buffers", "synchronous_commit", "fsync", "wal_level", "full_page_writes",
                 "wal_sync_method", "checkpoint_timeout", "max_wal_size", "max_connections", "jit"):
        row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
        settings[name] = row[0] if row else None
    version = conn.execute("SELECT version()").fetchone()
    short = conn.execute("SHOW server_version").fetchone()
    pgbench_version = subprocess.run([pgbench, "--version"], capture_output=True, text=True).stdout.strip()
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "postgresql": version[0] if version else None,
        "server_version": short[0] if short else None,
        "settings": settings,
        "pgbench": pgbench_version,
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "psycopg_impl": psycopg.pq.__impl__,
        "libpq": psycopg.pq.version(),
        "psycopg_pool": _version("psycopg-pool"),
        "redis_py": _version("redis"),
        "matplotlib": _version("matplotlib"),
        "git_commit": commit,
    }


# -- the scratch database ------------------------------------------------------------


def find_pgbench(server_major: int) -> str:
    explicit = os.environ.get("PGBENCH")
    candidates = [explicit] if explicit else []
    candidates += [f"/usr/lib/postgresql/{server_major}/bin/pgbench", shutil.which("pgbench") or ""]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise HarnessError("pgbench not found: set PGBENCH, or install postgresql-client "
                       f"(looked in /usr/lib/postgresql/{server_major}/bin and PATH)")


def install_sql() -> str:
    """The install script, as `python -m ledger sql` prints it for psql users."""
    done = subprocess.run([sys.executable, "-m", "ledger", "sql"], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise HarnessError(f"python -m ledger sql failed: {done.stderr.strip()}")
    return done.stdout


def psql(dsn: str, *, script: str | None = None, file: Path | None = None, variables: dict[str, Any] | None = None,
         ) -> None:
    args = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1"]
    for key, value in (variables or {}).items():
        args += ["-v", f"{key}={value}"]
    if file is not None:
        args += ["-f", str(file)]
    args += ["-d", dsn]
    done = subprocess.run(args, input=script, capture_output=True, text=True)
    if done.returncode != 0:
        raise HarnessError(f"psql {file or 'install script'} failed: {done.stderr.strip()[-2000:]}")


class Scratch:
    """The benchmark's own database: fresh, the ledger installed, setup.sql run."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.dsn = make_conninfo(config.admin_dsn, dbname=config.dbname)
        self.sql_sha256 = ""

    def create(self) -> None:
        name = self.config.dbname
        with psycopg.connect(self.config.admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.execute(f'CREATE DATABASE "{name}"')
            # The durable commit the issue measures, whatever the server's default.
            admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = on')
        script = install_sql()
        self.sql_sha256 = hashlib.sha256(script.encode()).hexdigest()[:12]
        psql(self.dsn, script=script)
        psql(self.dsn, file=SCRIPTS / "setup.sql", variables={"jobs": self.config.jobs})

    def drop(self) -> None:
        with psycopg.connect(self.config.admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.config.dbname}" WITH (FORCE)')


# -- pgbench --------------------------------------------------------------------------


class PgBench:
    def __init__(self, config: Config, scratch: Scratch, binary: str, nproc: int) -> None:
        self.config = config
        self.scratch = scratch
        self.binary = binary
        self.nproc = nproc
        self.ctl = psycopg.connect(scratch.dsn, autocommit=True)
        self.defines: dict[str, str] = {}
        self.seconds = 0.0

    def close(self) -> None:
        self.ctl.close()

    def prepare(self) -> None:
        # Every fence-N lease holds the same first token in a fresh database;
        # the scripts take it as a constant rather than paying a lookup.
        row = self.ctl.execute("SELECT min(token), max(token), count(*) FROM ledger.leases "
                               "WHERE job LIKE 'fence-%'").fetchone()
        assert row is not None
        if row[0] != row[1] or row[2] != self.config.jobs:
            raise HarnessError(f"setup: expected {self.config.jobs} fence leases with one token, got {row}")
        self.defines["token"] = str(row[0])

    def run(self, script: str, clients: int) -> dict[str, Any]:
        """One pgbench run: tps, latency, transactions; HarnessError when any client aborted."""
        per = self.config.jobs // clients
        if per < 1:
            raise HarnessError(f"{self.config.jobs} jobs cannot be split between {clients} clients")
        try:  # every run starts from a fresh checkpoint, none falls inside a run by chance
            self.ctl.execute("CHECKPOINT")
        except psycopg.Error:
            pass
        args = [self.binary, "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, self.nproc)),
                "-f", str(SCRIPTS / f"{script}.sql"), "-D", f"per={per}"]
        for key, value in self.defines.items():
            args += ["-D", f"{key}={value}"]
        if self.config.transactions is not None:
            args += ["-t", str(self.config.transactions)]
            timeout = 120.0
        else:
            args += ["-T", str(self.config.duration)]
            timeout = self.config.duration * 3 + 60.0
        args.append(self.scratch.dsn)
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        self.seconds += time.perf_counter() - started
        out = done.stdout + done.stderr
        tps = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", out, re.M)
        processed = re.search(r"number of transactions actually processed: (\d+)(?:/(\d+))?", out)
        latency = re.search(r"latency average = ([\d.]+) ms", out)
        failed = re.search(r"number of failed transactions: (\d+)", out)
        if done.returncode != 0 or "aborted" in out or not tps or not processed:
            errors = [line for line in out.splitlines() if "error" in line.lower()][:5]
            raise HarnessError(f"pgbench {script}.sql with {clients} clients failed (exit {done.returncode}): "
                               + ("; ".join(errors) or out[-1500:]))
        count = int(processed.group(1))
        if processed.group(2) is not None and count != int(processed.group(2)):
            raise HarnessError(f"pgbench {script}.sql: only {processed.group(0)}")
        if failed and int(failed.group(1)):
            raise HarnessError(f"pgbench {script}.sql: {failed.group(0)}")
        return {"tps": float(tps.group(1)), "transactions": count,
                "latency_ms": float(latency.group(1)) if latency else None}

    def hot_runs(self, raw: bool) -> int | None:
        """Runs the hot job has logged so far (to tell starts from skips)."""
        query = ("SELECT count(*) FROM bench_raw.runs WHERE job = 'hot'" if raw
                 else "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'hot'")
        try:
            row = self.ctl.execute(query).fetchone()
        except psycopg.Error:
            return None
        return int(row[0]) if row else None


def _side(label: str, script: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    values = [r["tps"] for r in runs]
    return {"label": label, "script": f"benchmarks/pgbench/{script}.sql", "tps": values,
            "median": statistics.median(values), "runs": runs}


def measure_pairs(bench: PgBench, pairs: Iterable[Pair]) -> list[dict[str, Any]]:
    """Each group of pairs that share a raw script (and clients) alternated: raw, ledger 1, ledger 2, raw, ..."""
    groups: dict[tuple[str, int, bool], list[Pair]] = {}
    for pair in pairs:
        groups.setdefault((pair.raw, pair.clients, pair.hot), []).append(pair)
    rows = []
    for (raw_script, clients, hot), members in groups.items():
        # Keyed by side: several pairs may run one ledger script with other settings.
        # raw, then the ceiling (the raw statements in the API's kind of function), then the ledger
        sides: list[tuple[str, str, Pair | None]] = [("raw", raw_script, None), ("ceiling", CEILINGS[raw_script], None)]
        sides += [(p.id, p.ledger, p) for p in members]
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side, _, _ in sides}
        name = "+".join(p.id for p in members)
        for round_ in range(bench.config.rounds):
            for side, script, pair in sides:
                bench.ctl.execute(EVENT_SETTINGS[pair.events if pair else None])
                on_raw_tables = side in ("raw", "ceiling")
                before = bench.hot_runs(on_raw_tables) if hot else None
                result = bench.run(script, clients)
                if hot:
                    after = bench.hot_runs(on_raw_tables)
                    if before is not None and after is not None:
                        result["started"] = after - before
                        result["started_share"] = round((after - before) / max(result["transactions"], 1), 4)
                runs[side].append(result)
                log(f"  {name:31} round {round_ + 1} {side:20} {result['tps']:10.1f} tps")
        bench.ctl.execute(EVENT_SETTINGS[None])
        raw_runs = runs["raw"]
        raw = _side("raw", raw_script, raw_runs)
        ceiling_runs = runs["ceiling"]
        ceiling = _side("ceiling", CEILINGS[raw_script], ceiling_runs)
        for pair in members:
            ledger_runs = runs[pair.id]
            ledger = _side("ledger", pair.ledger, ledger_runs)
            ratio = ledger["median"] / raw["median"]
            rows.append({
                "id": pair.id, "kind": "pair", "operation": pair.operation, "clients": pair.clients,
                "jobs": 1 if pair.hot else bench.config.jobs, "unit": "tps", "raw": raw, "ledger": ledger,
                "ratio": round(ratio, 4), "ceiling": ceiling,
                "ceiling_ratio": round(ceiling["median"] / raw["median"], 4),
                "ratio_to_ceiling": round(ledger["median"] / ceiling["median"], 4),
                "round_ratios": [round(b["tps"] / a["tps"], 4) for a, b in zip(raw_runs, ledger_runs)],
                "target": pair.target, "met": None if pair.target is None else ratio >= pair.target,
                "issue_ratio": pair.issue_ratio, "issue_raw": pair.issue_raw, "note": pair.note,
            })
            log(f"  {pair.id:31} ratio {ratio:.2f}" + (f" (target {pair.target})" if pair.target else ""))
    return rows


def measure_pg_references(bench: PgBench, references: Iterable[Reference]) -> list[dict[str, Any]]:
    rows = []
    for ref in references:
        assert ref.script is not None
        runs = []
        for round_ in range(bench.config.rounds):
            result = bench.run(ref.script, ref.clients)
            runs.append(result)
            log(f"  {ref.id:31} round {round_ + 1} {ref.script:20} {result['tps']:10.1f} tps")
        values = [r["tps"] for r in runs]
        rows.append({"id": ref.id, "kind": "reference", "operation": ref.operation, "clients": ref.clients,
                     "jobs": bench.config.jobs, "unit": "cycles/s", "durable": ref.durable, "client": ref.client,
                     "script": f"benchmarks/pgbench/{ref.script}.sql",
                     "value": {"values": values, "median": statistics.median(values), "runs": runs}})
    return rows


# -- the Python client ------------------------------------------------------------


def measure_python(config: Config, dsn: str) -> list[dict[str, Any]]:
    """ms per run cycle: raw psycopg, `with ledger.run()` over that connection, and over Ledger(dsn)'s pool."""
    from ledger import Ledger

    ttl = dt.timedelta(hours=1)
    conn = psycopg.connect(dsn, autocommit=True)
    over_conn = Ledger(conn, owner="bench-py")
    over_pool = Ledger(dsn, owner="bench-py")

    def raw_cycle() -> None:
        row = conn.execute("SELECT run_id, token FROM ledger.start_run(%s, %s, %s)",
                           ("py-raw", "bench-py", ttl)).fetchone()
        if row is None or row[0] is None:
            raise HarnessError("raw psycopg: start_run did not start")
        conn.execute("SELECT status FROM ledger.complete_run(%s, %s)", row).fetchone()

    def context(ledger: Ledger, job: str) -> Callable[[], None]:
        def cycle() -> None:
            with ledger.run(job, ttl=ttl) as run:
                if not run.started:
                    raise HarnessError(f"ledger.run({job!r}) did not start: {run.outcome}")
        return cycle

    sides = [("raw", raw_cycle), ("conn", context(over_conn, "py-conn")), ("pool", context(over_pool, "py-pool"))]
    ms: dict[str, list[float]] = {name: [] for name, _ in sides}
    try:
        for _, fn in sides:  # warm up: connections, prepared statements, the pool
            for _ in range(min(5, config.python_runs)):
                fn()
        for round_ in range(config.rounds):
            for name, fn in sides:
                started = time.perf_counter()
                for _ in range(config.python_runs):
                    fn()
                ms[name].append((time.perf_counter() - started) / config.python_runs * 1e3)
                log(f"  python round {round_ + 1} {name:5} {ms[name][-1]:8.3f} ms/run")
    finally:
        over_pool.close()
        conn.close()
    raw = {"label": "raw psycopg", "ms_per_run": ms["raw"], "median": statistics.median(ms["raw"])}
    rows = []
    for (row_id, operation, target, issue), name in zip(PYTHON_ROWS, ("conn", "pool")):
        side = {"label": "ledger.run over " + ("the caller's connection" if name == "conn" else "Ledger(dsn)"),
                "ms_per_run": ms[name], "median": statistics.median(ms[name])}
        ratio = raw["median"] / side["median"]
        rows.append({"id": row_id, "kind": "python", "operation": operation, "clients": 1, "jobs": 1,
                     "unit": "ms/run", "runs_per_round": config.python_runs, "raw": raw, "ledger": side,
                     "ratio": round(ratio, 4),
                     "round_ratios": [round(a / b, 4) for a, b in zip(ms["raw"], ms[name])],
                     "target": target, "met": ratio >= target, "issue_ratio": issue,
                     "issue_raw": "2.6–4 ms/run" if name == "conn" else "", "note": ""})
    return rows


# -- Redis ----------------------------------------------------------------------------


def _redis_cycles(url: str, keys: list[str], start_at: float, end_at: float) -> tuple[int, float]:
    """One process of the 8-client Redis row: SET NX EX + DEL cycles inside [start_at, end_at)."""
    import redis

    client = redis.Redis.from_url(url)
    client.ping()
    count = 0
    while time.time() < start_at:
        time.sleep(0.001)
    arrived = time.time() - start_at
    while time.time() < end_at:
        key = random.choice(keys)
        if client.set(key, "bench", nx=True, ex=3600) is not True:
            raise HarnessError(f"redis: SET {key} NX did not take it")
        client.delete(key)
        count += 1
    client.close()
    return count, arrived


def redis_info(url: str) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    info = client.info("server")
    config: dict[str, Any] = {}
    for name in ("appendonly", "appendfsync", "save"):
        try:
            config.update(client.config_get(name))
        except redis.ResponseError:
            pass
    client.close()
    return {"redis_server": info.get("redis_version"), "persistence": config}


def measure_redis(config: Config, references: list[Reference]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The Redis rows; skipped (with the reason) when redis-py or the server is missing."""
    rows = []
    try:
        import redis  # noqa: F401  (the `bench` extra)
        info = redis_info(config.redis_url)
    except Exception as error:  # noqa: BLE001 - no redis-py, no server: the rows say why
        reason = ("redis-py not installed (pip install -e '.[bench]')" if isinstance(error, ImportError)
                  else f"Redis at {config.redis_url} unavailable: {error}")
        log(f"  redis skipped: {reason}")
        for ref in references:
            rows.append({"id": ref.id, "kind": "reference", "operation": ref.operation, "clients": ref.clients,
                         "unit": "cycles/s", "durable": False, "client": ref.client, "skipped": reason})
        return rows, {"redis_skipped": reason}
    import redis as redis_module

    for ref in references:
        per = config.jobs // ref.clients
        values = []
        for round_ in range(config.rounds):
            if ref.clients == 1:
                client = redis_module.Redis.from_url(config.redis_url)
                keys = [f"ledger-bench:job-{i}" for i in range(1, per + 1)]
                n = config.python_runs * 10
                started = time.perf_counter()
                for _ in range(n):
                    key = random.choice(keys)
                    if client.set(key, "bench", nx=True, ex=3600) is not True:
                        raise HarnessError(f"redis: SET {key} NX did not take it")
                    client.delete(key)
                values.append(n / (time.perf_counter() - started))
                client.close()
            else:
                context = multiprocessing.get_context("spawn")
                start_at = time.time() + 2.0 + 0.3 * ref.clients
                end_at = start_at + config.redis_seconds
                with concurrent.futures.ProcessPoolExecutor(ref.clients, mp_context=context) as pool:
                    futures = [pool.submit(_redis_cycles, config.redis_url,
                                           [f"ledger-bench:c{c}:job-{i}" for i in range(1, per + 1)],
                                           start_at, end_at) for c in range(ref.clients)]
                    results = [f.result(timeout=config.redis_seconds + 60) for f in futures]
                late = max(arrived for _, arrived in results)
                if late > 0.05:
                    log(f"  redis: a process started {late:.2f} s into the window (machine busy)")
                values.append(sum(count for count, _ in results) / config.redis_seconds)
            log(f"  {ref.id:31} round {round_ + 1} {'redis-py':20} {values[-1]:10.1f} cycles/s")
        rows.append({"id": ref.id, "kind": "reference", "operation": ref.operation, "clients": ref.clients,
                     "jobs": config.jobs, "unit": "cycles/s", "durable": False, "client": ref.client,
                     "value": {"values": values, "median": statistics.median(values)}})
    return rows, info


# -- one whole run ----------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    began = time.perf_counter()
    wanted = set(config.only)

    def chosen(row_id: str) -> bool:
        return not wanted or row_id in wanted

    meta: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "mode": "smoke" if config.smoke else "full", "machine": machine_info()}
    conf = dataclasses.asdict(config)
    conf["admin_dsn"] = {k: v for k, v in conninfo_to_dict(config.admin_dsn).items() if k != "password"}
    meta["config"] = conf
    log(f"== ledger side-by-side benchmark ({meta['mode']}), {meta['date']}")
    machine = meta["machine"]
    log(f"machine: {machine['nproc']} cores ({machine['cpu_model']}), {machine['ram_gib']} GiB RAM, "
        f"load average {machine['load_average_start']}")
    scratch = Scratch(config)
    scratch.create()
    rows: list[dict[str, Any]] = []
    try:
        with psycopg.connect(scratch.dsn, autocommit=True) as conn:
            major = conn.info.server_version // 10000
            binary = find_pgbench(major)
            meta["software"] = software_info(conn, binary)
        software = meta["software"]
        meta["software"]["ledger_sql_sha256"] = scratch.sql_sha256
        log(f"PostgreSQL: {software['postgresql']}")
        log("settings: " + ", ".join(f"{k}={v}" for k, v in software["settings"].items()))
        log(f"{software['pgbench']}; Python {software['python']}, psycopg {software['psycopg']} "
            f"({software['psycopg_impl']}, libpq {software['libpq']}), psycopg_pool {software['psycopg_pool']}, "
            f"redis-py {software['redis_py']}")
        if software["settings"]["synchronous_commit"] != "on":
            raise HarnessError(f"synchronous_commit is {software['settings']['synchronous_commit']} in the "
                               "benchmark database, not on")
        length = f"-t {config.transactions} per client" if config.transactions else f"-T {config.duration}"
        log(f"pgbench -M prepared, {length}, {config.rounds} rounds alternated, {config.jobs} jobs")
        bench = PgBench(config, scratch, binary, machine["nproc"])
        try:
            bench.prepare()
            rows += measure_pairs(bench, [p for p in PAIRS if chosen(p.id)])
            rows += measure_pg_references(bench, [r for r in REFERENCES if r.script and chosen(r.id)])
        finally:
            bench.close()
        if any(chosen(r) for r, *_ in PYTHON_ROWS):
            rows += [r for r in measure_python(config, scratch.dsn) if chosen(r["id"])]
        redis_refs = [r for r in REFERENCES if r.script is None and chosen(r.id)]
        if redis_refs:
            redis_rows, info = measure_redis(config, redis_refs)
            rows += redis_rows
            meta["software"].update(info)
        meta["pgbench_seconds"] = round(bench.seconds, 1)
    finally:
        if not config.keep_db:
            scratch.drop()
    meta["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["seconds"] = round(time.perf_counter() - began, 1)
    order = {row_id: i for i, row_id in enumerate(ROW_IDS)}
    rows.sort(key=lambda r: order.get(r["id"], len(order)))
    return {"meta": meta, "rows": rows}


# -- output ---------------------------------------------------------------------------


def _tps(value: float) -> str:
    return f"{value:,.0f}"


def _met(row: dict[str, Any]) -> str:
    if row.get("target") is None:
        return "—"
    if row["met"]:
        return "**yes**"
    return f"no (−{row['target'] - row['ratio']:.2f})"


NOISY = 1.3  # rounds that disagree by more than this factor: flagged in the tables


def _noisy(values: list[float]) -> bool:
    return len(values) > 1 and min(values) > 0 and max(values) / min(values) > NOISY


def _per_round(row: dict[str, Any]) -> str:
    return " / ".join(f"{r:.2f}" for r in row["round_ratios"]) + (" †" if _noisy(row["round_ratios"]) else "")


def markdown(results: dict[str, Any]) -> str:
    meta, rows = results["meta"], {r["id"]: r for r in results["rows"]}
    machine, software = meta["machine"], meta.get("software", {})
    settings = software.get("settings", {})
    conf = meta["config"]
    length = (f"`-t {conf['transactions']}` per client" if conf.get("transactions")
              else f"`-T {conf['duration']}` s per side and round")
    out = [
        "## Side by side: the ledger against the raw SQL floor",
        "",
        f"Written by `make bench` (`benchmarks/run.py`) on {meta['date']}, in {meta['seconds'] / 60:.1f} min "
        f"(git `{software.get('git_commit')}`, install script sha256 `{software.get('ledger_sql_sha256')}`; "
        "the raw numbers: `benchmarks/results/latest.json`). "
        f"pgbench `-M prepared`, {length}, each pair alternated {conf['rounds']} times in one run "
        "(raw, ledger, raw, ledger), the median tps per side; ratio = ledger / raw. "
        f"{conf['jobs']:,} jobs, each client drawing a random job of its own slice; the hot job is one job "
        "that every client, each its own owner, loops start + complete on.",
        "",
        f"**A noisy machine**: a shared VM, load average {machine['load_average_start']} at the start and "
        f"{machine.get('load_average_end')} at the end (other work ran beside it). Read the ratios, whose two "
        "sides ran minutes apart on the same machine; the per-round ratios show the spread. Absolute tps are "
        "this machine's, not the ledger's.",
        "",
        f"Machine: {machine['nproc']} cores, {machine['cpu_model']}, {machine['ram_gib']} GiB RAM, Linux "
        f"{machine['kernel']}. PostgreSQL {software.get('server_version', '')}; `shared_buffers = {settings.get('shared_buffers')}`, "
        f"`synchronous_commit = {settings.get('synchronous_commit')}`, `fsync = {settings.get('fsync')}`, "
        f"`wal_level = {settings.get('wal_level')}`, `full_page_writes = {settings.get('full_page_writes')}`, "
        f"`wal_sync_method = {settings.get('wal_sync_method')}`. {software.get('pgbench')}; Python "
        f"{software.get('python')}, psycopg {software.get('psycopg')} ({software.get('psycopg_impl')}), "
        f"psycopg_pool {software.get('psycopg_pool')}, redis-py {software.get('redis_py')}, Redis "
        f"{software.get('redis_server', '—')}.",
        "",
        "The ceiling is the raw floor's very statements, each in a PL/pgSQL `SECURITY DEFINER` function "
        "with a fixed `search_path` (`bench_ceil` in `benchmarks/pgbench/setup.sql`), the kind of function "
        "the ledger's API is: ceiling/raw is what the wrapper alone costs, ledger/ceiling what the ledger's "
        "own work around the statements costs.",
        "",
        "| operation | clients | raw floor (tps) | ceiling (tps) | ledger (tps) | ratio ledger/raw | "
        "ceiling/raw | ledger/ceiling | per round | at the issue | target | met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for pair in PAIRS:
        row = rows.get(pair.id)
        if row is None:
            continue
        then = f"{row['issue_ratio']:.2f}" if row["issue_ratio"] is not None else "—"
        target = f"≥ {row['target']}" if row["target"] is not None else "—"
        jobs = "1 hot job" if pair.hot else f"{row['jobs']:,} jobs"
        ceiling = row.get("ceiling")
        if ceiling:
            ceiling_cells = (f"{_tps(ceiling['median'])} | {_tps(row['ledger']['median'])} | **{row['ratio']:.2f}** | "
                             f"{row['ceiling_ratio']:.2f} | {row['ratio_to_ceiling']:.2f}")
        else:  # a results file written before the ceiling was measured
            ceiling_cells = f"— | {_tps(row['ledger']['median'])} | **{row['ratio']:.2f}** | — | —"
        out.append(f"| {row['operation']}, {jobs} | {row['clients']} | {_tps(row['raw']['median'])} | "
                   f"{ceiling_cells} | {_per_round(row)} | {then} | {target} | {_met(row)} |")
    dagger = (f"† its rounds disagree by more than {NOISY - 1:.0%} (the machine was busy then): rerun that row "
              "(`--only ROW`) before reading much into it.")
    if any(_noisy(r["round_ratios"]) for r in rows.values() if r["kind"] == "pair"):
        out += ["", dagger]
    hot = rows.get("hot-8")
    if hot:
        shares = {side: [r.get("started_share") for r in hot[side]["runs"] if r.get("started_share") is not None]
                  for side in ("raw", "ledger")}
        if shares["raw"] and shares["ledger"]:
            out += ["", f"The hot job's loops that started a run: {statistics.median(shares['raw']):.0%} (raw), "
                        f"{statistics.median(shares['ledger']):.0%} (ledger); the rest are skips."]
    out += ["", "### The Python client (one connection, ms per run cycle)", "",
            "| operation | raw psycopg (ms/run) | ledger (ms/run) | ratio raw/ledger | per round | at the issue | "
            "target | met |",
            "|---|---:|---:|---:|---|---:|---:|---|"]
    for row_id, *_ in PYTHON_ROWS:
        row = rows.get(row_id)
        if row is None:
            continue
        out.append(f"| {row['operation']} | {row['raw']['median']:.2f} | {row['ledger']['median']:.2f} | "
                   f"**{row['ratio']:.2f}** | {_per_round(row)} | {row['issue_ratio']:.2f} | ≥ {row['target']} | "
                   f"{_met(row)} |")
    if any(rows.get(r) for r, *_ in PYTHON_ROWS):
        some = next(rows[r] for r, *_ in PYTHON_ROWS if r in rows)
        out += ["", f"{some['runs_per_round']} runs per side and round, alternated {conf['rounds']} times; raw "
                    "psycopg calls `ledger.start_run` then `ledger.complete_run` over the same connection "
                    "(psycopg's default `prepare_threshold`)."]
    if any(_noisy(r["round_ratios"]) for r in rows.values() if r["kind"] == "python"):
        out += ["", dagger]
    cycle = {c: rows[f"cycle-{c}"]["ledger"]["median"] for c in (1, 8) if f"cycle-{c}" in rows}
    out += ["", "### References (lock + unlock cycles per second, median (min–max of the rounds); not the ledger's "
                "guarantees)", "",
            "| reference | client | durable | 1 client | 8 clients | ledger start + complete ÷ this (1 / 8) |",
            "|---|---|---|---:|---:|---|"]
    seen = set()
    for ref in REFERENCES:
        if ref.operation in seen:
            continue
        seen.add(ref.operation)
        pair = [rows.get(r.id) for r in REFERENCES if r.operation == ref.operation]
        cells, ratios = [], []
        for clients, row in zip((1, 8), pair):
            if row is None or "value" not in row:
                cells.append("skipped" if row and row.get("skipped") else "—")
                ratios.append("—")
                continue
            values = row["value"]["values"]
            spread = f" ({_tps(min(values))}–{_tps(max(values))})" if len(values) > 1 else ""
            cells.append(_tps(row["value"]["median"]) + spread + (" †" if _noisy(values) else ""))
            ratios.append(f"{cycle[clients] / row['value']['median']:.2f}" if clients in cycle else "—")
        durable = "yes" if ref.durable else "**no** (non-durable)"
        client = ref.client.split(",")[0]
        out.append(f"| {ref.operation} | {client} | {durable} | {cells[0]} | {cells[1]} | {' / '.join(ratios)} |")
    skipped = [r["skipped"] for r in results["rows"] if r.get("skipped")]
    persistence = ", ".join(f"{k} {v!r}" if v == "" else f"{k} {v}"
                            for k, v in software.get("persistence", {}).items()) or "—"
    out += ["", "ShedLock and the advisory lock run as pgbench scripts like the rows above; Redis through "
                "redis-py (1 process; 8 processes), so its numbers include Python's cost per command. "
                "The advisory lock writes nothing and vanishes with its session; Redis keeps the key in memory "
                f"(its persistence here: {persistence}), so neither survives a crash the way a "
                "committed token does."
                + (f" Skipped: {skipped[0]}." if skipped else "")
                + (" " + dagger if any(_noisy(r["value"]["values"]) for r in rows.values() if "value" in r)
                   else "")]
    out += ["", "The chart of these ratios against their targets: `docs/images/bench-ratios.png` (written by the "
                "same run).", "",
            "### How to reproduce", "",
            "```sh",
            "make bench                     # full: a few minutes; writes this section, the chart and "
            "benchmarks/results/latest.json",
            "make bench BENCH_DURATION=30   # longer pgbench runs per side (BENCH_ROUNDS, BENCH_JOBS too)",
            "make bench-smoke               # seconds: every script runs once, nothing written here",
            ".venv/bin/python benchmarks/run.py --only acquire-1,acquire-8 --no-write   # a few rows",
            ".venv/bin/python benchmarks/run.py --render benchmarks/results/latest.json  # re-render, no measuring",
            "```",
            "",
            "The server is the one `LEDGER_BENCH_DSN` names (default `host=127.0.0.1 user=postgres "
            "dbname=postgres`; Redis: `LEDGER_BENCH_REDIS`, default the local one). The harness creates the "
            "scratch database `ledger_bench` afresh, installs the ledger as a psql user does "
            "(`python -m ledger sql | psql`), runs `benchmarks/pgbench/setup.sql` (the raw tables, 10,000 jobs), "
            "and drops it at the end (`--keep-db` keeps it, for profiling). Each pgbench run starts after a "
            "`CHECKPOINT`. The scripts, one per side, are in `benchmarks/pgbench/`."]
    return "\n".join(out) + "\n"


def write_markdown(path: Path, section: str) -> None:
    """Replace what lies between the markers (appended at the end when missing); the rest stays as it is."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{MARK_START}\n{section}{MARK_END}"
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        _, tail = rest.split(MARK_END, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def chart(results: dict[str, Any], path: Path) -> bool:
    """A PNG of the ratios against their targets; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results["rows"] if r["kind"] in ("pair", "python")]
    if not rows:
        return False
    labels = [f"{r['id']}" for r in rows]
    ratios = [r["ratio"] for r in rows]
    colors = ["#9e9e9e" if r["target"] is None else ("#2e7d32" if r["met"] else "#c62828") for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6), dpi=110)
    y = list(range(len(rows)))[::-1]
    ax.barh(y, ratios, color=colors, height=0.6, zorder=2)
    for yi, row in zip(y, rows):
        for r in row["round_ratios"]:
            ax.plot(r, yi, marker="|", color="black", markersize=9, zorder=3)
        if row["target"] is not None:
            ax.plot(row["target"], yi, marker="D", color="black", markersize=6, zorder=4)
        if row.get("issue_ratio") is not None:
            ax.plot(row["issue_ratio"], yi, marker="o", markerfacecolor="none", markeredgecolor="#555555",
                    markersize=6, zorder=4)
        right = max([row["ratio"], *row["round_ratios"], row["target"] or 0, row.get("issue_ratio") or 0])
        ax.text(right + 0.03, yi, f"{row['ratio']:.2f}", va="center", fontsize=8, zorder=5)
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=9)
    ax.axvline(1.0, color="#444444", linewidth=0.8, linestyle="--", zorder=1)
    ax.set_xlim(0, max(1.1, max(max([r["ratio"], *r["round_ratios"]]) for r in rows) + 0.2))
    ax.set_xlabel("ledger / raw floor (throughput; 1.0 = as fast as the raw SQL)")
    meta = results["meta"]
    ax.set_title(f"pg-job-ledger vs raw floor, {meta['date']}, {meta['machine']['nproc']} cores "
                 f"(bars: median; |: each round; ◆: target; ○: at the issue)", fontsize=9)
    ax.grid(axis="x", color="#dddddd", zorder=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
