"""Every connection the ledger opens, in one place: its settings, and what a failure to connect says.

Settings of a connection the ledger opens (a pool built from a DSN, a
context's own connection, the ``jobledger`` commands, metrics, reports):

- ``prepare_threshold=None``: psycopg never prepares a statement (it would
  after 5 executions of the same query). Behind a transaction pooler
  (PgBouncer ``pool_mode = transaction``, 1.18 and older have no
  prepared-statement support) the next transaction of a client may land on
  another server connection, where ``_pg3_2`` does not exist, or another
  client's ``_pg3_2`` does. A connection derived from a caller's connection
  (a context's own connection, from ``conninfo_of(conn)``) takes the
  caller's ``prepare_threshold`` instead; a pool the caller hands in is used
  as it is.
- ``autocommit=True``: every ledger call is its own transaction.
- TCP keepalives and ``tcp_user_timeout`` (:data:`TCP_PARAMS`), and a
  ``connect_timeout`` (:data:`CONNECT_TIMEOUT`), unless the conninfo (or
  ``PGCONNECT_TIMEOUT``) sets them: a peer that vanished without a RST is
  noticed, a connection attempt into a black hole ends.

A context's own connection also bounds each call (:func:`execute_bounded`,
:class:`ledger.watchdog.Watchdog`): a ``statement_timeout`` sent with the call itself, local
to its transaction (``set_config(..., true)`` in the same simple-protocol
query string, so it is neither session state a transaction pooler would
leak nor a startup parameter PgBouncer refuses), and a client-side bound
after which the connection's socket is shut down, so a call stuck in a
silent partition (a middlebox that keeps the socket open and forwards
nothing: no RST, no statement timeout, and keepalives answered) ends.

A failure to connect is raised as :class:`~ledger.errors.LedgerUnavailable`,
naming host and port, never the password.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import BaseRowFactory
from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolTimeout

from ledger.errors import LedgerUnavailable, translated
from ledger.text import first_line

__all__ = [
    "CONNECT_TIMEOUT",
    "PREPARE_THRESHOLD",
    "TCP_PARAMS",
    "abort",
    "call_bounds",
    "call_timeout",
    "connect",
    "connect_async",
    "connection_kwargs",
    "execute_bounded",
    "execute_bounded_async",
    "make_async_pool",
    "make_pool",
    "open_async_pool",
    "open_pool",
    "unavailable",
    "where",
]

log = logging.getLogger("ledger")

R = TypeVar("R")

PREPARE_THRESHOLD: int | None = None
"""psycopg's ``prepare_threshold`` for connections the ledger opens: never prepare."""

CONNECT_TIMEOUT = 5
"""Seconds, for connections the ledger opens when neither the conninfo nor ``PGCONNECT_TIMEOUT`` sets one."""

TCP_PARAMS: dict[str, str] = {
    "keepalives": "1",
    "keepalives_idle": "5",  # seconds of silence before the first probe
    "keepalives_interval": "2",
    "keepalives_count": "3",  # a dead peer is noticed ~11 s into a silence
    "tcp_user_timeout": "10000",  # ms that sent data may stay unacknowledged
}
"""libpq TCP settings of connections the ledger opens; ignored by libpq for Unix sockets."""

POOL_OPEN_TIMEOUT = 10.0
"""Seconds ``Ledger(dsn)`` waits for its pool's first connection, after the first check succeeded."""

# Bounds of a call on a context's own connection (seconds).
MIN_CALL_TIMEOUT = 1.0
MAX_CALL_TIMEOUT = 30.0
DEFAULT_CALL_TIMEOUT = 10.0  # before the ttl is known (a start with the job's registered ttl)
CALL_GRACE = 1.0  # the client-side bound is the statement timeout plus this

#: What a failed connection attempt raises: psycopg's OperationalError, or the UnicodeError of a
#: host name that cannot be looked up at all (an empty label, ``db..example``, or one over 63
#: characters: psycopg resolves the name itself and lets the ``idna`` codec's error through).
UNREACHABLE: tuple[type[Exception], ...] = (psycopg.OperationalError, UnicodeError)


def call_bounds(timeout: float, bound: float | None) -> tuple[float, float]:
    """(statement timeout, client-side limit) of one call; ``bound``: neither may go past it (seconds)."""
    limit = timeout + CALL_GRACE
    if bound is not None:
        bound = max(0.001, bound)
        timeout, limit = min(timeout, bound), min(limit, bound)
    return timeout, limit


