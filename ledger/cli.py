"""The `jobledger` command line (also `python -m ledger`).

Each command is a thin shell over one function of the package: the wrapper
(``ledger.wrapper``), the embedded server (``ledger.embedded``), the demo
(``ledger.demo``), the tables (``ledger.render``). Exit codes: 0 ok, 2 usage
(click), 1 a database or ledger error, told in one line; ``run`` has its own
(see ``ledger.wrapper.EXIT_CODES`` and the README).

The database: ``--dsn``, else ``LEDGER_DSN``, else the standard ``PG*``
variables, else the embedded PostgreSQL (``jobledger where`` tells which).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from datetime import timedelta
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click
import psycopg
from click.core import ParameterSource

from ledger import __version__, embedded, lookups, render
from ledger.client import Ledger
from ledger.durations import format_duration, parse_duration, positive_duration
from ledger.errors import JobNotFound, LedgerError
from ledger.wrapper import EXIT_CODES, EXIT_LEDGER_ERROR, Options, Wrapper


F = TypeVar("F", bound=Callable[..., Any])

TARGET_KEY = "ledger.target"


def one_line_errors() -> tuple[type[BaseException], ...]:
    """The errors a command reports in one line: the database's, the ledger's, the migrator's."""
    errors: list[type[BaseException]] = [psycopg.Error, LedgerError, embedded.EmbeddedUnavailable]
    alembic_util = sys.modules.get("alembic.util")  # imported only by the commands that migrate
    if alembic_util is not None:
        errors.append(alembic_util.CommandError)
    return tuple(errors)


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class _Commands(click.Group):
    """Turns a database or ledger error in any command into one line on stderr and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as error:
            if isinstance(error, one_line_errors()):
                raise click.ClickException(first_line(error)) from error
            raise


class OneLineUsageError(click.UsageError):
    """A usage error (exit 2) told in one line on stderr, its fix included, without click's usage block."""

    def show(self, file: Any = None) -> None:
        click.echo(f"Error: {self.format_message()}", file=file, err=file is None)


def unknown_jobs(jobs: Sequence[str]) -> click.ClickException:
    """The one-line error (exit 1) for job names the ledger does not know."""
    names = ", ".join(jobs)
    what = "no job named" if len(jobs) == 1 else "no jobs named"
    return click.ClickException(f"{what} {names} in this ledger (`jobledger status` lists the jobs; "
                                f"`jobledger register {jobs[0]}` creates one)")


if TYPE_CHECKING:  # click >= 8.2 types ParamType generically; older versions are not subscriptable
    _ParamType = click.ParamType[timedelta, Any]
else:
    _ParamType = click.ParamType


class Duration(_ParamType):
    """``90d``, ``10s``, ``1h30m`` or PostgreSQL interval text (``'80 minutes'``)."""

    name = "duration"

    def __init__(self, positive: bool = True) -> None:
        self._parse = positive_duration if positive else parse_duration

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return self._parse(str(value))
        except ValueError as error:
            self.fail(str(error), param, ctx)


DURATION: Duration = Duration()


def _source(ctx: click.Context, name: str) -> str:
    return "LEDGER_DSN" if ctx.get_parameter_source(name) is ParameterSource.ENVIRONMENT else "option"


def _resolve_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """The option's callback: the conninfo to use (the embedded server's when none is given)."""
    target = embedded.resolve(value, _source(ctx, param.name or "dsn"))
    ctx.meta[TARGET_KEY] = target
    return target.dsn


_DSN_HELP = ("libpq conninfo or URI of the database; default: the PG* variables when set, "
             "else the embedded PostgreSQL (see `jobledger where`).")



def dsn_option(command: F) -> F:
    """``--dsn``: the command gets a conninfo string (``""`` = libpq's PG* defaults), resolved before it runs."""
    return click.option("--dsn", envvar="LEDGER_DSN", default=None, show_envvar=True, callback=_resolve_dsn,
                        help=_DSN_HELP)(command)


