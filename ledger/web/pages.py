"""What each page shows, read in one transaction: plain data, the HTML's and the JSON's.

A page function takes the cursor of :meth:`ledger.web.reads.Reader.transaction`
and the request's choices (filters, window), and returns a frozen dataclass;
the templates draw it, the JSON endpoints return it through
:func:`ledger.web.jsonable.jsonable`. Every read is bounded (see the limits
below), so a page costs the same on a ledger of ten runs or of a million.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from ledger.models import JobStatus, PoolStatus, Run
from ledger.web import reads
from ledger.web.commands import Command, job_commands
from ledger.web.reads import (Alert, Failure, FenceWrite, LeaseNow, Neighbours, RunBar, Scheduler, SeatNow, SkippedRange, Slot,
                              TtlAdvice)
from ledger.web.schedules import in_words
from ledger.states import STATES

#: Jobs per page of the jobs page.
PAGE_SIZE = 100
#: Jobs listed per scheduler on the schedulers page (its job count counts them all).
SCHEDULER_JOBS = 50
#: Runs in a job's sparkline (the jobs page) and its success rate.
SPARK_RUNS = 20
#: The job page's windows, by the name its link uses.
WINDOWS: dict[str, timedelta] = {"1h": timedelta(hours=1), "6h": timedelta(hours=6), "24h": timedelta(days=1),
                                 "7d": timedelta(days=7), "30d": timedelta(days=30)}
DEFAULT_WINDOW = "24h"
#: Runs the timeline and the duration chart draw at most (the newest of the window).
WINDOW_RUNS = 1000
#: Slots the timeline marks one by one at most; more are counted, not drawn.
SLOT_MARKS = 150
UPCOMING_SLOTS = 10
RECENT_FAILURES = 10
SKIPPED_RANGES = 100


class UnknownJob(LookupError):
    """No job of that name: the page answers 404."""


class UnknownRun(LookupError):
    """No run of that id: the page answers 404."""


@dataclass(frozen=True)
class JobRow:
    """A row of the jobs page."""

    job: str
    state: str                    # the ledger's word (ledger.job_status.state)
    paused: bool
    schedule: str | None
    schedule_words: str
    time_zone: str | None
    last_run: RunBar | None
    next_slot: datetime | None
    runs: list[RunBar]            # the sparkline's, oldest first
    success_rate: float | None    # over those of them that ended
    status: JobStatus


@dataclass(frozen=True)
class JobsPage:
    now: datetime
    name: str | None
    state: str | None
    counts: dict[str, int]        # per state, over the jobs the name filter keeps
    total: int                    # jobs both filters keep
    page: int
    pages: int
    jobs: list[JobRow]


@dataclass(frozen=True)
class JobPage:
    now: datetime
    job: str
    state: str                    # the ledger's word (ledger.job_health.state)
    state_since: datetime | None  # when the state began
    reason: str | None            # why, in the ledger's words
    status: JobStatus
    schedule_words: str
    window: str
    since: datetime
    until: datetime
    runs: list[RunBar]            # the window's, oldest first
    runs_truncated: bool          # the window holds more than WINDOW_RUNS runs: the newest are drawn
    skipped: list[SkippedRange]
    slot_count: int | None        # slots in the window (None: no schedule)
    slot_marks: list[datetime]    # drawn when slot_count <= SLOT_MARKS
    upcoming: list[Slot]
    failures: list[Failure]
    advice: TtlAdvice | None
    commands: list[Command]
    #: seats mode (``max_concurrent`` > 1): up to that many live runs, each in a seat with its token
    max_concurrent: int = 1
    seats: list[SeatNow] = field(default_factory=list)

    @property
    def live_seats(self) -> list[SeatNow]:
        return [seat for seat in self.seats if seat.live]


@dataclass(frozen=True)
class RunPage:
    now: datetime
    run: Run
    duration: timedelta
    outcome: str
    lease: LeaseNow | None
    token_is_current: bool        # the job's live lease (or, in seats mode, a live seat) carries this run's token
    fences: list[FenceWrite]
    neighbours: Neighbours
    seat: SeatNow | None = None   # seats mode: the live seat that carries this run's token


@dataclass(frozen=True)
class AlertsPage:
    now: datetime
    alerts: list[Alert]


@dataclass(frozen=True)
class SchedulersPage:
    """The schedulers' registry: every row, live, stopping or expired; the upkeep leader marked."""

    now: datetime
    schedulers: list[Scheduler]

    @property
    def live(self) -> int:
        return sum(1 for row in self.schedulers if row.live)


@dataclass(frozen=True)
class Badge:
    job: str
    state: str


def _state(status: JobStatus) -> str:
    """The ledger's state word of the job (``job_status.state``, never worked out here)."""
    return status.state or "unknown"


def success_rate(runs: list[RunBar]) -> float | None:
    ended = [run for run in runs if run.status != "running"]
    return sum(run.status == "success" for run in ended) / len(ended) if ended else None


