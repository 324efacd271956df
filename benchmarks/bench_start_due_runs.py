"""Does the batched start pay? ledger.start_due_runs over N jobs against N start_due_run calls.

    .venv/bin/python benchmarks/bench_start_due_runs.py [--jobs N] [--rounds R]

N jobs on a one-minute schedule (interval '1 minute', default ttl). Each
round moves the ledger's clock (the seam, ledger._clock_offset, redefined
as the scratch database's owner) to one second past the next minute, so
every job has exactly one slot due, then starts them all, timed, either

- batch:  one `SELECT * FROM ledger.start_due_runs(all jobs, owner)` (one
  round trip, one transaction), or
- single: N `SELECT * FROM ledger.start_due_run(job, owner)` calls over one
  connection in autocommit (N round trips, N transactions: what a loop
  over the jobs does),

alternating, and then ends every run (untimed). It also times
`ledger.next_start(all jobs)`, the loop's one call to learn when to wake,
and `ledger.start_due_runs(all jobs)` with every job idle (a round with
nothing due), and a read of ledger.job_health with two schedulers
serving every job (the no-live-scheduler check is a key lookup per job). Prints the best and median per round and per slot.

Uses a scratch database on the server named by LEDGER_BENCH_DSN (default
the local postgres), dropped at the end. Machines are noisy: compare the
ratios within one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psycopg
from psycopg.conninfo import make_conninfo

from ledger.resources import install_sql

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")


def _advance_to_next_minute(conn: psycopg.Connection, offset: list[float]) -> None:
    now = conn.execute("SELECT extract(epoch FROM ledger._now())").fetchone()[0]  # type: ignore[index]
    offset[0] += 60 - float(now) % 60 + 1
    conn.execute("CREATE OR REPLACE FUNCTION ledger._clock_offset() RETURNS interval LANGUAGE sql STABLE "  # type: ignore[arg-type]
                 f"PARALLEL SAFE AS $$ SELECT interval '{offset[0]:.6f} seconds' $$")


def _end_all(conn: psycopg.Connection, started: list[tuple[int, int]]) -> None:
    with conn.transaction():
        for run_id, token in started:
            conn.execute("SELECT ledger.complete_run(%s, %s)", (run_id, token))


def bench(conn: psycopg.Connection, jobs: list[str], rounds: int) -> None:
    offset = [0.0]
    times: dict[str, list[float]] = {"batch": [], "single": []}
    for job in jobs:
        conn.execute("SELECT ledger.register_job(%s, '1 minute', '5 minutes')", (job,))
    # The first round starts every job's first slot (untimed), so that every
    # timed round starts a job that ran before, on both paths.
    _advance_to_next_minute(conn, offset)
    first = conn.execute("SELECT run_id, token FROM ledger.start_due_runs(%s, 'bench')", (jobs,)).fetchall()
    assert len(first) == len(jobs), len(first)
    _end_all(conn, first)

    # Two schedulers serving every job: a whole-ledger read of the states.
    for name in ("sched-a", "sched-b"):
        conn.execute("SELECT ledger.scheduler_heartbeat(%s, 'h', 1, 'bench', %s, '1 hour')", (name, jobs))
    reads = []
    for _ in range(5):
        t0 = time.perf_counter()
        conn.execute("SELECT count(*) FROM ledger.job_health").fetchone()
        reads.append(time.perf_counter() - t0)

    # The ends just moved every job's wakeup mark back to now: the first
    # round after them visits each job once (and finds nothing due); then
    # a round with nothing due, start_due_runs and next_start as the loop
    # calls them, reads the marks only.
    t0 = time.perf_counter()
    conn.execute("SELECT count(*) FROM ledger.start_due_runs(%s, 'bench')", (jobs,)).fetchone()
    revisit = time.perf_counter() - t0
    wake, idle = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        conn.execute("SELECT count(*) FROM ledger.start_due_runs(%s, 'bench')", (jobs,)).fetchone()
        idle.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        conn.execute("SELECT ledger.next_start(%s)", (jobs,)).fetchone()
        wake.append(time.perf_counter() - t0)

    for r in range(rounds * 2):
        mode = "batch" if r % 2 == 0 else "single"
        _advance_to_next_minute(conn, offset)
        t0 = time.perf_counter()
        if mode == "batch":
            started = conn.execute("SELECT run_id, token FROM ledger.start_due_runs(%s, 'bench')", (jobs,)).fetchall()
        else:
            started = []
            for job in jobs:
                row = conn.execute("SELECT outcome, run_id, token FROM ledger.start_due_run(%s, 'bench')",
                                   (job,)).fetchone()
                assert row is not None and row[0] == "started", row
                started.append((row[1], row[2]))
        times[mode].append(time.perf_counter() - t0)
        assert len(started) == len(jobs), (mode, len(started))
        _end_all(conn, started)

    n = len(jobs)
    print(f"{n} jobs, one slot due each, {rounds} rounds per mode")
    print(f"  next_start over {n} idle jobs: best {min(wake) * 1000:.1f} ms, median {statistics.median(wake) * 1000:.1f} ms"
          f" ({statistics.median(wake) / n * 1e6:.1f} us/job)")
    print(f"  start_due_runs over {n} idle jobs: best {min(idle) * 1000:.1f} ms, median {statistics.median(idle) * 1000:.1f} ms;"
          f" the first after {n} ends (each job visited once): {revisit * 1000:.1f} ms")
    print(f"  job_health over {n} jobs, 2 schedulers serving all: median {statistics.median(reads) * 1000:.1f} ms")
    for mode, label in (("batch", "start_due_runs, 1 call"), ("single", f"start_due_run, {n} calls")):
        best, median = min(times[mode]), statistics.median(times[mode])
        print(f"  {label:<28} best {best * 1000:8.1f} ms  median {median * 1000:8.1f} ms"
              f"  ({median / n * 1e6:6.1f} us/slot)")
    print(f"  batch / single (median): {statistics.median(times['batch']) / statistics.median(times['single']):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs on a one-minute schedule")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode")
    args = parser.parse_args()
    name = f"ledger_bench_sdr_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    try:
        with psycopg.connect(make_conninfo(ADMIN_DSN, dbname=name), autocommit=True) as conn:
            conn.execute(install_sql())  # type: ignore[arg-type]
            version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            print(f"PostgreSQL {version}, {os.cpu_count()} cores")
            bench(conn, [f"job-{i:05d}" for i in range(args.jobs)], args.rounds)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
