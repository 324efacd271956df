"""Whole-ledger reads in microseconds per job: job_status, job_health, alerts and a metrics scrape.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_reads.py [--sizes 1000,10000,100000] [--runs 10] [--rounds 5]

For each size it builds a scratch database (``ledger_bench_reads``) afresh:
the ledger installed from sql/, then JOBS jobs with an hourly schedule and
RUNS runs each, by bulk ``INSERT ... SELECT generate_series`` as the
database's owner (no triggers, no foreign-key checks: a bulk load), and the
jobs' state rows computed from that log by ``ledger._state_from_log``, as
the writers would have kept them (``ledger.verify_state()`` is checked
empty). The jobs are in every state, in the proportions of a ledger with
trouble: 10% down (their last three slots never ran: behind, which is where
a read used to evaluate the schedule), 10% failing, 1% each running,
crashed (a run marked running, its lease expired an hour ago) and paused,
the rest ok.

Then, over one connection with ``jit`` off (as the ledger's own readers set
it), each read ``--rounds`` times, best and median:

- ``server``: the read run to the end on the server, every column of every
  row computed and turned into text (``sum(hashtext(row::text))``), nothing
  sent: what the SQL costs;
- ``client``: the rows fetched by psycopg into Python tuples, as the
  dashboard's jobs page, ``jobledger status`` and ``jobledger metrics`` do.

The metrics scrape is the per-job statement of one ``ledger.metrics.read_snapshot``
(``queries.METRIC_JOBS``: the state rows, each job's alert kinds with them), in one
read-only transaction (``client``), and the whole exposition as ``jobledger metrics``
writes it (``exposition``: a connection opened, read as ledger_reader, the per-job
sample lines and the alerts by kind written by PostgreSQL in one statement,
``metrics.JOB_TEXT``, timed alone too as ``job lines``; ``exposition, open
connection``: ``metrics.read_text`` over a connection already open), and, for
comparison, the same text written by Python from the rows
(``text(samples(read_snapshot()))``, the path of ``families``). The dashboard's
``/api/jobs`` and jobs page (``/``) are timed over HTTP against ``jobledger web``'s
app on a loopback port: every job's state counted in SQL (the filters' counts), a
page of 100 read and drawn. Prints a markdown table;
BENCHMARKS.md ("One truth per job") has the figures. Nothing here asserts a
time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ledger import metrics, queries  # noqa: E402
from ledger.migrate import install_script  # noqa: E402

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
DB = "ledger_bench_reads"  # --db names another

# %(jobs)s jobs, %(runs)s runs each. Job i: i % 10 = 0 down (its last three slots not run), 1 failing
# (a run without a slot failed after its last slot succeeded), i % 100 = 3 running, 5 crashed, 7 paused; run k served the slot
# (runs - k + 1) hours before the current hour.
BUILD = [
    "SELECT ledger.register_job('template', '1 hour', ttl => '1 hour')",
    "SET session_replication_role = replica",
    """INSERT INTO ledger.jobs (job, schedule, time_zone, ttl, max_backfill, schedule_spec, created_at,
                               paused, paused_at, pause_reason)
       SELECT 'job-' || i, t.schedule, t.time_zone, t.ttl, t.max_backfill, t.schedule_spec, now() - interval '30 days',
              i %% 100 = 7, CASE WHEN i %% 100 = 7 THEN now() END, CASE WHEN i %% 100 = 7 THEN 'operator' END
         FROM generate_series(1, %(jobs)s::integer) i, ledger.jobs t WHERE t.job = 'template'""",
    "DELETE FROM ledger.counters WHERE job = 'template'",
    "DELETE FROM ledger.jobs WHERE job = 'template'",
    """INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, released_at, timeline)
       SELECT 'job-' || i, 'worker', %(runs)s + 1, interval '1 hour',
              CASE i %% 100 WHEN 3 THEN now() - interval '1 minute'
                           WHEN 5 THEN date_trunc('hour', now()) - interval '50 minutes'
                           ELSE date_trunc('hour', now()) - interval '1 hour' END,
              CASE i %% 100 WHEN 3 THEN now() + interval '59 minutes'
                           WHEN 5 THEN date_trunc('hour', now()) - interval '45 minutes'
                           ELSE date_trunc('hour', now()) - interval '59 minutes' END,
              CASE WHEN i %% 100 IN (3, 5) THEN NULL ELSE date_trunc('hour', now()) - interval '59 minutes' END, 1
         FROM generate_series(1, %(jobs)s::integer) i""",
    # the ended runs, in time order as a real log is; a failure now and then, and a failing job's last run
    """INSERT INTO ledger.job_execution_log
           (job, owner, token, slot, status, started_at, heartbeat_at, completed_at, failure_reason, error)
       SELECT 'job-' || i, 'worker', k, h.at - (%(runs)s - k + 1) * interval '1 hour', s.status,
              h.at - (%(runs)s - k + 1) * interval '1 hour',
              h.at - (%(runs)s - k + 1) * interval '1 hour' + interval '30 seconds',
              h.at - (%(runs)s - k + 1) * interval '1 hour' + (30 + (i * k) %% 60) * interval '1 second',
              CASE WHEN s.status = 'failure' THEN 'error' END, CASE WHEN s.status = 'failure' THEN 'boom' END
         FROM generate_series(1, %(runs)s::integer) k, generate_series(1, %(jobs)s::integer) i,
              (SELECT date_trunc('hour', now()) AS at) h,
              LATERAL (SELECT CASE WHEN (i + k) %% 13 = 0 AND k < %(runs)s - 1 THEN 'failure'
                                   ELSE 'success' END AS status) s
        WHERE NOT (i %% 10 = 0 AND k > %(runs)s - 3)
        ORDER BY k, i""",
    # a failing job's retry of nothing in particular (no slot), failed after its last slot succeeded
    """INSERT INTO ledger.job_execution_log
           (job, owner, token, slot, status, started_at, heartbeat_at, completed_at, failure_reason, error)
       SELECT 'job-' || i, 'worker', %(runs)s + 1, NULL, 'failure',
              date_trunc('hour', now()) - interval '50 minutes', date_trunc('hour', now()) - interval '50 minutes',
              date_trunc('hour', now()) - interval '49 minutes', 'error', 'boom'
         FROM generate_series(1, %(jobs)s::integer) i WHERE i %% 10 = 1""",
    # a running run of each running and crashed job (token runs + 1, the lease's)
    """INSERT INTO ledger.job_execution_log (job, owner, token, slot, status, started_at, heartbeat_at)
       SELECT l.job, 'worker', l.token, NULL, 'running', l.acquired_at, l.acquired_at
         FROM ledger.leases l WHERE l.released_at IS NULL""",
    # the state rows, as the writers keep them
    """INSERT INTO ledger.counters (job, runs_started, successes, failures, last_run_id, last_status, last_started_at,
                                   last_completed_at, last_success_started_at, last_success_at, running_run_id,
                                   running_token, running_started_at, done_slot, longest_success,
                                   consecutive_failures, next_due, latest_end, overlap_run_id, down_due)
       SELECT s.job, n.runs, n.successes, n.failures, s.last_run_id, s.last_status, s.last_started_at,
              s.last_completed_at, s.last_success_started_at, s.last_success_at, s.running_run_id,
              s.running_token, s.running_started_at, s.done_slot, s.longest_success, s.consecutive_failures,
              s.next_due, s.latest_end, s.overlap_run_id, s.down_due
         FROM ledger._state_from_log(ARRAY(SELECT j.job::text FROM ledger.jobs j)) s
         JOIN (SELECT r.job, count(*) AS runs, count(*) FILTER (WHERE r.status = 'success') AS successes,
                      count(*) FILTER (WHERE r.status = 'failure') AS failures
                 FROM ledger.job_execution_log r GROUP BY r.job) n ON n.job = s.job""",
    "SET session_replication_role = DEFAULT",
]

VIEWS = {
    "job_status": "ledger.job_status",
    "job_health": "ledger.job_health",
    "alerts": "ledger.alerts",
}


def build(jobs: int, runs: int, db: str = DB) -> tuple[str, float]:
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {db}")
    dsn = ADMIN_DSN.replace("dbname=postgres", f"dbname={db}")
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(install_script())  # type: ignore[arg-type]
        with conn.transaction():
            for statement in BUILD:
                conn.execute(statement, {"jobs": jobs, "runs": runs})  # type: ignore[arg-type]
        conn.execute("VACUUM ANALYZE")
        differ = conn.execute("SELECT count(*) FROM ledger.verify_state()").fetchone()
        assert differ == (0,), f"the bulk-built state rows are not the log's: {differ}"
    return dsn, time.monotonic() - started


def _best_and_median(samples: list[float]) -> tuple[float, float]:
    return min(samples), statistics.median(samples)


def _rounds(rounds: int, body: Any) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        body()
        samples.append(time.perf_counter() - started)
    return _best_and_median(samples)


#: The per-job statements of one scrape (ledger.metrics.read_snapshot, without the --audit ones, and the
#: database's risks and the schedulers, a few rows whatever the number of jobs).
SCRAPE = [("state rows", queries.METRIC_JOBS, metrics.EVERY_JOB)]
#: Each statement's server time (``scrape_parts``): the state rows (each job's alert kinds with them),
#: and the job lines with the alerts by kind (the one statement of the text exposition).
PARTS = [*SCRAPE, ("job lines and alert counts", metrics.JOB_TEXT, metrics.EVERY_JOB)]


def scrape(conn: psycopg.Connection[Any]) -> None:
    """Every statement of one ledger.metrics.read_snapshot, fetched, in one read-only transaction."""
    with conn.transaction():
        conn.execute("SET TRANSACTION READ ONLY")
        for _, statement, params in SCRAPE:
            conn.execute(statement, params, prepare=False).fetchall()


def scrape_parts(conn: psycopg.Connection[Any], rounds: int, jobs: int) -> dict[str, float]:
    """The server's time for each statement of a scrape (best of the rounds, us per job)."""
    out = {}
    for name, statement, params in PARTS:
        wrapped = f"SELECT sum(hashtext(t::text)) FROM ({statement}) AS t"
        best, _ = _rounds(rounds, lambda: conn.execute(wrapped, params, prepare=False).fetchall())  # type: ignore[arg-type]
        out[name] = round(best * 1e6 / jobs, 2)
    return out


