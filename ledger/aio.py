"""The asyncio Python client: ``AsyncLedger``, the same surface as :class:`ledger.client.Ledger`.

Over an ``AsyncConnection``, an ``AsyncConnectionPool`` or a conninfo string
(then the ledger opens and owns an ``AsyncConnectionPool``: use
``async with AsyncLedger(dsn) as ledger:`` or ``await ledger.close()``).
Contexts are ``async with``; the heartbeat is a task on the context's own
connection; cancelling the task running the body records the run as
``cancelled`` and lets the cancellation propagate.

Connections, poolers, bounds and the local deadline as in
:mod:`ledger.client`: the pool opened from a DSN (on first use or
``async with``) checks one connection first (LedgerUnavailable at once for a
wrong DSN) and never prepares statements; a context's own connection opened
from a caller's ``AsyncConnection`` takes its ``prepare_threshold``; each
call of a context is bounded (``statement_timeout`` sent with the call, and
an event-loop timer that shuts the socket down when no answer came), and
``check``/``fence``/``advance_fence``/the end treat a passed local deadline
as a lost lease, even while the heartbeat task is stuck in a call.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import BaseRowFactory, class_row, dict_row, scalar_row
from psycopg_pool import AsyncConnectionPool

from ledger import connect as connecting
from ledger import queries
from ledger.client import end_call, jsonb, run_start, split_time_left
from ledger.errors import LeaseLost, LeaseSuperseded, LedgerUnavailable, RunNotRunning, StaleToken, translated
from ledger.heartbeat import AsyncHeartbeat, Deadline, LeaseState, OnLost, Renewal, beat_interval, seconds
from ledger.identity import default_owner
from ledger.models import Job, JobStatus, Lease, Run, RunStart

__all__ = [
    "AsyncLeaseContext",
    "AsyncLedger",
    "AsyncRunContext",
    "AsyncScheduledJob",
    "advance_fence",
    "fence",
]

log = logging.getLogger("ledger")

R = TypeVar("R")
T = TypeVar("T")
P = ParamSpec("P")

AsyncConnection = psycopg.AsyncConnection[Any]


async def execute_own(conn: AsyncConnection, query: str, params: Mapping[str, Any],
                      row_factory: BaseRowFactory[R]) -> list[R]:
    """A ledger call that commits by itself outside a transaction, and joins one inside (savepoint)."""
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


async def fence(conn: AsyncConnection, job: str, resource: str, token: int) -> int:
    """``ledger.fence`` (lenient) in the caller's transaction on ``conn`` (see ``ledger.client.fence``)."""
    params = {"job": job, "resource": resource, "token": token}
    rows = await execute_in(conn, queries.FENCE, params, scalar_row)
    return int(rows[0])


async def advance_fence(conn: AsyncConnection, job: str, resource: str, token: int) -> bool:
    """``ledger.advance_fence`` (strict) in the caller's transaction on ``conn`` (see ``ledger.client``)."""
    params = {"job": job, "resource": resource, "token": token}
    rows = await execute_in(conn, queries.ADVANCE_FENCE, params, scalar_row)
    return bool(rows[0])


def conninfo_of(conn: AsyncConnection) -> str:
    """The conninfo of ``conn`` for a second connection; ``info.dsn`` omits the password."""
    password = conn.info.password
    return make_conninfo(conn.info.dsn, password=password) if password else conn.info.dsn


