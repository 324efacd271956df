"""Scale profile of the ledger's SQL: per-job calls and whole-ledger reads at two sizes.

    .venv/bin/python benchmarks/profile_scale.py [--sizes 1000:10,1000000:10] [--calls 300]
    .venv/bin/python benchmarks/profile_scale.py --sizes 1000:10,1000000:10 --calls-only --alternate 3 \
        --autovacuum-settings --keep-db     # the per-job calls only, the sizes alternated

With ``--calls-only`` each size gets its own database (``ledger_scale_JOBS``),
all are built first, and the per-job calls (``acquire``, ``start_run`` +
``complete_run``, ``heartbeat`` and ``fence`` on random jobs, ``job_status``
of one job) are measured size after size, ``--alternate`` rounds, the median
of the rounds reported; no whole-ledger reads, no purge. ``--reuse`` measures
databases a ``--keep-db`` run left. The table and index sizes
(``pg_total_relation_size``, ``pg_relation_size``) and the blocks each index
was read from outside shared buffers during the calls
(``pg_statio_user_indexes``) are part of the JSON.

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
DELETE FROM ledger.counters WHERE job = 'template';
DELETE FROM ledger.wakeups WHERE job = 'template';
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

# The state rows as the writers keep them (their counts above), computed from the log set-based
# (ledger._state_from_log, as benchmarks/bench_reads.py builds them), a chunk
# of jobs at a time: ledger._refresh_state recomputes one job per
# _set_state call, which at a million jobs took more than an hour here.
REFRESH = """
UPDATE ledger.counters c
   SET last_run_id = s.last_run_id, last_status = s.last_status, last_started_at = s.last_started_at,
       last_completed_at = s.last_completed_at, last_success_started_at = s.last_success_started_at,
       last_success_at = s.last_success_at, running_run_id = s.running_run_id, running_token = s.running_token,
       running_started_at = s.running_started_at, done_slot = s.done_slot, longest_success = s.longest_success,
       consecutive_failures = s.consecutive_failures, next_due = s.next_due, latest_end = s.latest_end,
       overlap_run_id = s.overlap_run_id, down_due = s.down_due
  FROM ledger._state_from_log(ARRAY(SELECT 'job-' || i FROM generate_series(%(lo)s::integer, %(hi)s::integer) i)) s
 WHERE c.job = s.job
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


# docs/operations.md, "Sizing": the autovacuum settings it recommends per million runs kept
AUTOVACUUM = """
ALTER TABLE ledger.job_execution_log SET (autovacuum_vacuum_scale_factor = 0.01,
                                         autovacuum_vacuum_insert_scale_factor = 0.01);
ALTER TABLE ledger.events SET (autovacuum_vacuum_scale_factor = 0.01);
ALTER TABLE ledger.leases SET (autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 10000);
ALTER TABLE ledger.counters SET (autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 10000)
"""

SIZES = """
SELECT c.relname, c.relkind::text, pg_relation_size(c.oid), pg_total_relation_size(c.oid)
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'ledger' AND c.relkind IN ('r', 'i') AND pg_relation_size(c.oid) > 0
 ORDER BY pg_relation_size(c.oid) DESC
"""

STATIO = """
SELECT relname || '.' || indexrelname, idx_blks_read, idx_blks_hit FROM pg_statio_user_indexes
 WHERE schemaname = 'ledger'
UNION ALL
SELECT relname, heap_blks_read, heap_blks_hit FROM pg_statio_user_tables WHERE schemaname = 'ledger'
"""


def dsn_of(db: str) -> str:
    return ADMIN_DSN.replace("dbname=postgres", f"dbname={db}")