def measure(dsn: str, jobs: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET jit = off")
        states = dict(conn.execute("SELECT state, count(*) FROM ledger.job_health GROUP BY 1 ORDER BY 1").fetchall())
        out["states"] = states
        for name, view in VIEWS.items():
            server = _rounds(rounds, lambda: conn.execute(f"SELECT sum(hashtext(v::text)) FROM {view} v").fetchall())
            client = _rounds(rounds, lambda: conn.execute(f"SELECT * FROM {view}").fetchall())
            out[name] = {"server": server, "client": client}
        out["metrics scrape"] = {"client": _rounds(rounds, lambda: scrape(conn))}
        out["scrape parts"] = scrape_parts(conn, rounds, jobs)
        out["job lines"] = _rounds(rounds, lambda: conn.execute(metrics.JOB_TEXT, metrics.EVERY_JOB, prepare=False,
                                                                binary=True).fetchall())
        out["python writer"] = _rounds(rounds, lambda: metrics.text(metrics.samples(metrics.read_snapshot(conn))))
        out["exposition, open connection"] = _rounds(rounds, lambda: metrics.read_text(conn))
    for name, parts in (("exposition", metrics.DEFAULT_PARTS), ("exposition, one part", 1)):
        # what `jobledger metrics` prints: the collector's bytes, its connections opened
        collector = metrics.LedgerCollector(lambda: psycopg.connect(dsn, autocommit=True), raise_errors=True,
                                            parts=parts)
        out[name] = _rounds(rounds, collector.text)
    out.update(web(dsn, rounds))
    return out


def web(dsn: str, rounds: int) -> dict[str, tuple[float, float]]:
    """The dashboard's /api/jobs and jobs page, over HTTP (one warm-up read first: the pool opens)."""
    from ledger.web.app import create_app
    from ledger.web.server import BackgroundServer

    out = {}
    with BackgroundServer(create_app(dsn)) as server:
        for name, path in (("/api/jobs", "/api/jobs"), ("jobs page", "/")):
            urllib.request.urlopen(server.url + path, timeout=600).read()
            out[name] = _rounds(rounds, lambda: urllib.request.urlopen(server.url + path, timeout=600).read())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000", help="numbers of jobs, comma-separated")
    parser.add_argument("--runs", type=int, default=10, help="runs per job")
    parser.add_argument("--rounds", type=int, default=5, help="times each read is timed")
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--db", default=DB, help=f"the scratch database's name (default {DB})")
    args = parser.parse_args()
    results = []
    for jobs in (int(size) for size in args.sizes.split(",")):
        dsn, seconds = build(jobs, args.runs, args.db)
        result = measure(dsn, jobs, args.rounds)
        result.update(jobs=jobs, build_seconds=round(seconds, 1))
        results.append(result)
        print(f"{jobs} jobs x {args.runs} runs built in {seconds:.1f} s; states {result['states']}", flush=True)
    if not args.keep_db:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {args.db} WITH (FORCE)")

    def us(seconds: float, jobs: int) -> str:
        return f"{seconds * 1e6 / jobs:.2f}"

    def row(label: str, timed: list[tuple[float, float]]) -> None:
        """us per job at each size (best / median), and the largest size's best in seconds."""
        cells = [f"{us(best, r['jobs'])} / {us(median, r['jobs'])}" for (best, median), r in zip(timed, results)]
        print(f"| {label} | " + " | ".join(cells) + f" | {timed[-1][0]:.2f} s |")

    print("\n| read (us per job: best / median) | " + " | ".join(f"{r['jobs']:,} jobs" for r in results)
          + f" | {results[-1]['jobs']:,} jobs, total (best) |")
    print("|---|" + "---:|" * (len(results) + 1))
    for name in VIEWS:
        for side in ("server", "client"):
            row(f"`{name}` ({side})", [r[name][side] for r in results])
    row("metrics scrape (client, `METRIC_JOBS`)", [r["metrics scrape"]["client"] for r in results])
    labels = {"job lines": "metrics job lines and alert counts (`metrics.JOB_TEXT`, fetched as bytes)",
              "exposition": "metrics exposition (`jobledger metrics`, whole text, connections opened: in parts "
                            "from 10,000 jobs)",
              "exposition, one part": "metrics exposition in one part (`--parts 1`: one connection)",
              "exposition, open connection": "metrics exposition over an open connection, one part (`read_text`)",
              "python writer": "metrics exposition, Python writer (`text(samples(read_snapshot()))`)"}
    for name in ("job lines", "exposition", "exposition, one part", "exposition, open connection", "python writer",
                 "/api/jobs",
                 "jobs page"):
        row(labels.get(name, f"`{name}` (HTTP)"), [r[name] for r in results])
    print("\n| scrape statement (server, us per job, best) | " + " | ".join(f"{r['jobs']:,} jobs" for r in results)
          + " |")
    print("|---|" + "---:|" * len(results))
    for part in results[0]["scrape parts"]:
        print(f"| {part} | " + " | ".join(f"{r['scrape parts'][part]:.2f}" for r in results) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
