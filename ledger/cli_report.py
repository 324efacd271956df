"""`jobledger report "SQL"` and `jobledger metrics`: the reporting commands.

Registered on the `jobledger` group at the end of ``ledger.cli``; they reuse
its ``--dsn`` option (same resolution: option, LEDGER_DSN, PG*, embedded), its
connection and its duration type. The guard, the session check and the
read-only run live in ``ledger.report`` (its docstring says what is checked
and why), the collector in ``ledger.metrics``.

`report` refuses, in one line and with exit code 1: a query the guard
refuses (size, shape, functions, relations, unknown columns), and a session
user that could leave ledger_reader again (a superuser, CREATEROLE, members of
other roles; ``--allow-superuser`` runs anyway). Its rows are streamed from a
server-side cursor in batches and stop at ``--limit`` (1000 by default, 0 for
all), with a note on stderr when the limit cut them: CSV and JSON are written
as the rows come, a table is printed in pages of ``TABLE_PAGE`` rows.
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
from ledger.report import (
    ALLOWED_FUNCTIONS, DEFAULT_LIMIT, MAX_CTES, MAX_DEPTH, MAX_QUERY_BYTES, MAX_SUBQUERIES, ReportRejected,
    ReportRows, stream_report,
)

FORMATS = ("table", "csv", "json")
#: Rows per printed table with --format table (each page is one table).
TABLE_PAGE = 1000


def _report_epilog() -> str:
    return (
        "The query must be one SELECT (CTEs, joins, subqueries, set operations and "
        "window functions are fine) over relations in schemas ledger and pg_catalog, "
        "schema-qualified; no writes, INTO, FOR UPDATE/SHARE, commands, (expr).field or "
        "schema-qualified function calls; every column reference a real column of the query's "
        "relations (t.name is otherwise the call name(t)); at most "
        f"{MAX_QUERY_BYTES} bytes, {MAX_DEPTH} levels of nesting, {MAX_SUBQUERIES} SELECTs and "
        f"{MAX_CTES} CTEs. It runs in a READ ONLY transaction as ledger_reader under "
        "--timeout (each statement, each fetch of rows). Connect as a reporting login whose "
        "only privileges come from ledger_reader (CREATE ROLE reports LOGIN IN ROLE "
        "ledger_reader;): a superuser, a role with CREATEROLE or a member of other roles is "
        "refused, as its query could take another role back, unless --allow-superuser. "
        "Intervals are seconds in CSV and JSON.\n\n"
        f"Functions allowed: {', '.join(ALLOWED_FUNCTIONS)}; and the built-in operators "
        "(->, ->>, @>, ?, ~, ||, &&, ...)."
    )


@click.command(epilog=_report_epilog())
@click.argument("sql", metavar="SQL")
@click.option("--format", "output", type=click.Choice(FORMATS), default="table", show_default=True,
              help="A table for people, CSV or JSON (a list of objects) for scripts.")
@click.option("--timeout", type=DURATION, default="5s", show_default=True,
              help="statement_timeout of the query, and of each fetch of rows (500ms, 5s, 1m, ...).")
@click.option("--limit", type=click.IntRange(min=0), default=DEFAULT_LIMIT, show_default=True,
              metavar="N", help="Stop after N rows, saying so on stderr (0: no limit). Rows are "
                                "streamed in batches, never all in memory.")
@click.option("--allow-superuser", is_flag=True,
              help="Run even when the session user could leave ledger_reader (a superuser, "
                   "CREATEROLE, a member of other roles): the guard is then the only wall.")
@dsn_option
def report(sql: str, output: str, timeout: timedelta, limit: int, allow_superuser: bool, dsn: str) -> None:
    """Run SQL, one read-only SELECT over the ledger, and print its rows (`-`: read SQL from stdin).

    \b
    jobledger report "SELECT job, failure_rate, p95_duration FROM ledger.run_stats"
    jobledger report --format csv --limit 0 "SELECT * FROM ledger.alerts"
    """
    if sql == "-":
        sql = sys.stdin.read()
    try:
        with connect(dsn) as conn, stream_report(conn, sql, timeout, limit=limit,
                                                 allow_superuser=allow_superuser) as rows:
            _print(rows, output)
    except ReportRejected as error:
        raise click.ClickException(str(error)) from error
    except psycopg.errors.QueryCanceled as error:
        raise click.ClickException(
            f"report timed out after {format_duration(timeout)} (statement_timeout); "
            "narrow the query or give a longer --timeout") from error
    if rows.truncated:
        _say(f"report stopped at {rows.count} rows; --limit N to change (--limit 0: no limit)")


def _print(rows: ReportRows, output: str) -> None:
    columns = rows.columns
    if output == "json":
        count = 0
        for row in rows:
            record = json.dumps(render.plain(dict(zip(columns, row))), indent=2, ensure_ascii=False,
                                default=str)
            click.echo(("[\n" if count == 0 else ",\n") + "\n".join("  " + line for line in record.splitlines()),
                       nl=False)
            count += 1
        click.echo("\n]" if count else "[]")
    elif output == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_csv_cell(value) for value in row])
    else:
        page: list[tuple[Any, ...]] = []
        first = 1
        for row in rows:
            if len(page) == TABLE_PAGE:  # a full page, and more to come: print it, start the next
                _print_table(columns, page, f"rows {first}-{first + len(page) - 1}")
                first += len(page)
                page = []
            page.append(row)
        if first == 1:
            _print_table(columns, page, f"{len(page)} row{'s' if len(page) != 1 else ''}")
        else:
            _print_table(columns, page, f"rows {first}-{first + len(page) - 1}")


def _print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str) -> None:
    table = Table(box=box.SIMPLE_HEAVY, caption=caption, caption_justify="left", min_width=len(caption))
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
