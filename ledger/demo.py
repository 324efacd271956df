"""``jobledger demo``: the ledger's promises, acted out in about ten seconds.

One scheduled job, ``publish`` (every 45 minutes, played 2250 times faster: a
slot every 1.2 s, a lease ttl of 0.9 s), and four workers that are threads of
this process with their own connections and owner names. The acts:

1. three workers start the same slot at once: one runs, the others are told no;
2. a worker freezes past its ttl; the next one takes over with a higher token,
   and the frozen worker's late publish is rejected by the fence;
3. a worker crashes mid-run and the job is down for three slots: the reaper
   closes the crashed run, and the catch-up (``max_backfill = 1``) runs only
   the newest slot, recording the dropped ones;
4. another job fails three times in a row (an alert);

then the status and alerts tables, and the overlap audit. The last line is
``audit: ledger.overlaps has N rows`` (0, or the demo exits 1).

It never writes into a database it did not create unless asked. By default
it runs on the embedded server, in a fresh database each time
(``jobledger_demo``); with the PG* variables set, in a scratch database it
creates on that server (``jobledger_demo_<random>``, the ledger installed)
and drops at the end, uninstalling first so that no ledger role it created
outlives it. ``LEDGER_DSN`` is not used. On a database of yours (``--dsn``,
confirmed with ``--yes-write-here``) it uses job names with a random suffix
and leaves its rows there.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ledger import embedded, lookups, queries, render
from ledger.client import Ledger, fence
from ledger.durations import format_duration
from ledger.errors import LedgerError
from ledger.models import Run, RunStart

DEMO_DATABASE = embedded.DEMO_DATABASE
REAL_PERIOD = timedelta(minutes=45)
PERIOD = 1.2  # seconds per slot at speed 1
TTL = 0.9
WORK = 0.25
DOWNTIME_SLOTS = 3


def main(dsn: str | None, *, speed: float = 1.0, out: Console | None = None) -> int:
    """Run the demo on ``dsn`` (a database of yours: the caller asked), else on a database of its own:
    a scratch database on the PG* variables' server, else a fresh embedded one; the exit code."""
    out = out or render.console()
    if dsn is None and embedded.pg_variables_set():
        with scratch_database(out) as (scratch, name, server):
            where = f"a scratch database [bold]{name}[/bold] on {server} (PG* variables; dropped at the end)"
            return Demo(scratch, out, speed=speed, suffix="", where=where).run()
    if dsn is None:
        data_dir = embedded.home() / "pgdata"
        with out.status("starting the embedded PostgreSQL…"):
            server_dsn = embedded.embedded_dsn(data_dir)
            embedded.ensure_database(server_dsn, DEMO_DATABASE, fresh=True)
            dsn = embedded.with_database(server_dsn, DEMO_DATABASE)
            embedded.ensure_installed(dsn)
        where = f"a fresh database [bold]{DEMO_DATABASE}[/bold] on the embedded PostgreSQL ({data_dir})"
        suffix = ""
    else:
        dsn = dsn or ""
        with psycopg.connect(dsn) as conn:  # a database of yours: never installed behind your back
            row = conn.execute(queries.LEDGER_INSTALLED).fetchone()
        if not row or row[0] is None:
            shown = embedded.mask_password(dsn) or "the PG* variables' database"
            out.print(f"the ledger is not installed in {shown} (or is too old): run `jobledger install --dsn ...` "
                      "there first", highlight=False)
            return 1
        where = f"[bold]{embedded.mask_password(dsn) or 'the PG* variables'}[/bold] (job names with a random suffix)"
        suffix = "-" + secrets.token_hex(3)
    return Demo(dsn, out, speed=speed, suffix=suffix, where=where).run()


def _maintenance_dsn() -> str:
    """Where to say CREATE/DROP DATABASE on the PG* variables' server: PGDATABASE, else ``postgres``."""
    return "" if os.environ.get("PGDATABASE") else make_conninfo("", dbname="postgres")


@contextmanager
def scratch_database(out: Console) -> Iterator[tuple[str, str, str]]:
    """A new database on the PG* variables' server with the ledger installed: its DSN, name and server.

    Dropped on the way out, whatever happened; before that the ledger is
    uninstalled, which drops the ledger roles unless another database uses them.
    """
    from ledger import migrate  # alembic: only for the scratch database

    name = f"{DEMO_DATABASE}_{secrets.token_hex(4)}"
    maintenance = _maintenance_dsn()
    with psycopg.connect(maintenance, autocommit=True) as conn:
        conn.execute(sql.SQL(queries.CREATE_DATABASE).format(sql.Identifier(name)))
        server = f"{conn.info.host}:{conn.info.port}"
    dsn = make_conninfo("", dbname=name)
    try:
        with out.status(f"installing the ledger in the scratch database {name}…"):
            embedded.ensure_installed(dsn)
        yield dsn, name, server
    finally:
        try:
            migrate.downgrade(dsn, "base")
        finally:
            with psycopg.connect(maintenance, autocommit=True) as conn:
                conn.execute(sql.SQL(queries.DROP_DATABASE).format(sql.Identifier(name)))


