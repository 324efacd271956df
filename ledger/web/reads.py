"""The dashboard's reads: one function per statement of ``ledger.queries`` (section "the dashboard").

Each takes the cursor of a page's read-only transaction (:meth:`Reader.transaction`:
``ledger_reader``, READ ONLY, a statement timeout, rolled back) and returns
typed rows. Nothing is prepared: the dashboard works behind a transaction pooler.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from ledger import queries
from ledger.connect import make_pool, open_pool
from ledger.models import JobStatus, PoolStatus, Run
from ledger.readonly import read_only_transaction

DEFAULT_TIMEOUT = timedelta(seconds=5)
#: Connections of the pool: pages are read in uvicorn's thread pool, a few at a time.
POOL_SIZE = 4

_STATUS_FIELDS = [field.name for field in fields(JobStatus)]
_RUN_FIELDS = [field.name for field in fields(Run)]


@dataclass(frozen=True)
class RunBar:
    """A run as the charts draw it: when, how long (so far), how it ended, under which token."""

    run_id: int
    owner: str
    token: int
    slot: datetime | None
    status: str
    failure_reason: str | None
    started_at: datetime
    completed_at: datetime | None
    seconds: float
    error: str | None  # its first 200 characters
    #: ``success``, ``failure``, ``lost`` (lease expired or superseded), ``cancelled`` or ``running``;
    #: computed from status and failure_reason (a field, so the JSON carries it too)
    outcome: str = ""

    def __post_init__(self) -> None:
        if self.failure_reason in ("lease_expired", "superseded"):
            outcome = "lost"
        elif self.failure_reason == "cancelled":
            outcome = "cancelled"
        else:
            outcome = self.status
        object.__setattr__(self, "outcome", outcome)


@dataclass(frozen=True)
class Failure:
    run_id: int
    owner: str
    token: int
    slot: datetime | None
    failure_reason: str
    started_at: datetime
    completed_at: datetime | None
    error: str | None


@dataclass(frozen=True)
class SkippedRange:
    first_slot: datetime
    last_slot: datetime
    slot_count: int
    reason: str
    recorded_at: datetime


@dataclass(frozen=True)
class Slot:
    """A slot of ``ledger.next_slots``: the instant, its wall clock and offset, a daylight-saving note."""

    slot: datetime
    local_time: datetime
    utc_offset: timedelta
    dst_change: str | None


@dataclass(frozen=True)
class TtlAdvice:
    ttl: timedelta | None
    longest_run: timedelta | None
    recommended_min: timedelta | None
    recommended_max: timedelta | None
    renew_every: timedelta | None
    verdict: str


@dataclass(frozen=True)
class RunFacts:
    run: Run
    duration: timedelta


@dataclass(frozen=True)
class Neighbours:
    previous_run_id: int | None
    next_run_id: int | None


@dataclass(frozen=True)
class LeaseNow:
    """The job's lease row as it is now; ``live`` while unreleased and unexpired."""

    owner: str
    token: int
    ttl: timedelta
    acquired_at: datetime
    expires_at: datetime
    released_at: datetime | None
    timeline: int
    live: bool
    #: seats mode (``max_concurrent`` > 1): the row only counts tokens, kept released; the
    #: holders are the job's seats (:func:`seats`)
    multi: bool = False
    max_concurrent: int = 1


@dataclass(frozen=True)
class SeatNow:
    """One seat of a job in seats mode (``ledger.lease_seats``): a lease of its own, with its token."""

    seat: int
    owner: str
    token: int
    ttl: timedelta
    acquired_at: datetime
    expires_at: datetime
    released_at: datetime | None
    run_id: int | None            # the seat's running run (None: none, or a bare acquire)
    live: bool


@dataclass(frozen=True)
class FenceWrite:
    resource: str
    token: int
    advanced_at: datetime


@dataclass(frozen=True)
class Alert:
    alert: str
    job: str
    run_id: int | None
    message: str
    since: datetime | None


@dataclass(frozen=True)
class Health:
    """A job's row of ``ledger.job_health``: its state, since when, why."""

    state: str
    since: datetime | None
    reason: str | None


