"""A job's state badge: one word for what the ledger says about the job now.

Read from ``ledger.job_status`` alone (the jobs page reads every job, and
that view costs per job, not per run). Job health states (issue 12) are not
in the ledger yet; when they are, :func:`job_state` is the one place to read
them instead.
"""

from __future__ import annotations

from typing import Literal

from ledger.models import JobStatus

State = Literal["running", "lease_expired", "paused", "failing", "overdue", "never_run", "ok"]

#: Every state, in the order the filters list them, with what it means.
STATES: dict[State, str] = {
    "running": "a run is in progress under a live lease",
    "lease_expired": "a run is still open but its lease expired: its worker crashed or froze "
                     "(the reaper, or the next start, closes it)",
    "paused": "paused: no slot is due until it is resumed",
    "failing": "its newest runs failed (failures since the last success)",
    "overdue": "a slot is more than one ttl old and has not succeeded, with no live run on it",
    "never_run": "registered, never run yet",
    "ok": "its last run succeeded and nothing is overdue",
}

#: The label a badge shows.
LABELS: dict[State, str] = {
    "running": "running", "lease_expired": "lease expired", "paused": "paused", "failing": "failing",
    "overdue": "overdue", "never_run": "never run", "ok": "ok",
}


def job_state(status: JobStatus) -> State:
    """The job's state: the first that holds, in the order of :data:`STATES`.

    A run in progress is the news, whatever came before it; but a run whose
    lease expired is no progress (``job_status.holder`` is only set while
    the lease is live), so it has its own state. A paused job is paused
    whatever its history. Failures in a row outrank overdue: the failure is
    the cause an operator looks for first.
    """
    if status.running_run_id is not None:
        return "running" if status.holder is not None else "lease_expired"
    if status.paused:
        return "paused"
    if status.consecutive_failures > 0:
        return "failing"
    if status.overdue:
        return "overdue"
    if status.last_run_id is None:
        return "never_run"
    return "ok"
