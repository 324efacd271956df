"""The asyncio Python client: ``AsyncLedger`` and its run and lease contexts.

``ledger/aio.py`` is the one source of the Python client: ``ledger/client.py``
(the sync ``Ledger``, with threads where the async client has tasks) is
generated from it by ``tools/async_to_sync.py`` (``make sync``). Where the two
differ, the primitive is in :mod:`ledger._acompat`, or the code is in an
``if ASYNC:`` block of the source.

A thin layer over the SQL functions of schema ``ledger``: every decision
(who holds a lease, whether a run starts, which slot is due, whether a token
is stale) is made by those functions. The client adds the context managers,
the heartbeat and typed results.

Connections:

- ``AsyncLedger(conn)``: plain calls (``acquire``, ``register_job``, ...) run
  on ``conn``; on a connection outside a transaction they commit at once,
  inside one they join it (as a savepoint). A run or lease context's calls
  (its start, heartbeats and end) run on connections of the ledger's own,
  opened from the same conninfo (or ``heartbeat_conninfo``): the heartbeat
  never shares a connection with a transaction of the caller. A context
  takes one for each call and gives it back after it; the ledger keeps up
  to four idle ones open for the next calls (a run costs no new
  connection); ``close()`` closes them. A connection
  made from a multi-host conninfo knows only the host it reached: pass that
  conninfo as ``heartbeat_conninfo`` so that a context follows a failover.
- ``AsyncLedger(pool)``: each plain call borrows a pool connection, and so
  does each call of a context (start, each heartbeat, end): an open run
  holds no connection between its calls, so a pool of 10 serves hundreds
  of open runs (BENCHMARKS.md). A heartbeat's wait for a free connection is
  bounded by the lease's local deadline; a pool that has none in time
  raises LedgerUnavailable.
- ``AsyncLedger("dsn")``: as with a pool, one that the ledger opens and owns;
  close it with ``await ledger.close()`` or ``async with AsyncLedger(dsn) as ledger:``.
  One connection is checked first: a wrong DSN raises
  :class:`~ledger.errors.LedgerUnavailable` (naming host and port) when the
  pool opens.

Behind a transaction pooler (PgBouncer ``pool_mode = transaction``): the
connections the ledger opens (its pool, a context's own connection) never
prepare statements (``prepare_threshold=None``, see :mod:`ledger.connect`);
a context's own connection opened from a caller's connection takes that
connection's ``prepare_threshold``. A caller's pool or connection is used
as it is: give it ``prepare_threshold=None`` behind such a pooler
(docs/poolers.md).

A context's calls (start, heartbeats, end, ``check(remote=True)``) are
bounded: a ``statement_timeout`` of a third of the ttl (1 s to 30 s) sent
with each call, and a client-side bound a second later after which the
connection is given up (its socket shut down) and the call raises
LedgerUnavailable; a heartbeat's call is given up at the lease's local
deadline at the latest. The local deadline counts from the moment the call
that renewed the lease was sent; once it passes the lease is lost
(``check``, ``fence``, ``advance_fence`` and the context's end raise
LeaseLost), even when the heartbeat is stuck in a call. The end of a run is
sent once more on a new connection when its connection turns out broken
(the server went away since its last call: a restart, a failover); the
run's row then tells whether the first attempt had ended it already.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import psycopg
from psycopg import AsyncTransaction
from psycopg.rows import BaseRowFactory, class_row, dict_row, scalar_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from ledger import connect as connecting
from ledger import models, queries  # models.Event: in the sync client `Event` is threading's
from ledger._acompat import (ASYNC, ADeferred, AEvent, ALock, adefer, ajoin, ashield, await_event, in_task,
                             keep_result_async)
from ledger.calls import (conninfo_of, end_call, ended_by_us, fence_failure, fence_not_committed, jsonb, run_start,
                          split_time_left)
from ledger.errors import (LeaseLost, LeaseSuperseded, LedgerError, LedgerUnavailable, RunNotRunning,
                           StaleToken, translated)
from ledger.heartbeat import Deadline, LeaseState, OnLost, Renewal, beat_interval, retry_or_lose, seconds
from ledger.identity import default_owner
from ledger.models import EventSettings, Job, JobStatus, Lease, Pool, PoolStatus, Run, RunStart
from ledger.text import first_line
from ledger.watchdog import AsyncWatchdog

__all__ = [
    "AsyncLeaseContext",
    "AsyncLedger",
    "AsyncRunContext",
    "AsyncScheduledJob",
    "advance_fence",
    "conninfo_of",
    "fence",
]

log = logging.getLogger("ledger")

R = TypeVar("R")
T = TypeVar("T")
P = ParamSpec("P")

AsyncConnection = psycopg.AsyncConnection[Any]

ENDED_AS_BOUND = 5.0
"""Seconds a heartbeat that found its run lost waits, at most, to read why (``_ended_as``)."""

END_ATTEMPTS = 4
"""How many connections the end of a run is sent on, at most, while each one turns out broken.

More than one: a pool may hand out several connections that a restart or a
failover broke before it notices."""


# -- executing one call -----------------------------------------------------

async def execute_own(conn: AsyncConnection, query: str, params: Mapping[str, Any],
                      row_factory: BaseRowFactory[R]) -> list[R]:
    """A ledger call that commits by itself when ``conn`` is outside a transaction.

    Inside a transaction of the caller it becomes a savepoint of it (psycopg's
    ``transaction()`` nesting): the caller's transaction decides.
    """
    with translated():
        if conn.autocommit:
            async with conn.cursor(row_factory=row_factory) as cur:
                await cur.execute(query, params)
                return await cur.fetchall()
        async with conn.transaction(), conn.cursor(row_factory=row_factory) as cur:
            await cur.execute(query, params)
            return await cur.fetchall()


async def execute_in(conn: AsyncConnection, query: str, params: Mapping[str, Any],
                     row_factory: BaseRowFactory[R]) -> list[R]:
    """A ledger call that belongs to the caller's transaction on ``conn`` (a fence)."""
    with translated():
        async with conn.cursor(row_factory=row_factory) as cur:
            await cur.execute(query, params)
            return await cur.fetchall()


# -- fences in the caller's transaction -------------------------------------

async def fence(conn: AsyncConnection, job: str, resource: str, token: int) -> int:
    """``ledger.fence`` (lenient) in the caller's transaction on ``conn``; returns ``token``.

    The fence checks the lease itself: LeaseSuperseded (LD001) unless ``token``
    is ``job``'s current live token, StaleToken (LD002) when a higher token of
    the job already wrote, FenceOfAnotherJob (LD006) when ``resource`` belongs
    to another job. Call it in the transaction of the write it guards.
    """
    params = {"job": job, "resource": resource, "token": token}
    rows = await execute_in(conn, queries.FENCE, params, scalar_row)
    return int(rows[0])


async def advance_fence(conn: AsyncConnection, job: str, resource: str, token: int) -> bool:
    """``ledger.advance_fence`` (strict, one write per token) in the caller's transaction on ``conn``.

    False when this token (or a higher one) already wrote; the errors of :func:`fence` otherwise.
    """
    params = {"job": job, "resource": resource, "token": token}
    rows = await execute_in(conn, queries.ADVANCE_FENCE, params, scalar_row)
    return bool(rows[0])


# -- a context's own connection ---------------------------------------------

