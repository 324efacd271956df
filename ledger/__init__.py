"""Postgres-native job ledger: leases, fencing tokens, execution log, bounded catch-up.

All semantics live in PL/pgSQL functions in schema ``ledger`` (see ``sql/``);
this package is a thin layer over them.
"""

from ledger.aio import AsyncLeaseContext, AsyncLedger, AsyncRunContext, AsyncScheduledJob
from ledger.client import LeaseContext, Ledger, RunContext, ScheduledJob
from ledger.errors import (
    FenceNotCommitted,
    FenceOfAnotherJob,
    InvalidArgument,
    JobNotFound,
    LeaseLost,
    LeaseSuperseded,
    LedgerError,
    LedgerUnavailable,
    PoolNotFound,
    RunNotFound,
    RunNotRunning,
    StaleToken,
)
from ledger.identity import default_owner
from ledger.models import Event, EventSettings, Job, JobStatus, Lease, Pool, PoolStatus, Run, RunStart
from ledger.scheduler.serve import ServedJob, job, serve, serve_async

__all__ = [
    "AsyncLeaseContext",
    "AsyncLedger",
    "AsyncRunContext",
    "AsyncScheduledJob",
    "Event",
    "EventSettings",
    "FenceNotCommitted",
    "FenceOfAnotherJob",
    "InvalidArgument",
    "Job",
    "JobNotFound",
    "JobStatus",
    "Lease",
    "LeaseContext",
    "LeaseLost",
    "LeaseSuperseded",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "Pool",
    "PoolNotFound",
    "PoolStatus",
    "Run",
    "RunContext",
    "RunNotFound",
    "RunNotRunning",
    "RunStart",
    "ScheduledJob",
    "ServedJob",
    "StaleToken",
    "default_owner",
    "job",
    "serve",
    "serve_async",
]
__version__ = "0.2.0.dev0"