class _AsyncControl:
    """A context's own connection (see ``ledger.client._Control``); the client-side bound is a loop timer."""

    def __init__(self, connect: Callable[[float], Awaitable[AsyncConnection]],
                 give_back: Callable[[AsyncConnection], Awaitable[None]]) -> None:
        self._connect = connect
        self._give_back = give_back
        self._conn: AsyncConnection | None = None
        self._where = "?"
        self._lock = asyncio.Lock()
        self._give_up: Callable[[], None] | None = None
        self._alarm: asyncio.TimerHandle | None = None
        self.timeout = connecting.DEFAULT_CALL_TIMEOUT

    async def execute(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R]) -> list[R]:
        return (await self.call(query, params, row_factory))[0]

    async def call(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R], *,
                   bound: float | None = None) -> tuple[list[R], float]:
        async with self._lock:
            if self._conn is not None and (self._conn.closed or self._conn.broken):
                await self._release()
            timeout, limit = connecting.call_bounds(self.timeout, bound)
            if self._conn is None:
                self._conn = await self._connect(limit if bound is not None else limit + connecting.CONNECT_TIMEOUT)
                self._where = connecting.where(self._conn)
            conn = self._conn
            given_up = False

            def give_up() -> None:
                nonlocal given_up
                if not given_up:
                    given_up = True
                    connecting.abort(conn)

            sent = time.monotonic()
            timer = asyncio.get_running_loop().call_later(limit, give_up)
            self._give_up = give_up
            try:
                rows = await connecting.execute_bounded_async(conn, query, params, row_factory, timeout)
            except psycopg.OperationalError as error:
                if given_up:
                    raise LedgerUnavailable(
                        f"no answer from the ledger's database ({self._where}) within {limit:.3g}s: "
                        "the connection was given up", {}) from error
                raise
            finally:
                timer.cancel()
                self._give_up = None
            return rows, sent

    def abort(self) -> None:
        """Give up the call in flight, if any: it raises LedgerUnavailable."""
        if self._give_up is not None:
            self._give_up()

    def alarm(self, at: float | None, action: Callable[[], object] | None = None) -> None:
        """Run ``action`` at monotonic time ``at`` in the event loop (None: no alarm)."""
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if at is not None and action is not None:
            delay = max(0.0, at - time.monotonic())
            self._alarm = asyncio.get_running_loop().call_later(delay, action)

    async def close(self) -> None:
        self.alarm(None)
        async with self._lock:
            await self._release()

    async def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await self._give_back(conn)
            except Exception:
                log.debug("closing a context connection failed", exc_info=True)


class _AsyncHolding:
    """What an async run and lease context share (see ``ledger.client._Holding``)."""

    def __init__(self, ledger: AsyncLedger, job: str, on_lost: OnLost | None) -> None:
        self._ledger = ledger
        self.lost = asyncio.Event()
        """Set as soon as the lease is known lost; ``await run.lost.wait()`` works."""
        self._callbacks: set[asyncio.Future[Any]] = set()
        self._state = LeaseState(job, ledger.owner, on_lost, signal=self.lost.set, dispatch=self._dispatch)
        self._control: _AsyncControl | None = None
        self._heartbeat: AsyncHeartbeat | None = None
        self._open = False

    def _dispatch(self, result: object) -> None:
        # An async on_lost callback: run it, and keep a reference until it is done.
        if inspect.isawaitable(result):
            future = asyncio.ensure_future(result)
            self._callbacks.add(future)
            future.add_done_callback(self._callbacks.discard)

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
        """Time to the lease's local deadline while held (zero once lost); None when not held."""
        left = self._state.time_left()
        return None if left is None else timedelta(seconds=left)

    def is_lost(self) -> bool:
        """True once the lease is known lost or its local deadline has passed (no I/O; marks the loss)."""
        return self._state.check_lost()

    async def check(self, *, remote: bool = False) -> None:
        """Raise LeaseLost when the lease is known lost or its local deadline passed; ``remote``: ask the ledger too."""
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
        """``ledger.fence(job, resource, token)`` in the caller's transaction on ``conn`` (see the sync client).

        LeaseLost (the context marked lost) on LD001 or LD002; FenceOfAnotherJob as is.
        """
        return int(await self._fenced(conn, queries.FENCE, resource))

    async def advance_fence(self, conn: AsyncConnection, resource: str) -> bool:
        """The strict fence (one write per token): False when this token already wrote; LeaseLost when a newer one did."""
        return bool(await self._fenced(conn, queries.ADVANCE_FENCE, resource))

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
        assert self._control is not None
        deadline = self._state.deadline
        bound = None if deadline is None else deadline.remaining()
        rows, sent = await self._control.call(query, params, dict_row, bound=bound)
        row = rows[0]
        return Renewal(None if row["expires_at"] is None else row["time_left"], sent)

    async def _stop_heartbeat(self) -> bool:
        """Stop the heartbeat (giving up its call when the lease is already lost); True when lost."""
        if self._heartbeat is not None:
            if self._state.check_lost() and self._control is not None:
                self._control.abort()
            await self._heartbeat.stop()
        lost = self._state.check_lost()
        self._state.deadline = None
        if self._control is not None:
            self._control.alarm(None)
        return lost

    async def _close_control(self) -> None:
        if self._control is not None:
            await self._control.close()