class _AsyncControl:
    """A context's calls: its start, heartbeats and end, never on the caller's transactions.

    Each call takes a connection (from the pool, or the ledger's spares) and
    gives it back when it ends, so an open run holds no connection between
    its calls; one that broke goes back as broken (the pool drops it) and the
    next call takes another, so a heartbeat survives a dropped connection.
    The calls of one context are serialized (a lock). Every call is
    bounded (:func:`ledger.connect.execute_bounded`): ``statement_timeout``
    = ``timeout`` on the server, and a watchdog that shuts the connection's
    socket down when no answer came ``CALL_GRACE`` later (or at ``bound``),
    so a call stuck in a silent partition ends with LedgerUnavailable.
    """

    def __init__(self, connect: Callable[[float], Awaitable[AsyncConnection]],
                 give_back: Callable[[AsyncConnection], Awaitable[None]], name: str) -> None:
        self._connect = connect
        self._give_back = give_back
        self._conn: AsyncConnection | None = None
        self._where = "?"
        self._lock = ALock()
        self._watchdog = AsyncWatchdog(name)
        self.timeout = connecting.DEFAULT_CALL_TIMEOUT
        """The statement timeout of each call, seconds (set from the ttl once it is known)."""
        self.retried = False
        """Whether the last call was sent again on a new connection (``attempts`` > 1)."""

    async def execute(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R]) -> list[R]:
        return (await self.call(query, params, row_factory))[0]

    async def call(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R], *,
                   bound: float | None = None, attempts: int = 1) -> tuple[list[R], float]:
        """The rows and the monotonic time the call was sent; ``bound``: give up after that many seconds at most.

        ``attempts`` > 1: when the connection turns out broken (the server went
        away since it was opened), send the call again on a new one, up to
        that many times in all. Only for a call whose effect can be looked up
        afterwards: the first attempt may have taken effect before the
        connection broke.
        """
        async with self._lock:
            self.retried = False
            try:
                for attempt in range(1, attempts + 1):
                    try:
                        return await self._call_once(query, params, row_factory, bound)
                    except LedgerUnavailable:
                        raise  # given up, or no connection: not a broken one to replace
                    except psycopg.OperationalError as error:
                        conn = self._conn
                        if attempt == attempts or conn is None or not conn.broken:
                            raise
                        log.warning("the connection of a ledger call broke (%s); sending it again on a new one",
                                    first_line(error))
                        await self._release()
                        self.retried = True
                raise AssertionError("unreachable")
            finally:
                # Given back after every call: N open runs need connections for
                # their calls in flight, not N held for their whole lives.
                await self._release()

    async def _call_once(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R],
                         bound: float | None) -> tuple[list[R], float]:
        if self._conn is not None and (self._conn.closed or self._conn.broken):
            await self._release()
        timeout, limit = connecting.call_bounds(self.timeout, bound)
        if self._conn is None:
            # A pool's wait for a connection is bounded too (a heartbeat's by the deadline).
            wait = limit if bound is not None else limit + connecting.CONNECT_TIMEOUT
            try:
                self._conn = await self._connect(wait)
            except PoolTimeout as error:
                raise LedgerUnavailable(
                    f"no free connection in the ledger's pool within {wait:.3g}s: every connection was busy "
                    "(raise the pool's max_size, pool_kwargs={'max_size': ...})", {}) from error
            self._where = connecting.where(self._conn)
        conn = self._conn
        sent = time.monotonic()
        key = self._watchdog.arm(sent + limit, lambda: connecting.abort(conn))
        try:
            rows = await connecting.execute_bounded_async(conn, query, params, row_factory, timeout)
        except psycopg.OperationalError as error:
            if self._watchdog.disarm(key):
                raise LedgerUnavailable(
                    f"no answer from the ledger's database ({self._where}) within "
                    f"{limit:.3g}s: the connection was given up", {}) from error
            raise
        finally:
            self._watchdog.disarm(key)
        return rows, sent

    def abort(self) -> None:
        """Give up the call in flight, if any: it raises LedgerUnavailable."""
        self._watchdog.fire()

    def alarm(self, at: float | None, action: Callable[[], object] | None = None) -> None:
        """Run ``action`` at monotonic time ``at`` in the watchdog (None: no alarm)."""
        self._watchdog.alarm(at, action)

    async def close(self) -> None:
        self._watchdog.alarm(None)
        async with self._lock:
            await self._release()
        self._watchdog.close()

    async def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await self._give_back(conn)
            except Exception:  # closing a dead connection may fail; it is gone either way
                log.debug("closing a context connection failed", exc_info=True)


class _AsyncSpares:
    """The own connections of an ``AsyncLedger(conn)``'s contexts, kept open for their next calls.

    A context's call takes one and gives it back; up to ``KEEP`` idle ones
    stay open, so a run costs no new connection (the connection given back
    is in no transaction: every call commits by itself). One that broke
    meanwhile (a server restart) is replaced on the context's next call
    (:meth:`_AsyncControl.call`); a start on a connection the server closed
    while it was idle fails once, like a pool's.
    """

    KEEP = 4

    def __init__(self, connect: Callable[[], Awaitable[AsyncConnection]]) -> None:
        self._connect = connect
        self._idle: list[AsyncConnection] = []

    async def take(self, timeout: float) -> AsyncConnection:  # bounded by connect_timeout instead
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return await self._connect()
            if not conn.closed and not conn.broken:
                return conn

    async def give_back(self, conn: AsyncConnection) -> None:
        idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        if conn.closed or conn.broken or not idle or len(self._idle) >= self.KEEP:
            await conn.close()
        else:
            self._idle.append(conn)

    async def close(self) -> None:
        while self._idle:
            await self._idle.pop().close()


# -- the heartbeat ------------------------------------------------------------

class AsyncHeartbeat:
    """Calls ``beat`` every ``interval`` seconds, beside the body, until stopped or lost.

    ``beat`` returns a :class:`~ledger.heartbeat.Renewal`; the heartbeat keeps
    ``state.deadline`` and wakes up at it at the latest, so a lease that
    nothing renewed is marked lost on time even when no call fails (a beat
    stuck in a call is ended by its connection's own bound, at the deadline
    at the latest). It runs as a task of the loop.
    """

    def __init__(self, *, beat: Callable[[], Awaitable[Renewal]], interval: float, state: LeaseState, name: str,
                 renewed: Callable[[float], object] | None = None) -> None:
        assert state.deadline is not None
        self._beat = beat
        self._renewed = renewed  # told the new deadline (the context's alarm)
        self._interval = interval
        self._deadline = state.deadline
        self._state = state
        self._name = name
        self._stop = AEvent()
        self._busy = ALock()  # held for one round: the check for stop, the beat, what it learnt
        self._start: ADeferred | None = None

    def start(self) -> None:
        # Its task (its thread, in the sync client) starts when the first beat is due, the interval or the
        # deadline, whichever is sooner: a run shorter than that costs none. The deadline's alarm is the
        # watchdog's, from the start.
        self._start = adefer(self._run, self._name, min(self._interval, self._deadline.remaining()))

    async def stop(self) -> None:
        """Stop: once this returns no beat starts and none is in flight (the wait is an event: no delay).

        A beat in flight is waited for; a heartbeat waiting for its next beat is
        not (it ends by itself when it wakes, touching nothing), so a context
        whose run was shorter than the interval never waits for a thread.
        """
        self._stop.set()
        worker = self._start.cancel() if self._start is not None else None
        if worker is None or in_task(worker):  # never started (and now never will), or called from the heartbeat
            return
        async with self._busy:
            pass
        if ASYNC:
            await ajoin(worker)  # in the loop the task ends at its next step: no thread to wait for

    async def _run(self) -> None:
        wait = 0.0  # started when the first beat is due
        while not await await_event(self._stop, min(wait, self._deadline.remaining())):
            async with self._busy:
                if self._stop.is_set():
                    return
                next_wait = await self._round()
            if next_wait is None:
                return
            wait = next_wait

    async def _round(self) -> float | None:
        """One beat: seconds to the next, or None when the lease is lost (or found lost first)."""
        # A fence or check found it lost first (stop keeping others out), or the deadline passed.
        if self._state.check_lost():
            return None
        try:
            renewal = await self._beat()
        except LedgerUnavailable as error:  # no answer: connection trouble, not the ledger's verdict
            return retry_or_lose(self._deadline, self._interval, self._state, error)
        except LedgerError as error:
            self._state.mark_lost("the ledger refused the heartbeat", error)
            return None
        except Exception as error:
            return retry_or_lose(self._deadline, self._interval, self._state, error)
        if renewal.time_left is None:
            self._state.mark_lost(renewal.lost_reason)
            return None
        self._deadline.renewed(renewal.time_left, renewal.sent_at)
        if self._renewed is not None:
            self._renewed(self._deadline.at)
        return self._interval


