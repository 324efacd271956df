"""What the commands share on their command lines: the database (``--dsn``), ``--json``, durations.

The database: ``--dsn``, else ``LEDGER_DSN``, else the standard ``PG*``
variables, else the embedded PostgreSQL (``ledger.embedded``; ``jobledger
where`` tells which).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, TypeVar

import click
import psycopg
from click.core import ParameterSource

from ledger import embedded
from ledger.durations import parse_duration, positive_duration

F = TypeVar("F", bound=Callable[..., Any])

#: Where ``--dsn``'s callback leaves the :class:`ledger.embedded.Target` (in ``ctx.meta``).
TARGET_KEY = "ledger.target"

DSN_HELP = ("libpq conninfo or URI of the database; default: the PG* variables when set, "
            "else the embedded PostgreSQL (see `jobledger where`).")


# -- the database ---------------------------------------------------------------------

def dsn_source(ctx: click.Context, name: str = "dsn") -> str:
    """Where a given ``--dsn`` came from, as :func:`ledger.embedded.resolve` names it."""
    return "LEDGER_DSN" if ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT else "option"


def _resolve_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """The option's callback: the conninfo to use (the embedded server's when none is given)."""
    target = embedded.resolve(value, dsn_source(ctx, param.name or "dsn"))
    ctx.meta[TARGET_KEY] = target
    return target.dsn


def _dsn(callback: Callable[[click.Context, click.Parameter, str | None], str] | None) -> Callable[[F], F]:
    return click.option("--dsn", envvar="LEDGER_DSN", default=None, show_envvar=True, callback=callback,
                        help=DSN_HELP)


def dsn_option(command: F) -> F:
    """``--dsn``: the command gets a conninfo string (``""`` = libpq's PG* defaults), resolved before it runs."""
    return _dsn(_resolve_dsn)(command)


def unresolved_dsn_option(command: F) -> F:
    """``--dsn`` as given (None when not), for a command that resolves it itself (``run``: its own exit code)."""
    return _dsn(None)(command)


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection, named in pg_stat_activity, with the ledger's settings (``ledger.connect``:
    nothing prepared, so it works behind a transaction pooler; LedgerUnavailable naming host and port)."""
    from ledger.connect import connect as open_connection

    return open_connection(dsn, application_name="jobledger")


# -- output -----------------------------------------------------------------------------

def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(command)


# -- durations --------------------------------------------------------------------------

if TYPE_CHECKING:  # click >= 8.2 types ParamType generically; older versions are not subscriptable
    _ParamType = click.ParamType[timedelta, Any]
else:
    _ParamType = click.ParamType


class Duration(_ParamType):
    """``90d``, ``10s``, ``1h30m`` or PostgreSQL interval text (``'80 minutes'``)."""

    name = "duration"

    def __init__(self, positive: bool = True) -> None:
        self._parse = positive_duration if positive else parse_duration

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return self._parse(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


DURATION: Duration = Duration()


# -- instants ---------------------------------------------------------------------------

def instant(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """An option's callback: ISO 8601 (``2026-03-28``, ``2026-03-28T12:00+01:00``); without a UTC offset, UTC."""
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"cannot read {value!r} as an ISO 8601 time (2026-03-28, 2026-03-28T12:00+01:00)",
                                 ctx, param) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)
