"""What not preparing costs on the hot path: prepare_threshold=5 (psycopg's default) against None.

    .venv/bin/python benchmarks/bench_prepare.py [--calls N] [--rounds R]

The connections the ledger opens say ``prepare_threshold=None`` (nothing is
prepared, so they work behind PgBouncer in transaction mode). This measures
what that costs, over one connection each, alternated ``--rounds`` times so
that both settings see the same machine:

1. ``Ledger(conn).start_run`` + ``complete_run`` (the plain client calls),
   with the connection's threshold 5 (prepared after 5 executions) and None;
   and the same two statements through psycopg directly.
2. The same two statements as a context's own connection sends them: one
   simple-protocol query string with the call's ``statement_timeout``
   (``ledger.connect.execute_bounded``), against the plain extended-protocol
   call, unprepared (``execute_own``, threshold None): the cost of the bound.
3. A whole ``with ledger.run(...)`` over a pool (start, end, heartbeat
   thread, watchdog thread), for scale.

Uses a scratch database on the server named by LEDGER_BENCH_DSN (default
the local postgres), dropped at the end. Microseconds per cycle: the best
of 5 timings per round, then the best over the rounds; and the medians of
single cycles run interleaved (A, B, A, B, ...), which a busy machine
disturbs least. Compare the ratios within one run, not absolute numbers
across machines. Each start_run commits a new token (flushed to WAL), so
the commit is most of a cycle: the ratio is what preparing saves of a whole
call, not of its parse.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import class_row, dict_row
from psycopg_pool import ConnectionPool

from ledger import Ledger, queries
from ledger.client import execute_own
from ledger.connect import execute_bounded
from ledger.models import Run
from ledger.resources import install_sql

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")


def timed(fn: Callable[[int], None], calls: int, repeats: int = 5) -> float:
    """Best-of-`repeats` microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


def client_cycle(conn: psycopg.Connection[Any], job: str) -> Callable[[int], None]:
    ledger = Ledger(conn, owner="bench")

    def cycle(_: int) -> None:
        start = ledger.start_run(job, ttl=timedelta(hours=1))
        assert start.run_id is not None and start.token is not None
        ledger.complete_run(start.run_id, start.token)

    return cycle


def statement_cycle(conn: psycopg.Connection[Any], job: str, bounded: bool) -> Callable[[int], None]:
    def call(query: str, params: dict[str, Any], row_factory: Any) -> list[Any]:
        if bounded:
            return execute_bounded(conn, query, params, row_factory, 10.0)
        return execute_own(conn, query, params, row_factory)

    def cycle(_: int) -> None:
        params = {"job": job, "owner": "bench", "ttl": timedelta(hours=1), "slot": None,
                  "idempotency_key": None, "detail": None}
        start = call(queries.START_RUN, params, dict_row)[0]
        call(queries.COMPLETE_RUN, {"run_id": start["run_id"], "token": start["token"], "detail": None},
             class_row(Run))

    return cycle


def context_cycle(ledger: Ledger, job: str) -> Callable[[int], None]:
    def cycle(_: int) -> None:
        with ledger.run(job, ttl=timedelta(hours=1)) as run:
            assert run.started

    return cycle


def compare(title: str, make: Callable[[str], tuple[Callable[[int], None], Callable[[int], None]]],
            calls: int, rounds: int) -> None:
    """A against B: per round, best of 5 timings of each (A then B), and per-cycle medians interleaved A, B, A, B."""
    first, second = make("x")
    best_a: list[float] = []
    best_b: list[float] = []
    cycles_a: list[float] = []
    cycles_b: list[float] = []
    for _ in range(rounds):
        best_a.append(timed(first, calls))
        best_b.append(timed(second, calls))
        for i in range(calls):  # interleaved: both see the same moment of a noisy machine
            for fn, into in ((first, cycles_a), (second, cycles_b)):
                started = time.perf_counter()
                fn(i)
                into.append((time.perf_counter() - started) * 1e6)
    a, b = min(best_a), min(best_b)
    ma, mb = statistics.median(cycles_a), statistics.median(cycles_b)
    ratios = [y / x for x, y in zip(best_a, best_b)]
    print(f"| {title} | {a:.0f} | {b:.0f} | {b / a:.2f} | {min(ratios):.2f}-{max(ratios):.2f} "
          f"| {ma:.0f} / {mb:.0f} = {mb / ma:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="cycles per timing")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two settings")
    args = parser.parse_args()
    name = f"ledger_bench_prepare_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    dsn = make_conninfo(ADMIN_DSN, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as setup:
            setup.execute(install_sql())  # type: ignore[arg-type]
            version = setup.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        prepared = psycopg.connect(dsn, autocommit=True, prepare_threshold=5)
        unprepared = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        print(f"PostgreSQL {version}, {os.cpu_count()} cores, {args.calls} cycles per timing, "
              f"{args.rounds} rounds alternated\n")
        print("| start_run + complete_run, one connection | A best (us) | B best (us) | B/A | B/A per round "
              "| interleaved medians A / B (us) |")
        print("|---|---:|---:|---:|---|---|")
        compare("client calls: A prepare_threshold=5, B None",
                lambda tag: (client_cycle(prepared, f"client-{tag}-5"), client_cycle(unprepared, f"client-{tag}-n")),
                args.calls, args.rounds)
        compare("raw statements: A prepare_threshold=5, B None",
                lambda tag: (statement_cycle(prepared, f"raw-{tag}-5", False),
                             statement_cycle(unprepared, f"raw-{tag}-n", False)),
                args.calls, args.rounds)
        compare("A extended unprepared, B bounded (simple protocol + statement_timeout)",
                lambda tag: (statement_cycle(unprepared, f"ext-{tag}", False),
                             statement_cycle(unprepared, f"bnd-{tag}", True)),
                args.calls, args.rounds)
        with ConnectionPool(dsn, min_size=2, max_size=2, kwargs={"autocommit": True, "prepare_threshold": None},
                            open=True) as pool:
            pool.wait()
            ledger = Ledger(pool, owner="bench")
            compare("A client calls (None), B `with ledger.run()` over a pool",
                    lambda tag: (client_cycle(unprepared, f"cmp-{tag}"), context_cycle(ledger, f"ctx-{tag}")),
                    max(50, args.calls // 3), args.rounds)
        prepared.close()
        unprepared.close()
        print()
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