# -- contexts ---------------------------------------------------------------

class _AsyncHolding:
    """What a run and a lease context share: the own connection, the heartbeat, the lost state."""

    def __init__(self, ledger: AsyncLedger, job: str, on_lost: OnLost | None) -> None:
        self._ledger = ledger
        self.lost = AEvent()
        """Set as soon as the lease is known lost (by a heartbeat, a fence or the end)."""
        self._callbacks: set[Any] = set()  # on_lost results still running
        self._state = LeaseState(job, ledger.owner, on_lost, signal=self.lost.set,
                                 dispatch=functools.partial(keep_result_async, pending=self._callbacks))
        self._control: _AsyncControl | None = None
        self._heartbeat: AsyncHeartbeat | None = None
        self._open = False
        # The resources this context's fence()/advance_fence() calls fenced, in order: a run names them to
        # complete_run (fenced), which records success only when each fence holds the run's token.
        self._fenced_resources: dict[str, None] = {}

    @property
    def job(self) -> str:
        return self._state.job

    @property
    def owner(self) -> str:
        return self._state.owner

    @property
    def token(self) -> int | None:
        return self._state.token

    @property
    def lost_error(self) -> LeaseLost | None:
        """The LeaseLost error once the lease is known lost (or its local deadline passed), else None."""
        return self._state.lost_error() if self._state.check_lost() else None

    @property
    def time_left(self) -> timedelta | None:
        """Time to the lease's local deadline while held (zero once lost); None when not held.

        The deadline is the send time of the call that last renewed the lease
        plus the time left the server reported, on the monotonic clock: never
        later than the server's expiry.
        """
        left = self._state.time_left()
        return None if left is None else timedelta(seconds=left)

    def is_lost(self) -> bool:
        """True once the lease is known lost or its local deadline has passed (no I/O).

        A passed deadline is recorded as the loss right here (``lost`` set,
        ``on_lost`` called), even when the heartbeat is stuck in a call.
        """
        return self._state.check_lost()

    async def check(self, *, remote: bool = False) -> None:
        """Raise LeaseLost when the lease is known lost or its local deadline has passed.

        With ``remote``, ask the ledger too. The local check is free (no
        I/O): call it between steps of a long body.
        """
        token = self._require_token()
        self._state.raise_if_lost()
        if remote:
            if self._control is None or not self._open:
                raise RuntimeError(f"the context of job {self.job} has ended")
            try:
                await self._control.execute(queries.ASSERT_CURRENT, {"job": self.job, "token": token}, scalar_row)
            except LeaseSuperseded as error:
                raise self._state.mark_lost("assert_current refused the token", error) from error

    async def fence(self, conn: AsyncConnection, resource: str) -> int:
        """Move ``resource``'s fence to this token inside the caller's transaction on ``conn``.

        LeaseLost without a round trip when the lease is known lost or its
        local deadline has passed. Otherwise one statement,
        ``ledger.fence(job, resource, token)``, which checks the lease
        itself: LeaseLost (and the context marked lost) when the token is no
        longer the job's current live token (LD001) or a takeover's newer
        token wrote first (LD002); FenceOfAnotherJob when ``resource`` belongs
        to another job (raised as is: a programming error, not a lost lease).
        Call it in the transaction of the write it protects, so that both
        commit or neither does.
        """
        return int(await self._fenced(conn, queries.FENCE, resource))

    async def advance_fence(self, conn: AsyncConnection, resource: str) -> bool:
        """The strict fence (one write per token): False when this token already wrote; LeaseLost when a newer one did."""
        return bool(await self._fenced(conn, queries.ADVANCE_FENCE, resource))

    @asynccontextmanager
    async def transaction(self, conn: AsyncConnection) -> AsyncIterator[AsyncTransaction]:
        """``async with run.transaction(conn):`` a transaction on ``conn`` that carries this token.

        ``conn.transaction()`` (a savepoint inside a transaction of the
        caller's), whose first statement sets ``ledger.job`` and
        ``ledger.token`` for the rest of the transaction (``SET LOCAL``), so
        that the tables ``ledger.protect`` guards accept its writes: each
        write runs the job's fence itself (docs/protect.md). LeaseLost
        without a round trip when the lease is known lost or its local
        deadline has passed. A protected table's refusal raises as
        ``fence`` does: LeaseLost (and the context marked lost) when the
        token is no longer current (LD001) or a newer one wrote (LD002);
        StaleToken as is when a strictly protected table was written with
        this token in an earlier transaction; FenceOfAnotherJob as is.
        """
        token = self._require_token()
        self._state.raise_if_lost()
        try:
            with translated():
                async with conn.transaction() as transaction:
                    await execute_in(conn, queries.CARRY_TOKEN, {"job": self.job, "token": str(token)}, scalar_row)
                    yield transaction
        except LeaseSuperseded as error:
            raise self._state.mark_lost("a protected table found the token no longer current", error) from error
        except StaleToken as error:
            if error.facts.get("highest_token") == token:  # strict: this token wrote before, no takeover
                raise
            raise self._state.mark_lost("a protected table found a newer token of the job had written",
                                        error) from error

    async def _fenced(self, conn: AsyncConnection, query: str, resource: str) -> Any:
        token = self._require_token()
        self._state.raise_if_lost()
        params = {"job": self.job, "resource": resource, "token": token}
        try:
            rows = await execute_in(conn, query, params, scalar_row)
        except LeaseSuperseded as error:
            raise self._state.mark_lost("the fence found the token no longer current", error) from error
        except StaleToken as error:
            raise self._state.mark_lost("the fence found a newer token of the job had written", error) from error
        self._fenced_resources[resource] = None
        return rows[0]

    def _require_token(self) -> int:
        if self._state.token is None:
            raise RuntimeError(f"job {self.job}: this context does not hold the lease ({self._not_held()})")
        return self._state.token

    def _not_held(self) -> str:
        return "not entered"

    def _start_heartbeat(self, interval: timedelta | None, ttl: timedelta | None,
                         time_left: timedelta | None, sent_at: float,
                         beat: Callable[[], Awaitable[Renewal]]) -> None:
        assert time_left is not None and self._control is not None
        control = self._control
        deadline = self._state.deadline = Deadline(time_left, sent_at)
        control.timeout = connecting.call_timeout(seconds(ttl if ttl is not None else time_left))

        def renewed(at: float) -> None:  # lost at the deadline, on time, even if the heartbeat is stuck
            control.alarm(at, alarm)

        def alarm() -> None:
            current = self._state.deadline
            if not self._state.check_lost() and current is not None:  # woken a hair early, or renewed since
                control.alarm(current.at, alarm)

        renewed(deadline.at)
        self._heartbeat = AsyncHeartbeat(
            beat=beat, interval=beat_interval(interval, ttl, time_left),
            state=self._state, name=f"ledger-heartbeat:{self.job}:{self.token}", renewed=renewed)
        self._heartbeat.start()

    async def _renewal(self, query: str, params: Mapping[str, Any]) -> Renewal:
        """A heartbeat's call on the own connection, given up at the local deadline at the latest."""
        assert self._control is not None
        deadline = self._state.deadline
        bound = None if deadline is None else deadline.remaining()
        rows, sent = await self._control.call(query, params, dict_row, bound=bound)
        row = rows[0]
        ended_as = row["ended_as"]
        if row["expires_at"] is None and ended_as is None and params.get("run_id") is not None:
            ended_as = await self._ended_as(params["run_id"])
        return Renewal(None if row["expires_at"] is None else row["time_left"], sent, ended_as)

    async def _ended_as(self, run_id: int) -> str | None:
        """Why a run whose heartbeat answered NULL was lost, read by a statement of its own: the
        heartbeat may have waited for the transaction that ended it (a cancel), which committed
        after that statement's snapshot. None when it cannot tell (the run was not ended, or the
        read failed: the loss stands, with the general reason)."""
        assert self._control is not None
        try:
            rows, _ = await self._control.call(queries.RUN_ENDED_AS, {"run_id": run_id}, dict_row,
                                               bound=ENDED_AS_BOUND)
        except psycopg.Error as error:
            log.debug("could not read why run %s was lost: %s", run_id, first_line(error))
            return None
        found: str | None = rows[0]["ended_as"] if rows else None
        return found

    async def _stop_heartbeat(self) -> bool:
        """Stop the heartbeat; True when the lease is lost (or its deadline passed), which ends the deadline.

        A heartbeat stuck in a call past the deadline is not waited for: its
        call is given up first.
        """
        if self._heartbeat is not None:
            if self._state.check_lost() and self._control is not None:
                self._control.abort()
            await self._heartbeat.stop()
        lost = self._state.check_lost()
        self._state.deadline = None  # from here the end's answer decides
        if self._control is not None:
            self._control.alarm(None)
        return lost

    async def _close_control(self) -> None:
        if self._control is not None:
            await self._control.close()


