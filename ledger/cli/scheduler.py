"""`jobledger scheduler --jobs FILE` (the loop: ``ledger.scheduler``), `scheduler check`, `scheduler
import-crontab`, and `jobledger trigger JOB` (a manual run; ``--here`` runs it in this process)."""

from __future__ import annotations

import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import IO, Any

import click
import psycopg
from psycopg.rows import dict_row

from ledger import embedded, queries
from ledger.cli._options import DURATION, connect, dsn_source, unresolved_dsn_option
from ledger.cli._output import one_line_errors, say
from ledger.client import Ledger, RunContext
from ledger.identity import default_owner
from ledger.models import RunStart
from ledger.scheduler import crontab
from ledger.scheduler.jobsfile import JobDefinition, JobsFileError, load
from ledger.scheduler.loop import Scheduler
from ledger.scheduler.sync import FileWatch
from ledger.text import first_line
from ledger.wrapper import CommandRunner

EXIT_REFUSED = 1  # an invalid jobs file (check, or at the scheduler's start)


@click.group(invoke_without_command=True)
@click.option("--jobs", "jobs_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="The jobs file (TOML): synced at start, on SIGHUP and when it changes.")
@click.option("--max-commands", type=click.IntRange(min=1), default=10, show_default=True,
              help="At most this many commands at a time in this process (more due ones wait).")
@click.option("--poll", type=DURATION, default=None, metavar="D",
              help="Ask the ledger at least this often instead of LISTEN (behind a transaction pooler, "
                   "where LISTEN does not hold); default: LISTEN, polling only when it is refused.")
@click.option("--grace", type=DURATION, default="30s", show_default=True,
              help="On SIGTERM: live commands get this long to finish, then are cancelled (SIGTERM, "
                   "SIGKILL after 10s more; recorded cancelled).")
@click.option("--ttl", type=DURATION, default="30s", show_default=True,
              help="This scheduler's row in ledger.schedulers lives this long without a heartbeat "
                   "(every ttl/3); the upkeep leader's term too.")
@click.option("--owner", default=None, help="This scheduler's name and the runs' owner; default host:pid:random.")
@click.option("-v", "--verbose", is_flag=True, help="Say when each run starts and ends, and each sync.")
@unresolved_dsn_option
@click.pass_context
def scheduler(ctx: click.Context, jobs_file: str | None, max_commands: int, poll: timedelta | None,
              grace: timedelta, ttl: timedelta, owner: str | None, verbose: bool, dsn: str | None) -> None:
    """Run the jobs of FILE on their schedules, on this host and any other running it with the same file.

    Each slot runs once across every scheduler (the ledger's lease and log), with `jobledger run`'s
    semantics per command. SIGHUP syncs the file again; SIGTERM stops starting runs and ends after the
    live ones (--grace). `jobledger scheduler check FILE` checks a file without a database.
    """
    if ctx.invoked_subcommand is not None:
        return
    if jobs_file is None:
        raise click.UsageError("give the jobs file: jobledger scheduler --jobs FILE (or a subcommand)")
    watch = FileWatch(jobs_file)
    try:
        watch.load()  # refused before any connection: nothing changes
    except JobsFileError as error:
        say(str(error))
        ctx.exit(EXIT_REFUSED)
    target = embedded.resolve(dsn, dsn_source(ctx))
    if verbose:
        import logging

        logging.getLogger("ledger").setLevel(logging.INFO)
    runner = CommandRunner(target.dsn, grace=min(grace, timedelta(seconds=10)), say=say, verbose=verbose)
    loop = Scheduler(target.dsn, runner, watch=watch, owner=owner, max_runs=max_commands, poll=poll,
                     grace=grace, ttl=ttl, say=say)
    _install_signals(loop)
    try:
        loop.run()
    except JobsFileError as error:
        say(str(error))
        ctx.exit(EXIT_REFUSED)
    except Exception as error:
        if not isinstance(error, one_line_errors()):
            raise
        say(f"error: {first_line(error)}")
        ctx.exit(1)
    say(f"scheduler {loop.owner} stopped")


def _install_signals(loop: Scheduler) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def stop(number: int, frame: FrameType | None) -> None:
        say(f"{signal.Signals(number).name} received: no more starts, live runs get the grace")
        loop.stop()

    def reload(number: int, frame: FrameType | None) -> None:
        loop.reload()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, reload)


@scheduler.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.pass_context
def check(ctx: click.Context, file: str) -> None:
    """Check a jobs file without connecting: every problem, each naming the job and the key; exit 1 if any."""
    try:
        loaded = load(file)
    except JobsFileError as error:
        say(str(error))
        ctx.exit(EXIT_REFUSED)
    count = len(loaded.jobs)
    pools = "".join(f", pool {name} size {size}" for name, size in sorted(loaded.pools.items()))
    click.echo(f"{file}: {count} job{'' if count == 1 else 's'}{pools}, source {loaded.source!r}, "
               f"removed jobs are {'paused' if loaded.removed == 'pause' else 'unregistered'}: ok")


