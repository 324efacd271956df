"""`jobledger demo`: the narrated ten-second scenario of ``ledger.demo``, on a database of its own."""

from __future__ import annotations

import os
import sys

import click

from ledger import embedded
from ledger.cli._output import OneLineUsageError, say

WRITE_HERE = "--yes-write-here"


@click.command()
@click.option("--dsn", default=None, metavar="DSN",
              help=f"Run on this database instead (with {WRITE_HERE}; the ledger installed): its jobs and runs "
                   "stay there, under job names with a random suffix. LEDGER_DSN is not used.")
@click.option("--yes-write-here", "write_here", is_flag=True,
              help="Confirm --dsn: the demo may write into that database and leave its rows there.")
@click.option("--speed", type=click.FloatRange(min=0.2, max=5), default=1.0, show_default=True,
              help="Faster (>1) or slower (<1) than the ten-second script.")
def demo(dsn: str | None, write_here: bool, speed: float) -> None:
    """A narrated ten-second scenario: contention, a frozen worker fenced off,
    a crash reaped, a downtime caught up, then the status, alerts and audit.

    It runs on a database of its own: a fresh one on the embedded PostgreSQL,
    or, with the PG* variables set, a scratch database it creates on that
    server and drops at the end. It writes into a database of yours only when
    asked: `--dsn DSN --yes-write-here`.
    """
    from ledger import demo as scenario  # rich progress and threads: only when asked

    if dsn is not None and not write_here:
        shown = embedded.mask_password(dsn) or "the PG* variables' database"
        raise OneLineUsageError(f"the demo writes jobs and runs into {shown} and leaves them there: add "
                                f"{WRITE_HERE} to confirm, or leave out --dsn for a database of the demo's own")
    if write_here and dsn is None:
        raise OneLineUsageError(f"{WRITE_HERE} confirms a --dsn: give the database too "
                                f"(jobledger demo --dsn DSN {WRITE_HERE}), or neither")
    if dsn is None and os.environ.get("LEDGER_DSN"):
        say(f"LEDGER_DSN is not used by the demo, which runs on a database of its own "
            f"(to run it there: jobledger demo --dsn \"$LEDGER_DSN\" {WRITE_HERE})")
    try:
        code = scenario.main(dsn, speed=speed)
    except embedded.NotInstalled as error:
        raise click.ClickException(
            f"the demo needs a server of its own and the embedded PostgreSQL is not installed (no module "
            f"{error.missing!r}): {embedded.EXTRA_HINT}, or set the PG* variables to a server where it may "
            f"create and drop a scratch database, or run it in a database of yours: --dsn DSN {WRITE_HERE}"
        ) from error
    sys.exit(code)


COMMANDS = (demo,)
