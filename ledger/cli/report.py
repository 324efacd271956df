"""`jobledger report "SQL"`: one read-only SELECT over the ledger, its rows as a table, CSV or JSON.

The guard, the session check and the read-only run live in ``ledger.report``
(its docstring says what is checked and why); the cells and tables are
``ledger.render``'s.

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
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import click
import psycopg

from ledger import render
from ledger.cli._options import DURATION, connect, dsn_option
from ledger.cli._output import plural, say
from ledger.durations import format_duration
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
        say(f"report stopped at {rows.count} rows; --limit N to change (--limit 0: no limit)")


def _print(rows: ReportRows, output: str) -> None:
    columns = rows.columns
    if output == "json":
        count = 0
        for row in rows:
            record = render.dumps(dict(zip(columns, row)), indent=2, default=str)
            click.echo(("[\n" if count == 0 else ",\n") + "\n".join("  " + line for line in record.splitlines()),
                       nl=False)
            count += 1
        click.echo("\n]" if count else "[]")
    elif output == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([render.csv_cell(value) for value in row])
    else:
        page: list[tuple[Any, ...]] = []
        first = 1
        for row in rows:
            if len(page) == TABLE_PAGE:  # a full page, and more to come: print it, start the next
                _print_table(columns, page, _span(first, page))
                first += len(page)
                page = []
            page.append(row)
        _print_table(columns, page, plural(len(page), "row") if first == 1 else _span(first, page))


def _span(first: int, page: Sequence[object]) -> str:
    return f"rows {first}-{first + len(page) - 1}"


def _print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str) -> None:
    render.console().print(render.rows_table(columns, rows, caption))


COMMANDS = (report,)
