"""Typed rows of the ledger's public SQL API (see docs/contract.md).

Frozen dataclasses, one per result shape; the queries in ``ledger.queries``
name their columns explicitly, so a column added to a view or type later does
not break ``class_row``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, get_args

Outcome = Literal["started", "skipped_overlap", "already_done", "paused", "nothing_due", "skipped_pool_full"]
Status = Literal["running", "success", "failure"]
FailureReason = Literal["error", "lease_expired", "superseded", "cancelled"]
EventKind = Literal["run_started", "run_ended", "run_lost", "run_cancelled", "cancel_requested",
                    "job_paused", "job_resumed", "alert_raised", "alert_cleared", "job_redefined"]
"""The kinds of ``ledger.events`` (its CHECK constraint ``events_kind_valid``)."""

EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)
ALERT_KINDS: tuple[EventKind, ...] = ("alert_raised", "alert_cleared")


@dataclass(frozen=True)
class Lease:
    """``ledger.lease``: a lease held with its fencing token."""

    job: str
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class RunStart:
    """``ledger.run_start``: what ``start_run``/``start_due_run`` did."""

    outcome: Outcome
    run_id: int | None
    token: int | None
    expires_at: datetime | None
    slot: datetime | None
    holder: str | None
    holder_expires_at: datetime | None

    @property
    def started(self) -> bool:
        return self.outcome == "started"


@dataclass(frozen=True)
class Run:
    """A row of ``ledger.job_execution_log``: one run."""

    run_id: int
    job: str
    owner: str
    token: int
    slot: datetime | None
    idempotency_key: str | None
    status: Status
    started_at: datetime
    heartbeat_at: datetime | None
    completed_at: datetime | None
    failure_reason: FailureReason | None
    error: str | None
    detail: dict[str, Any] | None
    cancel_requested_at: datetime | None = None  # an operator asked it to stop (ledger.request_cancel)
    seat: int = 1  # the seat it holds (a job of max_concurrent > 1: 1 .. N)


@dataclass(frozen=True)
class Job:
    """A row of ``ledger.jobs``: a registered job."""

    job: str
    schedule: str | None
    time_zone: str
    ttl: timedelta | None
    max_backfill: int
    paused: bool
    created_at: datetime
    updated_at: datetime
    late_after: timedelta | None = None
    down_after: timedelta | None = None
    min_runtime: timedelta | None = None
    max_runtime: timedelta | None = None
    pause_after_failures: int | None = None
    paused_at: datetime | None = None
    pause_reason: str | None = None
    jitter: timedelta | None = None  # a per-slot start offset in [0, jitter) (ledger.slot_jitter)
    start_deadline: timedelta | None = None  # a slot not started within this is skipped
    overlap_policy: str = "catch_up"  # catch_up, skip, buffer_one, replace
    defined_by: str | None = None  # the jobs file (ledger.sync_jobs source) that defined it last
    pool: str | None = None  # the pool it belongs to (ledger.pools), None: none
    max_concurrent: int = 1  # live runs at once, each in its own seat with its own token


@dataclass(frozen=True)
class JobStatus:
    """A row of the ``ledger.job_status`` view."""

    job: str
    schedule: str | None
    time_zone: str | None
    ttl: timedelta | None
    max_backfill: int | None
    paused: bool | None
    holder: str | None
    token: int | None
    lease_expires_at: datetime | None
    last_run_id: int | None
    last_status: Status | None
    last_started_at: datetime | None
    last_completed_at: datetime | None
    last_success_at: datetime | None
    running_run_id: int | None
    running_for: timedelta | None
    next_slot: datetime | None
    overdue: bool | None
    consecutive_failures: int
    runs_started: int
    successes: int
    failures: int
    skipped_overlap: int
    skipped_backfill: int
    leases_lost: int
    #: The job's one state (docs/contract.md, ledger.job_health): crashed, overrun, paused, running, down,
    #: late, failing, never_run or ok.
    state: str | None
    skipped_deadline: int | None = None  # slots skipped by their start_deadline
    skipped_pool_full: int | None = None  # starts skipped because the job's pool was full
    pool: str | None = None  # the pool the job belongs to (ledger.pools), None: none


@dataclass(frozen=True)
class Pool:
    """A row of ``ledger.pools``: a registered pool (what ``register_pool``/``resize_pool`` return).

    ``size``: at most that many live leases of its jobs at once; ``admitted_at``:
    the last start it admitted (None: none yet).
    """

    pool: str
    size: int
    created_at: datetime
    updated_at: datetime
    admitted_at: datetime | None = None


@dataclass(frozen=True)
class PoolStatus:
    """A row of the ``ledger.pool_status`` view: a pool, its limit and what uses it.

    ``used``: its live leases (what ``size`` limits); ``running``: its running
    runs; ``jobs``: the jobs in it; ``waiting``: the jobs a scheduler found the
    pool full for, waiting a place; ``skipped_pool_full``: the starts it
    refused, summed over its jobs.
    """

    pool: str
    size: int
    used: int
    running: int
    jobs: int
    waiting: int
    skipped_pool_full: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Event:
    """A row of ``ledger.events``: one state change, in ``event_id`` order.

    ``detail`` by kind (docs/contract.md, Events): a run's ``owner``,
    ``token``, ``status``, ``seconds``, ``error``...; an alert's ``alert``,
    ``message``, ``since``.
    """

    event_id: int
    at: datetime
    kind: EventKind
    job: str
    run_id: int | None
    detail: dict[str, Any]


@dataclass(frozen=True)
class EventSettings:
    """The row of ``ledger.event_settings``: which events are recorded and notified, and how long kept."""

    run_events: bool
    notify: bool
    retention: timedelta
    max_events: int
    updated_at: datetime


RiskKind = Literal["xmin_horizon", "dead_rows", "autovacuum_lag"]
Severity = Literal["ok", "warn", "critical"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
"""``ledger.db_risks.severity``, mildest first (the metric's 0, 1, 2)."""


@dataclass(frozen=True)
class DbRisk:
    """A row of ``ledger.db_risks``: one risk the database runs for the ledger's hot rows.

    ``value`` is in ``unit``: transactions (``xmin_horizon``), rows
    (``dead_rows``), seconds since the last vacuum (``autovacuum_lag``). The
    holder columns are the xmin horizon's oldest holder (a backend, a
    replication slot or a prepared transaction); a reader without
    ``pg_read_all_stats`` sees no ``state``, ``xact_start`` nor ``age`` of
    other roles' backends (docs/contract.md, Database risks).
    """

    kind: RiskKind
    relation: str | None
    severity: Severity
    value: int | None
    unit: str
    age: timedelta | None
    holder_type: str | None
    holder: str | None
    pid: int | None
    application_name: str | None
    state: str | None
    xact_start: datetime | None
    message: str
    detail: dict[str, Any]
