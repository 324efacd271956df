"""Looking: `status` (the jobs at a glance, the live alerts and schedulers; `--watch` redraws it),
`schedulers` (the schedulers' registry) and `runs` (a job's recent runs)."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

import click
import psycopg
from rich import box
from rich.table import Table

from ledger import lookups, render
from ledger.cli._options import DURATION, connect, dsn_option, json_option
from ledger.cli._output import database_now, unknown_jobs
from ledger.client import Ledger
from ledger.durations import format_duration

MIN_INTERVAL = timedelta(milliseconds=100)  # --watch never polls the database faster than this


@click.command()
@click.argument("jobs", nargs=-1, metavar="[JOB]...")
@click.option("--watch", is_flag=True,
              help="Redraw every --interval until Ctrl-C (with --json: one JSON object a line).")
@click.option("--interval", type=DURATION, default=None, help="With --watch: how often.  [default: 2s]")
@json_option
@dsn_option
def status(jobs: tuple[str, ...], watch: bool, interval: timedelta | None, as_json: bool, dsn: str) -> None:
    """The state at a glance: the `ledger.job_status` view, jobs with alerts in red,
    then the live alerts (`ledger.alerts`), the protected tables (`jobledger protect`),
    the pools (`jobledger pools`) and the live schedulers (`jobledger schedulers`).
    `--watch` redraws it until Ctrl-C."""
    if interval is not None and not watch:
        raise click.UsageError("--interval goes with --watch")
    every = interval if interval is not None else timedelta(seconds=2)
    if every < MIN_INTERVAL:
        raise click.BadParameter(f"at least {format_duration(MIN_INTERVAL)}", param_hint="--interval")
    with connect(dsn) as conn:
        if not watch:
            _show(conn, jobs, as_json)
            return
        out = render.console()
        try:
            while True:
                if not as_json:
                    out.clear()
                    out.print(f"[bold]jobledger status[/bold], every {format_duration(every)} "
                              f"({render.timestamp(database_now(conn))}; Ctrl-C to stop)")
                _show(conn, jobs, as_json, frame=True)
                sys.stdout.flush()
                time.sleep(every.total_seconds())
        except KeyboardInterrupt:
            # Ctrl-C: the way a watch ends. It may land in the middle of a query, which
            # leaves the connection busy: close it as it is (no further command on it).
            conn.close()
            return


def _show(conn: psycopg.Connection[Any], jobs: tuple[str, ...], as_json: bool, frame: bool = False) -> None:
    """One status: the table and the alerts, or the JSON (one line when ``frame``: a watch's stream)."""
    ledger = Ledger(conn)
    statuses = [render.with_counters(row) for row in ledger.job_statuses()]
    pools = ledger.pool_statuses()
    alerts = lookups.alerts(conn)
    protected = lookups.protected_tables(conn)
    schedulers = lookups.schedulers(conn)  # the live ones: `jobledger schedulers` lists the expired too
    now = database_now(conn)
    if jobs:
        known = {row.job for row in statuses}
        unknown = [job for job in dict.fromkeys(jobs) if job not in known]
        if unknown:
            raise unknown_jobs(unknown)
        statuses = [row for row in statuses if row.job in jobs]
        alerts = [row for row in alerts if row["job"] in jobs]
        protected = [row for row in protected if row["job"] in jobs]
        schedulers = [row for row in schedulers if set(row["jobs"]) & set(jobs)]
        pools = [row for row in pools if row.pool in {status.pool for status in statuses}]
    if as_json:
        document = {"jobs": statuses, "alerts": alerts, "protected_tables": protected, "schedulers": schedulers,
                    "pools": pools}
        click.echo(render.json_line(document) if frame else render.to_json(document))
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
    for row in protected:  # `jobledger protect`: a write must carry the job's live token
        line = f"protected table {row['table_name']}: job {row['job']} ({row['mode']})"
        out.print(render.cell(line) if row["enabled"]
                  else render.cell(f"{line}: its trigger is disabled, writes are not checked", style="bold red"))
    if pools:  # `jobledger pool register`: none, nothing printed
        out.print(render.pools_table(pools, now))
    if schedulers:  # none (no `jobledger scheduler` runs): nothing printed
        out.print(render.schedulers_table(schedulers, now, title="live schedulers (ledger.schedulers)"))


@click.command()
@click.option("--all", "expired", is_flag=True,
              help="Every row, the expired ones too (a scheduler that died).  [default: the live ones]")
@json_option
@dsn_option
def schedulers(expired: bool, as_json: bool, dsn: str) -> None:
    """The schedulers (`jobledger scheduler`, `ledger.serve`) that heartbeat into
    `ledger.schedulers`: host, pid, version, jobs served, heartbeat; live, stopping
    (SIGTERM) or expired (its heartbeat stopped: it died), and which one runs the
    upkeep (the leader). `--all` lists the expired ones too; a graceful stop
    removes its row."""
    with connect(dsn) as conn:
        rows = lookups.schedulers(conn, expired=expired)
        now = database_now(conn)
    if as_json:
        click.echo(render.to_json(rows))
        return
    if not rows:
        click.echo("no schedulers" if expired else
                   "no live scheduler (`jobledger schedulers --all` lists the expired ones too)")
        return
    render.console().print(render.schedulers_table(rows, now))


@click.command()
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
        now = database_now(conn)
    if as_json:
        click.echo(render.to_json(rows))
        return
    if not rows:
        click.echo(f"no runs of {job}")
        return
    out = render.console()
    out.print(render.fitted(out, lambda wide: render.runs_table(rows, now, title=f"runs of {job}", wide=wide)))


@click.command()
@click.argument("jobs", nargs=-1, metavar="[JOB]...")
@json_option
@dsn_option
def health(jobs: tuple[str, ...], as_json: bool, dsn: str) -> None:
    """Each job's state (`ledger.job_health`): crashed, overrun, paused, running, down,
    late, failing, never_run or ok, since when and why. Exit code 1 when a job listed
    is in a state that raises an alert (`ledger.alerts`: crashed, overrun, down, late,
    failing, paused after failures), so a shell or a probe can test it."""
    with connect(dsn) as conn:
        rows = lookups.job_health(conn)
        alerts = lookups.alerts(conn)
        now = database_now(conn)
    if jobs:
        unknown = [job for job in dict.fromkeys(jobs) if job not in {row["job"] for row in rows}]
        if unknown:
            raise unknown_jobs(unknown)
        rows = [row for row in rows if row["job"] in jobs]
    if as_json:
        click.echo(render.to_json(rows))
    elif not rows:
        click.echo("no jobs yet: `jobledger register` one")
    else:
        out = render.console()
        table = Table(box=box.SIMPLE_HEAVY, title="ledger.job_health", title_justify="left", title_style="bold")
        for name in ("job", "state", "since", "missed", "fails", "last success", "why"):
            table.add_column(name)
        for row in rows:
            missed = "-" if row["missed_slots"] is None else (
                f"{'>=' if row['missed_slots_capped'] else ''}{row['missed_slots']}")
            table.add_row(render.cell(row["job"]), render.state_text(row["state"]),
                          render.relative(row["since"], now) if row["since"] is not None else "-", missed,
                          str(row["consecutive_failures"] or 0),
                          render.relative(row["last_success_at"], now) if row["last_success_at"] else "never",
                          render.cell(row["reason"]))
        out.print(table)
    # the ledger says which states are trouble: those its alerts raise
    trouble = {(alert["job"], alert["alert"]) for alert in alerts}
    if any((row["job"], row["state"]) in trouble for row in rows):
        sys.exit(1)


@click.command("verify-state")
@json_option
@dsn_option
def verify_state(as_json: bool, dsn: str) -> None:
    """The audit of the jobs' state (`ledger.verify_state`): every job's state recomputed
    from the log, the schedule and the leases, against its stored row. Lists the jobs
    that differ, with the columns that do; none when the ledger holds. Exit code 1 when
    one differs. It reads the whole log."""
    with connect(dsn) as conn:
        rows = lookups.verify_state(conn)
    if as_json:
        click.echo(render.to_json(rows))
    elif not rows:
        click.echo("every job's stored state is the log's (ledger.verify_state is empty)")
    else:
        out = render.console()
        table = Table(box=box.SIMPLE_HEAVY, title="ledger.verify_state", title_justify="left",
                      title_style="bold red")
        for name in ("job", "state", "column", "stored", "expected"):
            table.add_column(name)
        for row in rows:
            for column, found in sorted((row["differences"] or {}).items()):
                table.add_row(render.cell(row["job"]), render.state_text(row["state"]), render.cell(column),
                              render.cell(render.dumps(found.get("stored"))),
                              render.cell(render.dumps(found.get("expected"))))
        out.print(table)
    if rows:
        sys.exit(1)


COMMANDS = (status, schedulers, runs, health, verify_state)