def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(command)


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection, named in pg_stat_activity, with the ledger's settings (``ledger.connect``:
    nothing prepared, so it works behind a transaction pooler; LedgerUnavailable naming host and port)."""
    from ledger.connect import connect as open_connection

    return open_connection(dsn, application_name="jobledger")


def _now(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def _say(message: str) -> None:
    click.echo(f"jobledger: {message}", err=True)


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


# -- setup ------------------------------------------------------------------------

@main.command()
@dsn_option
def install(dsn: str) -> None:
    """Install the ledger, or upgrade it to this version (a no-op when current)."""
    from ledger import migrate

    applied = migrate.upgrade(dsn)
    if applied:
        click.echo(f"ledger at revision {applied[-1]}: applied {', '.join(applied)}")
    else:
        click.echo(f"ledger at revision {migrate.current(dsn)}: already current")


@main.command()
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


@main.command()
def sql() -> None:
    """Print the install script, for `psql -v ON_ERROR_STOP=1 -f -`."""
    from ledger import migrate

    click.echo(migrate.install_script(), nl=False)


@main.command()
@dsn_option
@click.option("--show-password", is_flag=True, help="Print the DSN's password instead of ****.")
@click.pass_context
def where(ctx: click.Context, dsn: str, show_password: bool) -> None:
    """Print the DSN in use (stdout) and where it comes from (stderr)."""
    target: embedded.Target = ctx.meta[TARGET_KEY]
    click.echo(dsn if show_password else embedded.mask_password(dsn))
    click.echo(embedded.describe(target) if dsn or target.embedded else "from the PG* variables (libpq defaults)",
               err=True)


# -- jobs -------------------------------------------------------------------------

@main.command()
@click.argument("job")
@click.option("--schedule", default=None, metavar="SCHEDULE",
              help="An interval ('45 minutes') or a cron expression ('*/15 * * * *', '@daily'); "
                   "none: runs are not scheduled.")
@click.option("--ttl", type=DURATION, default=None, help="The default lease ttl of its runs (80m, 2h, ...).")
@click.option("--max-backfill", type=click.IntRange(min=1), default=1, show_default=True,
              help="After a downtime, run at most this many of the missed slots (the newest).")
@click.option("--tz", "time_zone", default="UTC", show_default=True, help="Time zone of the schedule.")
@json_option
@dsn_option
def register(job: str, schedule: str | None, ttl: timedelta | None, max_backfill: int, time_zone: str,
             as_json: bool, dsn: str) -> None:
    """Register JOB, or replace its definition (options left out get their defaults)."""
    with connect(dsn) as conn:
        registered = Ledger(conn).register_job(job, schedule=schedule, ttl=ttl, max_backfill=max_backfill,
                                               time_zone=time_zone)
    if as_json:
        click.echo(render.to_json(registered))
        return
    what = f"schedule {registered.schedule!r} ({registered.time_zone})" if registered.schedule else "no schedule"
    ttl_text = format_duration(registered.ttl) if registered.ttl is not None else "none (give --ttl to run)"
    click.echo(f"registered {registered.job}: {what}, ttl {ttl_text}, max backfill {registered.max_backfill}"
               + (" (paused)" if registered.paused else ""))


@contextmanager
def _registered(job: str) -> Iterator[None]:
    """LD005 (a job that was never registered) in one line that names the job and the fix."""
    try:
        yield
    except JobNotFound as error:
        raise click.ClickException(
            f"job not found: {job} was never registered: `jobledger register {job}` first "
            "(`jobledger status` lists the jobs)") from error


@main.command()
@click.argument("job")
@dsn_option
def pause(job: str, dsn: str) -> None:
    """Pause JOB: its runs answer `paused` (the wrapper exits 0 without running CMD)."""
    with connect(dsn) as conn, _registered(job):
        changed = Ledger(conn).pause_job(job)
    click.echo(f"paused {job}" if changed else f"{job} was already paused")


@main.command()
@click.argument("job")
@dsn_option
def resume(job: str, dsn: str) -> None:
    """Resume JOB after a pause."""
    with connect(dsn) as conn, _registered(job):
        changed = Ledger(conn).resume_job(job)
    click.echo(f"resumed {job}" if changed else f"{job} was not paused")


# -- the wrapper ------------------------------------------------------------------

def _run_epilog() -> str:
    rows = "\n".join(f"  {code:<7} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"\b\nExit codes:\n{rows}"


RUN_FORM = "jobledger run JOB [OPTIONS] -- CMD [ARGS]..."


class _RunCommand(click.Command):
    """``run JOB [OPTIONS] -- CMD [ARGS]...``: what precedes ``--`` is jobledger's, what follows it CMD's.

    Without the ``--``, click would take CMD's options as the wrapper's own
    (``-v``, ``--ttl``) and an option-first line's CMD as JOB; so CMD is only
    what follows the first ``--``, and a word left over before it is refused.
    """

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return ["JOB", "[OPTIONS]", "-- CMD [ARGS]..."]  # the usage line says it the way it must be typed

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        separated = "--" in args
        command = args[args.index("--") + 1:] if separated else []
        mine = args[:args.index("--")] if separated else args
        try:
            rest = super().parse_args(ctx, mine)
        except click.MissingParameter as error:
            if error.param is None or error.param.name != "job":
                raise
            given = f" -- {shlex.join(command)}" if command else " -- CMD [ARGS]..."
            raise OneLineUsageError(f"missing JOB: the job's name comes first, before the options and "
                                    f"`--`: jobledger run JOB [OPTIONS]{given}", ctx) from error
        except click.NoSuchOption as error:
            if separated:
                raise
            raise OneLineUsageError(f"no such option: {error.option_name} (if it is CMD's, put `--` before "
                                    f"CMD: {RUN_FORM})", ctx) from error
        if ctx.resilient_parsing:
            return rest
        stray: tuple[str, ...] = ctx.params.get("command") or ()
        if stray:
            job = str(ctx.params.get("job"))
            where = "before `--`" if separated else "without a `--` before it"
            raise OneLineUsageError(
                f"{stray[0]!r} follows JOB {job!r} {where}: options before `--` are jobledger's, CMD and its "
                f"arguments only after it: jobledger run {shlex.quote(job)} [OPTIONS] -- CMD [ARGS]...", ctx)
        if not command:
            what = "no CMD after `--`" if separated else "missing `-- CMD`"
            raise OneLineUsageError(f"{what}: {RUN_FORM}", ctx)
        ctx.params["command"] = tuple(command)
        return rest


@main.command(cls=_RunCommand, epilog=_run_epilog())
@click.argument("job")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.option("--ttl", type=DURATION, default=None,
              help="Lease ttl of the run (80m, 2h, ...); default: the job's registered ttl.")
@click.option("--owner", default=None, help="Who holds the lease; default hostname:pid:random.")
@click.option("--grace", type=DURATION, default="10s", show_default=True,
              help="After SIGTERM (lease lost, or forwarded), wait this long before SIGKILL.")
@click.option("--skip-exit-code", type=click.IntRange(0, 255), default=0, show_default=True,
              help="Exit code when another owner holds the job (`skipped: held by ...`).")
@click.option("-v", "--verbose", is_flag=True, help="Say when each run starts and ends (on stderr).")
@click.option("--dsn", envvar="LEDGER_DSN", default=None, show_envvar=True, help=_DSN_HELP)
@click.pass_context
def run(ctx: click.Context, job: str, command: tuple[str, ...], ttl: timedelta | None, owner: str | None,
        grace: timedelta, skip_exit_code: int, verbose: bool, dsn: str | None) -> None:
    """Run CMD as a run of JOB: at most one at a time across hosts, logged, fenced.

    For a job with a schedule (`jobledger register`), runs CMD once per due slot
    (catch-up, bounded by --max-backfill). CMD gets LEDGER_JOB, LEDGER_RUN_ID,
    LEDGER_FENCING_TOKEN, LEDGER_SLOT (ISO 8601, empty without a schedule),
    LEDGER_OWNER and LEDGER_DSN, so it can fence each write in the write's
    transaction: `ledger.fence(job => <LEDGER_JOB>, resource => '...', token =>
    <LEDGER_FENCING_TOKEN>)` (e.g. psql -v job="$LEDGER_JOB" -v
    token="$LEDGER_FENCING_TOKEN", then :'job' and :token; see the README).
    The lease is renewed every ttl/3; if it
    is lost, CMD gets SIGTERM, then SIGKILL after --grace. SIGTERM/SIGINT/SIGHUP
    are forwarded to CMD and the run is recorded `cancelled`.

    Options go before `--` (they are jobledger's), CMD and its arguments after it:
    `jobledger run nightly --ttl 80m -v -- ./nightly.sh --full` (`-v` is the
    wrapper's, `--full` the script's).
    """
    try:
        target = embedded.resolve(dsn, _source(ctx, "dsn"))
        conn = connect(target.dsn)
    except Exception as error:
        if not isinstance(error, one_line_errors()):
            raise
        _say(f"error: {first_line(error)}")
        ctx.exit(EXIT_LEDGER_ERROR)
    options = Options(job=job, argv=command, ttl=ttl, grace=grace, skip_exit_code=skip_exit_code,
                      verbose=verbose, dsn=target.dsn)
    with conn:
        code = Wrapper(conn, options, owner=owner, say=_say).run()
    ctx.exit(code)


# -- looking -----------------------------------------------------------------------

@main.command()
@click.argument("jobs", nargs=-1, metavar="[JOB]...")
@json_option
@dsn_option
def status(jobs: tuple[str, ...], as_json: bool, dsn: str) -> None:
    """The state at a glance: the `ledger.job_status` view, jobs with alerts in red,
    then the live alerts (`ledger.alerts`)."""
    with connect(dsn) as conn:
        statuses = [render.with_counters(row) for row in Ledger(conn).job_statuses()]
        alerts = lookups.alerts(conn)
        now = _now(conn)
    if jobs:
        known = {row.job for row in statuses}
        unknown = [job for job in dict.fromkeys(jobs) if job not in known]
        if unknown:
            raise unknown_jobs(unknown)
        statuses = [row for row in statuses if row.job in jobs]
        alerts = [row for row in alerts if row["job"] in jobs]
    if as_json:
        click.echo(render.to_json({"jobs": statuses, "alerts": alerts}))
        return
    out = render.console()
    if not statuses:
        out.print("no jobs yet: `jobledger register` one, or `jobledger run JOB --ttl 10m -- CMD`")
    else:
        out.print(render.fitted(out, lambda wide: render.status_table(statuses, alerts, now, wide=wide)))
    if alerts:
        out.print(render.alerts_table(alerts, now))
    elif statuses:
        out.print("[green]no alerts[/green]")


@main.command()
@click.argument("job")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="How many runs.")
@json_option
@dsn_option
def runs(job: str, limit: int, as_json: bool, dsn: str) -> None:
    """JOB's recent runs, newest first (`ledger.job_execution_log`)."""
    with connect(dsn) as conn:
        rows = lookups.recent_runs(conn, job, limit)
        if not rows and Ledger(conn).job_status(job) is None:
            raise unknown_jobs([job])
        now = _now(conn)
    if as_json:
        click.echo(render.to_json(rows))
        return
    if not rows:
        click.echo(f"no runs of {job}")
        return
    out = render.console()
    out.print(render.fitted(out, lambda wide: render.runs_table(rows, now, title=f"runs of {job}", wide=wide)))


# -- maintenance ---------------------------------------------------------------------

@main.command()
@click.option("--older-than", type=DURATION, required=True,
              help="Delete ended runs older than this (90d, '3 weeks', ...); a job's newest success stays.")
@dsn_option
def purge(older_than: timedelta, dsn: str) -> None:
    """Delete old ended runs from the log (`ledger.purge_log`)."""
    with connect(dsn) as conn:
        deleted = Ledger(conn).purge_log(older_than)
    click.echo(f"purged {deleted} run{'s' if deleted != 1 else ''} older than {format_duration(older_than)}")


@main.command()
@click.argument("job", required=False)
@dsn_option
def reap(job: str | None, dsn: str) -> None:
    """Close runs whose lease expired (crashed runners) as failed: `ledger.reap_expired`."""
    with connect(dsn) as conn:
        reaped = Ledger(conn).reap_expired(job)
    click.echo(f"reaped {reaped} run{'s' if reaped != 1 else ''}" + (f" of {job}" if job else ""))


# -- the demo ------------------------------------------------------------------------

WRITE_HERE = "--yes-write-here"


@main.command()
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
        _say(f"LEDGER_DSN is not used by the demo, which runs on a database of its own "
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


# -- reporting (ledger.cli_report imports the helpers above, so it is registered last) --

from ledger.cli_report import metrics, report  # noqa: E402

main.add_command(report)
main.add_command(metrics)
