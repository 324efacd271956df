"""Changing jobs and their log: `register`, `pause`, `resume`, `purge`, `reap`, and the operator's
`unregister`, `release` (a stuck lease) and `cancel` (a running run)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import click

from ledger import render
from ledger.cli._options import DURATION, Duration, connect, dsn_option, json_option
from ledger.cli._output import plural, registered_pool
from ledger.client import Ledger
from ledger.durations import format_duration
from ledger.errors import JobNotFound


BOUND = Duration(positive=False)
#: register_job's overlap policies (ledger._check_overlap_policy): click refuses another word.
OVERLAP_POLICIES = ("catch_up", "skip", "buffer_one", "replace")


@click.command()
@click.argument("job")
@click.option("--schedule", default=None, metavar="SCHEDULE",
              help="An interval ('45 minutes') or a cron expression ('*/15 * * * *', '@daily'); "
                   "none: runs are not scheduled.")
@click.option("--ttl", type=DURATION, default=None, help="The default lease ttl of its runs (80m, 2h, ...).")
@click.option("--max-backfill", type=click.IntRange(min=1), default=None,
              help="After a downtime, run at most this many of the missed slots (the newest); first default 1.")
@click.option("--tz", "time_zone", default=None, help="Time zone of the schedule; first default UTC.")
@click.option("--late-after", type=BOUND, default=None,
              help="A due slot not started within this is late (default: the ttl, at least 1m); 0 clears.")
@click.option("--down-after", type=BOUND, default=None,
              help="No success for longer than this is down (3 missed slots are too); 0 clears.")
@click.option("--min-runtime", type=BOUND, default=None,
              help="A success shorter than this raises a too_fast alert; 0 clears.")
@click.option("--max-runtime", type=BOUND, default=None,
              help="A run longer than this is overrun, and `jobledger run` stops CMD there; 0 clears.")
@click.option("--pause-after-failures", type=click.IntRange(min=0), default=None, metavar="N",
              help="The end of the Nth failure in a row pauses the job; 0 clears.")
@click.option("--jitter", type=BOUND, default=None,
              help="Each slot starts at an offset in [0, JITTER), the same on every host; "
                   "under the schedule's interval; 0 clears.")
@click.option("--start-deadline", type=BOUND, default=None,
              help="A slot not started within this after its due time is skipped, never run late; 0 clears.")
@click.option("--overlap-policy", type=click.Choice(OVERLAP_POLICIES), default=None,
              help="A slot due while a run is live: catch_up (runs after it; first default), skip, "
                   "buffer_one (the newest runs after it) or replace (the live run is superseded).")
@click.option("--pool", default=None, metavar="NAME",
              help="Put JOB in the registered pool NAME (`jobledger pool register`): its starts share the "
                   "pool's limit; '' takes it out of its pool.")
@click.option("--no-pool", is_flag=True, help="Take JOB out of its pool (as --pool '').")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=None, metavar="N",
              help="Up to N live runs at once, each in its own seat with its own token; first default 1 "
                   "(replace and buffer_one need 1).")
@json_option
@dsn_option
def register(job: str, schedule: str | None, ttl: timedelta | None, max_backfill: int | None,
             time_zone: str | None, late_after: timedelta | None, down_after: timedelta | None,
             min_runtime: timedelta | None, max_runtime: timedelta | None, pause_after_failures: int | None,
             jitter: timedelta | None, start_deadline: timedelta | None, overlap_policy: str | None,
             pool: str | None, no_pool: bool, max_concurrent: int | None, as_json: bool, dsn: str) -> None:
    """Register JOB, or change the options given of a registered JOB (the others stay as they are)."""
    if no_pool:
        if pool:
            raise click.UsageError("--no-pool takes JOB out of its pool: give it without --pool NAME")
        pool = ""
    with connect(dsn) as conn, registered_pool(pool or ""):
        registered = Ledger(conn).register_job(
            job, schedule=schedule, ttl=ttl, max_backfill=max_backfill, time_zone=time_zone,
            late_after=late_after, down_after=down_after, min_runtime=min_runtime, max_runtime=max_runtime,
            pause_after_failures=pause_after_failures, jitter=jitter, start_deadline=start_deadline,
            overlap_policy=overlap_policy, pool=pool, max_concurrent=max_concurrent)
    if as_json:
        click.echo(render.to_json(registered))
        return
    what = f"schedule {registered.schedule!r} ({registered.time_zone})" if registered.schedule else "no schedule"
    ttl_text = format_duration(registered.ttl) if registered.ttl is not None else "none (give --ttl to run)"
    bounds = [f"{name} {format_duration(value)}" for name, value in (
        ("late after", registered.late_after), ("down after", registered.down_after),
        ("min runtime", registered.min_runtime), ("max runtime", registered.max_runtime)) if value is not None]
    if registered.pause_after_failures is not None:
        bounds.append(f"pause after {registered.pause_after_failures} failures")
    bounds += [f"{name} {format_duration(value)}" for name, value in (
        ("jitter", registered.jitter), ("start deadline", registered.start_deadline)) if value is not None]
    if registered.overlap_policy != "catch_up":
        bounds.append(f"overlap policy {registered.overlap_policy}")
    if registered.pool is not None:
        bounds.append(f"pool {registered.pool}")
    if registered.max_concurrent != 1:
        bounds.append(f"max concurrent {registered.max_concurrent}")
    click.echo(f"registered {registered.job}: {what}, ttl {ttl_text}, max backfill {registered.max_backfill}"
               + "".join(f", {b}" for b in bounds)
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


def _set_paused(job: str, dsn: str, paused: bool) -> bool:
    """Pause or resume JOB: whether that changed it."""
    with connect(dsn) as conn, _registered(job):
        ledger = Ledger(conn)
        return ledger.pause_job(job) if paused else ledger.resume_job(job)


@click.command()
@click.argument("job")
@dsn_option
def pause(job: str, dsn: str) -> None:
    """Pause JOB: its runs answer `paused` (the wrapper exits 0 without running CMD)."""
    click.echo(f"paused {job}" if _set_paused(job, dsn, True) else f"{job} was already paused")


@click.command()
@click.argument("job")
@dsn_option
def resume(job: str, dsn: str) -> None:
    """Resume JOB after a pause."""
    click.echo(f"resumed {job}" if _set_paused(job, dsn, False) else f"{job} was not paused")


@click.command()
@click.option("--older-than", type=DURATION, required=True,
              help="Delete ended runs older than this (90d, '3 weeks', ...); a job's newest success stays.")
@click.option("--one-transaction", is_flag=True,
              help="All or nothing, in one transaction (`ledger.purge_log`): the ends of the runs of the jobs it "
                   "touched wait for it. Default: a commit after every batch of 10,000 run ids.")
@dsn_option
def purge(older_than: timedelta, one_transaction: bool, dsn: str) -> None:
    """Delete old ended runs from the log, a job's newest success kept, committing after every batch of
    10,000 run ids (`ledger.purge_log_batch`), so no lock is held longer than one batch."""
    with connect(dsn) as conn:
        ledger = Ledger(conn)
        deleted = ledger.purge_log(older_than) if one_transaction else ledger.purge_log_in_batches(older_than)
    click.echo(f"purged {plural(deleted, 'run')} older than {format_duration(older_than)}")


@click.command()
@click.argument("job", required=False)
@dsn_option
def reap(job: str | None, dsn: str) -> None:
    """Close runs whose lease expired (crashed runners) as failed: `ledger.reap_expired`."""
    with connect(dsn) as conn:
        reaped = Ledger(conn).reap_expired(job)
    click.echo(f"reaped {plural(reaped, 'run')}" + (f" of {job}" if job else ""))


@click.command()
@click.argument("job")
@click.option("--with-history", is_flag=True,
              help="Delete its runs, counters and purge marks too (its slots and keys may run again).")
@dsn_option
def unregister(job: str, with_history: bool, dsn: str) -> None:
    """Remove JOB's registration (`ledger.unregister_job`): schedule, bounds, pause. Its runs stay
    unless --with-history; its token mark always stays. Refused while a run of JOB is live."""
    with connect(dsn) as conn, _registered(job):
        Ledger(conn).unregister_job(job, with_history=with_history)
    click.echo(f"unregistered {job}" + (" and deleted its history" if with_history else " (its runs stay)"))


@click.command()
@click.argument("job")
@dsn_option
def release(job: str, dsn: str) -> None:
    """Force-release JOB's lease, whoever holds it (`ledger.force_release`): a new token supersedes
    the holder's, so its heartbeat, fenced writes and end are refused, and its running run is
    closed as failure (superseded)."""
    with connect(dsn) as conn, _registered(job):
        token = Ledger(conn).force_release(job)
    click.echo(f"{job} has no lease" if token is None
               else f"released {job}: token {token} supersedes the holder's; the job is free")


@click.command()
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@dsn_option
def cancel(run_id: int, dsn: str) -> None:
    """Ask running run RUN to stop (`ledger.request_cancel`): its holder's next heartbeat ends it as
    cancelled; `jobledger run` then stops CMD (SIGTERM), the Python client marks the run lost."""
    with connect(dsn) as conn:
        asked = Ledger(conn).request_cancel(run_id)
    click.echo(f"asked run {run_id} to stop: its holder's next heartbeat ends it as cancelled" if asked
               else f"run {run_id} was asked to stop already")


COMMANDS = (register, pause, resume, purge, reap, unregister, release, cancel)
