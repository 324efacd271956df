"""Where the hot path's time goes: per statement, per function, and WAL per call.

For each hot-path call (acquire, start_run + complete_run, heartbeat,
start_run + fail_run, fence, start_due_run + complete_run) it runs a warm-up,
then N calls with plprofiler on (``pl_profiler_linestats_local``: time per
PL/pgSQL statement, callees included; ``pl_profiler_callgraph_local``: self
time per function), and N calls more with it off to count the WAL bytes and
records per call (``pg_current_wal_lsn()`` before and after) against the raw
floor's statements (benchmarks/pgbench/raw_*.sql) on the same database.

    PYTHONPATH=. .venv/bin/python benchmarks/profile_hotpath.py [--calls 2000] [--jobs 1000]

The scratch database (``ledger_prof_<pid>``) is created afresh with
benchmarks/pgbench/setup.sql and dropped at the end. Needs the plprofiler
extension on the server (Debian: postgresql-15-plprofiler) and a superuser
DSN (LEDGER_BENCH_DSN). Times under the profiler are inflated by it (a clock
read per statement); read them as shares, not as absolute costs.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import psycopg

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")


def _psql(dsn: str, *, script: str | None = None, file: Path | None = None, jobs: int = 0) -> None:
    cmd = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", f"jobs={jobs}", "-d", dsn]
    cmd += ["-f", str(file)] if file else []
    subprocess.run(cmd, input=script, text=True, check=True, capture_output=True)


def _setup(admin: str, name: str, jobs: int) -> str:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = admin.replace("dbname=postgres", f"dbname={name}")
    if f"dbname={name}" not in dsn:
        dsn += f" dbname={name}"
    script = subprocess.run([sys.executable, "-m", "ledger", "sql"], text=True, check=True,
                            capture_output=True, cwd=ROOT).stdout
    _psql(dsn, script=script)
    _psql(dsn, file=HERE / "pgbench" / "setup.sql", jobs=jobs)
    _psql(dsn, script=(
        "CREATE EXTENSION plprofiler;\n"
        "SELECT ledger.register_job('due-' || i, schedule => '100 milliseconds', ttl => interval '1 hour')"
        f"  FROM generate_series(1, {jobs}) i;\n"))
    return dsn


class Q:
    """Runs an operation's statements: plainly, or each under EXPLAIN (ANALYZE, WAL) to sum the WAL it
    writes (the server's own count for this backend: other sessions' WAL does not show; the COMMIT
    record of each autocommitted statement, some 40 bytes, does not either)."""

    def __init__(self, conn: psycopg.Connection[Any], wal: bool = False) -> None:
        self.conn, self.wal = conn, wal
        self.records = self.fpi = self.bytes = 0

    def call(self, sql: str, params: tuple[Any, ...] = (), then: str | None = None,
             then_params: tuple[Any, ...] | None = None) -> Any:
        if not self.wal:
            return self.conn.execute(sql, params).fetchone()
        plan = self.conn.execute("EXPLAIN (ANALYZE, WAL, TIMING OFF, FORMAT JSON) " + sql,
                                 params).fetchone()[0][0]["Plan"]  # type: ignore[index]
        self.records += plan.get("WAL Records", 0)
        self.fpi += plan.get("WAL FPI", 0)
        self.bytes += plan.get("WAL Bytes", 0)
        if then is None:
            return None
        return self.conn.execute(then, then_params if then_params is not None else params).fetchone()


Op = Callable[[Q, int], None]

_STATE = "SELECT running_run_id, running_token FROM ledger.counters WHERE job = %s"
_RAW_RUN = "SELECT run_id, token FROM bench_raw.runs ORDER BY run_id DESC LIMIT 1"


def _ops(jobs: int) -> dict[str, tuple[Op, Op | None]]:
    """Each operation, and the raw floor's statements for the same work (or None)."""

    def acquire(q: Q, i: int) -> None:
        q.call("SELECT token FROM ledger.acquire(%s, 'bench', interval '1 hour')", (f"job-{i % jobs + 1}",))

    def _cycle(end: str) -> Op:
        def op(q: Q, i: int) -> None:
            job = f"job-{i % jobs + 1}"
            run_id, token = q.call("SELECT run_id, token FROM ledger.start_run(%s, 'bench', interval '1 hour')",
                                   (job,), then=_STATE)
            q.call(end, (run_id, token))
        return op

    started: dict[str, tuple[int, int]] = {}

    def heartbeat(q: Q, i: int) -> None:
        job = f"job-{i % 50 + 1}"
        if job not in started:
            started[job] = q.conn.execute("SELECT run_id, token FROM ledger.start_run(%s, 'bench', interval '1 hour')",
                                          (job,)).fetchone()  # type: ignore[assignment]
        q.call("SELECT ledger.heartbeat(%s, %s)", started[job])

    def fence(q: Q, i: int) -> None:
        j = i % jobs + 1
        with q.conn.transaction():
            token = q.conn.execute("SELECT token FROM ledger.leases WHERE job = %s", (f"fence-{j}",)).fetchone()
            q.call("SELECT ledger.fence(%s, %s, %s)", (f"fence-{j}", f"res-{j}", token[0]))  # type: ignore[index]
            q.call("INSERT INTO bench_app.writes (job, payload) VALUES (%s, 'payload') RETURNING id", (j,))

    def due(q: Q, i: int) -> None:
        job = f"due-{i % jobs + 1}"
        row = q.call("SELECT run_id, token FROM ledger.start_due_run(%s, 'bench')", (job,), then=_STATE)
        if row and row[0] is not None:
            q.call("SELECT status FROM ledger.complete_run(%s, %s)", (row[0], row[1]))

    def raw_acquire(q: Q, i: int) -> None:
        q.call("UPDATE bench_raw.leases SET owner = 'bench', token = token + 1, acquired_at = clock_timestamp(), "
               "expires_at = clock_timestamp() + interval '1 hour' WHERE job = %s "
               "AND (expires_at <= clock_timestamp() OR owner = 'bench') RETURNING token", (f"job-{i % jobs + 1}",))

    def raw_cycle(q: Q, i: int) -> None:
        run_id, token = q.call(
            "WITH l AS (UPDATE bench_raw.leases SET owner = 'bench', token = token + 1, "
            "acquired_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 hour' "
            "WHERE job = %s AND (expires_at <= clock_timestamp() OR owner = 'bench') RETURNING job, owner, token) "
            "INSERT INTO bench_raw.runs (job, owner, token, status, started_at) "
            "SELECT job, owner, token, 'running', clock_timestamp() FROM l RETURNING run_id, token",
            (f"job-{i % jobs + 1}",), then=_RAW_RUN, then_params=())
        q.call("WITH r AS (UPDATE bench_raw.runs SET status = 'success', ended_at = clock_timestamp() "
               "WHERE run_id = %s AND token = %s AND status = 'running' RETURNING job, token) "
               "UPDATE bench_raw.leases l SET expires_at = clock_timestamp() FROM r "
               "WHERE l.job = r.job AND l.token = r.token RETURNING l.token", (run_id, token))

    def raw_insert(q: Q, i: int) -> None:
        with q.conn.transaction():
            q.call("INSERT INTO bench_app.writes (job, payload) VALUES (%s, 'payload') RETURNING id", (i % jobs + 1,))

    return {
        "acquire": (acquire, raw_acquire),
        "start_run + complete_run": (_cycle("SELECT status FROM ledger.complete_run(%s, %s)"), raw_cycle),
        "start_run + fail_run": (_cycle("SELECT status FROM ledger.fail_run(%s, %s, 'boom')"), raw_cycle),
        "heartbeat": (heartbeat, None),
        "fence (+ INSERT)": (fence, raw_insert),
        "start_due_run + complete_run": (due, raw_cycle),
    }


