"""Keeping a lease alive, and knowing when it is gone.

``LeaseState`` is the bookkeeping every lease or run context shares (no I/O):
the job, token and run id, and whether the lease is known lost. The
heartbeat itself (``AsyncHeartbeat`` in ``ledger/aio.py``, a task; ``Heartbeat``
in the generated ``ledger/client.py``, a daemon thread) calls a ``beat``
function every ``interval`` seconds on the context's own connection; the
function returns a :class:`Renewal`: the lease's time left as the server
measured it (None when the ledger says the lease is lost) and when the call
was sent.

A beat that raises a ledger error (LD001, LD003, ...) also means lost. A beat
that fails otherwise (connection trouble, :class:`~ledger.errors.LedgerUnavailable`)
is retried, sooner than the interval, until the local deadline.

The local deadline (:class:`Deadline`, in ``LeaseState.deadline``) is when the
lease expires by the last time left the server reported, counted on the local
monotonic clock (never the wall clock) from the moment that call was *sent*:
the server measured ``expires_at - clock_timestamp()`` after the call left,
so send time + time left is never later than the server's expiry, however long
the answer took to come back. Once the deadline has passed the lease is lost,
whether or not a heartbeat is stuck in a call: ``check``/``fence``/the end of
a context look at the deadline themselves (:meth:`LeaseState.check_lost`), the
heartbeat wakes up at the deadline, and the context's alarm (a timer outside
the heartbeat, re-armed on each renewal) marks the loss at the deadline even
while the heartbeat is blocked. Lost is final: a renewal that arrives later
does not bring the lease back.

A lost lease cannot stop code that is already running: the heartbeat only
records the loss (the ``lost`` event, the optional callback) so that the next
``fence``/``check`` raises :class:`~ledger.errors.LeaseLost`. The fence is what
rejects a write the lost holder still attempts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
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


DEADLINE_PASSED = "the lease's local deadline passed before a heartbeat renewed it"
NO_BEAT = "no heartbeat got through before the lease's local deadline"


@dataclass(frozen=True)
class Renewal:
    """What a beat learnt: the server's time left (None: the lease is lost), and when the call was sent."""

    time_left: timedelta | None
    sent_at: float
    """``time.monotonic()`` just before the call was sent."""
    ended_as: str | None = None
    """Why a lost run ended, when the beat could tell: its failure_reason, 'cancelled' when an operator asked."""

    @property
    def lost_reason(self) -> str:
        """The reason a beat that found the lease gone gives."""
        return LOST_REASONS.get(self.ended_as or "", "the heartbeat found the lease taken or ended")


LOST_REASONS = {
    "cancelled": "an operator cancelled the run (ledger.request_cancel)",
    "superseded": "the lease was taken over: a newer token superseded it",
    "lease_expired": "the lease expired before the heartbeat renewed it",
}


class Deadline:
    """When the lease expires, on the local monotonic clock: send time of the call + the server's time left."""

    def __init__(self, time_left: timedelta, sent_at: float) -> None:
        self.renewed(time_left, sent_at)

    def renewed(self, time_left: timedelta, sent_at: float) -> None:
        self.at = sent_at + seconds(time_left)

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
        self.deadline: Deadline | None = None
        """The local deadline while the lease is held (None before, and once the context ends)."""

    @property
    def is_lost(self) -> bool:
        """Whether the loss was recorded (does not look at the deadline: see :meth:`check_lost`)."""
        return self._reason is not None

    def check_lost(self) -> bool:
        """True when the lease is lost; a passed local deadline is recorded as a loss first (signal, callback)."""
        deadline = self.deadline
        if self._reason is None and deadline is not None and deadline.remaining() <= 0:
            self.mark_lost(DEADLINE_PASSED)
        return self._reason is not None

    def time_left(self) -> float | None:
        """Seconds to the local deadline (None when there is none); 0 once lost."""
        deadline = self.deadline
        if deadline is None:
            return None
        return 0.0 if self.check_lost() else max(0.0, deadline.remaining())

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
        """Raise LeaseLost when the lease is lost or its local deadline has passed."""
        if self.check_lost():
            raise self.lost_error()


def retry_or_lose(deadline: Deadline, interval: float, state: LeaseState, error: Exception) -> float | None:
    """After a failed beat: seconds to wait before the next try, or None (and the lease marked lost) past the deadline."""
    retry = deadline.retry_after(interval)
    if retry is None:
        state.mark_lost(NO_BEAT, error)
        return None
    log.warning("heartbeat of job %s failed, retrying in %.2fs: %s", state.job, retry, error)
    return retry