class AsyncRunContext(_AsyncHolding):
    """One run of a job: ``start_run`` on enter, heartbeats, ``complete_run``/``fail_run``/``cancel_run`` on exit.

    ``started`` is False when the ledger did not start the run (``outcome`` says
    why: ``skipped_overlap`` with ``holder``/``holder_expires_at``,
    ``skipped_pool_full`` (the job's pool has as many live leases as its
    size: no token, counted in ``skipped_pool_full``), ``already_done``,
    ``paused``, ``nothing_due``); the body should return.
    That is not an error: nothing is logged as failed.

    On exit: normal exit completes the run; an Exception fails it with the
    exception's text and propagates; KeyboardInterrupt, SystemExit and
    other BaseExceptions (the async client: a cancelled task's
    CancelledError) cancel it (``failure_reason = 'cancelled'``) and
    propagate. When the ledger refuses
    to complete because the lease was lost (LD001, LD003), a normal exit
    raises LeaseLost. ``result`` is the ended run's row. ``detail`` (a dict
    the body may fill) is merged into the run's detail.

    The completion names the resources the run fenced (``fenced``: those of
    its ``fence``/``advance_fence`` calls, and those given to
    ``add_fenced``), and the ledger records success only when each fence
    holds the run's token, that is, when the fenced write committed. When
    one does not (its transaction rolled back, or a pooler lost its COMMIT),
    the run is recorded as failure and a normal exit raises
    FenceNotCommitted (LD007) after that is committed.
    """

    def __init__(self, ledger: AsyncLedger, job: str, *, ttl: timedelta | None = None,
                 slot: datetime | None = None, idempotency_key: str | None = None,
                 detail: Mapping[str, Any] | None = None, heartbeat_interval: timedelta | None = None,
                 on_lost: OnLost | None = None, due: bool = False,
                 backfill: tuple[datetime, datetime] | None = None,
                 adopt: tuple[RunStart, timedelta | None, float] | None = None) -> None:
        super().__init__(ledger, job, on_lost)
        self._ttl = ttl
        self._adopt = adopt
        self._slot = slot
        self._backfill = backfill
        self._idempotency_key = idempotency_key
        self._start_detail = detail
        self._heartbeat_interval = heartbeat_interval
        self._due = due
        self._begun = False
        self.start: RunStart | None = None
        """The ``ledger.run_start`` row, once entered."""
        self.result: Run | None = None
        """The run's log row after exit (None when it did not start or could not end)."""
        self.detail: dict[str, Any] = {}
        """Facts for the run's log row, sent with complete/fail (merged into its detail)."""

    @property
    def fenced(self) -> tuple[str, ...]:
        """The resources the completion names to ``complete_run`` (``fenced``), in the order first fenced."""
        return tuple(self._fenced_resources)

    def add_fenced(self, resource: str) -> None:
        """Name ``resource`` to the completion as fenced by this run, though this context did not fence it.

        For a write the client cannot see: a table that ``ledger.protect``
        guards, written through ``transaction()`` (its resource is the
        table's qualified name, ``public.orders``), or a fence that other
        code or a child process called with this run's token. The ledger
        then records success only when that fence holds the run's token.
        """
        self._fenced_resources[resource] = None

    # The run_start row, flattened.
    @property
    def outcome(self) -> str | None:
        return None if self.start is None else self.start.outcome

    @property
    def started(self) -> bool:
        return self.start is not None and self.start.started

    @property
    def run_id(self) -> int | None:
        return self._state.run_id

    @property
    def expires_at(self) -> datetime | None:
        return None if self.start is None else self.start.expires_at

    @property
    def slot(self) -> datetime | None:
        return self._slot if self.start is None else self.start.slot

    @property
    def holder(self) -> str | None:
        return None if self.start is None else self.start.holder

    @property
    def holder_expires_at(self) -> datetime | None:
        return None if self.start is None else self.start.holder_expires_at

    @property
    def is_open(self) -> bool:
        """Started and not yet ended."""
        return self._open

    def _not_held(self) -> str:
        return "not entered" if self.start is None else f"outcome {self.start.outcome}"

    async def __aenter__(self) -> AsyncRunContext:
        if not self._begun:
            await self._begin()
        elif not self._open:
            raise RuntimeError("a run context can be entered only once")
        return self

    async def _begin(self) -> None:
        self._begun = True
        control = await self._ledger._open_control(self.job)
        self._control = control
        try:
            if self._adopt is not None:  # started by ledger.start_due_runs: heartbeat and end it only
                start, time_left, sent = self._adopt
            elif self._backfill is not None:  # ledger.backfill: the oldest slot of the range not done
                params: dict[str, Any] = {"job": self.job, "owner": self.owner, "ttl": self._ttl,
                                          "from_slot": self._backfill[0], "to_slot": self._backfill[1]}
                rows, sent = await control.call(queries.BACKFILL, params, dict_row)
            elif self._due:
                params = {"job": self.job, "owner": self.owner, "ttl": self._ttl}
                rows, sent = await control.call(queries.START_DUE_RUN, params, dict_row)
            else:
                params = {"job": self.job, "owner": self.owner, "ttl": self._ttl, "slot": self._slot,
                          "idempotency_key": self._idempotency_key, "detail": jsonb(self._start_detail)}
                rows, sent = await control.call(queries.START_RUN, params, dict_row)
            if self._adopt is None:
                start, time_left = run_start(rows[0])
        except BaseException:
            await control.close()
            raise
        self.start = start
        if not start.started:
            await control.close()
            return
        self._state.token = start.token
        self._state.run_id = start.run_id
        self._open = True
        try:
            self._start_heartbeat(self._heartbeat_interval, self._ttl, time_left, sent, self._beat)
        except BaseException as error:
            # Interrupted between start_run and the heartbeat: do not leave a running row behind.
            await self._end(error)
            raise

    async def _beat(self) -> Renewal:
        return await self._renewal(queries.HEARTBEAT, {"run_id": self.run_id, "token": self.token, "ttl": self._ttl})

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._open:
            await ashield(self._end(exc))

    async def _end(self, exc: BaseException | None, error_text: str | None = None) -> None:
        self._open = False
        lost = self._state.lost_error() if await self._stop_heartbeat() else None
        assert self._control is not None
        query, params = end_call(self.run_id, self.token, exc, error_text, lost, self.detail, self.fenced)
        try:
            self.result = await self._record_end(self._control, query, params)
        except (LeaseSuperseded, RunNotRunning) as error:
            refused = self._state.mark_lost("the ledger refused to end the run", error)
            if lost is not None:
                # Known lost before the end: the ledger ended the run already
                # (cancelled, superseded, expired), and its row says how.
                self.result = await self._row_as_ended()
            if exc is None:
                raise refused from error
            if lost is None:
                log.warning("run %s of job %s could not record its end: %s", self.run_id, self.job, error)
            else:
                log.info("run %s of job %s was ended by the ledger already: %s", self.run_id, self.job, error)
        except Exception as error:
            if exc is None and lost is None:
                raise
            log.warning("run %s of job %s could not record its end: %s", self.run_id, self.job, error)
        finally:
            await self._close_control()
        if exc is None and lost is not None:
            raise lost
        if exc is None and self.result is not None and fence_not_committed(self.result) is not None:
            raise fence_failure(self.result)

    async def _row_as_ended(self) -> Run | None:
        """The run's row as the ledger left it (None when it cannot be read now)."""
        assert self._control is not None
        try:
            rows = await self._control.execute(queries.GET_RUN, {"run_id": self.run_id}, class_row(Run))
        except Exception:
            log.debug("reading how run %s ended failed", self.run_id, exc_info=True)
            return None
        return rows[0] if rows and rows[0].status != "running" else None

    async def _record_end(self, control: _AsyncControl, query: str, params: Mapping[str, Any]) -> Run:
        """Send the end; on a broken connection again on a new one, where the run's row tells what happened."""
        try:
            rows, _ = await control.call(query, params, class_row(Run), attempts=END_ATTEMPTS)
            return rows[0]
        except (LeaseSuperseded, RunNotRunning):
            if control.retried:
                # The attempt whose connection broke may have ended the run already: then it is ours.
                rows = await control.execute(queries.GET_RUN, {"run_id": self.run_id}, class_row(Run))
                if rows and ended_by_us(rows[0], query, self.token):
                    return rows[0]
            raise