@dataclass
class Worker:
    """One worker: its own connection and owner name, the client's SQL calls."""

    name: str
    conn: psycopg.Connection[Any]

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.conn, owner=self.name)

    def start(self, job: str) -> RunStart:
        return self.ledger.start_due_run(job)

    def publish(self, job: str, resource: str, token: int) -> int:
        """The fenced write: the job-aware fence (it checks the lease too) in the write's transaction."""
        with self.conn.transaction():
            return fence(self.conn, job, resource, token)

    def complete(self, run_id: int, token: int) -> Run:
        return self.ledger.complete_run(run_id, token)


class Demo:
    def __init__(self, dsn: str, out: Console, *, speed: float, suffix: str, where: str) -> None:
        self.dsn = dsn
        self.out = out
        self.speed = speed
        self.where = where
        self.job = f"publish{suffix}"
        self.other_job = f"nightly-report{suffix}"
        self.feed = f"{self.job}:feed"
        self.period = PERIOD / speed
        self.ttl = TTL / speed
        self.work = WORK / speed
        self.problems: list[str] = []
        # ledger.connect: the ledger's connection settings (nothing prepared: works behind PgBouncer).
        from ledger.connect import connect as open_connection

        self.conn = open_connection(dsn, application_name="jobledger-demo")
        self.ledger = Ledger(self.conn, owner="demo")
        self.workers = [Worker(f"worker-{n}", open_connection(dsn, application_name=f"jobledger-demo:worker-{n}"))
                        for n in (1, 2, 3)]

    # -- helpers ----------------------------------------------------------------------

    def say(self, text: str, style: str = "") -> None:
        self.out.print(text, style=style, highlight=False)

    def expect(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)
            self.say(f"   [bold red]unexpected:[/bold red] {problem}")

    def db_now(self) -> datetime:
        row = self.conn.execute(queries.DATABASE_NOW).fetchone()
        assert row is not None
        value: datetime = row[0]
        return value

    def clock(self, moment: datetime | None) -> str:
        return "?" if moment is None else moment.astimezone().strftime("%H:%M:%S.%f")[:-5]

    def wait_until(self, moment: datetime, label: str) -> None:
        """Sleep until ``moment`` on the database's clock, with a progress bar."""
        seconds = (moment - self.db_now()).total_seconds() + 0.03
        if seconds <= 0:
            return
        if not self.out.is_terminal:  # a log, not a screen: one line instead of a redrawn bar
            self.say(f"   [cyan]⏳ {label}: {seconds:.1f}s[/cyan]")
            time.sleep(seconds)
            return
        columns = (TextColumn("   [cyan]{task.description}"), BarColumn(bar_width=30),
                   TimeRemainingColumn(elapsed_when_finished=True))
        with Progress(*columns, console=self.out, transient=True) as progress:
            task = progress.add_task(label, total=seconds)
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < seconds:
                progress.update(task, completed=elapsed)
                time.sleep(min(0.05, seconds - elapsed))
            progress.update(task, completed=seconds)

    def wait_for_next_slot(self, label: str = "waiting for the next slot") -> None:
        status = self.ledger.job_status(self.job)
        assert status is not None and status.next_slot is not None
        self.wait_until(status.next_slot, label)

    def started_line(self, worker: Worker, start: RunStart) -> None:
        self.say(f"   [green]✓[/green] {worker.name} starts slot {self.clock(start.slot)} "
                 f"with fencing token [bold]{start.token}[/bold] (run {start.run_id})")

    def publish(self, worker: Worker, start: RunStart) -> None:
        assert start.token is not None and start.run_id is not None
        accepted = worker.publish(self.job, self.feed, start.token)
        self.say(f"   [green]✓[/green] {worker.name} publishes slot {self.clock(start.slot)}: "
                 f"fence {self.feed!r} accepts token {accepted}")
        time.sleep(self.work)
        worker.complete(start.run_id, start.token)
        self.say(f"   [green]✓[/green] {worker.name} completes run {start.run_id}")

    # -- the acts -----------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.intro()
            self.contention()
            self.freeze()
            self.crash_and_catch_up()
            self.failing_job()
            return self.finale()
        finally:
            for worker in self.workers:
                worker.conn.close()
            self.conn.close()

    def intro(self) -> None:
        scale = REAL_PERIOD.total_seconds() / self.period
        self.out.print(Panel.fit(
            Text.from_markup(
                f"[bold]jobledger demo[/bold]: a job ledger in ten seconds, on {self.where}\n"
                f"Job [bold]{self.job}[/bold] runs every 45 minutes; played {scale:,.0f}× faster: "
                f"a slot every {format_duration(timedelta(seconds=self.period))}, "
                f"a lease ttl of {format_duration(timedelta(seconds=self.ttl))}, max_backfill 1."),
            border_style="blue"))
        self.ledger.register_job(self.job, schedule=f"{self.period:g} seconds",
                                 ttl=timedelta(seconds=self.ttl), max_backfill=1)
        self.say(f"[dim]SELECT ledger.register_job('{self.job}', schedule => '{self.period:g} seconds', "
                 f"ttl => '{self.ttl:g} seconds', max_backfill => 1);[/dim]")

    def contention(self) -> None:
        self.out.rule("[bold]1 · Three workers, one slot")
        self.say("   Three hosts' cron fire at the same instant; each calls ledger.start_due_run.")
        barrier = threading.Barrier(len(self.workers))
        outcomes: dict[str, RunStart | BaseException] = {}

        def attempt(worker: Worker) -> None:
            barrier.wait()
            try:
                outcomes[worker.name] = worker.start(self.job)
            except BaseException as error:  # shown below; a demo never hangs on a thread
                outcomes[worker.name] = error

        threads = [threading.Thread(target=attempt, args=(worker,)) for worker in self.workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        table = Table(box=None, padding=(0, 2), show_header=True, header_style="dim")
        for column in ("worker", "outcome", "slot", "token"):
            table.add_column(column)
        winners: list[tuple[Worker, RunStart]] = []
        for worker in self.workers:
            result = outcomes[worker.name]
            if isinstance(result, BaseException):
                table.add_row(worker.name, Text(f"error: {result}", style="red"), "", "")
                continue
            if result.started:
                winners.append((worker, result))
            style = "green" if result.started else "yellow"
            table.add_row(worker.name, Text(result.outcome, style=style), self.clock(result.slot),
                          "-" if result.token is None else str(result.token))
        self.out.print(table)
        self.expect(len(winners) == 1, f"{len(winners)} workers started the slot, not exactly one")
        told = sorted({result.outcome for result in outcomes.values()
                       if isinstance(result, RunStart) and not result.started})
        meaning = {"already_done": "that slot is taken", "skipped_overlap": "another owner holds the job",
                   "nothing_due": "no slot left to run"}
        reasons = "; ".join(f"{outcome}: {meaning.get(outcome, outcome)}" for outcome in told)
        self.say(f"   One wins; the others are told no ({reasons}) and do nothing. Not a failure.")
        if winners:
            self.publish(*winners[0])

    def freeze(self) -> None:
        self.out.rule("[bold]2 · A worker freezes past its ttl")
        frozen, rescuer = self.workers[0], self.workers[1]
        self.wait_for_next_slot()
        start = frozen.start(self.job)
        self.expect(start.started, f"{frozen.name} could not start the slot: {start.outcome}")
        if not start.started:
            return
        assert start.expires_at is not None and start.slot is not None
        self.started_line(frozen, start)
        self.say(f"   [yellow]❄[/yellow] {frozen.name} freezes (a GC pause, a stopped VM): "
                 "no heartbeat, its lease runs out")
        takeover_at = max(start.expires_at, start.slot + timedelta(seconds=self.period))
        self.wait_until(takeover_at, f"{frozen.name} frozen")
        rescue = rescuer.start(self.job)
        self.expect(rescue.started, f"{rescuer.name} could not take over: {rescue.outcome}")
        if not rescue.started:
            return
        self.say(f"   [green]✓[/green] {rescuer.name} finds the lease expired: the ledger closes run "
                 f"{start.run_id} as lease_expired and issues token [bold]{rescue.token}[/bold] "
                 f"for slot {self.clock(rescue.slot)}")
        self.publish(rescuer, rescue)
        self.say(f"   [yellow]…[/yellow] {frozen.name} wakes up and publishes with its old token {start.token}:")
        assert start.token is not None and start.run_id is not None
        try:
            frozen.publish(self.job, self.feed, start.token)
            self.expect(False, "the fence accepted the frozen worker's late write")
        except LedgerError as error:
            self.say(f"   [bold red]✗ rejected by the fence[/bold red] ({error.sqlstate}): {error.message}")
        try:
            frozen.complete(start.run_id, start.token)
            self.expect(False, "the ledger let the frozen worker complete its run")
        except LedgerError as error:
            self.say(f"   [bold red]✗ complete_run refused[/bold red] ({error.sqlstate}): {error.message}")
        run = self.ledger.get_run(start.run_id)
        if run is not None:
            self.say(f"   The log keeps the takeover's verdict: run {run.run_id} is "
                     f"{run.status} ({run.failure_reason}).")

    def crash_and_catch_up(self) -> None:
        self.out.rule("[bold]3 · A crash, a downtime, a bounded catch-up")
        crasher, survivor = self.workers[2], self.workers[0]
        self.wait_for_next_slot()
        start = crasher.start(self.job)
        self.expect(start.started, f"{crasher.name} could not start: {start.outcome}")
        if not start.started:
            return
        assert start.expires_at is not None and start.slot is not None
        self.started_line(crasher, start)
        self.say(f"   [red]☠[/red] {crasher.name} is killed (kill -9): no heartbeat, no end; "
                 f"nobody runs {self.job} for {DOWNTIME_SLOTS} slots")
        self.wait_until(start.expires_at, "downtime: the crashed lease runs out")
        reaped = self.ledger.reap_expired(self.job)
        self.say(f"   [green]✓[/green] the reaper (jobledger reap, or pg_cron every minute) closes "
                 f"{reaped} run as lease_expired")
        self.expect(reaped == 1, f"reap_expired closed {reaped} runs, not 1")
        back_at = start.slot + timedelta(seconds=self.period * DOWNTIME_SLOTS)
        self.wait_until(back_at, "downtime")
        due = self.ledger.due_slots(self.job)
        self.say(f"   {survivor.name} is back. Due now, with max_backfill 1: "
                 f"{', '.join(self.clock(slot) for slot in due) or 'nothing'} (the newest slot only)")
        ran = 0
        while True:  # the catch-up loop every runner does: until the ledger says anything but started
            catch_up = survivor.start(self.job)
            if not catch_up.started:
                self.say(f"   start_due_run: [yellow]{catch_up.outcome}[/yellow]: caught up after {ran} run")
                break
            ran += 1
            self.started_line(survivor, catch_up)
            self.publish(survivor, catch_up)
        self.expect(ran >= 1, "the catch-up ran nothing")
        dropped = lookups.skipped_slots(self.conn, self.job)
        self.say("   The slots the bound dropped (the frozen and the crashed runs' slots, and the downtime's) "
                 "are recorded as ranges, one row per drop, never run late:")
        self.out.print(render.skipped_slots_table(dropped, title=None))
        self.expect(bool(dropped), "no dropped slots were recorded")

    def failing_job(self) -> None:
        self.out.rule("[bold]4 · Meanwhile, another job keeps failing")
        for attempt in range(1, 4):
            start = self.ledger.start_run(self.other_job, ttl=timedelta(minutes=5))
            assert start.run_id is not None and start.token is not None
            self.ledger.fail_run(start.run_id, start.token, f"exit code 1: smtp.example: connection refused "
                                                            f"(attempt {attempt})")
        self.say(f"   {self.other_job} failed 3 times in a row: ledger.alerts will say so.")

    def finale(self) -> int:
        jobs = [self.job, self.other_job]
        self.out.rule("[bold]The state at a glance: jobledger status")
        statuses = [row for row in self.ledger.job_statuses() if row.job in jobs]
        alerts = [row for row in lookups.alerts(self.conn) if row["job"] in jobs]
        now = self.db_now()
        self.out.print(render.fitted(self.out, lambda wide: render.status_table(statuses, alerts, now, wide=wide)))
        if alerts:
            self.out.print(render.alerts_table(alerts, now))
        overlaps = lookups.overlaps(self.conn, jobs)
        self.out.rule("[bold]The audit: SELECT * FROM ledger.overlaps")
        self.say("   Pairs of runs of one job whose time spans overlap: the proof that no two ran at once.")
        if overlaps:
            table = Table(box=None)
            for column in ("job", "run_id", "other_run_id"):
                table.add_column(column)
            for row in overlaps:
                table.add_row(str(row["job"]), str(row["run_id"]), str(row["other_run_id"]))
            self.out.print(table)
        for problem in self.problems:
            self.say(f"[bold red]problem:[/bold red] {problem}")
        verdict = "green" if not overlaps and not self.problems else "bold red"
        self.say(f"audit: ledger.overlaps has {len(overlaps)} rows", style=verdict)
        return 0 if not overlaps and not self.problems else 1