def _wal(conn: psycopg.Connection[Any], op: Op, calls: int, start: int) -> tuple[float, float, float, float]:
    """WAL bytes, records and full-page images per call, and ms per call (no EXPLAIN)."""
    q = Q(conn, wal=True)
    for i in range(start, start + calls):
        op(q, i)
    plain = Q(conn)
    t0 = time.perf_counter()
    for i in range(start, start + calls):
        op(plain, i)
    elapsed = time.perf_counter() - t0
    return q.bytes / calls, q.records / calls, q.fpi / calls, elapsed * 1000 / calls


def _profile(dsn: str, op: Op, calls: int) -> None:
    # A fresh session with the profiler on from its first call: a function
    # first run while it is off is never profiled in that session.
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        conn.execute("LOAD 'plprofiler'")
        conn.execute("SELECT pl_profiler_set_enabled_local(true)")
        q = Q(conn)
        for i in range(200):
            op(q, i + 5000)
        conn.execute("SELECT pl_profiler_reset_local()")
        for i in range(calls):
            op(q, i)
        conn.execute("SELECT pl_profiler_set_enabled_local(false)")
        _report(conn, calls)


def _report(conn: psycopg.Connection[Any], calls: int) -> None:
    names = {oid: name for oid, name in conn.execute(
        "SELECT p.oid, p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'ledger'")}
    # self time per function (the call graph's us_self, summed over stacks)
    selfs: dict[str, float] = defaultdict(float)
    total_top = 0.0
    for stack, _count, us_total, _children, us_self in conn.execute(
            "SELECT stack, call_count, us_total, us_children, us_self FROM pl_profiler_callgraph_local()"):
        selfs[names.get(stack[-1], str(stack[-1]))] += us_self
        if len(stack) == 1:
            total_top += us_total
    if not total_top:
        print("    (nothing profiled)")
        return
    print(f"    in PL/pgSQL: {total_top / calls:.0f} µs per call (under the profiler)")
    print("    self time by function:", ", ".join(
        f"{name} {100 * us / total_top:.0f}%" for name, us in sorted(selfs.items(), key=lambda kv: -kv[1])[:8]))
    # statements: the lines of ledger functions, callees included in a line's time
    source = {(oid, line): text for oid, line, text in conn.execute(
        "SELECT func_oid, line_number, source FROM pl_profiler_funcs_source(pl_profiler_func_oids_local())")}
    rows = conn.execute("SELECT func_oid, line_number, exec_count, total_time FROM pl_profiler_linestats_local() "
                        "WHERE line_number > 0 AND exec_count > 0 ORDER BY total_time DESC").fetchall()
    print("    statements (time incl. callees, share of the PL/pgSQL time; executions per call):")
    for oid, line, count, us in rows[:16]:
        text = " ".join((source.get((oid, line)) or "").split())[:90]
        print(f"      {100 * us / total_top:5.1f}%  {count / calls:4.2f}x  {names.get(oid, oid)}:{line}  {text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--only", default="", help="comma-separated operation names")
    parser.add_argument("--dsn", default=ADMIN_DSN)
    args = parser.parse_args()
    name = f"ledger_prof_{os.getpid()}"
    dsn = _setup(args.dsn, name, args.jobs)
    try:
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
            for label, (op, raw) in _ops(args.jobs).items():
                if args.only and label.split()[0] not in args.only.split(","):
                    continue
                print(f"== {label}")
                for i in range(200):
                    op(Q(conn), i)
                wal, recs, fpi, ms = _wal(conn, op, args.calls, random.randint(0, args.jobs))
                line = f"    WAL per call: {wal:.0f} bytes, {recs:.1f} records ({fpi:.2f} FPI), {ms:.3f} ms"
                if raw is not None:
                    for i in range(200):
                        raw(Q(conn), i)
                    rwal, rrecs, rfpi, rms = _wal(conn, raw, args.calls, random.randint(0, args.jobs))
                    line += (f"; raw floor {rwal:.0f} bytes, {rrecs:.1f} records ({rfpi:.2f} FPI), {rms:.3f} ms "
                             f"(WAL bytes {wal / rwal:.2f}x)")
                print(line, flush=True)
                _profile(dsn, op, args.calls)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
