"""Protecting a table: `protect` (`ledger.protect`) and `unprotect` (`ledger.unprotect`).

The table's name is resolved in the connection's search_path, as psql
resolves it; the caller must own the table (docs/protect.md)."""

from __future__ import annotations

import click

from ledger.cli._options import connect, dsn_option
from ledger.client import Ledger


@click.command()
@click.argument("table")
@click.option("--job", required=True, help="The job whose live token every write to TABLE must carry.")
@click.option("--strict", is_flag=True,
              help="Each token writes in one transaction only (as `ledger.advance_fence`); default: in as many "
                   "as it likes while it is live (as `ledger.fence`).")
@dsn_option
def protect(table: str, job: str, strict: bool, dsn: str) -> None:
    """Refuse every write to TABLE (INSERT, UPDATE, DELETE, TRUNCATE, COPY) from a transaction
    that does not carry JOB's live token in `ledger.token` (`ledger.protect`), so a zombie that
    wakes after a takeover cannot write a row, without a line of its SQL changed.
    `jobledger run JOB --pgoptions -- psql ...`, `ledger.run_guarded` and the Python client's
    `run.transaction(conn)` carry it."""
    mode = "strict" if strict else "lenient"
    with connect(dsn) as conn:
        resource = Ledger(conn).protect(table, job, mode=mode)
    click.echo(f"protected {resource} for job {job} ({mode}): a write must carry the job's live token")


@click.command()
@click.argument("table")
@dsn_option
def unprotect(table: str, dsn: str) -> None:
    """Remove TABLE's protection (`ledger.unprotect`): it takes any write again. Its fence stays."""
    with connect(dsn) as conn:
        removed = Ledger(conn).unprotect(table)
    click.echo(f"unprotected {table}" if removed else f"{table} was not protected")


COMMANDS = (protect, unprotect)