@scheduler.command("import-crontab")
@click.argument("file", type=click.File("r"), default="-")
@click.option("--system", is_flag=True, help="System crontab lines (/etc/crontab): a user field before the command.")
@click.option("--ttl", default=crontab.DEFAULT_TTL, show_default=True, help="The ttl written for each job.")
@click.pass_context
def import_crontab(ctx: click.Context, file: IO[str], system: bool, ttl: str) -> None:
    """Convert a crontab (FILE, or - for stdin, e.g. `crontab -l | jobledger scheduler import-crontab`)
    into a jobs file on stdout. Environment lines, @reboot and % in commands are refused (exit 1)."""
    try:
        text = crontab.convert(file, system=system, ttl=ttl)
    except crontab.CrontabError as error:
        say(str(error))
        ctx.exit(EXIT_REFUSED)
    click.echo(text, nl=False)


@click.command()
@click.argument("job")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- CMD [ARGS]...]")
@click.option("--here", is_flag=True,
              help="Run it in this process (CMD, or the job's command from --jobs) instead of a scheduler.")
@click.option("--jobs", "jobs_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="With --here: the jobs file that has the job's command.")
@click.option("--requested-by", default=None, help="Who asks (recorded with the trigger); default: host:pid.")
@unresolved_dsn_option
@click.pass_context
def trigger(ctx: click.Context, job: str, command: tuple[str, ...], here: bool, jobs_file: str | None,
            requested_by: str | None, dsn: str | None) -> None:
    """Run JOB now, once, respecting its lease and overlap policy: a manual run, logged as one.

    Without --here a scheduler serving JOB starts it (within a second where it LISTENs); with --here
    this process starts and runs it, with `jobledger run`'s semantics, and exits with CMD's code.
    """
    target = embedded.resolve(dsn, dsn_source(ctx))
    requested_by = requested_by or default_owner()
    definition: JobDefinition | None = None
    if here:
        if command:
            definition = JobDefinition(name=job, register={}, command=tuple(command))
        elif jobs_file is not None:
            try:
                definition = load(jobs_file).jobs.get(job)
            except JobsFileError as error:
                say(str(error))
                ctx.exit(EXIT_REFUSED)
            if definition is None:
                raise click.UsageError(f"job {job} is not in {jobs_file}")
        else:
            raise click.UsageError("--here needs the command: -- CMD, or --jobs FILE")
    elif command or jobs_file:
        raise click.UsageError("a command or --jobs is for --here only")
    with connect(target.dsn) as conn:
        trigger_id = Ledger(conn).trigger(job, requested_by=requested_by)
        if not here:
            click.echo(f"trigger {trigger_id} of job {job}: requested")
            return
        assert definition is not None
        ctx.exit(_run_here(conn, target.dsn, definition, trigger_id, requested_by))


def _run_here(conn: psycopg.Connection[Any], dsn: str, definition: JobDefinition, trigger_id: int,
              owner: str) -> int:
    """Start the trigger's run in this process (``start_due_runs`` for this job alone) and run it."""
    import time

    sent = time.monotonic()
    with conn.cursor(row_factory=dict_row) as cursor:
        cursor.execute(queries.START_DUE_RUNS, {"jobs": [definition.name], "owner": owner, "max_runs": 1})
        row = cursor.fetchone()
        cursor.execute(queries.TRIGGER_STATE, {"trigger_id": trigger_id})
        state = cursor.fetchone()
    if row is None or row["trigger_id"] != trigger_id:
        if row is not None:
            say(f"job {definition.name}: a due slot started first (run {row['run_id']}); running it")
        elif state is not None and state["status"] == "started":
            say(f"trigger {trigger_id} of job {definition.name} was started by a scheduler (run {state['run_id']})")
            return 0
        else:
            reason = f" ({state['skip_reason']})" if state is not None and state["skip_reason"] else ""
            status = state["status"] if state is not None else "unknown"
            say(f"trigger {trigger_id} of job {definition.name}: {status}{reason}, nothing run here")
            return 0
    start = RunStart(outcome="started", run_id=row["run_id"], token=row["token"], expires_at=row["expires_at"],
                     slot=row["slot"], holder=None, holder_expires_at=None)
    with Ledger(dsn, owner=owner) as ledger:
        run = RunContext(ledger, definition.name, ttl=definition.ttl, adopt=(start, row["time_left"], sent))
        run.detail["trigger_id"] = trigger_id
        runner = CommandRunner(dsn, say=say)
        stop = threading.Event()
        previous = {number: signal.signal(number, lambda n, f: stop.set())
                    for number in (signal.SIGTERM, signal.SIGINT)}
        try:
            return runner(ledger, run, definition, stop)
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

COMMANDS = (scheduler, trigger)
