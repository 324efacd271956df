"""The ledger's clock seam for tests: move a test database's ledger time forward."""

from __future__ import annotations

from datetime import timedelta

import psycopg


class LedgerClock:
    """The ledger's clock seam (sql/12_clock.sql), moved as the database's owner.

    advance() redefines ledger._clock_offset(): every lease, slot and health
    bound of that database sees the time move at once, without sleeping it
    out. The Python client's own deadlines (time.monotonic) do not move, nor
    does anything that compares the ledger's times with the process's clock
    (the dashboard's windows): there, real time still has to pass.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self._conn = conn
        self.offset = timedelta(0)

    def advance(self, by: timedelta) -> None:
        assert by > timedelta(0), "the ledger's clock only moves forward"
        self.offset += by
        # The offset as a literal: a function body takes no parameters.
        seconds = f"{self.offset.total_seconds():.6f}"
        self._conn.execute(
            "CREATE OR REPLACE FUNCTION ledger._clock_offset() RETURNS interval LANGUAGE sql STABLE "
            f"PARALLEL SAFE AS $$ SELECT interval '{seconds} seconds' $$")  # type: ignore[arg-type]
