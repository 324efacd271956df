"""Memory and threads of the Python client with 1,000 runs open at once, heartbeating (issue 14, point 3).

    .venv/bin/python benchmarks/bench_concurrent_runs.py                  # 1,000 runs, sync and async, pool of 10
    .venv/bin/python benchmarks/bench_concurrent_runs.py --runs 50 --hold 5 --client sync
    .venv/bin/python benchmarks/bench_concurrent_runs.py --pool-size 0    # a pool of N (the old sizing)
    .venv/bin/python benchmarks/bench_concurrent_runs.py --json /tmp/runs.json

What it measures, for the sync ``Ledger`` and for the asyncio ``AsyncLedger``:
N runs (``job-1`` .. ``job-N``, no registration: ``start_run`` with a ttl of
30 s) held open together for ``--hold`` seconds, each heartbeating every
``--heartbeat-interval``. The sync client gets N threads, each in
``with ledger.run(...)``; the async client N tasks, each in
``async with ledger.run(...)``. Both use ``Ledger(dsn)`` / ``AsyncLedger(dsn)``
with a pool of their own whose ``max_size`` is ``--pool-size`` (default 10,
the client's own default; 0: N) and the default ``min_size`` (1). Each call
of a context (its start, each heartbeat, its end) borrows a pool connection
and gives it back after it (``_AsyncControl.call`` in ``ledger/aio.py``,
``_Control.call`` in ``ledger/client.py``), so N open runs share the pool.
Before that change a context held one for its whole life and the pool had
to be N; ``--pool-size 0`` is that sizing (with the new client the pool
then grows only as far as the calls in flight). A
start waits 16 s at most for a free connection (its call bound, 11 s, plus
the connect timeout, 5 s), a heartbeat until its lease's local deadline;
a pool with none free by then raises LedgerUnavailable. At most
``--start-concurrency`` runs (100) are being started at once; the others
wait for their turn before ``ledger.run``. With ``--start-concurrency 0``
all N start at once.

Each client runs in a fresh child process, so that one's memory is not the
other's baseline. The child reads, from ``/proc/self/status``:

- the baseline: VmRSS and Threads after the imports, the ``Ledger`` (its
  pool open) and one monitoring connection, before any run;
- while all N runs are open (sampled every second of the hold): VmRSS (the
  highest sample), VmHWM, Threads and ``threading.active_count()``, the
  threads by name (the benchmark's own, the client's heartbeats and
  watchdogs, the pool's; the async client's tasks by coroutine), the
  server connections of the client (``pg_stat_activity`` by
  ``application_name``), with the memory of their server processes at the
  end of the hold (Pss and private, ``/proc/PID/smaps_rollup``), and the
  oldest ``heartbeat_at`` of the open runs (how late a heartbeat got);
- the peak of those server connections over the child's whole life
  (polled every 0.1 s while the runs open, during the hold and while they
  end), by phase, and the pool's own counters (``get_stats()``: requests,
  how many waited and how long, errors);
- after all runs have ended: the threads at once, and again after
  ``--linger`` seconds (the sync client parks finished threads for 30 s
  for reuse: ``ledger/_acompat.py``), and after ``ledger.close()``.

The per-run cost is (RSS with N open - baseline) / N. It includes what the
benchmark itself needs per run (a thread in the sync client, a task in the
async one); the reference row ``bare threads`` is N threads that only wait
on an event, without the ledger, in a child of their own.

The heartbeats: the server counts every ``ledger.heartbeat`` call
(``track_functions = 'pl'``, ``pg_stat_user_functions``); each run's
``heartbeat_at`` is read at the start and at the end of the hold, and every
run must have heartbeated during it. After each client: every run ended as
``success``, one per job, none lost (no ``LeaseLost``, no run left
running), ``ledger.overlaps`` and ``ledger.duplicates`` empty. Any of these
failing fails the benchmark (non-zero exit, after the table of what was
measured). The child's warnings (a heartbeat that failed and was retried)
are counted from its stderr.

The server is a private cluster in a temporary directory (tests/cluster.py:
as the ``postgres`` user when run as root), ``max_connections`` = N + 50,
``shared_buffers`` = 128MB, and ``fsync``, ``synchronous_commit`` and
``full_page_writes`` off: this measures the client's memory and threads,
not the speed of commits. It is stopped and removed at the end, also on
error. Timings (the time to open all N runs) are informational: on a shared
2-core machine they are noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/cluster.py: the private cluster

TTL = timedelta(seconds=30)


# -- what the process holds ---------------------------------------------------

def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM (kB) and Threads of this process, from /proc/self/status."""
    wanted = {"VmRSS", "VmHWM", "Threads"}
    found: dict[str, int] = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in wanted:
                found[key] = int(value.split()[0])
    return found