def build(jobs: int, runs: int, db: str = DB, autovacuum: bool = False) -> tuple[str, float]:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {db}")
        admin.execute(f"CREATE DATABASE {db}")
    dsn = dsn_of(db)
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
        conn.execute("SET session_replication_role = DEFAULT")
        bad = conn.execute("SELECT count(*) FROM ledger.verify_state()").fetchone()[0] if jobs <= 100000 else 0  # type: ignore[index]
        if bad:
            raise SystemExit(f"the computed state disagrees with the log: {bad} rows of ledger.verify_state()")
        if autovacuum:
            for statement in AUTOVACUUM.split(";\n"):
                conn.execute(statement)
        conn.execute("VACUUM ANALYZE")
    return dsn, time.monotonic() - started


def sizes(dsn: str) -> dict:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(SIZES).fetchall()
        database = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]  # type: ignore[index]
    return {"database_bytes": database,
            "relations": {name: {"kind": kind, "bytes": own, "total_bytes": total}
                          for name, kind, own, total in rows}}


def calls_only(dsn: str, jobs: int, calls: int, seed: int, due: bool) -> dict:
    """The per-job calls on random jobs, each the best of 3 rounds of `calls` (ms per call)."""
    rng = random.Random(seed)
    out: dict = {}
    pick = lambda: f"job-{rng.randint(1, jobs)}"  # noqa: E731
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        before = {k: (r, h) for k, r, h in conn.execute(STATIO).fetchall()}
        out["acquire"] = timed(conn, calls, lambda i: conn.execute(
            "SELECT * FROM ledger.acquire(%s, 'bench', interval '1 hour')", (pick(),)).fetchall())

        def cycle(i: int) -> None:
            s = conn.execute("SELECT run_id, token FROM ledger.start_run(%s, 'bench', interval '1 hour')",
                             (pick(),)).fetchone()
            if s and s[0]:
                conn.execute("SELECT 1 FROM ledger.complete_run(%s, %s)", s).fetchone()
        out["start_run + complete_run"] = timed(conn, calls, cycle)

        if due:  # each job's current slot can be started once: a fresh sample, the first round only
            due_jobs = iter(rng.sample(range(1, jobs + 1), min(jobs, 3 * calls + 10)))

            def due_cycle(i: int) -> None:
                s = conn.execute("SELECT outcome, run_id, token FROM ledger.start_due_run(%s, 'bench')",
                                 (f"job-{next(due_jobs)}",)).fetchone()
                if s and s[1]:
                    conn.execute("SELECT 1 FROM ledger.complete_run(%s, %s)", (s[1], s[2])).fetchone()
            out["start_due_run + complete_run"] = timed(conn, calls, due_cycle)

        # heartbeat and fence on `calls` random jobs each: runs opened (and leases taken) untimed
        open_runs = []
        for j in rng.sample(range(1, jobs + 1), min(jobs, calls)):
            s = conn.execute("SELECT run_id, token FROM ledger.start_run(%s, 'bench', interval '1 hour')",
                             (f"job-{j}",)).fetchone()
            if s and s[0]:
                open_runs.append(s)
        out["heartbeat"] = timed(conn, len(open_runs), lambda i: conn.execute(
            "SELECT ledger.heartbeat(%s, %s)", open_runs[i]).fetchone())
        for s in open_runs:
            conn.execute("SELECT 1 FROM ledger.complete_run(%s, %s)", s).fetchone()

        held = []
        for j in rng.sample(range(1, jobs + 1), min(jobs, calls)):
            t = conn.execute("SELECT token FROM ledger.acquire(%s, 'bench', interval '1 hour')",
                             (f"job-{j}",)).fetchone()
            if t and t[0] is not None:
                held.append((f"job-{j}", f"res-{j}", t[0]))
        for h in held:  # the fence row exists: the steady state, one token per lease
            conn.execute("SELECT ledger.fence(%s, %s, %s)", h).fetchone()
        out["fence"] = timed(conn, len(held), lambda i: conn.execute(
            "SELECT ledger.fence(%s, %s, %s)", held[i]).fetchone())

        out["job_status one job"] = timed(conn, calls, lambda i: conn.execute(
            "SELECT * FROM ledger.job_status WHERE job = %s", (pick(),)).fetchall())
        after = conn.execute(STATIO).fetchall()
        out["blocks_read_outside_shared_buffers"] = {
            k: r - before.get(k, (0, 0))[0] for k, r, h in after if r - before.get(k, (0, 0))[0] > 0}
        out["blocks_hit"] = {
            k: h - before.get(k, (0, 0))[1] for k, r, h in after if h - before.get(k, (0, 0))[1] > 0}
    return out