class AsyncRunContext(_AsyncHolding):
    """The async :class:`ledger.client.RunContext`; ``asyncio.CancelledError`` records ``cancelled``."""

    def __init__(self, ledger: AsyncLedger, job: str, *, ttl: timedelta | None = None,
                 slot: datetime | None = None, idempotency_key: str | None = None,
                 detail: Mapping[str, Any] | None = None, heartbeat_interval: timedelta | None = None,
                 on_lost: OnLost | None = None, due: bool = False) -> None:
        super().__init__(ledger, job, on_lost)
        self._ttl = ttl
        self._slot = slot
        self._idempotency_key = idempotency_key
        self._start_detail = detail
        self._heartbeat_interval = heartbeat_interval
        self._due = due
        self._begun = False
        self.start: RunStart | None = None
        self.result: Run | None = None
        self.detail: dict[str, Any] = {}

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
        control = await self._ledger._open_control()
        self._control = control
        try:
            if self._due:
                params: dict[str, Any] = {"job": self.job, "owner": self.owner, "ttl": self._ttl}
                rows, sent = await control.call(queries.START_DUE_RUN, params, dict_row)
            else:
                params = {"job": self.job, "owner": self.owner, "ttl": self._ttl, "slot": self._slot,
                          "idempotency_key": self._idempotency_key, "detail": jsonb(self._start_detail)}
                rows, sent = await control.call(queries.START_RUN, params, dict_row)
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
            await self._end(error)
            raise

    async def _beat(self) -> Renewal:
        return await self._renewal(queries.HEARTBEAT, {"run_id": self.run_id, "token": self.token, "ttl": self._ttl})

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._open:
            await _shielded(self._end(exc))

    async def _end(self, exc: BaseException | None, error_text: str | None = None) -> None:
        self._open = False
        lost = self._state.lost_error() if await self._stop_heartbeat() else None
        assert self._control is not None
        query, params = end_call(self.run_id, self.token, exc, error_text, lost, self.detail)
        try:
            self.result = (await self._control.execute(query, params, class_row(Run)))[0]
        except (LeaseSuperseded, RunNotRunning) as error:
            refused = self._state.mark_lost("the ledger refused to end the run", error)
            if exc is None:
                raise refused from error
            log.warning("run %s of job %s could not record its end: %s", self.run_id, self.job, error)
        except Exception as error:
            if exc is None and lost is None:
                raise
            log.warning("run %s of job %s could not record its end: %s", self.run_id, self.job, error)
        finally:
            await self._close_control()
        if exc is None and lost is not None:
            raise lost


class AsyncLeaseContext(_AsyncHolding):
    """The async :class:`ledger.client.LeaseContext`."""

    def __init__(self, ledger: AsyncLedger, job: str, *, ttl: timedelta | None = None,
                 renew_interval: timedelta | None = None, on_lost: OnLost | None = None) -> None:
        super().__init__(ledger, job, on_lost)
        self._ttl = ttl
        self._renew_interval = renew_interval
        self._entered = False
        self.lease: Lease | None = None
        self.released: bool | None = None

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
        control = await self._ledger._open_control()
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
            self._start_heartbeat(self._renew_interval, self._ttl, time_left, sent, self._renew)
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
            await _shielded(self._release(exc))

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


