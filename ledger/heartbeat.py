"""Keeping a lease alive, and knowing when it is gone.

``LeaseState`` is the bookkeeping every lease or run context shares (no I/O):
the job, token and run id, and whether the lease is known lost. ``Heartbeat``
(a daemon thread) and ``AsyncHeartbeat`` (a task) call a ``beat`` function
every ``interval`` seconds on the context's own connection; the function
returns the lease's time left as the server measured it, or None when the
ledger says the lease is lost.

A beat that raises a ledger error (LD001, LD003, ...) also means lost. A beat
that fails otherwise (connection trouble) is retried, sooner than the interval,
until the lease would have expired by the last time left the server reported,
counted on the local monotonic clock (never the wall clock): then the lease is
taken as lost, since nothing vouches for it any more.

A lost lease cannot stop code that is already running: the heartbeat only
records the loss (the ``lost`` event, the optional callback) so that the next
``fence``/``check`` raises :class:`~ledger.errors.LeaseLost`. The fence is what
rejects a write the lost holder still attempts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from ledger.errors import LeaseLost, LedgerError

log = logging.getLogger("ledger")

OnLost = Callable[[LeaseLost], Any]
"""Called once, with the :class:`LeaseLost` error, when the lease is found lost.

Sync contexts call it in the thread that found the loss (usually the heartbeat
thread); async contexts call it in the event loop, and await it when it
returns an awaitable. Keep it short: set a flag, cancel a task, signal the
worker. Its exceptions are logged, not raised.
"""

# Retry a failed beat at most this often, and at least this often.
_MIN_RETRY = 0.05
_MAX_RETRY = 5.0


def seconds(value: timedelta | float) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else float(value)


def beat_interval(explicit: timedelta | None, ttl: timedelta | None, time_left: timedelta | None) -> float:
    """The heartbeat period: as given, else a third of the ttl (or of the time left at the start)."""
    if explicit is not None:
        interval = seconds(explicit)
        if interval <= 0:
            raise ValueError("heartbeat interval must be positive")
        return interval
    basis = ttl if ttl is not None else time_left
    if basis is None or basis <= timedelta(0):
        raise ValueError("cannot derive a heartbeat interval: no ttl and no time left")
    return seconds(basis) / 3


class Deadline:
    """When the lease expires, on the local monotonic clock, from the server's time left."""

    def __init__(self, time_left: timedelta) -> None:
        self.renewed(time_left)

    def renewed(self, time_left: timedelta) -> None:
        self.at = time.monotonic() + seconds(time_left)

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def retry_after(self, interval: float) -> float | None:
        """How long to wait before retrying a failed beat; None when the lease is past saving."""
        remaining = self.remaining()
        if remaining <= 0:
            return None
        return max(_MIN_RETRY, min(interval, remaining / 4, _MAX_RETRY))


class LeaseState:
    """Job, token, run id, and whether the lease is known lost; shared by sync and async contexts."""

    def __init__(self, job: str, owner: str, on_lost: OnLost | None, *,
                 signal: Callable[[], object], dispatch: Callable[[object], object] | None = None) -> None:
        self.job = job
        self.owner = owner
        self.token: int | None = None
        self.run_id: int | None = None
        self._on_lost = on_lost
        self._signal = signal  # sets the context's `lost` event
        self._dispatch = dispatch  # what to do with the callback's result (async: await it)
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._cause: BaseException | None = None

    @property
    def is_lost(self) -> bool:
        return self._reason is not None

    def facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"job": self.job, "owner": self.owner, "token": self.token}
        if self.run_id is not None:
            facts["run_id"] = self.run_id
        return facts

    def lost_error(self) -> LeaseLost:
        """A fresh LeaseLost for the recorded loss, caused by what told us."""
        reason = self._reason or "lease lost"
        facts = self.facts()
        if isinstance(self._cause, LedgerError):
            facts = {**self._cause.facts, **facts}
        what = f"run {self.run_id} of job {self.job}" if self.run_id is not None else f"lease of job {self.job}"
        error = LeaseLost(f"lease lost: {what} with token {self.token}: {reason}", facts, reason)
        error.__cause__ = self._cause
        return error

    def mark_lost(self, reason: str, cause: BaseException | None = None) -> LeaseLost:
        """Record the loss (first report wins), signal it, and return the error to raise."""
        with self._lock:
            first = self._reason is None
            if first:
                self._reason = reason
                self._cause = cause
        error = self.lost_error()
        if first:
            log.warning("%s", error)
            self._signal()
            if self._on_lost is not None:
                try:
                    result = self._on_lost(error)
                    if self._dispatch is not None:
                        self._dispatch(result)
                except Exception:
                    log.exception("on_lost callback of job %s failed", self.job)
        return error

    def raise_if_lost(self) -> None:
        if self._reason is not None:
            raise self.lost_error()


class Heartbeat:
    """A daemon thread that calls ``beat`` every ``interval`` seconds until stopped or lost."""

    def __init__(self, *, beat: Callable[[], timedelta | None], interval: float, time_left: timedelta,
                 state: LeaseState, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._deadline = Deadline(time_left)
        self._state = state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop promptly (the wait is an Event) and join, unless called from the heartbeat itself."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        wait = self._interval
        while not self._stop.wait(wait):
            if self._state.is_lost:  # a fence or check found it first: stop keeping others out
                return
            try:
                time_left = self._beat()
            except LedgerError as error:
                self._state.mark_lost("the ledger refused the heartbeat", error)
                return
            except Exception as error:
                retry = self._deadline.retry_after(self._interval)
                if retry is None:
                    self._state.mark_lost("no heartbeat got through before the lease expired", error)
                    return
                log.warning("heartbeat of job %s failed, retrying in %.2fs: %s", self._state.job, retry, error)
                wait = retry
                continue
            if time_left is None:
                self._state.mark_lost("the heartbeat found the lease taken or ended")
                return
            self._deadline.renewed(time_left)
            wait = self._interval


class AsyncHeartbeat:
    """The task counterpart of :class:`Heartbeat`, for the asyncio client."""

    def __init__(self, *, beat: Callable[[], Awaitable[timedelta | None]], interval: float,
                 time_left: timedelta, state: LeaseState, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._deadline = Deadline(time_left)
        self._state = state
        self._name = name
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        self._stop.set()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            await task

    async def _stopped_within(self, wait: float) -> bool:
        try:
            await asyncio.wait_for(self._stop.wait(), wait)
        except asyncio.TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        wait = self._interval
        while not await self._stopped_within(wait):
            if self._state.is_lost:  # a fence or check found it first: stop keeping others out
                return
            try:
                time_left = await self._beat()
            except LedgerError as error:
                self._state.mark_lost("the ledger refused the heartbeat", error)
                return
            except Exception as error:
                retry = self._deadline.retry_after(self._interval)
                if retry is None:
                    self._state.mark_lost("no heartbeat got through before the lease expired", error)
                    return
                log.warning("heartbeat of job %s failed, retrying in %.2fs: %s", self._state.job, retry, error)
                wait = retry
                continue
            if time_left is None:
                self._state.mark_lost("the heartbeat found the lease taken or ended")
                return
            self._deadline.renewed(time_left)
            wait = self._interval

