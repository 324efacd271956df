"""The Python client against raw psycopg: one run at a time, and 100 concurrent runs over a pool of 10 (issue 24, point 4).

    .venv/bin/python benchmarks/bench_client.py                       # both parts, 5 rounds
    .venv/bin/python benchmarks/bench_client.py --part serial --runs 300 --rounds 5
    .venv/bin/python benchmarks/bench_client.py --part concurrent --threads 100 --pool 10 --cycles 20
    .venv/bin/python benchmarks/bench_client.py --profile conn        # cProfile of 500 runs of one side
    .venv/bin/python benchmarks/bench_client.py --smoke               # the script runs; no timing

One run at a time (``serial``), one connection, alternated side by side in
every round, ms per run cycle (start + complete, nothing in between):

- ``raw``: raw psycopg over one connection calling ``ledger.start_run`` and
  ``ledger.complete_run`` (psycopg's default ``prepare_threshold``, 5: what
  ``make bench`` compares against);
- ``raw-unprepared``: the same with ``prepare_threshold=None``, which is what
  the ledger's own connections use (they must work behind PgBouncer in
  transaction mode);
- ``raw-bounded``: raw psycopg sending what the client sends, through the
  client's own helper (``ledger.connect.execute_bounded``: the statement timeout's
  ``set_config`` and the call as one simple-protocol query, client-side
  binding, ``ledger.queries.START_RUN`` / ``COMPLETE_RUN``), on an unprepared
  connection: the client's statements without its context;
- ``conn``: ``with ledger.run(job)`` over ``Ledger(conn)``, the caller's
  connection (psycopg's default threshold);
- ``pool``: ``with ledger.run(job)`` over ``Ledger(dsn)``, the client's own pool.

100 concurrent runs over a pool of 10 (``concurrent``): ``--threads`` threads
(or asyncio tasks), each looping ``--cycles`` start + complete cycles on a job
of its own, all sharing one pool of ``--pool`` connections; runs per second
over the whole batch (wall clock), alternated side by side:

- ``raw-pool``: a ``psycopg_pool.ConnectionPool(min_size = max_size = pool)``,
  each call borrowing a connection and giving it back (what the client does);
- ``ledger-pool``: ``Ledger(dsn, pool_kwargs={"min_size": pool, "max_size": pool})``,
  ``with ledger.run(job)`` in each thread;
- ``raw-apool`` / ``ledger-apool``: the same with ``AsyncConnectionPool`` and
  ``AsyncLedger``, one task per run.

The ttl is one hour, so no heartbeat is due during a run: the cycle is the
client's start and end. Builds the scratch database ``ledger_bench_client`` on
the server ``LEDGER_BENCH_DSN`` names, installs the ledger as a psql user does,
drops the database at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import json
import os
import pstats
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool

ROOT = Path(__file__).resolve().parent.parent
ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
DB = "ledger_bench_client"
TTL = dt.timedelta(hours=1)
START = "SELECT run_id, token FROM ledger.start_run(%s, %s, %s)"
END = "SELECT status FROM ledger.complete_run(%s, %s)"


def install(admin_dsn: str, dsn: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    script = subprocess.run([sys.executable, "-m", "ledger", "sql"], capture_output=True, text=True,
                            check=True, cwd=ROOT).stdout
    done = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", dsn], input=script,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])


def raw_cycle(conn: psycopg.Connection[Any], job: str) -> None:
    row = conn.execute(START, (job, "bench-py", TTL)).fetchone()
    if row is None or row[0] is None:
        raise SystemExit(f"raw psycopg: start_run({job}) did not start")
    conn.execute(END, row).fetchone()


def bounded_cycle(conn: psycopg.Connection[Any], job: str) -> None:
    from psycopg.rows import tuple_row

    from ledger import queries
    from ledger.connect import execute_bounded

    rows = execute_bounded(conn, queries.START_RUN, {"job": job, "owner": "bench-py", "ttl": TTL, "slot": None,
                                                     "idempotency_key": None, "detail": None}, tuple_row, 10.0)
    if not rows or rows[0][1] is None:
        raise SystemExit(f"raw-bounded: start_run({job}) did not start")
    execute_bounded(conn, queries.COMPLETE_RUN, {"run_id": rows[0][1], "token": rows[0][2], "detail": None},
                    tuple_row, 10.0)


def serial_sides(dsn: str) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    from ledger import Ledger

    prepared = psycopg.connect(dsn, autocommit=True)
    unprepared = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
    caller = psycopg.connect(dsn, autocommit=True)
    over_conn = Ledger(caller, owner="bench-py")
    over_pool = Ledger(dsn, owner="bench-py")

    def context(ledger: Ledger, job: str) -> Callable[[], None]:
        def cycle() -> None:
            with ledger.run(job, ttl=TTL) as run:
                if not run.started:
                    raise SystemExit(f"ledger.run({job!r}) did not start: {run.outcome}")
        return cycle

    sides = {"raw": lambda: raw_cycle(prepared, "py-raw"),
             "raw-unprepared": lambda: raw_cycle(unprepared, "py-raw-unprepared"),
             "raw-bounded": lambda: bounded_cycle(unprepared, "py-raw-bounded"),
             "conn": context(over_conn, "py-conn"),
             "pool": context(over_pool, "py-pool")}

    def close() -> None:
        over_pool.close()
        over_conn.close()
        for c in (prepared, unprepared, caller):
            c.close()
    return sides, close


def serial(dsn: str, runs: int, rounds: int) -> dict:
    sides, close = serial_sides(dsn)
    ms: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for fn in sides.values():  # warm up: connections, prepared statements, the pool
            for _ in range(10):
                fn()
        for rnd in range(rounds):
            order = list(sides.items())
            if rnd % 2:
                order.reverse()
            for name, fn in order:
                started, cpu_started = time.perf_counter(), time.process_time()
                for _ in range(runs):
                    fn()
                ms[name].append((time.perf_counter() - started) / runs * 1e3)
                cpu[name].append((time.process_time() - cpu_started) / runs * 1e3)
            print(f"serial round {rnd + 1}: " + ", ".join(f"{n} {ms[n][-1]:.3f}" for n in sides),
                  file=sys.stderr, flush=True)
    finally:
        close()
    out: dict = {"runs_per_round": runs, "rounds": rounds, "ms_per_run": ms, "client_cpu_ms_per_run": cpu,
                 "median_ms": {n: statistics.median(v) for n, v in ms.items()},
                 "median_cpu_ms": {n: statistics.median(v) for n, v in cpu.items()}}
    out["ratios"] = {f"raw/{n}": {"median_of_rounds": statistics.median(a / b for a, b in zip(ms["raw"], ms[n])),
                                  "per_round": [round(a / b, 3) for a, b in zip(ms["raw"], ms[n])]}
                     for n in ("conn", "pool", "raw-unprepared", "raw-bounded")}
    out["ratios"].update({f"raw-unprepared/{n}": {
        "median_of_rounds": statistics.median(a / b for a, b in zip(ms["raw-unprepared"], ms[n])),
        "per_round": [round(a / b, 3) for a, b in zip(ms["raw-unprepared"], ms[n])]} for n in ("conn", "pool")})
    out["ratios"].update({f"raw-bounded/{n}": {
        "median_of_rounds": statistics.median(a / b for a, b in zip(ms["raw-bounded"], ms[n])),
        "per_round": [round(a / b, 3) for a, b in zip(ms["raw-bounded"], ms[n])]} for n in ("conn", "pool")})
    return out


def _threads(n: int, body: Callable[[int], None]) -> float:
    barrier = threading.Barrier(n + 1)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            body(i)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def concurrent(dsn: str, threads: int, pool_size: int, cycles: int, rounds: int) -> dict:
    from ledger import AsyncLedger, Ledger

    def raw_pool() -> float:
        with ConnectionPool(dsn, min_size=pool_size, max_size=pool_size, open=True,
                            kwargs={"autocommit": True}) as pool:
            pool.wait()

            def body(i: int) -> None:
                job = f"cc-raw-{i}"
                for _ in range(cycles):
                    with pool.connection() as c:
                        row = c.execute(START, (job, "bench-py", TTL)).fetchone()
                    assert row is not None and row[0] is not None
                    with pool.connection() as c:
                        c.execute(END, row).fetchone()
            return _threads(threads, body)

    def ledger_pool() -> float:
        ledger = Ledger(dsn, owner="bench-py", pool_kwargs={"min_size": pool_size, "max_size": pool_size})
        try:
            ledger.open()
            ledger._pool.wait()  # type: ignore[union-attr]

            def body(i: int) -> None:
                job = f"cc-ledger-{i}"
                for _ in range(cycles):
                    with ledger.run(job, ttl=TTL) as run:
                        assert run.started, run.outcome
            return _threads(threads, body)
        finally:
            ledger.close()

    async def araw() -> float:
        async with AsyncConnectionPool(dsn, min_size=pool_size, max_size=pool_size, open=False,
                                       kwargs={"autocommit": True}) as pool:
            await pool.wait()

            async def body(i: int) -> None:
                job = f"cc-araw-{i}"
                for _ in range(cycles):
                    async with pool.connection() as c:
                        row = await (await c.execute(START, (job, "bench-py", TTL))).fetchone()
                    assert row is not None and row[0] is not None
                    async with pool.connection() as c:
                        await (await c.execute(END, row)).fetchone()
            started = time.perf_counter()
            await asyncio.gather(*(body(i) for i in range(threads)))
            return time.perf_counter() - started

    async def aledger() -> float:
        ledger = AsyncLedger(dsn, owner="bench-py", pool_kwargs={"min_size": pool_size, "max_size": pool_size})
        try:
            await ledger.open()
            await ledger._pool.wait()  # type: ignore[union-attr]

            async def body(i: int) -> None:
                job = f"cc-aledger-{i}"
                for _ in range(cycles):
                    async with ledger.run(job, ttl=TTL) as run:
                        assert run.started, run.outcome
            started = time.perf_counter()
            await asyncio.gather(*(body(i) for i in range(threads)))
            return time.perf_counter() - started
        finally:
            await ledger.close()

    sides: dict[str, Callable[[], float]] = {"raw-pool": raw_pool, "ledger-pool": ledger_pool,
                                             "raw-apool": lambda: asyncio.run(araw()),
                                             "ledger-apool": lambda: asyncio.run(aledger())}
    total = threads * cycles
    rps: dict[str, list[float]] = {n: [] for n in sides}
    for rnd in range(rounds):
        order = list(sides.items())
        if rnd % 2:
            order.reverse()
        for name, fn in order:
            rps[name].append(total / fn())
        print(f"concurrent round {rnd + 1}: " + ", ".join(f"{n} {rps[n][-1]:.0f}/s" for n in sides),
              file=sys.stderr, flush=True)
    out: dict = {"threads": threads, "pool": pool_size, "cycles_per_thread": cycles, "rounds": rounds,
                 "runs_per_second": rps, "median": {n: statistics.median(v) for n, v in rps.items()}}
    out["ratios"] = {
        "ledger-pool/raw-pool": {"median_of_rounds": statistics.median(
            b / a for a, b in zip(rps["raw-pool"], rps["ledger-pool"])),
            "per_round": [round(b / a, 3) for a, b in zip(rps["raw-pool"], rps["ledger-pool"])]},
        "ledger-apool/raw-apool": {"median_of_rounds": statistics.median(
            b / a for a, b in zip(rps["raw-apool"], rps["ledger-apool"])),
            "per_round": [round(b / a, 3) for a, b in zip(rps["raw-apool"], rps["ledger-apool"])]}}
    return out


def profile(dsn: str, side: str, runs: int) -> None:
    sides, close = serial_sides(dsn)
    try:
        for _ in range(20):
            sides[side]()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(runs):
            sides[side]()
        prof.disable()
    finally:
        close()
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--part", choices=["serial", "concurrent", "both"], default="both")
    parser.add_argument("--runs", type=int, default=300, help="serial: runs per side and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=100)
    parser.add_argument("--pool", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=20, help="concurrent: cycles per thread (task)")
    parser.add_argument("--profile", choices=["raw", "raw-unprepared", "raw-bounded", "conn", "pool"],
                        help="cProfile --runs runs of one serial side instead")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="a few runs of each side; no timing worth reading")
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--dsn", default=ADMIN_DSN, help="an admin conninfo on the server (LEDGER_BENCH_DSN)")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.rounds, args.threads, args.pool, args.cycles = 3, 1, 4, 2, 2
    dsn = make_conninfo(args.dsn, dbname=DB)
    install(args.dsn, dsn)
    try:
        if args.profile:
            profile(dsn, args.profile, args.runs)
            return 0
        with psycopg.connect(dsn) as conn:
            meta = {"at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "loadavg_start": os.getloadavg(),
                    "server": conn.execute("SHOW server_version").fetchone()[0],  # type: ignore[index]
                    "synchronous_commit": conn.execute("SHOW synchronous_commit").fetchone()[0]}  # type: ignore[index]
        out: dict = {"meta": meta}
        if args.part in ("serial", "both"):
            out["serial"] = serial(dsn, args.runs, args.rounds)
        if args.part in ("concurrent", "both"):
            out["concurrent"] = concurrent(dsn, args.threads, args.pool, args.cycles, args.rounds)
        meta["loadavg_end"] = os.getloadavg()
        with psycopg.connect(dsn) as conn:
            bad = conn.execute("SELECT (SELECT count(*) FROM ledger.overlaps) + (SELECT count(*) FROM"
                               " ledger.job_execution_log WHERE status <> 'success')").fetchone()[0]  # type: ignore[index]
        if bad:
            raise SystemExit(f"{bad} runs not ended in success, or overlaps")
        text = json.dumps(out, indent=1)
        print(text)
        if args.json:
            Path(args.json).write_text(text)
    finally:
        if not args.keep_db:
            with psycopg.connect(args.dsn, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
