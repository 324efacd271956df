"""Scale profile of the ledger's SQL: per-job calls and whole-ledger reads at two sizes.

    .venv/bin/python benchmarks/profile_scale.py [--sizes 1000:10,1000000:10] [--calls 300]

For each size JOBS:RUNS_PER_JOB it builds a scratch database (``ledger_scale``)
afresh: the ledger installed from sql/, then JOBS registered jobs (an hourly
schedule, ttl 1 hour), their lease rows and JOBS * RUNS_PER_JOB rows of log,
all by bulk ``INSERT ... SELECT generate_series`` (not through the API), and
the jobs' state (``ledger.counters``) computed from that log by
``ledger._refresh_state``, as the writing functions would have kept it.
Then, over one connection, the average latency of each per-job call on
random jobs (round trip and commit included), the whole-ledger reads
(``job_status`` for all jobs, ``alerts``, one metrics scrape as
``jobledger metrics`` reads it), the EXPLAIN of the per-job reads, and a
``purge_log`` of about half the log. Prints one JSON document and a
markdown table; BENCHMARKS.md ("SQL hot path") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
DB = "ledger_scale"

BUILD = """
SET session_replication_role = replica;  -- no FK checks, no triggers: a bulk load
SELECT ledger.register_job('template', '1 hour', ttl => '1 hour');
INSERT INTO ledger.jobs (job, schedule, time_zone, ttl, max_backfill, schedule_spec, created_at)
SELECT 'job-' || i, t.schedule, t.time_zone, t.ttl, t.max_backfill, t.schedule_spec, now() - interval '30 days'
  FROM generate_series(1, %(jobs)s::integer) i, ledger.jobs t WHERE t.job = 'template';
DELETE FROM ledger.jobs WHERE job = 'template';
INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, released_at, timeline)
SELECT 'job-' || i, 'worker', %(runs)s, interval '1 hour',
       date_trunc('hour', now()) - interval '1 hour', date_trunc('hour', now()) - interval '59 minutes',
       date_trunc('hour', now()) - interval '59 minutes', 1
  FROM generate_series(1, %(jobs)s::integer) i;
-- Run k of each job served the slot k hours before the last full hour; one
-- in ten failed. Ordered by time, as a real log is.
INSERT INTO ledger.job_execution_log
    (job, owner, token, slot, status, started_at, heartbeat_at, completed_at, failure_reason, error)
SELECT 'job-' || i, 'worker', k, date_trunc('hour', now()) - (%(runs)s - k + 1) * interval '1 hour',
       CASE WHEN (i + k) %% 10 = 0 THEN 'failure' ELSE 'success' END,
       date_trunc('hour', now()) - (%(runs)s - k + 1) * interval '1 hour',
       date_trunc('hour', now()) - (%(runs)s - k + 1) * interval '1 hour' + interval '30 seconds',
       date_trunc('hour', now()) - (%(runs)s - k + 1) * interval '1 hour' + (30 + (i * k) %% 60) * interval '1 second',
       CASE WHEN (i + k) %% 10 = 0 THEN 'error' END,
       CASE WHEN (i + k) %% 10 = 0 THEN 'boom' END
  FROM generate_series(1, %(runs)s::integer) k, generate_series(1, %(jobs)s::integer) i
 ORDER BY k, i;
INSERT INTO ledger.counters (job, runs_started, successes, failures)
SELECT r.job, count(*), count(*) FILTER (WHERE r.status = 'success'), count(*) FILTER (WHERE r.status = 'failure')
  FROM ledger.job_execution_log r GROUP BY r.job;
"""

REFRESH = """
SELECT ledger._refresh_state(array_agg('job-' || i)) FROM generate_series(%(lo)s::integer, %(hi)s::integer) i
"""

SCRAPE = [  # what one `jobledger metrics` scrape reads (ledger/queries.py)
    "SELECT * FROM ledger.job_status ORDER BY job",
    "SELECT job, failure_rate, p50_duration, p95_duration, max_duration FROM ledger.run_stats ORDER BY job",
    "SELECT alert, count(*) FROM ledger.alerts GROUP BY alert",
]


def psql_install(dsn: str) -> None:
    script = "".join(p.read_text() for p in sorted((ROOT / "sql").glob("*.sql")))
    done = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", dsn], input=script,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])


def build(jobs: int, runs: int) -> tuple[str, float]:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DB}")
        admin.execute(f"CREATE DATABASE {DB}")
    dsn = ADMIN_DSN.replace("dbname=postgres", f"dbname={DB}")
    started = time.monotonic()
    psql_install(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            for statement in BUILD.split(";\n"):
                if statement.strip():
                    conn.execute(statement, {"jobs": jobs, "runs": runs})
        # the state the writing functions keep, from the log, in chunks
        for lo in range(1, jobs + 1, 50000):
            conn.execute(REFRESH, {"lo": lo, "hi": min(jobs, lo + 49999)})
        conn.execute("VACUUM ANALYZE")
    return dsn, time.monotonic() - started


def timed(conn: psycopg.Connection, calls: int, body) -> float:
    """Average ms per call of body(i), best of 3 rounds of `calls`."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for i in range(calls):
            body(i)
        best = min(best, (time.perf_counter() - started) / calls * 1000)
    return round(best, 3)