@dataclass(frozen=True)
class Scheduler:
    """A row of ``ledger.schedulers`` (``queries.SCHEDULERS``): live until ``expires_at``; ``leader``
    while it holds the upkeep lease."""

    scheduler: str
    host: str
    pid: int
    version: str
    jobs: list[str]
    job_count: int
    started_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    stopping: bool
    live: bool
    status: str  # live, stopping (SIGTERM: it starts no run) or expired (it died)
    leader: bool
    heartbeat_age: timedelta


class Reader:
    """Where every request reads: a small pool of connections to the ledger, each read in its own transaction.

    Pages, their JSON, the badge and ``/metrics`` all take their connection
    from the pool (``pool_size`` at most, named ``jobledger web`` in
    ``pg_stat_activity``); none opens one of its own.
    """

    def __init__(self, dsn: str, *, timeout: timedelta = DEFAULT_TIMEOUT, pool_size: int = POOL_SIZE) -> None:
        self.dsn = dsn
        self.timeout = timeout
        # check: a connection the server dropped (a restart) is replaced, not handed to a page.
        self._pool: ConnectionPool[Any] = make_pool(dsn, {
            "min_size": 1, "max_size": pool_size, "name": "jobledger-web", "timeout": timeout.total_seconds(),
            "check": ConnectionPool.check_connection, "kwargs": {"application_name": "jobledger web"}})
        self._open = False
        # one opening at a time: concurrent first requests wait for it rather than each probing the database
        self._opening = threading.Lock()

    def open(self) -> None:
        """Connect now: LedgerUnavailable, naming host and port, when the database does not answer."""
        if self._open:
            return
        with self._opening:
            if not self._open:
                open_pool(self._pool)
                self._open = True

    def close(self) -> None:
        with self._opening:
            if self._open:
                self._pool.close()
                self._open = False

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor[Any]]:
        """A cursor in a read-only transaction as ledger_reader, rolled back at the end."""
        self.open()
        with self._pool.connection() as conn, read_only_transaction(conn, self.timeout) as cur:
            yield cur

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A connection of the pool, given back at the end (``/metrics``: its collector opens the transaction)."""
        self.open()
        with self._pool.connection() as conn:
            yield conn


def _rows(cur: psycopg.Cursor[Any], query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    cur.execute(query, params, prepare=False)
    names = [column.name for column in cur.description or []]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _job_status(row: dict[str, Any]) -> JobStatus:
    return JobStatus(**{name: row[name] for name in _STATUS_FIELDS})


def now(cur: psycopg.Cursor[Any]) -> datetime:
    """The database's clock: relative times on the pages are measured from it."""
    cur.execute(queries.DATABASE_NOW, prepare=False)
    row = cur.fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def job_counts(cur: psycopg.Cursor[Any], name: str | None) -> dict[str, int]:
    """The jobs whose name contains ``name`` (any case; None: every job), per state."""
    return {row["state"]: row["jobs"] for row in _rows(cur, queries.WEB_JOB_COUNTS, {"name": name or None})}


def jobs(cur: psycopg.Cursor[Any], name: str | None, state: str | None, limit: int, offset: int) -> list[JobStatus]:
    """The jobs whose name contains ``name`` (any case; None: every job) in ``state`` (None: any),
    by name: ``limit`` of them after the first ``offset``."""
    return [_job_status(row) for row in _rows(cur, queries.WEB_JOBS, {"name": name or None, "state": state,
                                                                       "limit": limit, "offset": offset})]


def job(cur: psycopg.Cursor[Any], job: str) -> JobStatus | None:
    found = _rows(cur, queries.JOB_STATUS, {"job": job})
    return _job_status(found[0]) if found else None


def health(cur: psycopg.Cursor[Any], job: str) -> Health | None:
    found = _rows(cur, queries.WEB_JOB_HEALTH, {"job": job})
    return Health(**found[0]) if found else None


def last_runs(cur: psycopg.Cursor[Any], jobs: Sequence[str], per_job: int) -> dict[str, list[RunBar]]:
    """The newest ``per_job`` runs of each job, oldest first."""
    result: dict[str, list[RunBar]] = {name: [] for name in jobs}
    for row in _rows(cur, queries.WEB_LAST_RUNS, {"jobs": list(jobs), "per_job": per_job}):
        result[row.pop("job")].append(RunBar(**row))
    return result


