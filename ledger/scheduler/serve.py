"""``ledger.serve(dsn, jobs)``: the scheduler's loop in-process, for Python functions (``@ledger.job``).

The same loop as ``jobledger scheduler`` (:class:`ledger.scheduler.loop.Scheduler`), with the
:class:`~ledger.scheduler.loop.CallableRunner` as its runner: each due run calls the job's function
with the run context (``run.token``, ``run.fence(conn, resource)``, ``run.check()``), in a worker
thread; a return completes the run, an exception fails it. Every process serving the same jobs
splits the slots with every other (and with ``jobledger scheduler`` hosts): each slot runs once.

``serve`` blocks until ``stop`` is set (or Ctrl-C); ``serve_async`` is the asyncio twin: the loop
runs in a thread of its own, a coroutine function runs on the caller's event loop, and cancelling
the task stops the loop as SIGTERM does (no more starts, the live runs get the grace).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Generic, TypeVar

from ledger.client import RunContext
from ledger.scheduler.jobsfile import JobDefinition, definition
from ledger.scheduler.loop import CallableRunner, Scheduler

__all__ = ["ServedJob", "job", "serve", "serve_async"]

T = TypeVar("T")


class ServedJob(Generic[T]):
    """A function and its job's definition; calling it calls the function (tests, a manual call)."""

    def __init__(self, function: Callable[[RunContext], T], job: JobDefinition) -> None:
        self.function = function
        self.definition = job
        functools.update_wrapper(self, function)

    @property
    def name(self) -> str:
        return self.definition.name

    def __call__(self, run: RunContext) -> T:
        return self.function(run)


def job(name: str, **options: Any) -> Callable[[Callable[[RunContext], T]], ServedJob[T]]:
    """``@ledger.job("nightly", schedule="0 3 * * *", ttl="1h", jitter="5m")``: a job for :func:`serve`.

    The options are a jobs file's keys (``register_job``'s: schedule, time_zone, ttl, max_backfill, the
    health bounds, jitter, start_deadline, overlap_policy, pool: a pool registered before, with
    ``Ledger.register_pool``), durations as text ("80m") or timedelta; checked at once (JobsFileError
    naming the job and the key).
    """
    checked = definition(name, options, require_command=False)

    def decorate(function: Callable[[RunContext], T]) -> ServedJob[T]:
        return ServedJob(function, checked)

    return decorate


def _scheduler(dsn: str, jobs: Iterable[ServedJob[Any]], functions: Mapping[str, Callable[[RunContext], object]],
               options: Mapping[str, Any]) -> Scheduler:
    definitions = {served.name: served.definition for served in jobs}
    return Scheduler(dsn, CallableRunner(functions), jobs=definitions, **options)


def serve(dsn: str, jobs: Iterable[ServedJob[Any]], *, stop: threading.Event | None = None,
          source: str = "python", removed: str = "pause", owner: str | None = None, max_runs: int = 10,
          poll: timedelta | None = None, grace: timedelta = timedelta(seconds=10),
          ttl: timedelta = timedelta(seconds=30)) -> Scheduler:
    """Serve ``jobs`` until ``stop`` is set (or KeyboardInterrupt); the scheduler, for its ``stats``.

    The jobs are synced as ``source``'s whole set (``ledger.sync_jobs``): a job another process of the
    same source no longer serves is paused (``removed``); give each application its own ``source``.
    """
    served = list(jobs)
    functions = {item.name: item.function for item in served}
    loop = _scheduler(dsn, served, functions, {"source": source, "removed": removed, "owner": owner,
                                                "max_runs": max_runs, "poll": poll, "grace": grace, "ttl": ttl})
    watcher: threading.Thread | None = None
    if stop is not None:
        def watch() -> None:
            stop.wait()
            loop.stop()

        watcher = threading.Thread(target=watch, name="ledger-serve-stop", daemon=True)
        watcher.start()
    try:
        loop.run()
    except KeyboardInterrupt:
        loop.stop()
        raise
    return loop


async def serve_async(dsn: str, jobs: Iterable[ServedJob[Any]], *, source: str = "python",
                      removed: str = "pause", owner: str | None = None, max_runs: int = 10,
                      poll: timedelta | None = None, grace: timedelta = timedelta(seconds=10),
                      ttl: timedelta = timedelta(seconds=30)) -> Scheduler:
    """:func:`serve` for asyncio: until the task is cancelled (then the loop stops as on SIGTERM).

    A coroutine function runs on this event loop (its run context is the threaded one: its heartbeat
    is a thread's, so a busy event loop does not lose the lease); a plain function in the worker thread.
    """
    served = list(jobs)
    event_loop = asyncio.get_running_loop()

    def on_loop(function: Callable[[RunContext], object]) -> Callable[[RunContext], object]:
        if not inspect.iscoroutinefunction(function):
            return function

        def call(run: RunContext) -> object:
            return asyncio.run_coroutine_threadsafe(function(run), event_loop).result()

        return call

    functions = {item.name: on_loop(item.function) for item in served}
    loop = _scheduler(dsn, served, functions, {"source": source, "removed": removed, "owner": owner,
                                                "max_runs": max_runs, "poll": poll, "grace": grace, "ttl": ttl})
    thread = asyncio.ensure_future(asyncio.to_thread(loop.run))
    try:
        await asyncio.shield(thread)
    except asyncio.CancelledError:
        loop.stop()
        await thread  # the live runs end (their coroutines still run on this loop)
        raise
    return loop
