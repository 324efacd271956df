"""The scheduler at scale: N jobs on one schedule, served by two scheduler processes.

    .venv/bin/python benchmarks/bench_scheduler.py [--jobs 10000] [--every 60] [--jitter 10]
        [--slots 3] [--schedulers 2] [--runner function|command] [--max-runs 500]

Each job is scheduled every ``--every`` seconds (60: the issue's one-minute schedule; a shorter
interval gets data faster) with a ``--jitter`` bound, so the N starts of a slot are spread over
the jitter window as in production. ``--schedulers`` processes run the loop of
``ledger.scheduler.loop.Scheduler`` for ``--slots`` slots, with ``--runner function`` (a Python
function that returns at once: the loop and the ledger alone) or ``--runner command`` (``true`` as a
command through ``jobledger run``'s semantics: a process group and a reaper per run).

It reports, from the log:

- the lag from due time to start, ``started_at - slot - ledger.slot_jitter(job, slot)``, p50 / p99 / max;
- the SQL calls per started run: the loop's own calls (start_due_runs, next_start, scheduler_heartbeat,
  upkeep) counted in the loop, divided by the runs it started, plus the run's end (complete_run, one
  call per run; heartbeats only for runs longer than ttl/3, none here);
- each scheduler's peak resident memory (VmHWM).

It uses a scratch database on the server named by LEDGER_BENCH_DSN (default the local postgres),
dropped at the end. The machine is what it is (shared, 2 cores here): the lag includes waiting for
a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
DATABASE = "ledger_bench_scheduler"

# One scheduler process: the library's loop over the jobs, until stdin closes; then its stats.
SCHEDULER = r"""
import json, sys, threading
from datetime import timedelta
from ledger.scheduler.jobsfile import JobDefinition
from ledger.scheduler.loop import CallableRunner, Scheduler

dsn, count, runner_kind, max_runs = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
every, jitter = sys.argv[5], sys.argv[6]
names = [f"bench-{i:05d}" for i in range(count)]
register = {"schedule": f"{every} seconds", "ttl": timedelta(minutes=5), "jitter": timedelta(seconds=float(jitter)),
            "max_backfill": 1}
if runner_kind == "command":
    from ledger.wrapper import CommandRunner
    jobs = {name: JobDefinition(name=name, register=register, command=("true",)) for name in names}
    runner = CommandRunner(dsn, say=lambda message: None)
else:
    jobs = {name: JobDefinition(name=name, register=register) for name in names}
    runner = CallableRunner({name: (lambda run: None) for name in names})
loop = Scheduler(dsn, runner, jobs=jobs, source="bench", max_runs=max_runs, say=lambda m: print(m, file=sys.stderr))
threading.Thread(target=lambda: (sys.stdin.read(), loop.stop()), daemon=True).start()
loop.run()
peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"calls": loop.stats.calls, "started": loop.stats.started, "rounds": loop.stats.rounds,
                  "peak_rss_kb": int(peak)}))
"""


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10000)
    parser.add_argument("--every", type=int, default=60, help="the schedule's interval, seconds")
    parser.add_argument("--jitter", type=float, default=10.0, help="the jitter bound, seconds (< --every)")
    parser.add_argument("--slots", type=int, default=3, help="slots to measure (after the first one)")
    parser.add_argument("--schedulers", type=int, default=2)
    parser.add_argument("--runner", choices=("function", "command"), default="function")
    parser.add_argument("--max-runs", type=int, default=500, help="each scheduler's cap on live runs")
    args = parser.parse_args()

    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DATABASE}")
    dsn = make_conninfo(ADMIN_DSN, dbname=DATABASE)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        from ledger.migrate import install_script

        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(install_script())  # type: ignore[arg-type]
        processes = [subprocess.Popen([sys.executable, "-c", SCHEDULER, dsn, str(args.jobs), args.runner,
                                       str(args.max_runs), str(args.every), str(args.jitter)],
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for _ in range(args.schedulers)]
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 60 + args.every * (args.slots + 2)
            while time.monotonic() < deadline:  # the first slot's runs warm up; then --slots full ones
                time.sleep(1)
                slots = conn.execute("SELECT count(DISTINCT slot) FROM ledger.job_execution_log "
                                     "WHERE status = 'success'").fetchone()[0]
                if slots >= args.slots + 1:
                    break
            time.sleep(args.jitter + 2)  # the last slot's jittered starts
        outputs = [process.communicate(input="", timeout=300)[0] for process in processes]
        stats = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
        with psycopg.connect(dsn, autocommit=True) as conn:
            first = conn.execute("SELECT min(slot) FROM ledger.job_execution_log").fetchone()[0]
            rows = conn.execute(
                "SELECT extract(epoch FROM r.started_at - r.slot - ledger.slot_jitter(r.job, r.slot)) "
                "FROM ledger.job_execution_log r WHERE r.slot > %s AND r.status <> 'running'", (first,)).fetchall()
            duplicates = conn.execute("SELECT count(*) FROM ledger.duplicates").fetchone()[0]
            per_slot = conn.execute("SELECT slot, count(*) FROM ledger.job_execution_log WHERE slot > %s "
                                    "GROUP BY slot ORDER BY slot", (first,)).fetchall()
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
    lags = [float(row[0]) for row in rows]
    started = sum(s["started"] for s in stats)
    loop_calls = sum(sum(s["calls"].values()) for s in stats)
    calls: dict[str, int] = {}
    for s in stats:
        for name, count in s["calls"].items():
            calls[name] = calls.get(name, 0) + count
    print(f"{args.jobs} jobs every {args.every}s (jitter < {args.jitter}s), {args.schedulers} schedulers, "
          f"runner {args.runner}, max_runs {args.max_runs}")
    print(f"runs per measured slot: {[count for _, count in per_slot]}; duplicates: {duplicates}")
    if lags:
        print(f"lag due->start (jitter excluded), {len(lags)} runs: p50 {percentile(lags, 0.5) * 1000:.0f} ms, "
              f"p99 {percentile(lags, 0.99) * 1000:.0f} ms, max {max(lags) * 1000:.0f} ms, "
              f"mean {statistics.mean(lags) * 1000:.0f} ms")
    print(f"loop calls: {calls}; rounds {[s['rounds'] for s in stats]}")
    if started:
        print(f"SQL calls per run: {loop_calls / started:.3f} by the loop (start_due_runs, next_start, heartbeat, "
              f"upkeep) + 1 to end it (complete_run) = {loop_calls / started + 1:.3f}")
    print(f"peak resident memory per scheduler: {[round(s['peak_rss_kb'] / 1024) for s in stats]} MB")


if __name__ == "__main__":
    main()
