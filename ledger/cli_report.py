"""`jobledger report "SQL"` and `jobledger metrics`: the reporting commands.

Registered on the `jobledger` group at the end of ``ledger.cli``; they reuse
its ``--dsn`` option (same resolution: option, LEDGER_DSN, PG*, embedded), its
connection and its duration type. The guard and the read-only run live in
``ledger.report``, the collector in ``ledger.metrics``.
"""

from __future__ import annotations

import csv
import json
import signal
import sys
import threading
from collections.abc import Sequence
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from types import FrameType
from typing import Any

import click
import psycopg
from rich import box
from rich.markup import escape
from rich.table import Table

from ledger import render
from ledger.cli import DURATION, _say, connect, dsn_option
from ledger.durations import format_duration
from ledger.metrics import LedgerCollector, exposition, serve
from ledger.report import ALLOWED_FUNCTIONS, ReportRejected, check, run_read_only

FORMATS = ("table", "csv", "json")


def _report_epilog() -> str:
    return (
        "The query must be one SELECT (CTEs, joins, subqueries, set operations and "
        "window functions are fine) over relations in schemas ledger and pg_catalog, "
        "schema-qualified; no writes, INTO, FOR UPDATE/SHARE, commands or schema-qualified "
        "function calls. It runs in a READ ONLY transaction as ledger_reader (the "
        "connecting user must be a member: GRANT ledger_reader TO <role>) under "
        "--timeout. Intervals are seconds in CSV and JSON.\n\n"
        f"Functions allowed: {', '.join(ALLOWED_FUNCTIONS)}; and the built-in operators "
        "(->, ->>, @>, ?, ~, ||, &&, ...)."
    )


@click.command(epilog=_report_epilog())
@click.argument("sql", metavar="SQL")
@click.option("--format", "output", type=click.Choice(FORMATS), default="table", show_default=True,
              help="A table for people, CSV or JSON (a list of objects) for scripts.")
@click.option("--timeout", type=DURATION, default="5s", show_default=True,
              help="statement_timeout of the query (500ms, 5s, 1m, ...).")
@dsn_option
def report(sql: str, output: str, timeout: timedelta, dsn: str) -> None:
    """Run SQL, one read-only SELECT over the ledger, and print its rows (`-`: read SQL from stdin).

    \b
    jobledger report "SELECT job, failure_rate, p95_duration FROM ledger.run_stats"
    jobledger report --format csv "SELECT * FROM ledger.alerts"
    """
    if sql == "-":
        sql = sys.stdin.read()
    try:
        checked = check(sql)
    except ReportRejected as error:
        raise click.ClickException(str(error)) from error
    with connect(dsn) as conn:
        try:
            columns, rows = run_read_only(conn, checked, timeout)
        except psycopg.errors.QueryCanceled as error:
            raise click.ClickException(
                f"report timed out after {format_duration(timeout)} (statement_timeout); "
                "narrow the query or give a longer --timeout") from error
    if output == "json":
        records = [dict(zip(columns, row)) for row in rows]
        click.echo(json.dumps(render.plain(records), indent=2, ensure_ascii=False, default=str))
    elif output == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_csv_cell(value) for value in row] for row in rows)
    else:
        _print_table(columns, rows)


def _print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(box=box.SIMPLE_HEAVY, caption=f"{len(rows)} row{'s' if len(rows) != 1 else ''}",
                  caption_justify="left")
    numeric = [bool(rows) and all(isinstance(row[i], (int, float, Decimal)) and not isinstance(row[i], bool)
                                  for row in rows if row[i] is not None)
               for i in range(len(columns))]
    for name, right in zip(columns, numeric):
        table.add_column(name, justify="right" if right else "left")
    for row in rows:
        table.add_row(*("[dim]null[/dim]" if value is None else escape(_text(value)) for value in row))
    render.console().print(table)


def _text(value: Any) -> str:
    """A cell for people: ISO timestamps, intervals as [d day[s], ]h:mm:ss[.ffffff], JSON for jsonb."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    return str(value)


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return _text(value)


@click.command()
@click.option("--serve", "port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve /metrics on PORT for Prometheus to scrape (0: any free port) "
                   "instead of printing once.")
@click.option("--host", default=None, metavar="ADDRESS",
              help="Address to bind with --serve  [default: 127.0.0.1; 0.0.0.0 for every interface]")
@click.option("--timeout", type=DURATION, default="10s", show_default=True,
              help="statement_timeout of each query of a scrape.")
@dsn_option
def metrics(port: int | None, host: str | None, timeout: timedelta, dsn: str) -> None:
    """Prometheus metrics of the ledger, read from its views (text exposition format).

    Once on stdout, or on every scrape with --serve (stop with SIGTERM or Ctrl-C).
    Metrics: jobledger_up, jobledger_runs_started_total, jobledger_runs_total{status},
    jobledger_runs_running, jobledger_skipped_total{reason}, jobledger_leases_lost_total,
    jobledger_run_duration_seconds{quantile}, jobledger_run_failure_ratio,
    jobledger_job_overdue, jobledger_consecutive_failures (all by job) and
    jobledger_alerts{alert}.
    """
    def open_connection() -> psycopg.Connection[Any]:
        return connect(dsn)

    if port is None:
        if host is not None:
            raise click.UsageError("--host only applies with --serve PORT")
        click.echo(exposition(open_connection, timeout), nl=False)
        return

    def scrape_failed(error: Exception) -> None:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        _say(f"scrape failed, answering jobledger_up 0: {lines[0]}")

    collector = LedgerCollector(open_connection, timeout=timeout, on_error=scrape_failed)
    try:
        server = serve(collector, port, host or "127.0.0.1")
    except OSError as error:
        raise click.ClickException(f"cannot listen on {host or '127.0.0.1'}:{port}: "
                                   f"{error.strerror or error}") from error
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        _say(f"serving metrics on {server.url} (SIGTERM or Ctrl-C to stop)")
        sys.stderr.flush()
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    _say("metrics server stopped")