class AsyncLeaseContext(_AsyncHolding):
    """A plain lease (``acquire``/``renew``/``release``), without the execution log.

    ``acquired`` is False when another owner holds the job; the body should
    return. While held, the lease is renewed every ttl/3 on the context's own
    connection; on exit it is released. A normal exit whose release finds the
    lease no longer held raises LeaseLost.
    """

    def __init__(self, ledger: AsyncLedger, job: str, *, ttl: timedelta | None = None,
                 heartbeat_interval: timedelta | None = None, on_lost: OnLost | None = None) -> None:
        super().__init__(ledger, job, on_lost)
        self._ttl = ttl
        self._heartbeat_interval = heartbeat_interval
        self._entered = False
        self.lease: Lease | None = None
        """The ``ledger.lease`` row when acquired."""
        self.released: bool | None = None
        """What ``ledger.release`` answered on exit."""

    @property
    def acquired(self) -> bool:
        return self.lease is not None

    @property
    def expires_at(self) -> datetime | None:
        return None if self.lease is None else self.lease.expires_at

    def _not_held(self) -> str:
        return "not entered" if not self._entered else "not acquired"

    async def __aenter__(self) -> AsyncLeaseContext:
        if self._entered:
            raise RuntimeError("a lease context can be entered only once")
        self._entered = True
        control = await self._ledger._open_control(self.job)
        self._control = control
        try:
            rows, sent = await control.call(
                queries.ACQUIRE, {"job": self.job, "owner": self.owner, "ttl": self._ttl}, dict_row)
        except BaseException:
            await control.close()
            raise
        if not rows:
            await control.close()
            return self
        values, time_left = split_time_left(rows[0])
        self.lease = Lease(**values)
        self._state.token = self.lease.token
        self._open = True
        try:
            self._start_heartbeat(self._heartbeat_interval, self._ttl, time_left, sent, self._renew)
        except BaseException:
            await self._release(None)
            raise
        return self

    async def _renew(self) -> Renewal:
        return await self._renewal(queries.RENEW, {"job": self.job, "owner": self.owner, "token": self.token,
                                                   "ttl": self._ttl})

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._open:
            await ashield(self._release(exc))

    async def _release(self, exc: BaseException | None) -> None:
        self._open = False
        lost = self._state.lost_error() if await self._stop_heartbeat() else None
        assert self._control is not None
        try:
            params = {"job": self.job, "owner": self.owner, "token": self.token}
            self.released = bool((await self._control.execute(queries.RELEASE, params, scalar_row))[0])
        except Exception as error:
            if exc is None and lost is None:
                raise
            log.warning("lease of job %s could not be released: %s", self.job, error)
        finally:
            await self._close_control()
        if self.released is False:
            lost = self._state.mark_lost("the lease was no longer held at release")
        if exc is None and lost is not None:
            raise lost


# -- the decorator ------------------------------------------------------------

class AsyncScheduledJob(Generic[P, T]):
    """A function registered as a scheduled job; calling it runs the job's due slots.

    The function takes the run context first (``run.slot`` is the slot it
    serves, ``run.fence`` guards its writes). ``register()`` upserts the job
    (``ledger.register_job``); the first call does it once per process, never
    at import. A call loops on ``start_due_run`` (see :meth:`AsyncLedger.catch_up`)
    and returns the function's results, oldest slot first; an exception fails
    that run and propagates.
    """

    def __init__(self, ledger: AsyncLedger, fn: Callable[Concatenate[AsyncRunContext, P], Awaitable[T]], *,
                 job: str, schedule: str | None, ttl: timedelta | None, max_backfill: int, time_zone: str,
                 heartbeat_interval: timedelta | None, on_lost: OnLost | None) -> None:
        self.ledger = ledger
        self.fn = fn
        self.job = job
        self.schedule = schedule
        self.ttl = ttl
        self.max_backfill = max_backfill
        self.time_zone = time_zone
        self._heartbeat_interval = heartbeat_interval
        self._on_lost = on_lost
        self._registered = False
        self._lock = ALock()
        functools.update_wrapper(self, fn)

    async def register(self) -> Job:
        job = await self.ledger.register_job(self.job, schedule=self.schedule, ttl=self.ttl,
                                             max_backfill=self.max_backfill, time_zone=self.time_zone)
        self._registered = True
        return job

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> list[T]:
        async with self._lock:
            if not self._registered:
                await self.register()
        results: list[T] = []
        async for run in self.ledger.catch_up(self.job, heartbeat_interval=self._heartbeat_interval,
                                              on_lost=self._on_lost):
            async with run:
                results.append(await self.fn(run, *args, **kwargs))
        return results


# -- the ledger ---------------------------------------------------------------

