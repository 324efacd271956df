"""A read-only transaction as ``ledger_reader``: how the reports, the metrics and the dashboard read the ledger.

Each read gets a transaction of its own that can only read (READ ONLY, under
``SET LOCAL ROLE ledger_reader``: SELECT on the ledger, no EXECUTE on its
functions), bounded by a ``statement_timeout``, and always rolled back.
``ledger.report`` adds its guards around it (the parser, the column and the
session fences); the metrics and the dashboard read ``ledger.queries``'
statements in it as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import pq, sql

__all__ = ["READER_ROLE", "read_only_transaction"]

READER_ROLE = "ledger_reader"


@contextmanager
def read_only_transaction(conn: psycopg.Connection[Any], timeout: timedelta, *, repeatable_read: bool = False,
                          snapshot: str | None = None) -> Iterator[psycopg.Cursor[Any]]:
    """A cursor in a transaction of its own that can only read, always rolled back.

    With ``repeatable_read``, every statement of it reads one snapshot (REPEATABLE READ: a
    read-only transaction meets no serialization failure); with ``snapshot``, that snapshot is
    one another transaction exported (``pg_export_snapshot()``, while it is still open): two
    connections read the same rows (a scrape in parts, :func:`ledger.metrics.read_text`).

    READ ONLY, ``SET LOCAL ROLE ledger_reader`` (SELECT on the ledger, no
    EXECUTE on its functions), ``statement_timeout`` = ``timeout`` per
    statement, ``search_path`` = pg_catalog, ``jit`` off. InsufficientPrivilege when the
    connecting user is not a member of ledger_reader. The session comes out
    as it went in (role, settings). Nothing is prepared (``prepare=False``),
    so it works through PgBouncer. It does not check the session user:
    :func:`ledger.report.check_session` does, for the report functions.
    """
    if timeout <= timedelta(0):
        raise ValueError("timeout must be positive")
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise ValueError("reading the ledger needs a connection with no transaction open: "
                         "each read runs in a read-only transaction of its own")
    milliseconds = max(1, round(timeout.total_seconds() * 1000))
    with conn.transaction(force_rollback=True), conn.cursor() as cur:
        if repeatable_read or snapshot is not None:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY", prepare=False)
        else:
            cur.execute("SET TRANSACTION READ ONLY", prepare=False)
        if snapshot is not None:
            # before the first query of the transaction, as PostgreSQL requires (no parameter: a literal)
            cur.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)), prepare=False)
        cur.execute(f"SET LOCAL ROLE {READER_ROLE}", prepare=False)
        # jit off: the planner prices the views' PL/pgSQL calls high, so over
        # a few thousand jobs it would JIT-compile them, and the compilation
        # took longer than the read (ledger.alerts over 10,000 jobs: 2.5 s
        # with it, 1.0 s without; BENCHMARKS.md).
        cur.execute(
            "SELECT pg_catalog.set_config('statement_timeout', %s, true),"
            " pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true),"
            " pg_catalog.set_config('standard_conforming_strings', 'on', true),"
            " pg_catalog.set_config('jit', 'off', true)",
            (str(milliseconds),), prepare=False)
        yield cur