def window_runs(cur: psycopg.Cursor[Any], job: str, since: datetime, until: datetime, limit: int) -> list[RunBar]:
    """The newest ``limit`` runs that started in [since, until], and the running run; oldest first."""
    params = {"job": job, "since": since, "until": until, "limit": limit}
    return [RunBar(**row) for row in _rows(cur, queries.WEB_WINDOW_RUNS, params)]


def failures(cur: psycopg.Cursor[Any], job: str, limit: int) -> list[Failure]:
    return [Failure(**row) for row in _rows(cur, queries.WEB_FAILURES, {"job": job, "limit": limit})]


def skipped(cur: psycopg.Cursor[Any], job: str, since: datetime, until: datetime, limit: int) -> list[SkippedRange]:
    params = {"job": job, "since": since, "until": until, "limit": limit}
    return [SkippedRange(**row) for row in _rows(cur, queries.WEB_SKIPPED, params)]


def slot_count(cur: psycopg.Cursor[Any], job: str, since: datetime, until: datetime) -> int | None:
    """How many slots fall in (since, until]; None for a job without a schedule."""
    found = _rows(cur, queries.WEB_SLOT_COUNT, {"job": job, "since": since, "until": until})
    return int(found[0]["slot_count"]) if found else None


def slots(cur: psycopg.Cursor[Any], job: str, count: int, after: datetime) -> list[Slot]:
    """The job's next ``count`` slots after ``after`` (a scheduled job only)."""
    return [Slot(**row) for row in _rows(cur, queries.NEXT_SLOTS, {"job": job, "count": count, "after": after})]


def ttl_advice(cur: psycopg.Cursor[Any], job: str) -> TtlAdvice | None:
    found = _rows(cur, queries.WEB_TTL_ADVICE, {"job": job})
    return TtlAdvice(**found[0]) if found else None


def run(cur: psycopg.Cursor[Any], run_id: int) -> RunFacts | None:
    found = _rows(cur, queries.WEB_RUN, {"run_id": run_id})
    if not found:
        return None
    row = found[0]
    return RunFacts(Run(**{name: row[name] for name in _RUN_FIELDS}), row["duration"])


def neighbours(cur: psycopg.Cursor[Any], run: Run) -> Neighbours:
    params = {"job": run.job, "started_at": run.started_at, "run_id": run.run_id}
    return Neighbours(**_rows(cur, queries.WEB_RUN_NEIGHBOURS, params)[0])


def lease(cur: psycopg.Cursor[Any], job: str) -> LeaseNow | None:
    found = _rows(cur, queries.WEB_LEASE, {"job": job})
    return LeaseNow(**found[0]) if found else None


def seats(cur: psycopg.Cursor[Any], job: str) -> list[SeatNow]:
    """The job's seats, by seat (none unless it is in seats mode)."""
    return [SeatNow(**row) for row in _rows(cur, queries.WEB_SEATS, {"job": job})]


def fences(cur: psycopg.Cursor[Any], job: str, token: int) -> list[FenceWrite]:
    return [FenceWrite(**row) for row in _rows(cur, queries.WEB_FENCES, {"job": job, "token": token})]


def alerts(cur: psycopg.Cursor[Any]) -> list[Alert]:
    return [Alert(**row) for row in _rows(cur, queries.ALERTS, {})]


def pools(cur: psycopg.Cursor[Any]) -> list[PoolStatus]:
    """Every row of ``ledger.pool_status``, by pool: size, used, running, jobs, waiting, skipped_pool_full."""
    return [PoolStatus(**row) for row in _rows(cur, queries.POOL_STATUSES, {})]


def schedulers(cur: psycopg.Cursor[Any], first_jobs: int) -> list[Scheduler]:
    """Every row of ``ledger.schedulers``, the expired ones too, by name; of the jobs each serves, the
    first ``first_jobs`` (``job_count`` counts them all)."""
    return [Scheduler(**row) for row in _rows(cur, queries.SCHEDULERS, {"all": True, "first_jobs": first_jobs})]