def measure(dsn: str, jobs: int, calls: int, purge_hours: int = 0) -> dict:
    rng = random.Random(7)
    out: dict = {}
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        pick = lambda: f"job-{rng.randint(1, jobs)}"  # noqa: E731

        out["acquire"] = timed(conn, calls, lambda i: conn.execute(
            "SELECT * FROM ledger.acquire(%s, 'bench', interval '1 hour')", (pick(),)).fetchall())

        def cycle(i: int) -> None:
            s = conn.execute("SELECT run_id, token FROM ledger.start_run(%s, 'bench', interval '1 hour')",
                             (pick(),)).fetchone()
            if s and s[0]:
                conn.execute("SELECT 1 FROM ledger.complete_run(%s, %s)", s).fetchone()
        out["start_run + complete_run"] = timed(conn, calls, cycle)

        due_jobs = iter(rng.sample(range(1, jobs + 1), min(jobs, 3 * calls + 10)))

        def due_cycle(i: int) -> None:
            s = conn.execute("SELECT outcome, run_id, token FROM ledger.start_due_run(%s, 'bench')",
                             (f"job-{next(due_jobs)}",)).fetchone()
            if s and s[1]:
                conn.execute("SELECT 1 FROM ledger.complete_run(%s, %s)", (s[1], s[2])).fetchone()
        out["start_due_run + complete_run"] = timed(conn, calls, due_cycle)

        out["due_slots"] = timed(conn, calls, lambda i: conn.execute(
            "SELECT * FROM ledger.due_slots(%s)", (pick(),)).fetchall())

        hb = conn.execute("SELECT run_id, token FROM ledger.start_run('heartbeat-job', 'beater', interval '1 hour')").fetchone()
        out["heartbeat"] = timed(conn, calls, lambda i: conn.execute(
            "SELECT ledger.heartbeat(%s, %s)", hb).fetchone())
        conn.execute("SELECT 1 FROM ledger.complete_run(%s, %s)", hb).fetchone()

        out["job_status one job"] = timed(conn, calls, lambda i: conn.execute(
            "SELECT * FROM ledger.job_status WHERE job = %s", (pick(),)).fetchall())

        whole: dict = {}
        for name, query in [("job_status all jobs", "SELECT sum(hashtext(s::text)) FROM ledger.job_status s"),
                            ("alerts", "SELECT sum(hashtext(a::text)) FROM ledger.alerts a"),
                            ("run_stats", "SELECT sum(hashtext(s::text)) FROM ledger.run_stats s")]:
            started = time.perf_counter()
            conn.execute(query).fetchall()
            whole[name] = round((time.perf_counter() - started) * 1000, 1)
        started = time.perf_counter()
        with conn.transaction():
            conn.execute("SET TRANSACTION READ ONLY")
            for query in SCRAPE:
                conn.execute(query).fetchall()
        whole["metrics scrape"] = round((time.perf_counter() - started) * 1000, 1)
        out["whole_ms"] = whole
        out["whole_us_per_job"] = {k: round(v * 1000 / jobs, 2) for k, v in whole.items()}

        out["explain"] = {
            "job_status one job": [r[0] for r in conn.execute(
                "EXPLAIN SELECT * FROM ledger.job_status WHERE job = 'job-1'").fetchall()],
            "running run (start path)": [r[0] for r in conn.execute(
                "EXPLAIN SELECT * FROM ledger.job_execution_log r WHERE r.job = 'job-1' AND r.status = 'running'"
            ).fetchall()],
            "newest done slot": [r[0] for r in conn.execute(
                "EXPLAIN SELECT r.slot FROM ledger.job_execution_log r WHERE r.job = 'job-1' AND r.status = 'success'"
                " AND r.slot IS NOT NULL ORDER BY r.slot DESC LIMIT 1").fetchall()],
        }

        # purge part of the log (default about half), in batches of 10,000 run ids
        rows = conn.execute("SELECT count(*) FROM ledger.job_execution_log").fetchone()[0]
        started = time.perf_counter()
        purged = conn.execute("SELECT ledger.purge_log(older_than => %s)",
                              (f"{purge_hours or max(2, (rows // jobs) // 2)} hours",)).fetchone()[0]
        out["purge_log"] = {"rows_before": rows, "purged": purged,
                            "seconds": round(time.perf_counter() - started, 1)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000:10,1000000:10", help="JOBS:RUNS_PER_JOB, comma-separated")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--purge-hours", type=int, default=0,
                        help="purge_log(older_than => N hours); default half the runs per job")
    args = parser.parse_args()
    results = []
    for size in args.sizes.split(","):
        jobs, runs = (int(x) for x in size.split(":"))
        dsn, seconds = build(jobs, runs)
        result = {"jobs": jobs, "log_rows": jobs * runs, "build_seconds": round(seconds, 1)}
        result.update(measure(dsn, jobs, args.calls, args.purge_hours))
        with psycopg.connect(dsn) as conn:
            result["database_size"] = conn.execute(
                "SELECT pg_size_pretty(pg_database_size(current_database()))").fetchone()[0]
        results.append(result)
        print(json.dumps(result, indent=1), file=sys.stderr, flush=True)
    if not args.keep_db:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DB}")
    print(json.dumps(results, indent=1))
    if len(results) == 2:
        small, large = results
        print(f"\n| call | {small['jobs']:,} jobs / {small['log_rows']:,} rows (ms) | "
              f"{large['jobs']:,} jobs / {large['log_rows']:,} rows (ms) | ratio |\n|---|---:|---:|---:|")
        for key in ["acquire", "start_run + complete_run", "start_due_run + complete_run", "due_slots",
                    "heartbeat", "job_status one job"]:
            print(f"| `{key}` | {small[key]} | {large[key]} | {large[key] / small[key]:.2f} |")
        print("\n| whole-ledger read | small (ms) | large (ms) | small (us/job) | large (us/job) |\n|---|---:|---:|---:|---:|")
        for key in small["whole_ms"]:
            print(f"| {key} | {small['whole_ms'][key]} | {large['whole_ms'][key]} | "
                  f"{small['whole_us_per_job'][key]} | {large['whole_us_per_job'][key]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
