"""`jobledger run JOB [OPTIONS] -- CMD [ARGS]...`: CMD as a run of JOB, supervised by ``ledger.wrapper``.

Its exit codes are the wrapper's (``ledger.wrapper.EXIT_CODES``, listed in
its help): a database it cannot reach is 125, not 1, and said on stderr.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from datetime import datetime, timedelta

import click

from ledger import embedded
from ledger.cli._options import DURATION, connect, dsn_source, instant, unresolved_dsn_option
from ledger.cli._output import OneLineUsageError, one_line_errors, say
from ledger.text import first_line
from ledger.wrapper import EXIT_CODES, EXIT_LEDGER_ERROR, Options, Wrapper

RUN_FORM = "jobledger run JOB [OPTIONS] -- CMD [ARGS]..."
MAX_RETRIES = 100


def _run_epilog() -> str:
    rows = "\n".join(f"  {code:<7} {meaning}" for code, meaning in EXIT_CODES.items())
    return f"\b\nExit codes:\n{rows}"


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


@click.command(cls=_RunCommand, epilog=_run_epilog())
@click.argument("job")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.option("--ttl", type=DURATION, default=None,
              help="Lease ttl of the run (80m, 2h, ...); default: the job's registered ttl.")
@click.option("--owner", default=None, help="Who holds the lease; default hostname:pid:random.")
@click.option("--grace", type=DURATION, default="10s", show_default=True,
              help="After SIGTERM (lease lost, or forwarded), wait this long before SIGKILL.")
@click.option("--skip-exit-code", type=click.IntRange(0, 255), default=0, show_default=True,
              help="Exit code when another owner holds the job (`skipped: held by ...`, or `nothing due: slot "
                   "... is being run by ...`), or its pool is full (`skipped: pool P of job J is full ...`).")
@click.option("--timeout", type=DURATION, default=None,
              help="Stop CMD once it has run this long (SIGTERM, SIGKILL after --grace): the run fails with "
                   "`timeout: ran longer than ...`, exit 123.")
@click.option("--retries", type=click.IntRange(0, MAX_RETRIES), default=0, show_default=True,
              help="Try a failed run (CMD's non-zero exit, or a timeout) again up to N times, each attempt a "
                   "run of its own for the same slot.")
@click.option("--backoff", type=DURATION, default="30s", show_default=True,
              help="Wait before the first retry; doubled after each one, at most 10m (or --backoff when longer).")
@click.option("--pgoptions", is_flag=True,
              help="Also put `-c ledger.job=JOB -c ledger.token=N` into CMD's PGOPTIONS, so that its psql (any "
                   "libpq client) writes tables protected with `jobledger protect`. Not through PgBouncer, which "
                   "refuses `options`.")
@click.option("--fenced", "fenced", multiple=True, metavar="RESOURCE",
              help="A resource CMD fences (repeatable; a protected table: its name, public.orders): the run is "
                   "a success only when the resource's fence holds the run's token, else a failure, exit 122. "
                   "CMD may also write resources into the file $LEDGER_FENCED_FILE, one per line.")
@click.option("-v", "--verbose", is_flag=True, help="Say when each run starts and ends (on stderr).")
@unresolved_dsn_option
@click.pass_context
def run(ctx: click.Context, job: str, command: tuple[str, ...], ttl: timedelta | None, owner: str | None,
        grace: timedelta, skip_exit_code: int, timeout: timedelta | None, retries: int, backoff: timedelta,
        pgoptions: bool, fenced: tuple[str, ...], verbose: bool, dsn: str | None) -> None:
    """Run CMD as a run of JOB: at most one at a time across hosts, logged, fenced.

    For a job with a schedule (`jobledger register`), runs CMD once per due slot
    (catch-up, bounded by --max-backfill). CMD gets LEDGER_JOB, LEDGER_RUN_ID,
    LEDGER_FENCING_TOKEN, LEDGER_SLOT (ISO 8601, empty without a schedule),
    LEDGER_OWNER and LEDGER_DSN, so it can fence each write in the write's
    transaction: `ledger.fence(job => <LEDGER_JOB>, resource => '...', token =>
    <LEDGER_FENCING_TOKEN>)` (e.g. psql -v job="$LEDGER_JOB" -v
    token="$LEDGER_FENCING_TOKEN", then :'job' and :token; see the README).
    With --pgoptions, CMD's psql carries the token itself (PGOPTIONS), which
    is all a table protected with `jobledger protect` asks. Name what CMD
    fences with --fenced (or in $LEDGER_FENCED_FILE): a run whose fenced
    write did not commit (a rolled back or lost COMMIT) is then a failure.
    The lease is renewed every ttl/3; if it
    is lost, CMD gets SIGTERM, then SIGKILL after --grace. SIGTERM/SIGINT/SIGHUP
    are forwarded to CMD and the run is recorded `cancelled`. --timeout stops
    CMD after that long; --retries N tries a failed slot again (after --backoff,
    doubled each time), each attempt its own run; a signal ends the retries.

    Options go before `--` (they are jobledger's), CMD and its arguments after it:
    `jobledger run nightly --ttl 80m -v -- ./nightly.sh --full` (`-v` is the
    wrapper's, `--full` the script's).
    """
    try:
        target = embedded.resolve(dsn, dsn_source(ctx))
        conn = connect(target.dsn)
    except Exception as error:
        if not isinstance(error, one_line_errors()):
            raise
        say(f"error: {first_line(error)}")
        ctx.exit(EXIT_LEDGER_ERROR)
    options = Options(job=job, argv=command, ttl=ttl, grace=grace, skip_exit_code=skip_exit_code,
                      verbose=verbose, dsn=target.dsn, timeout=timeout, retries=retries, backoff=backoff,
                      pgoptions=pgoptions, fenced=fenced)
    with conn:
        code = Wrapper(conn, options, owner=owner, say=say).run()
    ctx.exit(code)


def _wrap(ctx: click.Context, dsn: str | None, owner: str | None, options: Options) -> None:
    """Connect (a database it cannot reach: exit 125, said in one line) and run the wrapper."""
    try:
        target = embedded.resolve(dsn, dsn_source(ctx))
        conn = connect(target.dsn)
    except Exception as error:
        if not isinstance(error, one_line_errors()):
            raise
        say(f"error: {first_line(error)}")
        ctx.exit(EXIT_LEDGER_ERROR)
    with conn:
        code = Wrapper(conn, replace(options, dsn=target.dsn), owner=owner, say=say).run()
    ctx.exit(code)


@click.command(cls=_RunCommand, epilog=_run_epilog())
@click.argument("job")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.option("--from", "from_slot", callback=instant, required=True, metavar="TIME",
              help="The first slot of the range (ISO 8601, UTC without an offset).")
@click.option("--to", "to_slot", callback=instant, required=True, metavar="TIME",
              help="The last slot of the range (at most 1000 slots; a slot in the future is not run).")
@click.option("--ttl", type=DURATION, default=None,
              help="Lease ttl of each run (80m, 2h, ...); default: the job's registered ttl.")
@click.option("--owner", default=None, help="Who holds the lease; default hostname:pid:random.")
@click.option("--grace", type=DURATION, default="10s", show_default=True,
              help="After SIGTERM (lease lost, or forwarded), wait this long before SIGKILL.")
@click.option("--timeout", type=DURATION, default=None,
              help="Stop CMD once it has run this long (as `jobledger run --timeout`).")
@click.option("--fenced", "fenced", multiple=True, metavar="RESOURCE",
              help="A resource CMD fences (repeatable; a protected table: its name, public.orders): the run is "
                   "a success only when the resource's fence holds the run's token, else a failure, exit 122. "
                   "CMD may also write resources into the file $LEDGER_FENCED_FILE, one per line.")
@click.option("-v", "--verbose", is_flag=True, help="Say when each run starts and ends (on stderr).")
@unresolved_dsn_option
@click.pass_context
def backfill(ctx: click.Context, job: str, command: tuple[str, ...], from_slot: datetime, to_slot: datetime,
             ttl: timedelta | None, owner: str | None, grace: timedelta, timeout: timedelta | None,
             fenced: tuple[str, ...], verbose: bool, dsn: str | None) -> None:
    """Run CMD once for each slot of JOB from --from to --to that has not succeeded, oldest first
    (`ledger.backfill`), under the lease as `jobledger run` does (same environment, heartbeats,
    fencing, exit codes). A slot that succeeded, also before a purge, is never run again; the
    first run that fails ends the backfill (run it again to retry from there).

    `jobledger backfill nightly --from 2026-03-01 --to 2026-03-07 -- ./nightly.sh`
    """
    _wrap(ctx, dsn, owner, Options(job=job, argv=command, ttl=ttl, grace=grace, verbose=verbose,
                                   timeout=timeout, backfill=(from_slot, to_slot), fenced=fenced))


COMMANDS = (run, backfill)
