"""Pools, a limit shared by jobs: `pool register`, `pool resize`, `pool drop`, `pool list`, and
`pools` (the list, as `schedulers` lists the schedulers).

A pool admits at most SIZE live leases of its jobs at once, whichever jobs they are; a start that
would exceed it is skipped as `skipped_pool_full` (docs/limits.md). A job joins one with
`jobledger register JOB --pool NAME`."""

from __future__ import annotations

import click

from ledger import render
from ledger.cli._options import connect, dsn_option, json_option
from ledger.cli._output import database_now, plural, registered_pool
from ledger.client import Ledger
from ledger.models import Pool


def _said(verb: str, row: Pool, as_json: bool) -> None:
    if as_json:
        click.echo(render.to_json(row))
    else:
        click.echo(f"{verb} pool {row.pool}: size {row.size} (at most {plural(row.size, 'live lease')} "
                   "of its jobs at once)")


@click.group()
def pool() -> None:
    """Pools: a limit of live leases shared by jobs (`ledger.pools`). A start that would exceed a
    pool's size is skipped (`skipped_pool_full`), never an error; `jobledger register JOB --pool NAME`
    puts a job in one."""


@pool.command("register")
@click.argument("name")
@click.argument("size", type=int)
@json_option
@dsn_option
def register_pool(name: str, size: int, as_json: bool, dsn: str) -> None:
    """Create pool NAME, at most SIZE live leases of its jobs at once (1 to 100,000), or change the
    size of the pool NAME (`ledger.register_pool`)."""
    with connect(dsn) as conn:
        row = Ledger(conn).register_pool(name, size)
    _said("registered", row, as_json)


@pool.command()
@click.argument("name")
@click.argument("size", type=int)
@json_option
@dsn_option
def resize(name: str, size: int, as_json: bool, dsn: str) -> None:
    """Change the size of the registered pool NAME (`ledger.resize_pool`). A smaller size stops
    nothing that runs: no start is admitted until its live leases are fewer than SIZE."""
    with connect(dsn) as conn, registered_pool(name):
        row = Ledger(conn).resize_pool(name, size)
    _said("resized", row, as_json)


@pool.command()
@click.argument("name")
@click.option("--detach", is_flag=True, help="Take the jobs that belong to it out of it first (else refused "
                                             "while a job belongs to it).")
@dsn_option
def drop(name: str, detach: bool, dsn: str) -> None:
    """Drop pool NAME (`ledger.drop_pool`). Refused while jobs belong to it (the message names them),
    unless --detach, which takes them out of it: their starts are then limited by no pool."""
    with connect(dsn) as conn:
        dropped = Ledger(conn).drop_pool(name, detach=detach)
    click.echo(f"dropped pool {name}" if dropped else f"no pool named {name}: nothing dropped")


def _list(as_json: bool, dsn: str) -> None:
    with connect(dsn) as conn:
        rows = Ledger(conn).pool_statuses()
        now = database_now(conn)
    if as_json:
        click.echo(render.to_json(rows))
    elif not rows:
        click.echo("no pools: `jobledger pool register NAME SIZE` creates one")
    else:
        render.console().print(render.pools_table(rows, now))


@pool.command("list")
@json_option
@dsn_option
def list_pools(as_json: bool, dsn: str) -> None:
    """Every pool (`ledger.pool_status`): size, used (live leases), running, jobs, waiting (jobs a
    scheduler keeps waiting a place), skipped_pool_full (the starts it refused)."""
    _list(as_json, dsn)


@click.command()
@json_option
@dsn_option
def pools(as_json: bool, dsn: str) -> None:
    """Every pool (`ledger.pool_status`), as `jobledger pool list`: size, used (live leases), running,
    jobs, waiting, skipped_pool_full."""
    _list(as_json, dsn)


COMMANDS = (pool, pools)