def jobs_page(cur: psycopg.Cursor[Any], *, name: str | None = None, state: str | None = None,
              page: int = 1) -> JobsPage:
    """The jobs the filters keep, counted per state, and a page of them, each with its sparkline
    (the counts and the page read in SQL: a ledger of 100,000 jobs sends 100 rows, not all)."""
    now = reads.now(cur)
    counts = reads.job_counts(cur, name)
    total = sum(counts.values()) if state is None else counts.get(state, 0)
    pages = max(1, -(-total // PAGE_SIZE))
    page = min(max(1, page), pages)
    shown = [(status, _state(status))
             for status in reads.jobs(cur, name, state, PAGE_SIZE, (page - 1) * PAGE_SIZE)]
    runs = reads.last_runs(cur, [status.job for status, _ in shown], SPARK_RUNS)
    rows = []
    for status, found in shown:
        mine = runs[status.job]
        rows.append(JobRow(
            job=status.job, state=found, paused=bool(status.paused), schedule=status.schedule,
            schedule_words=in_words(status.schedule), time_zone=status.time_zone, last_run=mine[-1] if mine else None, next_slot=status.next_slot,
            runs=mine, success_rate=success_rate(mine), status=status))
    # every state the ledger has (in its order), and any other word it gave a job
    known = {key: counts.get(key, 0) for key in STATES} | dict(counts)
    return JobsPage(now=now, name=name, state=state, counts=known,
                    total=total, page=page, pages=pages, jobs=rows)


def job_page(cur: psycopg.Cursor[Any], job: str, *, window: str = DEFAULT_WINDOW) -> JobPage:
    """The job's window of runs, skips and slots, its next slots, failures, ttl advice and commands."""
    now = reads.now(cur)
    status = reads.job(cur, job)
    if status is None:
        raise UnknownJob(job)
    health = reads.health(cur, job)
    state = health.state if health is not None else _state(status)
    since, until = now - WINDOWS[window], now
    runs = reads.window_runs(cur, job, since, until, WINDOW_RUNS)
    in_window = sum(1 for run in runs if run.started_at >= since)
    count = reads.slot_count(cur, job, since, until)
    marks: list[datetime] = []
    upcoming: list[Slot] = []
    if count is not None:
        if 0 < count <= SLOT_MARKS:
            marks = [slot.slot for slot in reads.slots(cur, job, count, since) if slot.slot <= until]
        upcoming = reads.slots(cur, job, UPCOMING_SLOTS, now)
    return JobPage(
        now=now, job=job, state=state, state_since=health.since if health else None,
        reason=health.reason if health else None, status=status, schedule_words=in_words(status.schedule), window=window, since=since, until=until, runs=runs,
        runs_truncated=in_window >= WINDOW_RUNS,
        skipped=reads.skipped(cur, job, since, until, SKIPPED_RANGES), slot_count=count, slot_marks=marks,
        upcoming=upcoming, failures=reads.failures(cur, job, RECENT_FAILURES), advice=reads.ttl_advice(cur, job),
        commands=job_commands(status, state), **_seats(cur, job))


def _seats(cur: psycopg.Cursor[Any], job: str) -> dict[str, Any]:
    """A job in seats mode: its bound and its seats (a single-holder job reads no seat)."""
    lease = reads.lease(cur, job)
    if lease is None or not lease.multi:
        return {"max_concurrent": lease.max_concurrent if lease else 1, "seats": []}
    return {"max_concurrent": lease.max_concurrent, "seats": reads.seats(cur, job)}


def run_page(cur: psycopg.Cursor[Any], run_id: int) -> RunPage:
    """Every field of the run's log row, its lease, its fence writes, its neighbours."""
    now = reads.now(cur)
    facts = reads.run(cur, run_id)
    if facts is None:
        raise UnknownRun(str(run_id))
    run = facts.run
    lease = reads.lease(cur, run.job)
    seat = None
    if lease is not None and lease.multi:
        seat = next((s for s in reads.seats(cur, run.job) if s.live and s.token == run.token), None)
    bar = RunBar(run_id=run.run_id, owner=run.owner, token=run.token, slot=run.slot, status=run.status,
                 failure_reason=run.failure_reason, started_at=run.started_at, completed_at=run.completed_at,
                 seconds=facts.duration.total_seconds(), error=None)
    return RunPage(
        now=now, run=run, duration=facts.duration, outcome=bar.outcome, lease=lease,
        token_is_current=seat is not None or (lease is not None and lease.live and lease.token == run.token),
        fences=reads.fences(cur, run.job, run.token), neighbours=reads.neighbours(cur, run), seat=seat)


def alerts_page(cur: psycopg.Cursor[Any]) -> AlertsPage:
    return AlertsPage(now=reads.now(cur), alerts=reads.alerts(cur))


@dataclass(frozen=True)
class PoolsPage:
    """The pools (``ledger.pool_status``): each one's size and what uses it; a full one marked."""

    now: datetime
    pools: list[PoolStatus]

    @property
    def full(self) -> int:
        return sum(1 for row in self.pools if row.used >= row.size)


def pools_page(cur: psycopg.Cursor[Any]) -> PoolsPage:
    return PoolsPage(now=reads.now(cur), pools=reads.pools(cur))


def schedulers_page(cur: psycopg.Cursor[Any]) -> SchedulersPage:
    return SchedulersPage(now=reads.now(cur), schedulers=reads.schedulers(cur, SCHEDULER_JOBS))


def badge(cur: psycopg.Cursor[Any], job: str) -> Badge:
    status = reads.job(cur, job)
    if status is None:
        raise UnknownJob(job)
    return Badge(job=job, state=_state(status))
