"""Setting up: `install`, `uninstall`, `sql` (the install script) and `where` (the database in use)."""

from __future__ import annotations

import click

from ledger import embedded
from ledger.cli._options import TARGET_KEY, dsn_option


@click.command()
@dsn_option
def install(dsn: str) -> None:
    """Install the ledger, or upgrade it to this version (a no-op when current)."""
    from ledger import migrate

    applied = migrate.upgrade(dsn)
    if applied:
        click.echo(f"ledger at revision {applied[-1]}: applied {', '.join(applied)}")
    else:
        click.echo(f"ledger at revision {migrate.current(dsn)}: already current")


@click.command()
@dsn_option
@click.option("--yes", is_flag=True, help="Confirm: the ledger's tables and their history go away.")
def uninstall(dsn: str, yes: bool) -> None:
    """Remove the ledger: schema ledger with all its data, and the roles nothing else uses.

    The roles (ledger_owner, ledger_client, ledger_reader) are cluster-wide:
    each stays while another database's ledger uses it or while it is granted
    to another role. `DROP SCHEMA ledger CASCADE` alone leaves all three.
    """
    from ledger import migrate

    if not yes:
        raise click.UsageError("uninstall deletes every run, lease and fence of this database's ledger: "
                               "add --yes to confirm")
    if migrate.current(dsn) is None:
        click.echo("no ledger installed here: nothing to do")
        return
    migrate.downgrade(dsn, "base")
    click.echo("ledger uninstalled")


@click.command()
@dsn_option
@click.option("--to", "release", metavar="VERSION", required=True,
              help="The release to go back to, e.g. 0.1.0.")
@click.option("--yes", is_flag=True, help="Confirm: what came after that release goes away.")
def downgrade(dsn: str, release: str, yes: bool) -> None:
    """Take the ledger back to an earlier release's schema (the history stays).

    Each revision's downgrade restores the functions and views as they were;
    clients of the newer version then get the older behaviour. Going below
    the first release is `jobledger uninstall`.
    """
    from ledger import migrate

    revision = migrate.RELEASES.get(release)
    if revision is None:
        known = ", ".join(sorted(migrate.RELEASES))
        raise click.BadParameter(f"unknown release {release!r}: this package knows {known}", param_hint="--to")
    if not yes:
        raise click.UsageError(f"downgrade takes the ledger back to {release}'s schema: add --yes to confirm")
    at = migrate.current(dsn)
    if at is None:
        raise click.ClickException("no ledger is installed here: nothing to downgrade")
    if at <= revision:
        click.echo(f"ledger at revision {at}: already at or below {release} (revision {revision})")
        return
    migrate.downgrade(dsn, revision)
    click.echo(f"ledger at revision {revision} ({release}): was {at}")


@click.command()
@click.option("--upgrade-from", "release", metavar="VERSION",
              help="Print instead the upgrade from that release (e.g. 0.1.0) to this version.")
def sql(release: str | None) -> None:
    """Print the install script, for `psql -v ON_ERROR_STOP=1 -f -`.

    With --upgrade-from, the upgrade script of a database installed at that
    release: one transaction, refused (nothing changed) by a database at any
    other revision. `jobledger install` upgrades online from any revision.
    """
    from ledger import migrate

    if release is None:
        click.echo(migrate.install_script(), nl=False)
        return
    try:
        click.echo(migrate.upgrade_script(release), nl=False)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--upgrade-from") from None


@click.command()
@dsn_option
@click.option("--show-password", is_flag=True, help="Print the DSN's password instead of ****.")
@click.pass_context
def where(ctx: click.Context, dsn: str, show_password: bool) -> None:
    """Print the DSN in use (stdout) and where it comes from (stderr)."""
    target: embedded.Target = ctx.meta[TARGET_KEY]
    click.echo(dsn if show_password else embedded.mask_password(dsn))
    click.echo(embedded.describe(target) if dsn or target.embedded else "from the PG* variables (libpq defaults)",
               err=True)


COMMANDS = (install, downgrade, uninstall, sql, where)