def where(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    """``host H, port P`` of an open connection, for messages."""
    try:
        return f"host {conn.info.host}, port {conn.info.port}"
    except psycopg.Error:
        return "?"


def call_timeout(ttl_seconds: float | None) -> float:
    """The statement timeout of a context's calls: a third of the ttl, within [1 s, 30 s]."""
    if ttl_seconds is None or ttl_seconds <= 0:
        return DEFAULT_CALL_TIMEOUT
    return min(MAX_CALL_TIMEOUT, max(MIN_CALL_TIMEOUT, ttl_seconds / 3))


# -- opening connections -----------------------------------------------------------------

def connection_kwargs(conninfo: str, *, prepare_threshold: int | None = PREPARE_THRESHOLD,
                      autocommit: bool = True, **extra: Any) -> dict[str, Any]:
    """The keyword arguments of ``psycopg.connect`` for a connection the ledger opens.

    What the conninfo says wins over the TCP defaults and the connect timeout;
    ``extra`` wins over everything.
    """
    given = _parse(conninfo)
    kwargs: dict[str, Any] = {"autocommit": autocommit, "prepare_threshold": prepare_threshold}
    kwargs.update({key: value for key, value in TCP_PARAMS.items() if key not in given})
    if "connect_timeout" not in given and not os.environ.get("PGCONNECT_TIMEOUT"):
        kwargs["connect_timeout"] = CONNECT_TIMEOUT
    kwargs.update(extra)
    return kwargs


def connect(conninfo: str, *, prepare_threshold: int | None = PREPARE_THRESHOLD, autocommit: bool = True,
            **extra: Any) -> psycopg.Connection[Any]:
    """A connection with the ledger's settings (:func:`connection_kwargs`); LedgerUnavailable when it fails."""
    kwargs = connection_kwargs(conninfo, prepare_threshold=prepare_threshold, autocommit=autocommit, **extra)
    try:
        return psycopg.Connection.connect(conninfo, **kwargs)
    except UNREACHABLE as error:
        raise unavailable(conninfo, error, extra) from error


async def connect_async(conninfo: str, *, prepare_threshold: int | None = PREPARE_THRESHOLD,
                        autocommit: bool = True, **extra: Any) -> psycopg.AsyncConnection[Any]:
    """The async :func:`connect`."""
    kwargs = connection_kwargs(conninfo, prepare_threshold=prepare_threshold, autocommit=autocommit, **extra)
    try:
        return await psycopg.AsyncConnection.connect(conninfo, **kwargs)
    except UNREACHABLE as error:
        raise unavailable(conninfo, error, extra) from error


def _pool_options(conninfo: str, options: Mapping[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {"min_size": 1, "max_size": 10, "name": "ledger", **options}
    # The ledger's connection settings, then the caller's kwargs over them.
    merged["kwargs"] = {**connection_kwargs(conninfo), **dict(options.get("kwargs") or {})}
    return merged


def make_pool(conninfo: str, options: Mapping[str, Any]) -> ConnectionPool[Any]:
    """The ConnectionPool of ``Ledger(dsn)``, not yet open (see :func:`open_pool`).

    ``options`` are ConnectionPool arguments (``pool_kwargs``); their
    ``kwargs`` go over the ledger's connection settings; ``open`` is the
    ledger's to decide.
    """
    merged = _pool_options(conninfo, options)
    merged.pop("open", None)
    return ConnectionPool(conninfo, open=False, **merged)


def make_async_pool(conninfo: str, options: Mapping[str, Any]) -> AsyncConnectionPool[Any]:
    """The AsyncConnectionPool of ``AsyncLedger(dsn)``, not yet open (see :func:`open_async_pool`)."""
    merged = _pool_options(conninfo, options)
    merged.pop("open", None)
    return AsyncConnectionPool(conninfo, open=False, **merged)


def open_pool(pool: ConnectionPool[Any]) -> None:
    """Check one connection, then open ``pool`` and wait for it; LedgerUnavailable when either fails.

    The check makes a wrong DSN fail now, with its reason, rather than as a
    PoolTimeout on the first call.
    """
    conninfo, kwargs = _pool_target(pool.conninfo, pool.kwargs)
    try:
        psycopg.Connection.connect(conninfo, **kwargs).close()
    except UNREACHABLE as error:
        raise unavailable(conninfo, error, kwargs) from error
    try:
        pool.open(wait=True, timeout=POOL_OPEN_TIMEOUT)
    except PoolTimeout as error:  # the pool is closed by then
        raise unavailable(conninfo, error, kwargs) from error


async def open_async_pool(pool: AsyncConnectionPool[Any]) -> None:
    """The async :func:`open_pool`."""
    conninfo, kwargs = _pool_target(pool.conninfo, pool.kwargs)
    try:
        probe = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
    except UNREACHABLE as error:
        raise unavailable(conninfo, error, kwargs) from error
    await probe.close()
    try:
        await pool.open(wait=True, timeout=POOL_OPEN_TIMEOUT)
    except PoolTimeout as error:
        raise unavailable(conninfo, error, kwargs) from error


def _pool_target(conninfo: object, kwargs: object) -> tuple[str, dict[str, Any]]:
    assert isinstance(conninfo, str) and isinstance(kwargs, dict)  # a pool made by make_pool
    return conninfo, dict(kwargs)


def _parse(conninfo: str) -> dict[str, Any]:
    try:
        return conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return {}  # psycopg.connect will say what is wrong with it


def unavailable(conninfo: str, error: BaseException, kwargs: Mapping[str, Any] | None = None,
                what: str = "cannot connect to the ledger's database") -> LedgerUnavailable:
    """The LedgerUnavailable for ``error``: host and port (from the conninfo, then PG*, then libpq's defaults)."""
    params = {**_parse(conninfo), **{key: value for key, value in (kwargs or {}).items()
                                     if key in ("host", "hostaddr", "port", "dbname", "user")}}
    host = str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST")
               or os.environ.get("PGHOSTADDR") or "the default Unix socket")
    port = str(params.get("port") or os.environ.get("PGPORT") or "5432")
    dbname = params.get("dbname") or os.environ.get("PGDATABASE")
    user = params.get("user") or os.environ.get("PGUSER")
    reason = first_line(error)
    if isinstance(error, UnicodeError):
        reason = f"not a host name that can be looked up ({reason})"
    facts = {"host": host, "port": port, "dbname": dbname, "user": user}
    return LedgerUnavailable(f"{what} at host {host}, port {port}: {reason}", facts)


# -- bounding a call ------------------------------------------------------------------------

def abort(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Shut down ``conn``'s socket, so that a call blocked on it ends now (the connection is then broken).

    The file descriptor stays open (libpq closes it with the connection), so
    it cannot be reused under libpq's feet. Works from any thread.
    """
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return  # closed already
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


_TIMEOUT_PREFIX = "SELECT pg_catalog.set_config('statement_timeout', %(_ledger_statement_timeout)s, true);\n"


def _bounded(query: str, params: Mapping[str, Any], timeout: float) -> tuple[str, dict[str, Any]]:
    milliseconds = max(1, int(timeout * 1000))
    return _TIMEOUT_PREFIX + query, {**params, "_ledger_statement_timeout": str(milliseconds)}


def execute_bounded(conn: psycopg.Connection[Any], query: str, params: Mapping[str, Any],
                    row_factory: BaseRowFactory[R], timeout: float) -> list[R]:
    """One ledger call under ``statement_timeout = timeout``, set for its transaction only.

    Sent as one simple-protocol query string (client-side binding), so the
    timeout is in force when the call starts, nothing is prepared, and it
    costs no extra round trip. Commits by itself on an autocommit
    connection; inside a transaction of the connection it joins it.
    """
    text, values = _bounded(query, params, timeout)
    with translated():
        if conn.autocommit:
            return _client_fetch(conn, text, values, row_factory)
        with conn.transaction():
            return _client_fetch(conn, text, values, row_factory)


def _client_fetch(conn: psycopg.Connection[Any], text: str, values: Mapping[str, Any],
                  row_factory: BaseRowFactory[R]) -> list[R]:
    with psycopg.ClientCursor(conn) as cur:
        cur.execute(text, values)
        cur.nextset()  # past set_config's row
        cur.row_factory = row_factory
        rows: list[R] = cur.fetchall()
        return rows


async def execute_bounded_async(conn: psycopg.AsyncConnection[Any], query: str, params: Mapping[str, Any],
                                row_factory: BaseRowFactory[R], timeout: float) -> list[R]:
    """The async :func:`execute_bounded`."""
    text, values = _bounded(query, params, timeout)
    with translated():
        if conn.autocommit:
            return await _client_fetch_async(conn, text, values, row_factory)
        async with conn.transaction():
            return await _client_fetch_async(conn, text, values, row_factory)


async def _client_fetch_async(conn: psycopg.AsyncConnection[Any], text: str, values: Mapping[str, Any],
                              row_factory: BaseRowFactory[R]) -> list[R]:
    async with psycopg.AsyncClientCursor(conn) as cur:
        await cur.execute(text, values)
        cur.nextset()
        cur.row_factory = row_factory
        rows: list[R] = await cur.fetchall()
        return rows