CALLS = ["acquire", "start_run + complete_run", "start_due_run + complete_run", "heartbeat", "fence",
         "job_status one job"]


def main_calls_only(args: argparse.Namespace) -> int:
    import statistics
    sized = [tuple(int(x) for x in size.split(":")) for size in args.sizes.split(",")]
    results = []
    for jobs, runs in sized:
        db = f"{DB}_{jobs}"
        if args.reuse:
            dsn, seconds = dsn_of(db), 0.0
        else:
            dsn, seconds = build(jobs, runs, db, args.autovacuum_settings)
            print(f"built {jobs} jobs x {runs} runs in {seconds:.0f} s", file=sys.stderr, flush=True)
        with psycopg.connect(dsn) as conn:
            settings = dict(conn.execute(
                "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name IN"
                " ('shared_buffers', 'autovacuum', 'synchronous_commit', 'fsync', 'max_wal_size')").fetchall())
            reloptions = dict(conn.execute(
                "SELECT relname, array_to_string(reloptions, ', ') FROM pg_class WHERE relnamespace ="
                " 'ledger'::regnamespace AND reloptions IS NOT NULL AND relkind = 'r'").fetchall())
        results.append({"jobs": jobs, "log_rows": jobs * runs, "build_seconds": round(seconds, 1),
                        "dsn": dsn, "settings": settings, "reloptions": reloptions, "rounds": []})
    for rnd in range(args.alternate):
        for result in results:
            got = calls_only(result["dsn"], result["jobs"], args.calls, seed=7 + rnd, due=rnd == 0)
            result["rounds"].append(got)
            print(json.dumps({"jobs": result["jobs"], "round": rnd + 1,
                              **{k: got[k] for k in CALLS if k in got}}), file=sys.stderr, flush=True)
    for result in results:
        result["median_ms"] = {k: round(statistics.median(r[k] for r in result["rounds"] if k in r), 3)
                               for k in CALLS if any(k in r for r in result["rounds"])}
        result.update(sizes(result["dsn"]))
    if not args.keep_db:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            for result in results:
                admin.execute(f"DROP DATABASE IF EXISTS {DB}_{result['jobs']}")
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    small, large = results[0], results[-1]
    print(f"\n| call | {small['jobs']:,} jobs / {small['log_rows']:,} rows (ms) | "
          f"{large['jobs']:,} jobs / {large['log_rows']:,} rows (ms) | ratio | per round (large / small) |"
          "\n|---|---:|---:|---:|---|")
    for key in small["median_ms"]:
        per = " / ".join(f"{b[key] / a[key]:.2f}" for a, b in zip(small["rounds"], large["rounds"]) if key in a)
        print(f"| `{key}` | {small['median_ms'][key]} | {large['median_ms'][key]} | "
              f"{large['median_ms'][key] / small['median_ms'][key]:.2f} | {per} |")
    return 0


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
    parser.add_argument("--calls-only", action="store_true",
                        help="the per-job calls only, one database per size, the sizes alternated")
    parser.add_argument("--alternate", type=int, default=3, help="with --calls-only: rounds over the sizes")
    parser.add_argument("--reuse", action="store_true", help="with --calls-only: measure the kept databases")
    parser.add_argument("--autovacuum-settings", action="store_true",
                        help="set the per-table autovacuum settings docs/operations.md recommends")
    parser.add_argument("--json", help="with --calls-only: write the results here too")
    args = parser.parse_args()
    if args.calls_only:
        return main_calls_only(args)
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
