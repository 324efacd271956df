"""`jobledger web`: the read-only dashboard in a browser (``ledger.web``; the ``web`` extra)."""

from __future__ import annotations

from datetime import timedelta

import click

from ledger import embedded
from ledger.cli._options import DURATION, dsn_source, unresolved_dsn_option
from ledger.cli._output import OneLineUsageError, say
from ledger.durations import format_duration

DEFAULT_PORT = 8187
MIN_REFRESH, MAX_REFRESH = timedelta(seconds=1), timedelta(hours=1)


def _whole_seconds(ctx: click.Context, param: click.Parameter, value: timedelta) -> int:
    """--refresh's callback: the duration in the whole seconds a page counts (as its
    ``<meta http-equiv="refresh">`` does), 1s to 1h."""
    seconds = value.total_seconds()
    if not (MIN_REFRESH <= value <= MAX_REFRESH and seconds == int(seconds)):
        raise click.BadParameter(f"{format_duration(value)}: give 1s to 1h, in whole seconds (15s, 1m)", ctx, param)
    return int(seconds)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, metavar="ADDRESS",
              help="Address to listen on. Anything but loopback needs --token or --basic-auth.")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True,
              help="Port to listen on (0: any free port).")
@click.option("--token", envvar="LEDGER_WEB_TOKEN", show_envvar=True, default=None, metavar="TOKEN",
              help="Require this token: `Authorization: Bearer TOKEN`, or `?token=TOKEN` once in a browser "
                   "(it answers with a cookie).")
@click.option("--basic-auth", envvar="LEDGER_WEB_BASIC_AUTH", show_envvar=True, default=None,
              metavar="USER:PASSWORD", help="Require HTTP basic auth with these credentials.")
@click.option("--refresh", type=DURATION, default="15s", show_default=True, callback=_whole_seconds,
              help="How often an open page refreshes itself: 1s to 1h, in whole seconds.")
@click.option("--timeout", type=DURATION, default="5s", show_default=True,
              help="statement_timeout of each read.")
@click.option("--demo", is_flag=True,
              help="Show the ledger `jobledger demo` left on the embedded PostgreSQL (database "
                   f"{embedded.DEMO_DATABASE}), and keep that server up until the dashboard stops.")
@unresolved_dsn_option
@click.pass_context
def web(ctx: click.Context, host: str, port: int, token: str | None, basic_auth: str | None, refresh: int,
        timeout: timedelta, demo: bool, dsn: str | None) -> None:
    """A read-only dashboard of the ledger: jobs, a job's runs and slots, a run, the alerts.

    Every page reads in one read-only transaction as ledger_reader, as
    `jobledger metrics` does, and refreshes itself; each has its JSON under
    /api/ (/api/jobs, /api/jobs/JOB, /api/runs/ID, /api/alerts). Also
    /badge/JOB.svg, a status badge, and /metrics, the Prometheus metrics.
    Stop with Ctrl-C or SIGTERM.

    It listens on 127.0.0.1 unless --host says otherwise; another address
    shows the ledger to whoever reaches it, so it then needs --token or
    --basic-auth (the environment variables keep them out of `ps`).

    After `jobledger demo`, `jobledger web --demo` shows the demo's ledger.
    """
    try:
        from ledger.web.access import Access, AccessError, check_bind
        from ledger.web.app import create_app
        from ledger.web.reads import Reader
        from ledger.web.server import bind, serve, url_of
    except ImportError as error:
        raise click.ClickException(f"jobledger web needs the web extra: pip install 'pg-job-ledger[web]' "
                                   f"(missing: {error.name})") from error
    try:
        access = Access.parse(token, basic_auth)
        check_bind(host, access)
    except AccessError as error:
        raise click.UsageError(str(error)) from error
    conninfo = _demo_dsn(ctx, dsn) if demo else embedded.resolve(dsn, dsn_source(ctx)).dsn
    reader = Reader(conninfo, timeout=timeout)
    reader.open()  # a wrong DSN fails now, in one line, not on the first page
    try:
        sock = bind(host, port)
    except OSError as error:
        reader.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
    how = " (token required: open it once with ?token=TOKEN)" if token else ""
    how += " (basic auth required)" if basic_auth else ""
    say(f"serving the dashboard on {url_of(sock)}/{how}, read-only; Ctrl-C to stop")
    try:
        serve(create_app(reader, access=access, refresh=refresh, timeout=timeout), sock)
    finally:
        reader.close()
    say("dashboard stopped")


def _demo_dsn(ctx: click.Context, dsn: str | None) -> str:
    """The demo's ledger. It lives on the embedded server, which stops with the last jobledger
    process using it: this one holds it up, so no DSN printed by `jobledger where` could."""
    if dsn is not None and dsn_source(ctx) == "option":
        raise OneLineUsageError("--demo shows the demo's ledger on the embedded PostgreSQL: "
                                "leave out --dsn, or leave out --demo to show the ledger at --dsn")
    if embedded.pg_variables_set():
        raise OneLineUsageError("with the PG* variables set, `jobledger demo` runs in a scratch database it "
                                "drops at its end, so there is no demo ledger to show: unset them for both "
                                "commands (the demo then keeps its ledger on the embedded PostgreSQL)")
    if dsn is not None:
        say("LEDGER_DSN is not used with --demo, which shows the demo's ledger on the embedded PostgreSQL")
    return embedded.demo_dsn(embedded.home() / "pgdata")


COMMANDS = (web,)