class AsyncLedger:
    """The ledger's SQL API over a psycopg AsyncConnection, an AsyncConnectionPool, or a conninfo string.

    ``owner`` defaults to :func:`ledger.identity.default_owner`
    (``hostname:pid:random``, new in a forked child). ``heartbeat_conninfo``
    (AsyncConnection only) is where contexts open their own connection, when
    the connection's own conninfo will not do (a multi-host conninfo, a
    password from a callback); that connection takes the caller's
    connection's ``prepare_threshold``. ``pool_kwargs`` (conninfo only) go to
    the AsyncConnectionPool the ledger opens; its ``kwargs`` go over the
    ledger's connection settings (autocommit, ``prepare_threshold=None``, TCP
    keepalives, a connect timeout: see :mod:`ledger.connect`).

    From a conninfo string the ledger checks one connection first and waits
    for its pool: LedgerUnavailable (naming host and port) when the database
    cannot be reached, at once rather than as a PoolTimeout on the first
    call. A pool passed in is used as it is (behind a transaction pooler,
    create it with ``kwargs={"prepare_threshold": None, ...}``).
    """

    def __init__(self, source: AsyncConnection | AsyncConnectionPool[Any] | str, *, owner: str | None = None,
                 heartbeat_conninfo: str | None = None, pool_kwargs: Mapping[str, Any] | None = None) -> None:
        self._owner = owner
        self._conn: AsyncConnection | None = None
        self._pool: AsyncConnectionPool[Any] | None = None
        self._owns_pool = False
        self._pool_opened = False
        self._opening = ALock()
        self._heartbeat_conninfo: str | None = None
        self._spares: _AsyncSpares | None = None  # the contexts' own connections, for AsyncLedger(conn)
        if heartbeat_conninfo is not None and not isinstance(source, psycopg.AsyncConnection):
            raise TypeError("heartbeat_conninfo applies to an AsyncLedger over an AsyncConnection only")
        if isinstance(source, str):
            self._pool = connecting.make_async_pool(source, pool_kwargs or {})
            self._owns_pool = True
            if not ASYNC:
                # At once: a wrong DSN fails here, not on the first call (unless the caller said open=False).
                if (pool_kwargs or {}).get("open", True):
                    self.open()
        elif isinstance(source, psycopg.AsyncConnection):
            self._conn = source
            self._heartbeat_conninfo = heartbeat_conninfo if heartbeat_conninfo is not None else conninfo_of(source)
        elif isinstance(source, AsyncConnectionPool):
            self._pool = source
        else:
            raise TypeError(
                "AsyncLedger takes a psycopg AsyncConnection, a psycopg_pool AsyncConnectionPool or a conninfo "
                "string (ledger.Ledger takes sync ones, ledger.AsyncLedger async ones), "
                f"not {type(source).__name__}")

    @property
    def owner(self) -> str:
        return self._owner if self._owner is not None else default_owner()

    async def open(self) -> None:
        """Open the pool the ledger owns (done on first use anyway); LedgerUnavailable when it cannot connect."""
        if not self._owns_pool or self._pool_opened:
            return
        assert self._pool is not None
        async with self._opening:
            if not self._pool_opened:
                await connecting.open_async_pool(self._pool)
                self._pool_opened = True

    async def close(self) -> None:
        """Close what the ledger opened: the pool from a conninfo string, the spare context connections.

        A caller's pool or connection stays open.
        """
        if self._owns_pool and self._pool is not None:
            await self._pool.close()
        if self._spares is not None:
            await self._spares.close()

    async def __aenter__(self) -> AsyncLedger:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- plumbing -------------------------------------------------------------

    async def _call(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R]) -> list[R]:
        if self._conn is not None:
            return await execute_own(self._conn, query, params, row_factory)
        assert self._pool is not None
        await self.open()
        try:
            async with self._pool.connection() as conn:
                return await execute_own(conn, query, params, row_factory)
        except PoolTimeout as error:
            raise LedgerUnavailable(
                f"no free connection in the ledger's pool within {self._pool.timeout:.3g}s: every connection was "
                "busy (raise the pool's max_size, pool_kwargs={'max_size': ...})", {}) from error

    async def _open_control(self, job: str) -> _AsyncControl:
        name = f"ledger-watchdog:{job}"
        if self._pool is not None:
            await self.open()
            pool = self._pool
            return _AsyncControl(pool.getconn, pool.putconn, name)  # getconn(timeout)
        if self._spares is None:
            conninfo = self._heartbeat_conninfo
            assert conninfo is not None and self._conn is not None
            # Derived from the caller's connection: its prepare_threshold (behind a
            # transaction pooler it is None), always autocommit (one call, one transaction).
            prepare_threshold = self._conn.prepare_threshold

            async def connect() -> AsyncConnection:  # bounded by connect_timeout
                return await connecting.connect_async(conninfo, prepare_threshold=prepare_threshold)

            self._spares = _AsyncSpares(connect)
        return _AsyncControl(self._spares.take, self._spares.give_back, name)

    # -- contexts ---------------------------------------------------------------

    def run(self, job: str, *, ttl: timedelta | None = None, slot: datetime | None = None,
            idempotency_key: str | None = None, detail: Mapping[str, Any] | None = None,
            heartbeat_interval: timedelta | None = None, on_lost: OnLost | None = None) -> AsyncRunContext:
        """A run of ``job`` as a context manager, ``async with`` (see :class:`AsyncRunContext`).

        ``ttl`` None means the job's registered ttl. Heartbeats every
        ``heartbeat_interval`` (default ttl/3). ``on_lost`` is called once, in
        the event loop, when the lease is found lost.
        """
        return AsyncRunContext(self, job, ttl=ttl, slot=slot, idempotency_key=idempotency_key, detail=detail,
                               heartbeat_interval=heartbeat_interval, on_lost=on_lost)

    def lease(self, job: str, *, ttl: timedelta | None = None, heartbeat_interval: timedelta | None = None,
              on_lost: OnLost | None = None, renew_interval: timedelta | None = None) -> AsyncLeaseContext:
        """A plain lease of ``job`` as a context manager, ``async with`` (see :class:`AsyncLeaseContext`).

        Renewed every ``heartbeat_interval`` (default ttl/3), the same knob as
        a run's. ``renew_interval`` is its old name, deprecated.
        """
        if renew_interval is not None:
            warnings.warn("lease(renew_interval=...) is deprecated: use heartbeat_interval=...",
                          DeprecationWarning, stacklevel=2)
            heartbeat_interval = renew_interval if heartbeat_interval is None else heartbeat_interval
        return AsyncLeaseContext(self, job, ttl=ttl, heartbeat_interval=heartbeat_interval, on_lost=on_lost)

    async def catch_up(self, job: str, *, ttl: timedelta | None = None,
                       heartbeat_interval: timedelta | None = None,
                       on_lost: OnLost | None = None) -> AsyncIterator[AsyncRunContext]:
        """Started runs of ``job``'s due slots, oldest first, one at a time (``start_due_run``).

        Use each with ``async with run:`` so that an exception fails it. Each
        run is started before it is yielded (its heartbeat runs). The loop ends
        when ``start_due_run`` answers anything but ``started``
        (``nothing_due``, ``skipped_overlap``, ``skipped_pool_full``, ``paused``), and after a run
        that did not end in success, so a failing slot is retried on the next
        call, not in a tight loop. A run the loop body left open is completed
        when the loop moves on, and cancelled when the loop is abandoned.
        """
        while True:
            run = AsyncRunContext(self, job, ttl=ttl, heartbeat_interval=heartbeat_interval, on_lost=on_lost,
                                  due=True)
            await run._begin()
            if not run.started:
                return
            resumed = False
            try:
                yield run
                resumed = True
            finally:
                if run.is_open:
                    if resumed:
                        await run._end(None)
                    else:
                        await ashield(run._end(GeneratorExit(), "the catch-up loop was left before the run ended"))
            if run.result is None or run.result.status != "success":
                return

    def job(self, job: str, *, schedule: str | None = None, ttl: timedelta | None = None, max_backfill: int = 1,
            time_zone: str = "UTC", heartbeat_interval: timedelta | None = None, on_lost: OnLost | None = None,
            ) -> Callable[[Callable[Concatenate[AsyncRunContext, P], Awaitable[T]]], AsyncScheduledJob[P, T]]:
        """Decorator: register ``fn`` as scheduled job ``job``; calling it runs the due slots."""

        def decorate(fn: Callable[Concatenate[AsyncRunContext, P], Awaitable[T]]) -> AsyncScheduledJob[P, T]:
            return AsyncScheduledJob(self, fn, job=job, schedule=schedule, ttl=ttl, max_backfill=max_backfill,
                                     time_zone=time_zone, heartbeat_interval=heartbeat_interval, on_lost=on_lost)

        return decorate

    # -- the SQL API, one method per function -------------------------------------

    async def acquire(self, job: str, ttl: timedelta | None = None, *, owner: str | None = None) -> Lease | None:
        """``ledger.acquire``: the lease, or None when another owner holds it (or the job's pool is full)."""
        rows = await self._call(queries.ACQUIRE, {"job": job, "owner": owner or self.owner, "ttl": ttl}, dict_row)
        return Lease(**split_time_left(rows[0])[0]) if rows else None

    async def renew(self, job: str, token: int, ttl: timedelta | None = None, *,
                    owner: str | None = None) -> datetime | None:
        """``ledger.renew``: the new expiry, or None when the lease is lost."""
        params = {"job": job, "owner": owner or self.owner, "token": token, "ttl": ttl}
        expires_at: datetime | None = (await self._call(queries.RENEW, params, dict_row))[0]["expires_at"]
        return expires_at

    async def release(self, job: str, token: int, *, owner: str | None = None) -> bool:
        """``ledger.release``: False when that owner and token do not hold the lease."""
        params = {"job": job, "owner": owner or self.owner, "token": token}
        return bool((await self._call(queries.RELEASE, params, scalar_row))[0])

    async def is_current(self, job: str, token: int) -> bool:
        return bool((await self._call(queries.IS_CURRENT, {"job": job, "token": token}, scalar_row))[0])

    async def assert_current(self, job: str, token: int) -> None:
        """Raise LeaseSuperseded unless the token is current."""
        await self._call(queries.ASSERT_CURRENT, {"job": job, "token": token}, scalar_row)

    async def start_run(self, job: str, *, ttl: timedelta | None = None, slot: datetime | None = None,
                        idempotency_key: str | None = None, detail: Mapping[str, Any] | None = None,
                        owner: str | None = None) -> RunStart:
        """``ledger.start_run``, without a heartbeat (see :meth:`run` for the context)."""
        params = {"job": job, "owner": owner or self.owner, "ttl": ttl, "slot": slot,
                  "idempotency_key": idempotency_key, "detail": jsonb(detail)}
        return run_start((await self._call(queries.START_RUN, params, dict_row))[0])[0]

    async def start_due_run(self, job: str, *, ttl: timedelta | None = None, owner: str | None = None) -> RunStart:
        """``ledger.start_due_run``, without a heartbeat (see :meth:`catch_up`)."""
        params = {"job": job, "owner": owner or self.owner, "ttl": ttl}
        return run_start((await self._call(queries.START_DUE_RUN, params, dict_row))[0])[0]

    async def heartbeat(self, run_id: int, token: int, ttl: timedelta | None = None) -> datetime | None:
        """``ledger.heartbeat``: the new expiry, or None when the lease is lost."""
        params = {"run_id": run_id, "token": token, "ttl": ttl}
        expires_at: datetime | None = (await self._call(queries.HEARTBEAT, params, dict_row))[0]["expires_at"]
        return expires_at

    async def complete_run(self, run_id: int, token: int, detail: Mapping[str, Any] | None = None,
                           fenced: Sequence[str] | None = None) -> Run:
        """``ledger.complete_run``. With ``fenced``, the row is a failure when a fence does not hold the token."""
        params: dict[str, Any] = {"run_id": run_id, "token": token, "detail": jsonb(detail)}
        if fenced:
            params["fenced"] = list(fenced)
            return (await self._call(queries.COMPLETE_FENCED_RUN, params, class_row(Run)))[0]
        return (await self._call(queries.COMPLETE_RUN, params, class_row(Run)))[0]

    async def fail_run(self, run_id: int, token: int, error: str, detail: Mapping[str, Any] | None = None) -> Run:
        params = {"run_id": run_id, "token": token, "error": error, "detail": jsonb(detail)}
        return (await self._call(queries.FAIL_RUN, params, class_row(Run)))[0]

    async def cancel_run(self, run_id: int, token: int, error: str | None = None) -> Run:
        params = {"run_id": run_id, "token": token, "error": error}
        return (await self._call(queries.CANCEL_RUN, params, class_row(Run)))[0]

    async def get_run(self, run_id: int) -> Run | None:
        """The run's row of ``ledger.job_execution_log``."""
        rows = await self._call(queries.GET_RUN, {"run_id": run_id}, class_row(Run))
        return rows[0] if rows else None

    async def reap_expired(self, job: str | None = None) -> int:
        return int((await self._call(queries.REAP_EXPIRED, {"job": job}, scalar_row))[0])

    async def register_job(self, job: str, *, schedule: str | None = None, ttl: timedelta | None = None,
                           max_backfill: int | None = None, time_zone: str | None = None,
                           late_after: timedelta | None = None, down_after: timedelta | None = None,
                           min_runtime: timedelta | None = None, max_runtime: timedelta | None = None,
                           pause_after_failures: int | None = None, jitter: timedelta | None = None,
                           start_deadline: timedelta | None = None, overlap_policy: str | None = None,
                           pool: str | None = None,
                           max_concurrent: int | None = None) -> Job:
        """Register ``job``, or change the options given of a registered job.

        An option left None keeps what the job has (a first registration: no
        schedule, no ttl, ``max_backfill`` 1, UTC, no health bounds, no jitter,
        no start deadline, overlap policy ``catch_up``); a bound of
        ``timedelta(0)`` (``pause_after_failures`` 0) clears it. ``jitter``: each
        slot starts at an offset in [0, jitter), the same on every host;
        ``start_deadline``: a slot not started within it after its due time is
        skipped, never run late; ``overlap_policy``: ``catch_up``, ``skip``,
        ``buffer_one`` or ``replace`` (docs/contract.md, "The scheduler");
        ``pool``: the registered pool the job joins (PoolNotFound when there is
        none of that name), ``""`` takes it out of its pool.
        ``max_concurrent``: up to that many live runs at once, each in its own seat with its own
        token (docs/contract.md, "Concurrent runs"; ``replace`` and ``buffer_one`` need 1).
        """
        params = {"job": job, "schedule": schedule, "ttl": ttl, "max_backfill": max_backfill,
                  "time_zone": time_zone, "late_after": late_after, "down_after": down_after,
                  "min_runtime": min_runtime, "max_runtime": max_runtime,
                  "pause_after_failures": pause_after_failures, "jitter": jitter,
                  "start_deadline": start_deadline, "overlap_policy": overlap_policy, "pool": pool,
                  "max_concurrent": max_concurrent}
        return (await self._call(queries.REGISTER_JOB, params, class_row(Job)))[0]

    async def unregister_job(self, job: str, *, with_history: bool = False) -> bool:
        """Remove ``job``'s registration (``ledger.unregister_job``); with ``with_history`` its runs and
        counters too. Refused (InvalidArgument) while a run of the job is live."""
        params = {"job": job, "with_history": with_history}
        return bool((await self._call(queries.UNREGISTER_JOB, params, scalar_row))[0])

    async def force_release(self, job: str) -> int | None:
        """Release ``job``'s lease whoever holds it (``ledger.force_release``): the new token, which
        supersedes the holder's; None when the job never held a lease."""
        row = (await self._call(queries.FORCE_RELEASE, {"job": job}, scalar_row))[0]
        return None if row is None else int(row)

    async def request_cancel(self, run_id: int) -> bool:
        """Ask a running run to stop (``ledger.request_cancel``): its holder's next heartbeat ends it
        as cancelled and marks it lost. True when this call made the request."""
        return bool((await self._call(queries.REQUEST_CANCEL, {"run_id": run_id}, scalar_row))[0])

    async def pause_job(self, job: str) -> bool:
        return bool((await self._call(queries.PAUSE_JOB, {"job": job}, scalar_row))[0])

    async def resume_job(self, job: str) -> bool:
        return bool((await self._call(queries.RESUME_JOB, {"job": job}, scalar_row))[0])

    async def trigger(self, job: str, *, requested_by: str | None = None,
                      detail: Mapping[str, Any] | None = None) -> int:
        """Ask for a manual run of ``job`` now (``ledger.trigger``): the trigger's id. A scheduler starts it
        (respecting the lease and the job's overlap policy), logged as manual; a pending one is returned
        again rather than doubled."""
        params = {"job": job, "requested_by": requested_by, "detail": jsonb(detail)}
        return int((await self._call(queries.TRIGGER, params, scalar_row))[0])

    async def protect(self, table: str, job: str, *, mode: str = "lenient") -> str:
        """``ledger.protect``: refuse every write to ``table`` (a name, resolved in the connection's
        search_path; the caller must own it) from a transaction that does not carry ``job``'s live
        token. ``mode`` ``"strict"``: each token writes in one transaction only. Returns the fence's
        resource, the table's qualified name."""
        params = {"table": table, "job": job, "mode": mode}
        return str((await self._call(queries.PROTECT, params, scalar_row))[0])

    async def unprotect(self, table: str) -> bool:
        """``ledger.unprotect``: the table takes any write again; False when it was not protected."""
        return bool((await self._call(queries.UNPROTECT, {"table": table}, scalar_row))[0])

    async def register_pool(self, pool: str, size: int) -> Pool:
        """``ledger.register_pool``: create ``pool`` (at most ``size`` live leases of its jobs at once,
        whichever jobs they are), or change its size; the pool's row. A smaller size stops nothing
        that runs: no start is admitted until the live leases are fewer."""
        return (await self._call(queries.REGISTER_POOL, {"pool": pool, "size": size}, class_row(Pool)))[0]

    async def resize_pool(self, pool: str, size: int) -> Pool:
        """``ledger.resize_pool``: the size of a registered pool (PoolNotFound otherwise); the pool's row."""
        return (await self._call(queries.RESIZE_POOL, {"pool": pool, "size": size}, class_row(Pool)))[0]

    async def drop_pool(self, pool: str, *, detach: bool = False) -> bool:
        """``ledger.drop_pool``: False when there is no such pool. While jobs belong to it, refused
        (psycopg's DependentObjectsStillExist, 2BP01, its DETAIL naming the jobs) unless ``detach``,
        which takes them out of it first."""
        return bool((await self._call(queries.DROP_POOL, {"pool": pool, "detach": detach}, scalar_row))[0])

    async def pool_status(self, pool: str) -> PoolStatus | None:
        """The pool's row of the ``ledger.pool_status`` view: size, used, running, jobs, waiting,
        skipped_pool_full."""
        rows = await self._call(queries.POOL_STATUS, {"pool": pool}, class_row(PoolStatus))
        return rows[0] if rows else None

    async def pool_statuses(self) -> list[PoolStatus]:
        """Every row of the ``ledger.pool_status`` view, by pool."""
        return await self._call(queries.POOL_STATUSES, {}, class_row(PoolStatus))

    async def due_slots(self, job: str, at: datetime | None = None) -> list[datetime]:
        return list(await self._call(queries.DUE_SLOTS, {"job": job, "at": at}, scalar_row))

    async def job_status(self, job: str) -> JobStatus | None:
        """The job's row of the ``ledger.job_status`` view."""
        rows = await self._call(queries.JOB_STATUS, {"job": job}, class_row(JobStatus))
        return rows[0] if rows else None

    async def job_statuses(self) -> list[JobStatus]:
        """Every row of the ``ledger.job_status`` view, by job."""
        return await self._call(queries.JOB_STATUSES, {}, class_row(JobStatus))

    async def purge_log(self, older_than: timedelta) -> int:
        """``ledger.purge_log``: delete the ended runs older than ``older_than`` (never a job's newest
        success) in one transaction; how many. Small purges; see :meth:`purge_log_in_batches`."""
        return int((await self._call(queries.PURGE_LOG, {"older_than": older_than}, scalar_row))[0])

    async def purge_log_in_batches(self, older_than: timedelta) -> int:
        """The same purge, one ``ledger.purge_log_batch`` call per 10,000 run ids; how many it deleted.

        Each batch is a call of its own: it commits by itself (outside a transaction of the caller's),
        so no lock is held longer than one batch and the ends of running jobs never wait for the whole
        purge; stopped half-way, it keeps the batches it committed, each whole. What
        ``CALL ledger.purge_log_in_batches`` does in SQL, over any connection.
        """
        deleted, from_run_id = 0, None
        while True:
            [batch] = await self._call(queries.PURGE_LOG_BATCH,
                                       {"older_than": older_than, "from_run_id": from_run_id}, dict_row)
            deleted += int(batch["deleted"])
            from_run_id = batch["next_run_id"]
            if from_run_id is None:
                return deleted

    # -- events -------------------------------------------------------------------

    async def events(self, after: int | None = None, *, job: str | None = None,
                     kinds: Sequence[str] | None = None, limit: int = 100) -> list[models.Event]:
        """Rows of ``ledger.events`` in ``event_id`` order, of ``job`` and ``kinds`` (None: any).

        ``after`` None: the newest ``limit`` events; else the first ``limit``
        after event ``after`` (page on with the last one's ``event_id``). The
        ids are taken in the order the changes were written, which two
        transactions may commit the other way round: a reader that must
        miss nothing follows them with :class:`ledger.tail.EventCursor`.
        """
        params = {"after": after, "job": job, "kinds": list(kinds) if kinds else None, "limit": limit}
        if after is None:
            return await self._call(queries.EVENTS_NEWEST, {**params, "through": None}, class_row(models.Event))
        return await self._call(queries.EVENTS_AFTER, params, class_row(models.Event))

    async def sync_alerts(self) -> list[models.Event]:
        """``ledger.sync_alerts``: record the alerts raised and cleared since the last call; those events."""
        return await self._call(queries.SYNC_ALERTS, {}, class_row(models.Event))

    async def configure_events(self, *, run_events: bool | None = None, notify: bool | None = None,
                               retention: timedelta | None = None, max_events: int | None = None) -> EventSettings:
        """``ledger.configure_events``: change the options given (None keeps one); the settings after it."""
        params = {"run_events": run_events, "notify": notify, "retention": retention, "max_events": max_events}
        return (await self._call(queries.CONFIGURE_EVENTS, params, class_row(EventSettings)))[0]

    async def event_settings(self) -> EventSettings:
        """The settings as they are (``ledger.event_settings``): a read, which ``ledger_reader`` may do too."""
        return (await self._call(queries.EVENT_SETTINGS, {}, class_row(EventSettings)))[0]

    async def purge_events(self) -> int:
        """``ledger.purge_events``: delete the events past the retention now; how many."""
        return int((await self._call(queries.PURGE_EVENTS, {}, scalar_row))[0])
