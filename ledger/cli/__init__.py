"""The `jobledger` command line (also `python -m ledger`): ``main``, the group of every command.

Each command is a thin shell over one function of the package, one module a
group of commands:

- ``ledger.cli.install``: ``install``, ``uninstall``, ``sql``, ``where``;
- ``ledger.cli.jobs``: ``register``, ``pause``, ``resume``, ``purge``, ``reap``;
- ``ledger.cli.status``: ``status``, ``schedulers``, ``runs`` (the tables: ``ledger.render``);
- ``ledger.cli.risks``: ``risks``, what the database does to the ledger (``ledger.db_risks``);
- ``ledger.cli.next``: ``next``, a schedule's next slots (``ledger.next_slots``, ``ledger.preview_slots``);
- ``ledger.cli.events``: ``events``, ``watch``, ``configure-events`` (``ledger.events``, ``ledger.tail``);
- ``ledger.cli.notify``: ``notify``, alert events to a webhook (``ledger.tail``, ``ledger.webhook``);
- ``ledger.cli.run``: ``run``, the wrapper (``ledger.wrapper``);
- ``ledger.cli.scheduler``: ``scheduler`` (its ``check``, ``import-crontab``), ``trigger``
  (``ledger.scheduler``, its commands run by ``ledger.wrapper``);
- ``ledger.cli.pools``: ``pool`` (``register``, ``resize``, ``drop``, ``list``) and ``pools``, a limit
  shared by jobs (``ledger.pools``);
- ``ledger.cli.protect``: ``protect``, ``unprotect``, a table's writes fenced (``ledger.protect``);
- ``ledger.cli.report``: ``report`` (``ledger.report``);
- ``ledger.cli.metrics``: ``metrics`` (``ledger.metrics``);
- ``ledger.cli.web``: ``web``, the dashboard (``ledger.web``);
- ``ledger.cli.demo``: ``demo`` (``ledger.demo``);
- ``ledger.cli.verify``: ``verify``, the guarantees checked where you run (``ledger.verify``).

What they share: ``ledger.cli._options`` (``--dsn``, ``--json``, durations,
the connection) and ``ledger.cli._output`` (messages, one-line errors). The
command modules import only those two, never this package's ``main``, so
each imports on its own, and ``main`` imports a command's module only when
that command runs (:data:`COMMAND_MODULES`).

Exit codes: 0 ok, 2 usage (click), 1 a database or ledger error, told in one
line; ``run`` has its own (see ``ledger.wrapper.EXIT_CODES`` and the README).

The database: ``--dsn``, else ``LEDGER_DSN``, else the standard ``PG*``
variables, else the embedded PostgreSQL (``jobledger where`` tells which).
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from ledger import __version__
from ledger.cli._output import Commands

__all__ = ["COMMAND_MODULES", "main"]

#: Each command and its module (``ledger.cli.<module>``, whose ``COMMANDS`` defines it), imported only
#: when the command runs: ``jobledger run`` in a cron line does not load sqlglot (``report``),
#: prometheus_client (``metrics``) or the dashboard. ``--help`` imports them all, to list them.
COMMAND_MODULES: dict[str, str] = {
    "install": "install", "downgrade": "install", "uninstall": "install", "sql": "install", "where": "install",
    "register": "jobs", "pause": "jobs", "resume": "jobs", "purge": "jobs", "reap": "jobs",
    "unregister": "jobs", "release": "jobs", "cancel": "jobs",
    "status": "status", "schedulers": "status", "runs": "status", "health": "status", "verify-state": "status",
    "risks": "risks",
    "next": "next",
    "events": "events", "watch": "events", "configure-events": "events",
    "notify": "notify",
    "run": "run", "backfill": "run",
    "scheduler": "scheduler", "trigger": "scheduler",
    "pool": "pools", "pools": "pools",
    "protect": "protect", "unprotect": "protect",
    "report": "report",
    "metrics": "metrics",
    "web": "web",
    "demo": "demo",
    "verify": "verify",
}


class _Commands(Commands):
    """The group of :data:`COMMAND_MODULES`: a command's module is imported when it is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMAND_MODULES:
            return None
        module = importlib.import_module(f"ledger.cli.{COMMAND_MODULES[cmd_name]}")
        # a dict, not the builtin next(): importing ledger.cli.next makes `next` this package's submodule
        commands: dict[str | None, click.Command] = {command.name: command for command in module.COMMANDS}
        return commands[cmd_name]


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="jobledger")
def main() -> None:
    """Postgres-native job ledger: leases with fencing tokens, an execution log,
    bounded catch-up for scheduled jobs.

    Wrap a cron line: `jobledger run JOB --ttl 80m -- ./job.sh`. With no database
    given, an embedded PostgreSQL is used (`jobledger where`); try `jobledger demo`.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("jobledger: %(message)s"))
    log = logging.getLogger("ledger")
    if not log.handlers:
        log.addHandler(handler)
        log.setLevel(logging.WARNING)
        log.propagate = False
