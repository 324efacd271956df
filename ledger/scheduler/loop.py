"""The scheduler's one loop: ask when, sleep, start what is due in one call, run it, keep upkeep.

Each round costs a constant number of calls, whatever the number of jobs:

- ``ledger.start_due_runs(jobs, owner, max_runs)`` starts every due run of the
  jobs served (slots with their jitter, start deadlines, overlap policies,
  manual triggers; SKIP LOCKED across jobs, so several schedulers split the
  work) in one round trip, at most as many as the cap on concurrent runs
  leaves free;
- ``ledger.next_start(jobs)`` says how long to sleep: until the earliest next
  start (plus ``batch``, 50 ms: the starts of that window go in one call), or until a ``NOTIFY ledger_scheduler`` (a trigger, a registration, a
  pause) wakes the loop, on a session that allows LISTEN; with ``poll`` (or
  when LISTEN fails), at least every ``poll`` instead. Behind a transaction
  pooler LISTEN does not hold: give ``poll`` there.

Every started run is handed to a *runner* in a worker thread of its own, in a
run context adopting the run (``RunContext(adopt=...)``): the heartbeat every
ttl/3 and the end (``complete_run``/``fail_run``/``cancel_run``) are the
client's. The runner is the strategy: a command (``ledger.wrapper.CommandRunner``,
``jobledger run``'s semantics) or a Python callable (:class:`CallableRunner`,
``ledger.serve``).

Every ttl/3 of its own row the loop calls ``ledger.scheduler_heartbeat``;
when it answers true this scheduler is the upkeep leader (one at a time, by
the ledger's own lease) and runs ``reap_expired``, ``sync_alerts``, the log
purge and the events purge at the cadence of the jobs file's ``[upkeep]``.

Stopping (:meth:`Scheduler.stop`, SIGTERM/SIGINT in the CLI): no run is
started any more, the live ones get ``grace`` to finish, then they are
cancelled (recorded ``cancelled``, not failed); the scheduler's row is removed
(``scheduler_stop``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import psycopg
from psycopg.rows import dict_row

from ledger import queries
from ledger import connect as connecting
from ledger.client import Ledger, RunContext
from ledger.identity import default_owner
from ledger.models import RunStart
from ledger.scheduler.jobsfile import JobDefinition, JobsFile, JobsFileError, Upkeep
from ledger.scheduler.sync import FileWatch, sync_file, sync_jobs
from ledger.text import first_line

__all__ = ["CallableRunner", "Runner", "Scheduler", "Stats"]

log = logging.getLogger("ledger.scheduler")

_SLICE = 0.05  # seconds: how often a sleep looks at a worker's end, a signal, a NOTIFY
_MAX_SLEEP = 30.0  # even with LISTEN, ask again at least this often (a NOTIFY lost to a reconnect)
_FILE_CHECK = 1.0  # seconds between two looks at the jobs file's mtime


class Runner(Protocol):
    """Runs one started run: enters ``run`` (which adopts it), does the work, leaves it as the work ended.

    Called in a worker thread, with the scheduler's ledger (for a retry's own
    run). ``stop`` is set when the scheduler's grace is
    over: the runner cancels what it runs (the run recorded ``cancelled``).
    """

    def __call__(self, ledger: Ledger, run: RunContext, job: JobDefinition, stop: threading.Event) -> object: ...


class CallableRunner:
    """The runner of ``ledger.serve``: a Python function per job, called with the run context.

    A return completes the run, an exception fails it (the client's run
    context); ``stop`` cannot interrupt a function: the scheduler cancels its
    run in the ledger after the grace, and the function's late end is refused.
    """

    def __init__(self, functions: Mapping[str, Callable[[RunContext], object]]) -> None:
        self._functions = dict(functions)

    def __call__(self, ledger: Ledger, run: RunContext, job: JobDefinition, stop: threading.Event) -> None:
        function = self._functions[job.name]
        with run:
            function(run)


@dataclass
class Stats:
    """What the loop did: the calls it made (the benchmark's SQL calls per slot) and the runs it started."""

    calls: dict[str, int] = field(default_factory=dict)
    started: int = 0
    rounds: int = 0

    def count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1


@dataclass
class _Live:
    run: RunContext
    thread: threading.Thread
    stop: threading.Event


class Scheduler:
    """One scheduler process's loop over ``jobs`` (or the jobs of ``watch``'s file, kept in sync).

    ``conninfo``: the database; the loop's own connection (LISTEN, its calls)
    and a pool for the runs (their starts are the loop's, their heartbeats
    and ends the workers'). ``watch``: the jobs file, synced at start, on
    :meth:`reload` (SIGHUP) and when it changes; an invalid file changes
    nothing (the last good definition keeps running) and is said loudly.
    ``jobs`` instead: a fixed set, synced once under ``source``.
    """

    def __init__(self, conninfo: str, runner: Runner, *, watch: FileWatch | None = None,
                 jobs: Mapping[str, JobDefinition] | None = None, source: str = "python",
                 removed: str = "pause", upkeep: Upkeep | None = None, owner: str | None = None,
                 max_runs: int = 10, poll: timedelta | None = None, grace: timedelta = timedelta(seconds=10),
                 ttl: timedelta = timedelta(seconds=30), batch: timedelta = timedelta(milliseconds=50),
                 say: Callable[[str], None] | None = None) -> None:
        if (watch is None) == (jobs is None):
            raise ValueError("a scheduler serves the jobs of a file (watch) or a fixed set (jobs), one of them")
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, not {max_runs}")
        self._conninfo = conninfo
        self._runner = runner
        self._watch = watch
        self._jobs: dict[str, JobDefinition] = dict(jobs or {})
        self._source = source
        self._removed = removed
        self._upkeep = upkeep or Upkeep()
        self.owner = owner or default_owner()
        self._max_runs = max_runs
        self._poll = poll.total_seconds() if poll is not None else None
        self._grace = grace.total_seconds()
        self._ttl = ttl
        self._batch = batch.total_seconds()
        self._say = say or log.warning
        self._stopping = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()
        self._ended = threading.Event()  # a run ended: its job's next start is to be asked (coalesced)
        self._live: dict[int, _Live] = {}
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None
        self._ledger: Ledger | None = None
        self.listening = False
        self.leader = False
        self.stats = Stats()
        self._upkeep_done: dict[str, float] = {}

    # -- control from outside (signal handlers, another thread) ------------------------

    def stop(self) -> None:
        """Stop starting runs; let the live ones finish within the grace, then cancel them."""
        self._stopping.set()
        self._wake.set()

    def reload(self) -> None:
        """Sync the jobs file again (SIGHUP)."""
        self._reload.set()
        self._wake.set()

    @property
    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> None:
        """The loop, until :meth:`stop`; then the live runs end (grace, cancel) and the row goes."""
        self._conn = connecting.connect(self._conninfo)
        # The runs' pool: a run holds a connection only during a call (its end, a heartbeat), so a few
        # serve hundreds of live runs; never one per run (a shared server's max_connections).
        self._ledger = Ledger(self._conninfo, owner=self.owner,
                              pool_kwargs={"min_size": 1, "max_size": min(self._max_runs, 8) + 2})
        try:
            if self._poll is None:
                try:
                    self._conn.execute(queries.LISTEN_SCHEDULER)
                    self.listening = True
                except psycopg.Error as error:
                    self._say(f"LISTEN refused ({first_line(error)}): polling every second instead")
                    self._poll = 1.0
            self._sync(first=True)
            self._loop()
            self._shut_down()
        finally:
            self._ledger.close()
            self._conn.close()

    def _loop(self) -> None:
        next_beat = 0.0
        next_start: float | None = 0.0  # monotonic; None: nothing will be due
        next_file = time.monotonic() + _FILE_CHECK
        while not self._stopping.is_set():
            now = time.monotonic()
            if self._reload.is_set() or (self._watch is not None and now >= next_file):
                next_file = now + _FILE_CHECK
                forced = self._reload.is_set()
                self._reload.clear()
                if forced or (self._watch is not None and self._watch.changed()):
                    self._sync()
                    next_start = now
            if now >= next_beat:
                self._beat()
                next_beat = now + self._ttl.total_seconds() / 3
                if self.leader:
                    self._upkeep_round()
            woken = self._wake.is_set()
            self._wake.clear()
            if self._ended.is_set():
                # The ended runs' jobs may be due earlier than the plan: a round soon, one for all the
                # ends of the next `batch`.
                self._ended.clear()
                soon = now + self._batch
                next_start = soon if next_start is None else min(next_start, soon)
            self._reap_workers()
            free = self._max_runs - len(self._live)
            if free > 0 and self._jobs and (woken or (next_start is not None and now >= next_start)):
                started = self._start_due(free)
                self.stats.rounds += 1
                if started >= free:  # the cap: more may be due; ask again when a run ends
                    next_start = None
                else:
                    next_start = self._next_start()
            elif free > 0 and not self._jobs:
                next_start = None
            wake_at = min(at for at in (next_beat, next_file if self._watch else None, next_start,
                                        now + (self._poll if self._poll is not None else _MAX_SLEEP))
                          if at is not None)
            self._sleep(wake_at)

    def _sleep(self, until: float) -> None:
        while not self._wake.is_set() and not self._stopping.is_set() and not self._ended.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            if self.listening:
                # notifies() also yields what came during the loop's other calls (psycopg's backlog)
                assert self._conn is not None
                for _ in self._conn.notifies(timeout=min(left, _SLICE), stop_after=1):
                    self._wake.set()
            else:
                time.sleep(min(left, _SLICE))

    # -- the calls -----------------------------------------------------------------------

    def _call(self, name: str, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.stats.count(name)
        return self._execute(query, params)

    def _execute(self, query: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        assert self._conn is not None
        with self._conn.cursor(row_factory=dict_row) as cursor:
            cursor.execute(query, params)
            return cursor.fetchall() if cursor.description is not None else []

    def _next_start(self) -> float | None:
        """``ledger.next_start`` as a monotonic moment (None: nothing will ever be due)."""
        try:
            rows = self._call("next_start", queries.NEXT_START, {"jobs": self.jobs})
        except psycopg.Error as error:
            self._say(f"next_start failed: {first_line(error)}; asking again in a second")
            return time.monotonic() + 1.0
        wait: timedelta | None = rows[0]["wait"]
        if wait is None:
            return None
        # A little later than the earliest start, so that the starts of that window (jittered slots
        # are spread over it) go in one start_due_runs: fewer calls per run for at most this much lag.
        return time.monotonic() + max(wait.total_seconds(), 0.0) + self._batch

    def _start_due(self, free: int) -> int:
        sent = time.monotonic()
        try:
            rows = self._call("start_due_runs", queries.START_DUE_RUNS,
                              {"jobs": self.jobs, "owner": self.owner, "max_runs": free})
        except psycopg.Error as error:
            self._say(f"start_due_runs failed: {first_line(error)}")
            return 0
        for row in rows:
            self._hand_over(row, sent)
        return len(rows)

    def _hand_over(self, row: dict[str, Any], sent: float) -> None:
        assert self._ledger is not None
        job = self._jobs.get(row["job"])
        start = RunStart(outcome="started", run_id=row["run_id"], token=row["token"],
                         expires_at=row["expires_at"], slot=row["slot"], holder=None, holder_expires_at=None)
        definition = job if job is not None else JobDefinition(name=row["job"], register={})
        run = RunContext(self._ledger, row["job"], ttl=definition.ttl, adopt=(start, row["time_left"], sent))
        if row.get("trigger_id") is not None:
            run.detail["trigger_id"] = row["trigger_id"]
        stop = threading.Event()
        thread = threading.Thread(target=self._work, args=(run, definition, stop),
                                  name=f"ledger-scheduler:{row['job']}:{row['run_id']}", daemon=True)
        with self._lock:
            self._live[int(row["run_id"])] = _Live(run, thread, stop)
        self.stats.started += 1
        thread.start()

    def _work(self, run: RunContext, job: JobDefinition, stop: threading.Event) -> None:
        try:
            assert self._ledger is not None
            self._runner(self._ledger, run, job, stop)
        except Exception as error:  # the run context recorded the end; a runner's own failure is said here
            log.info("run %s of job %s: %s", run.run_id, job.name, first_line(error))
        finally:
            self._ended.set()

    def _reap_workers(self) -> None:
        with self._lock:
            for run_id in [run_id for run_id, live in self._live.items() if not live.thread.is_alive()]:
                del self._live[run_id]

    def _beat(self, *, stopping: bool = False) -> None:
        from ledger import __version__  # at call time: ledger/__init__ imports this module

        params = {"scheduler": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                  "version": __version__, "jobs": self.jobs, "ttl": self._ttl, "stopping": stopping}
        try:
            rows = self._call("scheduler_heartbeat", queries.SCHEDULER_HEARTBEAT, params)
        except psycopg.Error as error:
            self._say(f"scheduler_heartbeat failed: {first_line(error)}")
            self.leader = False
            return
        leader = bool(next(iter(rows[0].values())))
        if leader != self.leader:
            log.info("scheduler %s %s the upkeep leader", self.owner, "is" if leader else "is no longer")
        self.leader = leader

    # -- upkeep (the leader only) ------------------------------------------------------------

    def _due(self, task: str, every: timedelta | None) -> bool:
        if every is None:
            return False
        now = time.monotonic()
        if now - self._upkeep_done.get(task, -1e18) < every.total_seconds():
            return False
        self._upkeep_done[task] = now
        return True

    def _upkeep_round(self) -> None:
        upkeep = self._upkeep
        tasks: list[tuple[str, str, dict[str, Any]]] = []
        if self._due("reap_expired", upkeep.reap_every):
            tasks.append(("reap_expired", queries.REAP_ALL, {}))
        if self._due("sync_alerts", upkeep.sync_alerts_every):
            tasks.append(("sync_alerts", queries.SYNC_ALERTS, {}))
        if self._due("purge_events", upkeep.purge_events_every):
            tasks.append(("purge_events", queries.PURGE_EVENTS, {}))
        for name, query, params in tasks:
            try:
                self._call(name, query, params)
            except psycopg.Error as error:
                self._say(f"upkeep {name} failed: {first_line(error)}")
        if upkeep.purge_log_older_than is not None and self._due("purge_log", upkeep.purge_every):
            from_run_id = None
            try:
                while True:  # a batch per call, each its own transaction
                    rows = self._call("purge_log_batch", queries.PURGE_LOG_BATCH,
                                      {"older_than": upkeep.purge_log_older_than, "from_run_id": from_run_id})
                    from_run_id = rows[0]["next_run_id"]
                    if from_run_id is None or self._stopping.is_set():
                        break
            except psycopg.Error as error:
                self._say(f"upkeep purge_log_batch failed: {first_line(error)}")

    # -- the jobs file ------------------------------------------------------------------------

    def _sync(self, *, first: bool = False) -> None:
        assert self._conn is not None
        if self._watch is None:
            if first:
                self.stats.count("sync_jobs")
                sync_jobs(self._conn, self._jobs, source=self._source, removed=self._removed, say=log.info)
            return
        try:
            loaded: JobsFile = self._watch.load()
        except JobsFileError as error:
            if first:
                raise
            self._say(f"{error}\nthe last good definition keeps running ({len(self._jobs)} jobs)")
            return
        try:
            self.stats.count("sync_jobs")
            sync_file(self._conn, loaded, say=log.info)  # its [pools] first, in the same transaction
        except psycopg.Error as error:
            if first:
                raise
            self._say(f"jobs file {loaded.path} refused by the ledger, nothing changed: {first_line(error)}\n"
                      f"the last good definition keeps running ({len(self._jobs)} jobs)")
            return
        self._watch.accepted(loaded)
        self._jobs = dict(loaded.jobs)
        self._upkeep = loaded.upkeep

    # -- the end ---------------------------------------------------------------------------------

    def _shut_down(self) -> None:
        """No more starts; the live runs get the grace, then are cancelled; the row goes."""
        self._beat(stopping=True)
        deadline = time.monotonic() + self._grace
        while self._alive() and time.monotonic() < deadline:
            time.sleep(_SLICE)
        with self._lock:
            late = [live for live in self._live.values() if live.thread.is_alive()]
        if late:
            self._say(f"grace over: cancelling {len(late)} live run{'' if len(late) == 1 else 's'}")
        for live in late:
            live.stop.set()
        for live in late:
            live.thread.join(max(self._grace, 5.0) + 10.0)
            if live.thread.is_alive():  # a function the stop cannot reach: cancel its run in the ledger
                self._cancel_in_ledger(live.run)
        try:
            self._call("scheduler_stop", queries.SCHEDULER_STOP, {"scheduler": self.owner})
        except psycopg.Error as error:
            self._say(f"scheduler_stop failed: {first_line(error)}")

    def _alive(self) -> bool:
        with self._lock:
            return any(live.thread.is_alive() for live in self._live.values())

    def _cancel_in_ledger(self, run: RunContext) -> None:
        try:
            self._execute(queries.CANCEL_RUN, {"run_id": run.run_id, "token": run.token,
                                               "error": "the scheduler stopped: its grace was over"})
        except psycopg.Error as error:
            self._say(f"cancel_run of run {run.run_id} failed: {first_line(error)}")
