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
def sql() -> None:
    """Print the install script, for `psql -v ON_ERROR_STOP=1 -f -`."""
    from ledger import migrate

    click.echo(migrate.install_script(), nl=False)


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


COMMANDS = (install, uninstall, sql, where)
