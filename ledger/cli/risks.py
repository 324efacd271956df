"""`jobledger risks`: what slows the ledger down from the database (``ledger.db_risks``).

The xmin horizon's age and holder, dead rows and autovacuum lag on the hot
tables; exit code 1 when any is warn or critical, so a shell or a probe can
test it. Read as the connecting user: a user without ``pg_read_all_stats``
sees no state nor age of other roles' transactions (docs/contract.md).
"""

from __future__ import annotations

import sys

import click
from rich import box
from rich.table import Table

from ledger import lookups, render
from ledger.cli._options import connect, dsn_option, json_option

STYLE = {"ok": "green", "warn": "yellow", "critical": "bold red"}


@click.command()
@json_option
@dsn_option
def risks(as_json: bool, dsn: str) -> None:
    """What the database does to the ledger (`ledger.db_risks`): the xmin horizon's age and
    who holds it, dead rows and autovacuum lag on the ledger's hot tables, each ok, warn or
    critical with what to do. Exit code 1 when any is warn or critical."""
    with connect(dsn) as conn:
        rows = lookups.db_risks(conn)
    if as_json:
        click.echo(render.to_json(rows))
    else:
        table = Table(box=box.SIMPLE_HEAVY, title="ledger.db_risks", title_justify="left", title_style="bold")
        for name in ("risk", "table", "severity", "value", "what"):
            table.add_column(name)
        for row in rows:
            value = "-" if row.value is None else f"{row.value:,} {row.unit}"
            table.add_row(render.cell(row.kind), render.cell(row.relation or "-"),
                          render.cell(row.severity, style=STYLE[row.severity]), value, render.cell(row.message))
        render.console().print(table)
    if any(row.severity != "ok" for row in rows):
        sys.exit(1)


COMMANDS = (risks,)
