"""The dashboard on a big ledger: the jobs page over 10,000 jobs, a job page over 1,000,000 runs.

    .venv/bin/python benchmarks/bench_web.py            # 1,000 jobs, 100,000 runs (a quick look)
    .venv/bin/python benchmarks/bench_web.py --full     # 10,000 jobs, 1,000,000 runs (BENCHMARKS.md)
    .venv/bin/python benchmarks/bench_web.py --keep     # leave the scratch database for a look

The ledger is built by bulk INSERT ... SELECT generate_series (not through
the API: a million runs through start_run would take an hour): jobs with
cron and interval schedules in UTC and Europe/Berlin, one lease and one
counters row each, and the runs, of which half belong to one job (``big``,
a run a minute for most of a year), so that one job page reads a job with
500,000 runs while the jobs page reads 10,000 jobs. 5% of the runs failed.

Then the dashboard runs in this process (uvicorn on a free loopback port, a
thread) and each page is fetched over HTTP, HTML and JSON, best and median
of ``--repeats``: the jobs page (the first page of 100 and a name filter),
the big job's page (24-hour and 30-day windows), a run page, the alerts
page, ``/badge/big.svg`` and ``/metrics``.

Uses a scratch database on the server named by LEDGER_BENCH_DSN (default
the local postgres), dropped at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ledger.resources import install_sql  # noqa: E402

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")

SCHEDULES = ("ARRAY['*/5 * * * *', '0 * * * *', '15 minutes', '1 hour', '30 2 * * *']")
ZONES = "ARRAY['UTC', 'Europe/Berlin']"

# Jobs first (each with its schedule parsed once, as register_job does), then
# a lease per job (the log's foreign key; its token is the job's newest), the
# runs, and the counters that match them.
BUILD = [
    f"""
    INSERT INTO ledger.jobs (job, schedule, time_zone, ttl, max_backfill, schedule_spec, created_at, updated_at)
    SELECT j.job, j.schedule, j.zone, interval '10 minutes', 1,
           ledger._parse_schedule(j.schedule, j.zone), now() - interval '400 days', now() - interval '400 days'
      FROM (SELECT CASE WHEN i = 1 THEN 'big' ELSE 'job-' || lpad(i::text, 5, '0') END AS job,
                   CASE WHEN i = 1 THEN '* * * * *' ELSE ({SCHEDULES})[1 + mod(i, 5)] END AS schedule,
                   ({ZONES})[1 + mod(i / 5, 2)] AS zone
              FROM generate_series(1, %(jobs)s) AS i) AS j
    """,
    """
    CREATE TEMP TABLE plan AS
    SELECT j.job, CASE WHEN j.job = 'big' THEN %(big)s ELSE %(each)s END AS runs,
           CASE WHEN j.job = 'big' THEN interval '1 minute' ELSE interval '1 hour' END AS every
      FROM ledger.jobs j
    """,
    """
    INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, released_at, timeline)
    SELECT p.job, 'bench', p.runs, interval '10 minutes', now() - interval '2 minutes',
           now() - interval '1 minute', now() - interval '1 minute', 1
      FROM plan p WHERE p.runs > 0
    """,
    # A bulk load: no per-row triggers (the foreign-key checks, and the state
    # refresh a write from outside the ledger's functions triggers), the rows
    # are consistent by construction; the jobs' state is refreshed once below.
    "SET LOCAL session_replication_role = replica",
    # Run n of a job started n `every`s ago (plus two seconds) and lasted 1 to
    # 50 s, so no two overlap (the audit stays empty); every 20th failed.
    """
    INSERT INTO ledger.job_execution_log
           (job, owner, token, slot, status, started_at, heartbeat_at, completed_at, failure_reason, error, detail)
    SELECT p.job, 'bench-' || mod(n, 7), n,
           date_trunc('minute', now()) - (p.runs - n + 1) * p.every,
           CASE WHEN mod(n, 20) = 0 THEN 'failure' ELSE 'success' END,
           date_trunc('minute', now()) - (p.runs - n + 1) * p.every + interval '2 seconds',
           NULL,
           date_trunc('minute', now()) - (p.runs - n + 1) * p.every + interval '2 seconds'
               + (1 + mod(n::bigint * 7919, 50)) * interval '1 second',
           CASE WHEN mod(n, 20) = 0 THEN 'error' END,
           CASE WHEN mod(n, 20) = 0 THEN 'exit status 1: connection reset by peer' END,
           NULL
      FROM plan p CROSS JOIN LATERAL generate_series(1, p.runs) AS n
    """,
    "SET LOCAL session_replication_role = origin",
    """
    INSERT INTO ledger.counters (job, runs_started, successes, failures)
    SELECT r.job, count(*), count(*) FILTER (WHERE r.status = 'success'),
           count(*) FILTER (WHERE r.status = 'failure')
      FROM ledger.job_execution_log r GROUP BY r.job
    """,
]

# The jobs' state kept beside their counters (last run, running run, done
# slot, ...), where the schema has it: what the ledger's functions maintain
# run by run, recomputed once from the log.
HAS_STATE = "SELECT to_regprocedure('ledger._refresh_state(text[])') IS NOT NULL"
REFRESH_STATE = "SELECT ledger._refresh_state(array_agg(j.job)::text[]) FROM ledger.jobs j"


def build(conn: psycopg.Connection, jobs: int, runs: int) -> None:
    big = runs // 2
    each = (runs - big) // max(1, jobs - 1)
    started = time.perf_counter()
    with conn.transaction():
        for statement in BUILD:
            conn.execute(statement, {"jobs": jobs, "big": big, "each": each})  # type: ignore[arg-type]
        if conn.execute(HAS_STATE).fetchone()[0]:  # type: ignore[index]
            conn.execute(REFRESH_STATE)
    conn.execute("ANALYZE")
    total = conn.execute("SELECT count(*) FROM ledger.job_execution_log").fetchone()[0]  # type: ignore[index]
    print(f"built {jobs:,} jobs and {total:,} runs ({big:,} of job big) "
          f"in {time.perf_counter() - started:.1f} s\n")


def fetch(url: str) -> float:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            response.read()
    except urllib.error.HTTPError as error:
        raise SystemExit(f"{url}: HTTP {error.code}: {error.read().decode()[-400:]}") from None
    return (time.perf_counter() - started) * 1000


def measure(base: str, repeats: int) -> list[tuple[str, float, float]]:
    run_id = None
    pages = [
        ("jobs page, first 100 of all jobs", "/"),
        ("jobs page, JSON", "/api/jobs"),
        ("jobs page, name filter `job-09`", "/?q=job-09"),
        ("jobs page, state filter `failing`", "/?state=failing"),
        ("job page of `big`, 24 h window", "/jobs/big"),
        ("job page of `big`, 30 d window", "/jobs/big?window=30d"),
        ("job page of `big`, JSON", "/api/jobs/big"),
        ("job page of a small job", "/jobs/job-00042"),
        ("run page", "/runs/{run_id}"),
        ("alerts page", "/alerts"),
        ("badge", "/badge/big.svg"),
        ("/metrics", "/metrics"),
    ]
    results = []
    for label, path in pages:
        if "{run_id}" in path:
            if run_id is None:
                import json
                with urllib.request.urlopen(base + "/api/jobs/big", timeout=120) as response:
                    run_id = json.load(response)["runs"][0]["run_id"]
            path = path.format(run_id=run_id)
        fetch(base + path)  # warm: the first read of a page loads its pages of the table
        times = [fetch(base + path) for _ in range(repeats)]
        results.append((label, min(times), statistics.median(times)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--full", action="store_true", help="10,000 jobs and 1,000,000 runs")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="do not drop the scratch database")
    args = parser.parse_args()
    jobs = args.jobs or (10_000 if args.full else 1_000)
    runs = args.runs or (1_000_000 if args.full else 100_000)

    from ledger.web.app import create_app
    from ledger.web.server import BackgroundServer

    name = f"ledger_bench_web_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
    dsn = make_conninfo(ADMIN_DSN, dbname=name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(install_sql())  # type: ignore[arg-type]
            version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            print(f"PostgreSQL {version}, {os.cpu_count()} cores, best and median of {args.repeats}\n")
            build(conn, jobs, runs)
        # a long statement timeout: the benchmark measures each page, however long it takes; no
        # metrics cache: each /metrics fetch is a read, not the body of the one before
        with BackgroundServer(create_app(dsn, timeout=timedelta(seconds=120),
                                         metrics_cache=timedelta(0))) as server:
            results = measure(server.url, args.repeats)
        print("| page | best (ms) | median (ms) |")
        print("|---|---:|---:|")
        for label, best, median in results:
            print(f"| {label} | {best:.0f} | {median:.0f} |")
    finally:
        if args.keep:
            print(f"\nkept: {dsn}")
        else:
            with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