async def _shielded(end: Awaitable[None]) -> None:
    """Record the end even when the task is cancelled again meanwhile (the end finishes in the background)."""
    await asyncio.shield(end)


class AsyncScheduledJob(Generic[P, T]):
    """The async :class:`ledger.client.ScheduledJob`: ``await job()`` runs the due slots."""

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
        functools.update_wrapper(self, fn)

    async def register(self) -> Job:
        job = await self.ledger.register_job(self.job, schedule=self.schedule, ttl=self.ttl,
                                             max_backfill=self.max_backfill, time_zone=self.time_zone)
        self._registered = True
        return job

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> list[T]:
        if not self._registered:
            await self.register()
        results: list[T] = []
        async for run in self.ledger.catch_up(self.job, heartbeat_interval=self._heartbeat_interval,
                                              on_lost=self._on_lost):
            async with run:
                results.append(await self.fn(run, *args, **kwargs))
        return results


class AsyncLedger:
    """The ledger's SQL API over an AsyncConnection, an AsyncConnectionPool, or a conninfo string.

    As :class:`ledger.client.Ledger`. From a conninfo string the pool is
    opened on first use (or ``async with``, ``await ledger.open()``): one
    connection is checked first, so a wrong DSN raises LedgerUnavailable
    (naming host and port) then, at once. Its connections never prepare
    statements; ``pool_kwargs["kwargs"]`` go over the ledger's connection
    settings. A pool passed in is used as it is (behind a transaction
    pooler, create it with ``kwargs={"prepare_threshold": None, ...}``).
    """

    def __init__(self, source: AsyncConnection | AsyncConnectionPool[Any] | str, *, owner: str | None = None,
                 heartbeat_conninfo: str | None = None, pool_kwargs: Mapping[str, Any] | None = None) -> None:
        self._owner = owner
        self._conn: AsyncConnection | None = None
        self._pool: AsyncConnectionPool[Any] | None = None
        self._owns_pool = False
        self._pool_opened = False
        self._heartbeat_conninfo: str | None = None
        if heartbeat_conninfo is not None and not isinstance(source, psycopg.AsyncConnection):
            raise TypeError("heartbeat_conninfo applies to an AsyncLedger over an AsyncConnection only")
        self._opening: asyncio.Lock | None = None
        if isinstance(source, str):
            # Opened on first use (or `async with`): an async pool opens inside a running loop.
            self._pool = connecting.async_pool(source, pool_kwargs or {})
            self._owns_pool = True
        elif isinstance(source, psycopg.AsyncConnection):
            self._conn = source
            self._heartbeat_conninfo = heartbeat_conninfo or conninfo_of(source)
        elif isinstance(source, AsyncConnectionPool):
            self._pool = source
        else:
            raise TypeError(
                "AsyncLedger takes a psycopg AsyncConnection, a psycopg_pool AsyncConnectionPool or a "
                f"conninfo string (use ledger.Ledger for sync connections), not {type(source).__name__}")

    @property
    def owner(self) -> str:
        return self._owner if self._owner is not None else default_owner()

    async def open(self) -> None:
        """Open the pool the ledger owns (done on first use anyway); LedgerUnavailable when it cannot connect."""
        if not self._owns_pool or self._pool_opened:
            return
        assert self._pool is not None
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if not self._pool_opened:
                await connecting.open_async_pool(self._pool)
                self._pool_opened = True

    async def close(self) -> None:
        """Close the pool the ledger opened from a conninfo string."""
        if self._owns_pool and self._pool is not None:
            await self._pool.close()

    async def __aenter__(self) -> AsyncLedger:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _call(self, query: str, params: Mapping[str, Any], row_factory: BaseRowFactory[R]) -> list[R]:
        if self._conn is not None:
            return await execute_own(self._conn, query, params, row_factory)
        assert self._pool is not None
        await self.open()
        async with self._pool.connection() as conn:
            return await execute_own(conn, query, params, row_factory)

    async def _open_control(self) -> _AsyncControl:
        if self._pool is not None:
            await self.open()
            pool = self._pool
            return _AsyncControl(pool.getconn, pool.putconn)
        conninfo = self._heartbeat_conninfo
        assert conninfo is not None and self._conn is not None
        prepare_threshold = self._conn.prepare_threshold  # derived from the caller's: its setting

        async def connect(timeout: float) -> AsyncConnection:  # bounded by connect_timeout instead
            return await connecting.connect_async(conninfo, prepare_threshold=prepare_threshold)

        async def close(conn: AsyncConnection) -> None:
            await conn.close()

        return _AsyncControl(connect, close)

    # -- contexts ---------------------------------------------------------------

    def run(self, job: str, *, ttl: timedelta | None = None, slot: datetime | None = None,
            idempotency_key: str | None = None, detail: Mapping[str, Any] | None = None,
            heartbeat_interval: timedelta | None = None, on_lost: OnLost | None = None) -> AsyncRunContext:
        """A run of ``job`` as an async context manager; ``on_lost`` runs in the event loop."""
        return AsyncRunContext(self, job, ttl=ttl, slot=slot, idempotency_key=idempotency_key, detail=detail,
                               heartbeat_interval=heartbeat_interval, on_lost=on_lost)

    def lease(self, job: str, *, ttl: timedelta | None = None, renew_interval: timedelta | None = None,
              on_lost: OnLost | None = None) -> AsyncLeaseContext:
        return AsyncLeaseContext(self, job, ttl=ttl, renew_interval=renew_interval, on_lost=on_lost)

    async def catch_up(self, job: str, *, ttl: timedelta | None = None,
                       heartbeat_interval: timedelta | None = None,
                       on_lost: OnLost | None = None) -> AsyncIterator[AsyncRunContext]:
        """``async for run in ledger.catch_up(job):`` (see :meth:`ledger.client.Ledger.catch_up`)."""
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
                        await _shielded(run._end(GeneratorExit(), "the catch-up loop was left before the run ended"))
            if run.result is None or run.result.status != "success":
                return

    def job(self, job: str, *, schedule: str | None = None, ttl: timedelta | None = None, max_backfill: int = 1,
            time_zone: str = "UTC", heartbeat_interval: timedelta | None = None, on_lost: OnLost | None = None,
            ) -> Callable[[Callable[Concatenate[AsyncRunContext, P], Awaitable[T]]], AsyncScheduledJob[P, T]]:
        """Decorator for an ``async def fn(run, ...)``: register it as job ``job``; ``await fn()`` runs due slots."""

        def decorate(fn: Callable[Concatenate[AsyncRunContext, P], Awaitable[T]]) -> AsyncScheduledJob[P, T]:
            return AsyncScheduledJob(self, fn, job=job, schedule=schedule, ttl=ttl, max_backfill=max_backfill,
                                     time_zone=time_zone, heartbeat_interval=heartbeat_interval, on_lost=on_lost)

        return decorate

    # -- the SQL API ---------------------------------------------------------------

    async def acquire(self, job: str, ttl: timedelta | None = None, *, owner: str | None = None) -> Lease | None:
        rows = await self._call(queries.ACQUIRE, {"job": job, "owner": owner or self.owner, "ttl": ttl}, dict_row)
        return Lease(**split_time_left(rows[0])[0]) if rows else None

    async def renew(self, job: str, token: int, ttl: timedelta | None = None, *,
                    owner: str | None = None) -> datetime | None:
        params = {"job": job, "owner": owner or self.owner, "token": token, "ttl": ttl}
        expires_at: datetime | None = (await self._call(queries.RENEW, params, dict_row))[0]["expires_at"]
        return expires_at

    async def release(self, job: str, token: int, *, owner: str | None = None) -> bool:
        params = {"job": job, "owner": owner or self.owner, "token": token}
        return bool((await self._call(queries.RELEASE, params, scalar_row))[0])

    async def is_current(self, job: str, token: int) -> bool:
        return bool((await self._call(queries.IS_CURRENT, {"job": job, "token": token}, scalar_row))[0])

    async def assert_current(self, job: str, token: int) -> None:
        await self._call(queries.ASSERT_CURRENT, {"job": job, "token": token}, scalar_row)

    async def start_run(self, job: str, *, ttl: timedelta | None = None, slot: datetime | None = None,
                        idempotency_key: str | None = None, detail: Mapping[str, Any] | None = None,
                        owner: str | None = None) -> RunStart:
        params = {"job": job, "owner": owner or self.owner, "ttl": ttl, "slot": slot,
                  "idempotency_key": idempotency_key, "detail": jsonb(detail)}
        return run_start((await self._call(queries.START_RUN, params, dict_row))[0])[0]

    async def start_due_run(self, job: str, *, ttl: timedelta | None = None, owner: str | None = None) -> RunStart:
        params = {"job": job, "owner": owner or self.owner, "ttl": ttl}
        return run_start((await self._call(queries.START_DUE_RUN, params, dict_row))[0])[0]

    async def heartbeat(self, run_id: int, token: int, ttl: timedelta | None = None) -> datetime | None:
        params = {"run_id": run_id, "token": token, "ttl": ttl}
        expires_at: datetime | None = (await self._call(queries.HEARTBEAT, params, dict_row))[0]["expires_at"]
        return expires_at

    async def complete_run(self, run_id: int, token: int, detail: Mapping[str, Any] | None = None) -> Run:
        params = {"run_id": run_id, "token": token, "detail": jsonb(detail)}
        return (await self._call(queries.COMPLETE_RUN, params, class_row(Run)))[0]

    async def fail_run(self, run_id: int, token: int, error: str, detail: Mapping[str, Any] | None = None) -> Run:
        params = {"run_id": run_id, "token": token, "error": error, "detail": jsonb(detail)}
        return (await self._call(queries.FAIL_RUN, params, class_row(Run)))[0]

    async def cancel_run(self, run_id: int, token: int, error: str | None = None) -> Run:
        params = {"run_id": run_id, "token": token, "error": error}
        return (await self._call(queries.CANCEL_RUN, params, class_row(Run)))[0]

    async def get_run(self, run_id: int) -> Run | None:
        rows = await self._call(queries.GET_RUN, {"run_id": run_id}, class_row(Run))
        return rows[0] if rows else None

    async def reap_expired(self, job: str | None = None) -> int:
        return int((await self._call(queries.REAP_EXPIRED, {"job": job}, scalar_row))[0])

    async def register_job(self, job: str, *, schedule: str | None = None, ttl: timedelta | None = None,
                           max_backfill: int = 1, time_zone: str = "UTC") -> Job:
        params = {"job": job, "schedule": schedule, "ttl": ttl, "max_backfill": max_backfill,
                  "time_zone": time_zone}
        return (await self._call(queries.REGISTER_JOB, params, class_row(Job)))[0]

    async def pause_job(self, job: str) -> bool:
        return bool((await self._call(queries.PAUSE_JOB, {"job": job}, scalar_row))[0])

    async def resume_job(self, job: str) -> bool:
        return bool((await self._call(queries.RESUME_JOB, {"job": job}, scalar_row))[0])

    async def due_slots(self, job: str, at: datetime | None = None) -> list[datetime]:
        return list(await self._call(queries.DUE_SLOTS, {"job": job, "at": at}, scalar_row))

    async def job_status(self, job: str) -> JobStatus | None:
        rows = await self._call(queries.JOB_STATUS, {"job": job}, class_row(JobStatus))
        return rows[0] if rows else None

    async def job_statuses(self) -> list[JobStatus]:
        return await self._call(queries.JOB_STATUSES, {}, class_row(JobStatus))

    async def purge_log(self, older_than: timedelta) -> int:
        return int((await self._call(queries.PURGE_LOG, {"older_than": older_than}, scalar_row))[0])
