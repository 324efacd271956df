"""`jobledger verify`: the ledger's guarantees checked against your database, through your path (``ledger.verify``)."""

from __future__ import annotations

import click

from ledger.cli._options import dsn_option, json_option
from ledger.cli._output import plural
from ledger.render import to_json
from ledger.text import visible
from ledger.verify import Report, verify

LABELS = {"held": "held", "warn": "WARN", "failed": "FAILED", "skipped": "skipped"}
COLOURS = {"held": "green", "warn": "yellow", "failed": "red", "skipped": None}


@click.command("verify")
@json_option
@dsn_option
@click.pass_context
def verify_command(ctx: click.Context, as_json: bool, dsn: str) -> None:
    """Check the ledger's guarantees on this database, through this DSN, in under a minute.

    Two racing workers get one run per slot; a zombie past its ttl is refused
    by the fence; the client notices a lost lease by the lease's expiry;
    tokens keep increasing across a reconnect; the database's clock against
    this host's; whether the path is a transaction pooler and breaks prepared
    statements; the role's privileges; whether commits reach a synchronous
    standby; what holds back the xmin horizon.

    Each is printed as held, WARN or FAILED (with how to reproduce it). The
    scratch jobs (jobledger-verify:...) are removed at the end; their lease
    rows and fences stay, as every job's do: they are the token high-water
    marks. Exit 0 when nothing failed (warnings allowed), 1 when a check
    failed, 2 for a usage error.
    """
    report = verify(dsn)
    if as_json:
        click.echo(to_json(report.as_json()))
    else:
        show(report)
    ctx.exit(1 if report.failed else 0)


def show(report: Report) -> None:
    """The report for people: each check, held or not and why, then what to do; the cleanup; the counts."""
    target = report.target
    version = str(target["server_version"]).split()[0]
    click.echo(visible(f"jobledger verify: database {target['dbname']} as {target['role']} "
                       f"via {target['host']}:{target['port']} (PostgreSQL {version})"))
    width = max(len(check.name) for check in report.checks)
    indent = " " * (8 + width + 2)
    for check in report.checks:
        label = click.style(f"{LABELS[check.status]:<7}", fg=COLOURS[check.status])
        click.echo(f"{label} {check.name:<{width}}  {visible(check.guarantee)}")
        click.echo(f"{indent}{visible(check.summary)}")
        if check.status == "failed" and check.how_to_reproduce:
            click.echo(f"{indent}to reproduce:")
            for line in check.how_to_reproduce.splitlines():
                click.echo(f"{indent}  {visible(line)}")
        if check.advice and check.status != "skipped":
            click.echo(f"{indent}what to do: {visible(check.advice)}")
    cleanup = report.cleanup
    if cleanup:
        click.echo(f"scratch jobs: {plural(len(cleanup['removed']), 'job')} removed, {cleanup['runs_left']} runs "
                   f"and {cleanup['jobs_left']} registrations left; kept by design: "
                   f"{plural(cleanup['lease_rows_kept'], 'lease row')} and {plural(cleanup['fences_kept'], 'fence')}, "
                   "the token high-water marks")
        for job, error in cleanup["errors"].items():
            click.echo(visible(f"  could not remove {job}: {error}"))
    counts = report.counts()
    click.echo(f"{plural(len(report.checks), 'check')} in {report.seconds:.1f} s: {counts['held']} held, "
               f"{plural(counts['warn'], 'warning')}, {counts['failed']} failed"
               + (f", {counts['skipped']} skipped" if counts["skipped"] else ""))


COMMANDS = (verify_command,)
