"""How the commands speak: messages on stderr, errors in one line, counts in words.

Exit codes: 0 ok, 2 usage (click), 1 a database or ledger error, told in one
line (:class:`Commands`); ``run`` has its own (``ledger.wrapper.EXIT_CODES``).
The tables and JSON themselves are ``ledger.render``'s.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any

import click
import psycopg

from ledger import embedded, queries
from ledger.errors import LedgerError, PoolNotFound, missing_ledger
from ledger.text import first_line


def say(message: str) -> None:
    """A message for people on stderr: ``jobledger: message``."""
    click.echo(f"jobledger: {message}", err=True)


def plural(count: int, noun: str) -> str:
    """``1 run``, ``3 runs``."""
    return f"{count} {noun}{'s' if count != 1 else ''}"


def database_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database's clock, which the tables' relative times are measured from."""
    row = conn.execute(queries.DATABASE_NOW).fetchone()
    assert row is not None
    when: datetime = row[0]
    return when


# -- errors --------------------------------------------------------------------------

def one_line_errors() -> tuple[type[BaseException], ...]:
    """The errors a command reports in one line: the database's, the ledger's, the migrator's."""
    errors: list[type[BaseException]] = [psycopg.Error, LedgerError, embedded.EmbeddedUnavailable]
    alembic_util = sys.modules.get("alembic.util")  # imported only by the commands that migrate
    if alembic_util is not None:
        errors.append(alembic_util.CommandError)
    return tuple(errors)


class Commands(click.Group):
    """Turns a database or ledger error in any command into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as error:
            if isinstance(error, one_line_errors()):
                raise click.ClickException(one_line(error)) from error
            raise


def one_line(error: BaseException) -> str:
    """An error in one line; for a database without the ledger (or with an older one), the fix too."""
    if missing_ledger(error):
        return (f"this database has no ledger, or an older one ({first_line(error)}): "
                "run `jobledger install` to install or upgrade it")
    return first_line(error)


class OneLineUsageError(click.UsageError):
    """A usage error (exit 2) told in one line on stderr, its fix included, without click's usage block."""

    def show(self, file: Any = None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file, err=file is None)


def unknown_jobs(jobs: Sequence[str]) -> click.ClickException:
    """The one-line error (exit 1) for job names the ledger does not know."""
    names = ", ".join(jobs)
    what = "no job named" if len(jobs) == 1 else "no jobs named"
    return click.ClickException(f"{what} {names} in this ledger (`jobledger status` lists the jobs; "
                                f"`jobledger register {jobs[0]}` creates one)")


@contextmanager
def registered_pool(pool: str) -> Iterator[None]:
    """LD008 (a pool that was never registered) in one line (exit 1) that names the pool and the fix."""
    try:
        yield
    except PoolNotFound as error:
        name = error.facts.get("pool", pool)
        raise click.ClickException(
            f"pool not found: {name} was never registered: `jobledger pool register {name} SIZE` first "
            "(`jobledger pools` lists the pools)") from error


# -- stopping -------------------------------------------------------------------------

def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM (a service manager's stop) end the block quietly: the way a
    command that follows the ledger ends, exit 0. A pipe closed by its reader ends it too."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        # `jobledger watch | head`: the reader is gone. Python would complain once more when it
        # flushes stdout at exit, so stdout goes to /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        signal.signal(signal.SIGTERM, previous)