def thread_kinds() -> dict[str, int]:
    """The live Python threads by kind: their name up to the first ':' or '-<digits>'."""
    kinds: Counter[str] = Counter()
    for thread in threading.enumerate():
        kinds[re.split(r":|-\d+$|_\d+$", thread.name)[0]] += 1
    return dict(sorted(kinds.items()))


def sample(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    status = proc_status()
    return {"rss_kb": status["VmRSS"], "hwm_kb": status["VmHWM"], "threads": status["Threads"],
            "active_count": threading.active_count(), "kinds": thread_kinds(), **(extra or {})}


def task_kinds() -> dict[str, int]:
    """The asyncio tasks by the coroutine they run."""
    kinds: Counter[str] = Counter()
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        kinds[getattr(coro, "__qualname__", type(coro).__name__)] += 1
    return dict(sorted(kinds.items()))


BACKENDS = "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s"


def backend_memory(pids: list[int]) -> dict[str, Any]:
    """The server processes of the client's connections: Pss and private memory (kB), from /proc (same machine)."""
    pss = private = seen = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                fields = {line.split(":")[0]: int(line.split()[1]) for line in rollup if line.endswith("kB\n")}
        except OSError:
            continue
        seen += 1
        pss += fields.get("Pss", 0)
        private += fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {"backends": seen, "pss_kb": pss, "private_kb": private}


CONNECTIONS = ("SELECT count(*) FROM pg_stat_activity"
               " WHERE datname = current_database() AND application_name = %s")
HEARTBEATS_OF = ("SELECT run_id, heartbeat_at, heartbeat_at > started_at FROM ledger.job_execution_log"
                 " WHERE owner = %s AND status = 'running'")


def heartbeat_progress(first: list[tuple[Any, ...]], last: list[tuple[Any, ...]]) -> dict[str, int]:
    before = {run_id: at for run_id, at, _ in first}
    return {"running_at_hold_start": len(first), "running_at_hold_end": len(last),
            "heartbeated_by_hold_end": sum(1 for _, _, beat in last if beat),
            "advanced_during_hold": sum(1 for run_id, at, _ in last if run_id in before and at > before[run_id])}


HEARTBEAT_AGE = ("SELECT coalesce(max(extract(epoch FROM clock_timestamp() - heartbeat_at)), 0)::float8"
                 "  FROM ledger.job_execution_log WHERE owner = %s AND status = 'running'")


class Peaks:
    """The highest count of the client's server connections, by phase (polled at most every ``every`` s)."""

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.by_phase: dict[str, int] = {}
        self._next = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def record(self, phase: str, connections: int) -> None:
        self._next = time.monotonic() + self.every
        self.by_phase[phase] = max(self.by_phase.get(phase, 0), connections)

    def summary(self) -> dict[str, Any]:
        return {"peak": max(self.by_phase.values(), default=0), "by_phase": dict(self.by_phase)}


def pool_stats(pool: Any) -> dict[str, Any]:
    """The pool's counters (psycopg_pool ``get_stats``) and max_size."""
    if pool is None:
        return {}
    return {"max_size": pool.max_size, **pool.get_stats()}


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    return {"count": len(ordered), "median": ordered[len(ordered) // 2],
            "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], "max": ordered[-1]}


def heartbeat_age_summary(ages: list[float]) -> dict[str, float]:
    return {"max_s": max(ages, default=0.0), "samples": len(ages)}


# -- the children: one client each ---------------------------------------------

def sync_child(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    from ledger import Ledger, _acompat

    n, app = args.runs, "bench-sync"
    pool_size = args.pool_size or n
    interval = timedelta(seconds=args.heartbeat_interval)
    monitor = psycopg.connect(args.dsn, autocommit=True)
    ledger = Ledger(args.dsn, pool_kwargs={"max_size": pool_size, "kwargs": {"application_name": app}})
    owner = ledger.owner
    peaks = Peaks()
    ages: list[float] = []

    def connections(phase: str | None = None) -> int:
        row = monitor.execute(CONNECTIONS, (app,)).fetchone()
        assert row is not None
        if phase is not None:
            peaks.record(phase, int(row[0]))
        return int(row[0])

    def heartbeat_age() -> float:
        row = monitor.execute(HEARTBEAT_AGE, (owner,)).fetchone()
        assert row is not None
        ages.append(float(row[0]))
        return ages[-1]

    time.sleep(0.5)
    result: dict[str, Any] = {"client": "sync", "runs": n, "owner": owner, "pool_max_size": pool_size,
                              "baseline": sample({"connections": connections("baseline")})}

    lock = threading.Lock()
    entered = failed = 0
    all_in = threading.Event()
    release = threading.Event()
    errors: list[str] = []
    ended: list[tuple[int | None, str | None, bool]] = []
    start_seconds: list[float] = []  # from ledger.run to inside it, per run (list.append is atomic)

    gate = threading.BoundedSemaphore(args.start_concurrency) if args.start_concurrency else None

    def body(i: int) -> None:
        nonlocal entered, failed
        inside = False
        gated = gate is not None and gate.acquire()
        asked = time.monotonic()
        try:
            with ledger.run(f"job-{i}", ttl=TTL, heartbeat_interval=interval) as run:
                start_seconds.append(time.monotonic() - asked)
                if gated:
                    gate.release()  # type: ignore[union-attr]
                    gated = False
                if not run.started:
                    raise RuntimeError(f"job-{i} did not start: {run.outcome}")
                inside = True
                with lock:
                    entered += 1
                    if entered + failed == n:
                        all_in.set()
                release.wait()
                lost = run.is_lost()
            with lock:
                ended.append((run.run_id, None if run.result is None else run.result.status, lost))
        except BaseException as error:
            with lock:
                errors.append(f"job-{i} ({'after' if inside else 'before'} entering): "
                              f"{type(error).__name__}: {error}")
                if not inside:
                    failed += 1
                    if entered + failed == n:
                        all_in.set()
        finally:
            if gated:
                gate.release()  # type: ignore[union-attr]

    threads = [threading.Thread(target=body, args=(i,), name=f"bench-run-{i}", daemon=True)
               for i in range(1, n + 1)]
    started = time.monotonic()
    try:
        for thread in threads:
            thread.start()
            if peaks.due():
                connections("open")
        while True:
            connections("open")
            if all_in.wait(0.1):
                break
            if time.monotonic() - started > args.open_timeout:
                raise RuntimeError(f"only {entered} of {n} runs open after {args.open_timeout}s "
                                   f"({failed} failed): {errors[:5]}")
        result["open_seconds"] = time.monotonic() - started
        result["entered"], result["failed_to_enter"] = entered, failed
        held = hold(args, lambda: sample({"connections": connections("hold"), "heartbeat_age": heartbeat_age()}),
                    lambda: monitor.execute(HEARTBEATS_OF, (owner,)).fetchall(), time.sleep,
                    lambda: connections("hold"))
        result.update(held)
        result["server_memory"] = backend_memory([pid for pid, in monitor.execute(BACKENDS, (app,)).fetchall()])
        result["pool_at_hold_end"] = pool_stats(ledger._pool)
    finally:
        release.set()
        limit = time.monotonic() + 60
        for thread in threads:
            while thread.is_alive() and time.monotonic() < limit:
                thread.join(0.1)
                if peaks.due():
                    connections("end")
    result["all_joined"] = not any(thread.is_alive() for thread in threads)
    result["heartbeat_age"] = heartbeat_age_summary(ages)
    result["start_seconds"] = spread(start_seconds)
    result["ended"] = summarize_ended(ended, n)
    result["errors"] = errors
    result["after_end"] = sample({"parked": _acompat.parked(),
                                  "connections": connections("end")})
    result["server_connections"] = peaks.summary()
    result["pool"] = pool_stats(ledger._pool)
    time.sleep(args.linger)
    result["after_linger"] = sample({"parked": _acompat.parked()})
    ledger.close()
    time.sleep(0.5)
    result["after_close"] = sample({"parked": _acompat.parked(),
                                    "connections": connections()})
    monitor.close()
    return result


def hold(args: argparse.Namespace, take: Any, runs_now: Any, sleep: Any, poll: Any) -> dict[str, Any]:
    """Sync: sample every second of the hold (the highest RSS and thread count win), poll connections between."""
    first = runs_now()
    samples = [take()]
    end = time.monotonic() + args.hold
    while time.monotonic() < end:
        next_sample = min(end, time.monotonic() + 1.0)
        while time.monotonic() < next_sample:
            sleep(min(0.1, max(0.0, next_sample - time.monotonic())))
            poll()
        samples.append(take())
    last = runs_now()
    return {"loaded": peak(samples), "samples": len(samples), "heartbeats": heartbeat_progress(first, last)}


def peak(samples: list[dict[str, Any]]) -> dict[str, Any]:
    top = max(samples, key=lambda s: s["rss_kb"])
    return top | {"threads": max(s["threads"] for s in samples),
                  "active_count": max(s["active_count"] for s in samples),
                  "connections": max(s["connections"] for s in samples),
                  "heartbeat_age": max(s.get("heartbeat_age", 0.0) for s in samples),
                  "hwm_kb": max(s["hwm_kb"] for s in samples)}


def summarize_ended(ended: list[tuple[int | None, str | None, bool]], n: int) -> dict[str, Any]:
    return {"count": len(ended), "statuses": dict(Counter(str(status) for _, status, _ in ended)),
            "lost": sum(1 for _, _, lost in ended if lost), "distinct_run_ids": len({r for r, _, _ in ended})}


def async_child(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_async_child(args))


async def _async_child(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    from ledger import AsyncLedger

    n, app = args.runs, "bench-async"
    interval = timedelta(seconds=args.heartbeat_interval)
    pool_size = args.pool_size or n
    monitor = await psycopg.AsyncConnection.connect(args.dsn, autocommit=True)
    peaks = Peaks()
    ages: list[float] = []

    async def connections(phase: str | None = None) -> int:
        cur = await monitor.execute(CONNECTIONS, (app,))
        count = int((await cur.fetchone())[0])  # type: ignore[index]
        if phase is not None:
            peaks.record(phase, count)
        return count

    async def heartbeat_age() -> float:
        cur = await monitor.execute(HEARTBEAT_AGE, (owner,))
        ages.append(float((await cur.fetchone())[0]))  # type: ignore[index]
        return ages[-1]

    async def runs_now() -> list[tuple[Any, ...]]:
        cur = await monitor.execute(HEARTBEATS_OF, (owner,))
        return await cur.fetchall()

    ledger = AsyncLedger(args.dsn, pool_kwargs={"max_size": pool_size, "kwargs": {"application_name": app}})
    await ledger.open()
    owner = ledger.owner
    await asyncio.sleep(0.5)
    result: dict[str, Any] = {"client": "async", "runs": n, "owner": owner, "pool_max_size": pool_size,
                              "baseline": sample({"connections": await connections("baseline"),
                                                  "tasks": len(asyncio.all_tasks())})}
    entered = failed = 0
    all_in = asyncio.Event()
    release = asyncio.Event()
    errors: list[str] = []
    ended: list[tuple[int | None, str | None, bool]] = []
    start_seconds: list[float] = []  # from ledger.run to inside it, per run

    gate = asyncio.BoundedSemaphore(args.start_concurrency) if args.start_concurrency else None

    async def body(i: int) -> None:
        nonlocal entered, failed
        inside = False
        gated = False
        if gate is not None:
            await gate.acquire()
            gated = True
        asked = time.monotonic()
        try:
            async with ledger.run(f"job-{i}", ttl=TTL, heartbeat_interval=interval) as run:
                start_seconds.append(time.monotonic() - asked)
                if gated:
                    gate.release()  # type: ignore[union-attr]
                    gated = False
                if not run.started:
                    raise RuntimeError(f"job-{i} did not start: {run.outcome}")
                inside = True
                entered += 1
                if entered + failed == n:
                    all_in.set()
                await release.wait()
                lost = run.is_lost()
            ended.append((run.run_id, None if run.result is None else run.result.status, lost))
        except BaseException as error:
            errors.append(f"job-{i} ({'after' if inside else 'before'} entering): {type(error).__name__}: {error}")
            if not inside:
                failed += 1
                if entered + failed == n:
                    all_in.set()
        finally:
            if gated:
                gate.release()  # type: ignore[union-attr]

    async def loaded_sample() -> dict[str, Any]:
        return sample({"connections": await connections("hold"), "heartbeat_age": await heartbeat_age(),
                       "tasks": len(asyncio.all_tasks())})

    started = time.monotonic()
    tasks = [asyncio.create_task(body(i), name=f"bench-run-{i}") for i in range(1, n + 1)]
    try:
        while not all_in.is_set():
            try:
                await asyncio.wait_for(all_in.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
            await connections("open")
            if not all_in.is_set() and time.monotonic() - started > args.open_timeout:
                raise RuntimeError(f"only {entered} of {n} runs open after {args.open_timeout}s "
                                   f"({failed} failed): {errors[:5]}")
        result["open_seconds"] = time.monotonic() - started
        result["entered"], result["failed_to_enter"] = entered, failed
        first = await runs_now()
        samples = [await loaded_sample()]
        end = time.monotonic() + args.hold
        while time.monotonic() < end:
            next_sample = min(end, time.monotonic() + 1.0)
            while time.monotonic() < next_sample:
                await asyncio.sleep(min(0.1, max(0.0, next_sample - time.monotonic())))
                await connections("hold")
            samples.append(await loaded_sample())
        last = await runs_now()
        result["task_kinds"] = task_kinds()
        cur = await monitor.execute(BACKENDS, (app,))
        result["server_memory"] = backend_memory([pid for pid, in await cur.fetchall()])
        result["pool_at_hold_end"] = pool_stats(ledger._pool)
        result["loaded"] = peak(samples) | {"tasks": max(s["tasks"] for s in samples)}
        result["samples"] = len(samples)
        result["heartbeats"] = heartbeat_progress(first, last)
    finally:
        release.set()
        limit = time.monotonic() + 60
        pending = set(tasks)
        while pending and time.monotonic() < limit:
            _, pending = await asyncio.wait(pending, timeout=0.1)
            await connections("end")
    result["all_joined"] = not pending
    result["heartbeat_age"] = heartbeat_age_summary(ages)
    result["start_seconds"] = spread(start_seconds)
    result["ended"] = summarize_ended(ended, n)
    result["errors"] = errors
    result["after_end"] = sample({"connections": await connections("end"), "tasks": len(asyncio.all_tasks())})
    result["server_connections"] = peaks.summary()
    result["pool"] = pool_stats(ledger._pool)
    await asyncio.sleep(args.linger)
    result["after_linger"] = sample({"tasks": len(asyncio.all_tasks())})
    await ledger.close()
    await asyncio.sleep(0.5)
    result["after_close"] = sample({"connections": await connections(), "tasks": len(asyncio.all_tasks())})
    await monitor.close()
    return result


def bare_threads_child(args: argparse.Namespace) -> dict[str, Any]:
    """The reference: N threads that only wait on an event (what the sync benchmark's own threads cost)."""
    import psycopg  # noqa: F401  (the same imports as the sync child, so the baselines compare)

    import ledger  # noqa: F401

    time.sleep(0.5)
    result: dict[str, Any] = {"client": "bare threads", "runs": args.runs, "baseline": sample()}
    release = threading.Event()
    threads = [threading.Thread(target=release.wait, name=f"bench-run-{i}", daemon=True)
               for i in range(1, args.runs + 1)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    result["open_seconds"] = time.monotonic() - started
    samples = []
    for _ in range(3):
        time.sleep(1)
        samples.append(sample())
    top = max(samples, key=lambda s: s["rss_kb"])
    result["loaded"] = top | {"threads": max(s["threads"] for s in samples)}
    release.set()
    for thread in threads:
        thread.join()
    result["after_end"] = sample()
    return result


CHILDREN = {"sync": sync_child, "async": async_child, "bare": bare_threads_child}


# -- the parent: the cluster, the children, the checks ------------------------------

def heartbeat_calls(conn: Any) -> int:
    row = conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions"
                       " WHERE schemaname = 'ledger' AND funcname = 'heartbeat'").fetchone()
    return int(row[0])


def check_ledger(conn: Any, result: dict[str, Any]) -> list[str]:
    """What the ledger recorded for the child's runs; the list of what is wrong (empty: all good)."""
    n, owner = result["runs"], result["owner"]
    problems: list[str] = []
    statuses = dict(conn.execute("SELECT status, count(*) FROM ledger.job_execution_log WHERE owner = %s"
                                 " GROUP BY status", (owner,)).fetchall())
    jobs, beat = conn.execute(
        "SELECT count(DISTINCT job), count(*) FILTER (WHERE heartbeat_at > started_at)"
        "  FROM ledger.job_execution_log WHERE owner = %s", (owner,)).fetchone()
    overlaps = conn.execute("SELECT count(*) FROM ledger.overlaps").fetchone()[0]
    duplicates = conn.execute("SELECT count(*) FROM ledger.duplicates").fetchone()[0]
    running = conn.execute("SELECT count(*) FROM ledger.job_execution_log WHERE status = 'running'").fetchone()[0]
    result["ledger"] = {"statuses": statuses, "distinct_jobs": jobs, "heartbeated": beat,
                        "overlaps": overlaps, "duplicates": duplicates, "running_anywhere": running}
    if statuses != {"success": n}:
        problems.append(f"statuses {statuses}, expected {{'success': {n}}}")
    if jobs != n:
        problems.append(f"runs of {jobs} distinct jobs, expected {n}")
    if beat != n:
        problems.append(f"{beat} of {n} runs heartbeated")
    if overlaps or duplicates or running:
        problems.append(f"overlaps {overlaps}, duplicates {duplicates}, runs still running {running}")
    if result.get("failed_to_enter"):
        problems.append(f"{result['failed_to_enter']} runs failed to open")
    if result.get("errors"):
        problems.append(f"{len(result['errors'])} errors in the runs: {result['errors'][:5]}")
    ended = result.get("ended", {})
    if ended.get("count") != n or ended.get("statuses") != {"success": n} or ended.get("lost"):
        problems.append(f"the client saw {ended}")
    if not result.get("all_joined", False):
        problems.append("not every run's thread/task ended")
    hb = result.get("heartbeats", {})
    if hb.get("advanced_during_hold") != n:
        problems.append(f"{hb.get('advanced_during_hold')} of {n} runs heartbeated during the hold")
    return problems


def run_child(kind: str, args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, __file__, "--child", kind, "--dsn", dsn, "--out", out.name,
                   "--runs", str(args.runs), "--heartbeat-interval", str(args.heartbeat_interval),
                   "--hold", str(args.hold), "--linger", str(args.linger),
                   "--start-concurrency", str(args.start_concurrency), "--open-timeout", str(args.open_timeout),
                   "--pool-size", str(args.pool_size)]
        done = subprocess.run(command, text=True, capture_output=True,
                              timeout=args.open_timeout + args.hold + args.linger + 300)
        if done.returncode != 0:
            raise RuntimeError(f"the {kind} child failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                               f"{done.stderr[-5000:]}")
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        result["stderr_tail"] = done.stderr[-2000:]
        result["warnings"] = warning_counts(done.stderr)
        return result


def warning_counts(stderr: str) -> dict[str, int]:
    """The child's log lines (the client logs a failed heartbeat as a warning), by kind."""
    kinds: Counter[str] = Counter()
    for line in stderr.splitlines():
        if "heartbeat of job" in line and "retrying" in line:
            kinds["heartbeat failed, retried"] += 1
        elif "could not record its end" in line:
            kinds["end not recorded"] += 1
        elif "broke" in line and "sending it again" in line:
            kinds["call sent again on a new connection"] += 1
        elif "Traceback" in line:
            kinds["traceback"] += 1
        elif "WARNING" in line.upper() or "ERROR" in line.upper():
            kinds["other warning or error"] += 1
    return dict(kinds)


def mb(kb: int) -> str:
    return f"{kb / 1024:.1f}"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| client | runs | pool max_size | baseline RSS MB | RSS with N runs open MB | per run KB "
             "| threads baseline | threads with N open | server connections (peak) | server backends Pss MB "
             "| runs that heartbeated | time to open all N (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "loaded" not in r:
            continue
        n, base, loaded = r["runs"], r["baseline"], r["loaded"]
        opened = r.get("entered", n)
        per_run = (loaded["rss_kb"] - base["rss_kb"]) / max(1, opened)
        runs = f"{n:,}" if opened == n else f"{opened:,} of {n:,} (FAILED)"
        if r["client"] == "bare threads":
            pool = conns = server = beat = "-"
            name = "(reference) bare threads, no ledger"
        else:
            pool = f"{r['pool_max_size']:,}"
            conns = f"{r.get('server_connections', {}).get('peak', loaded['connections']):,}"
            server = mb(r["server_memory"]["pss_kb"]) if "server_memory" in r else "?"
            beat = f"{r['heartbeats']['advanced_during_hold']:,}"
            name = f"{r['client']} (`{'Ledger' if r['client'] == 'sync' else 'AsyncLedger'}`)"
        lines.append(f"| {name} | {runs} | {pool} | {mb(base['rss_kb'])} | {mb(loaded['rss_kb'])} | {per_run:.0f} "
                     f"| {base['threads']} | {loaded['threads']:,} | {conns} | {server} | {beat} "
                     f"| {r['open_seconds']:.1f} |")
    return "\n".join(lines)


def details(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        if "loaded" not in r:
            continue
        loaded = r["loaded"]
        lines.append(f"- {r['client']}: threads by kind with N open {loaded['kinds']}; VmHWM {mb(loaded['hwm_kb'])} MB")
        if "after_linger" in r:
            lines.append(f"  threads after all runs ended: {r['after_end']['threads']} at once "
                         f"(parked {r['after_end'].get('parked', '-')}), "
                         f"{r['after_linger']['threads']} after {r['linger']:g} s, "
                         f"{r['after_close']['threads']} after close(); "
                         f"server connections after the runs {r['after_end']['connections']}, "
                         f"after close() {r['after_close']['connections']}; "
                         f"RSS after close() {mb(r['after_close']['rss_kb'])} MB, "
                         f"VmHWM by then {mb(r['after_close']['hwm_kb'])} MB")
        if "server_memory" in r:
            mem = r["server_memory"]
            lines.append(f"  the server processes of its {mem['backends']} connections: Pss "
                         f"{mb(mem['pss_kb'])} MB, private {mb(mem['private_kb'])} MB "
                         f"({mem['private_kb'] / max(1, mem['backends']):.0f} kB private per connection)")
        if "heartbeat_calls" in r:
            lines.append(f"  ledger.heartbeat calls on the server: {r['heartbeat_calls']:,} "
                         f"({r['heartbeat_calls'] / r['runs']:.1f} per run); ledger: {r.get('ledger')}")
        if "tasks" in loaded:
            lines.append(f"  asyncio tasks with N open: {loaded['tasks']:,} {r.get('task_kinds', '')}")
        if "server_connections" in r:
            lines.append(f"  server connections: peak {r['server_connections']['peak']} of a pool of "
                         f"{r['pool_max_size']} (by phase {r['server_connections']['by_phase']}); "
                         f"oldest heartbeat_at of an open run during the hold "
                         f"{r['heartbeat_age']['max_s']:.2f} s (heartbeat every {r['heartbeat_interval']:g} s)")
        if r.get("start_seconds"):
            st = r["start_seconds"]
            lines.append(f"  a run's start (ledger.run to inside it): median {st['median'] * 1000:.0f} ms, "
                         f"p99 {st['p99'] * 1000:.0f} ms, max {st['max'] * 1000:.0f} ms "
                         f"(a start waits 16 s at most for a connection)")
        if r.get("pool"):
            p = r["pool"]
            queued, waited = p.get("requests_queued", 0), p.get("requests_wait_ms", 0)
            lines.append(f"  pool: {p.get('requests_num', 0):,} requests, {queued:,} of them waited "
                         f"({waited / max(1, queued):.1f} ms on average, {waited / 1000:.1f} s in all), "
                         f"{p.get('requests_errors', 0)} timed out; {p.get('connections_num', 0)} connections "
                         f"opened, {p.get('connections_errors', 0)} failed, {p.get('returns_bad', 0)} returned bad")
        if r.get("warnings") is not None:
            lines.append(f"  the child's warnings: {r['warnings'] or 'none'}")
        if r.get("errors"):
            kinds = Counter(re.sub(r"job-\d+", "job-N", e)[:200] for e in r["errors"])
            lines.append(f"  errors in the runs ({len(r['errors'])}): {dict(kinds.most_common(5))}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs open at once (default 1000)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats (1)")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds all runs stay open together (10)")
    parser.add_argument("--client", choices=("sync", "async", "both"), default="both")
    parser.add_argument("--linger", type=float, default=35.0,
                        help="seconds to wait after the runs end before counting threads again (35: the sync "
                             "client keeps finished threads 30 s for reuse)")
    parser.add_argument("--start-concurrency", type=int, default=100,
                        help="at most this many runs being started at once (default 100; 0: all N at once)")
    parser.add_argument("--open-timeout", type=float, default=300.0, help="give up opening the N runs after this")
    parser.add_argument("--pool-size", type=int, default=10,
                        help="the pool's max_size (default 10, the client's default; 0: N, one connection per "
                             "run, the setup before each call gave its connection back)")
    parser.add_argument("--no-reference", action="store_true", help="skip the bare-threads reference row")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=tuple(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--dsn", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = CHILDREN[args.child](args)
        result["linger"] = args.linger
        result["heartbeat_interval"] = args.heartbeat_interval
        Path(args.out).write_text(json.dumps(result, default=str))
        return 0

    from cluster import Cluster  # type: ignore[import-not-found]  # tests/cluster.py

    root = Path(tempfile.mkdtemp(prefix="ledger-bench-runs-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster = Cluster(root, "bench")
    results: list[dict[str, Any]] = []
    problems: dict[str, list[str]] = {}
    server = "?"
    try:
        cluster.initdb()
        cluster.configure(max_connections=args.runs + 50, shared_buffers="128MB", fsync="off",
                          synchronous_commit="off", full_page_writes="off", track_functions="pl")
        cluster.start()
        cluster.install_ledger()
        dsn = cluster.dsn()
        with cluster.connect() as conn:
            server = conn.execute("SHOW server_version").fetchone()[0]
        kinds = ["sync", "async"] if args.client == "both" else [args.client]
        if "sync" in kinds and not args.no_reference:
            kinds.append("bare")
        for kind in kinds:
            print(f"{kind}: {args.runs} runs, heartbeat every {args.heartbeat_interval:g} s, "
                  f"held {args.hold:g} s, pool max_size {args.pool_size or args.runs}, "
                  f"start concurrency {args.start_concurrency or 'all'} ...", flush=True)
            with cluster.connect() as conn:
                before = heartbeat_calls(conn)
            try:
                result = run_child(kind, args, dsn)
            except Exception as error:
                problems[kind] = [str(error)]
                print(error, file=sys.stderr)
                continue
            results.append(result)
            if kind != "bare":
                time.sleep(1.0)  # the backends' function stats reach the server as they exit
                with cluster.connect() as conn:
                    result["heartbeat_calls"] = heartbeat_calls(conn) - before
                    found = check_ledger(conn, result)
                if found:
                    problems[kind] = found
    finally:
        cluster.stop("fast")
        shutil.rmtree(root, ignore_errors=True)

    if results:
        print(f"\nPostgreSQL {server} (max_connections {args.runs + 50}); Python {sys.version.split()[0]}; "
              f"{os.cpu_count()} cores")
        print()
        print(table(results))
        print()
        print(details(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "max_connections": args.runs + 50,
                                         "pool_max_size": args.pool_size or args.runs,
                                         "results": results, "problems": problems, "server": server},
                                        indent=2, default=str))
    if problems:
        print("\nFAILED:", file=sys.stderr)
        for kind, found in problems.items():
            for problem in found:
                print(f"  {kind}: {problem}", file=sys.stderr)
        return 1
    print("\nall runs ended as success, every run heartbeated during the hold, no overlaps, none lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
