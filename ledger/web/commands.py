"""The exact ``jobledger`` command of each operator action on a job: the dashboard only reads.

Arguments are shell-quoted (a job's name may hold anything a label allows),
durations written exactly (``80m``, not a rounded ``1h 20m``). The commands
name no database: they take ``--dsn`` or ``LEDGER_DSN`` as the dashboard does.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from datetime import timedelta

from ledger.models import JobStatus


@dataclass(frozen=True)
class Command:
    action: str      # what it does, in a few words
    command: str     # the line to run
    why: str         # when to run it


def exact_duration(value: timedelta) -> str:
    """The duration in one unit, exactly: ``80m``, ``36h``, ``90s``, ``1500ms``."""
    micros = round(value.total_seconds() * 1_000_000)
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000), ("s", 1_000_000),
                       ("ms", 1_000)):
        if micros % size == 0:
            return f"{micros // size}{unit}"
    return f"{micros / 1_000_000}s"


def _line(*words: str) -> str:
    return " ".join(shlex.quote(word) for word in words)


def job_commands(status: JobStatus, state: str) -> list[Command]:
    """The actions on the job as it is now, the one its state calls for first."""
    job = status.job
    found: list[Command] = []
    if state == "crashed":
        found.append(Command("close the crashed run", _line("jobledger", "reap", job),
                             "its run is marked running but its lease is gone: mark the run failed "
                             "(lease_expired) now rather than at the next start"))
    if status.paused:
        found.append(Command("resume", _line("jobledger", "resume", job), "slots become due again"))
    elif status.schedule is not None:
        found.append(Command("pause", _line("jobledger", "pause", job),
                             "no slot is due until resumed; a run in progress goes on"))
    run = ["jobledger", "run", job]
    if status.ttl is None:
        run += ["--ttl", "10m"]
    found.append(Command("run it now, wrapped", _line(*run) + " -- COMMAND",
                         "starts the due slot (or, without a schedule, one run) under a lease"))
    found.append(Command("its recent runs", _line("jobledger", "runs", job, "--limit", "50"), "a table"))
    found.append(Command("its status and alerts", _line("jobledger", "status", job), "a table"))
    if status.schedule is not None:
        found.append(Command("its next slots", _line("jobledger", "next", job),
                             "local time, UTC, daylight-saving changes"))
        register = ["jobledger", "register", job, "--schedule", status.schedule]
        if status.time_zone:
            register += ["--tz", status.time_zone]
        if status.ttl is not None:
            register += ["--ttl", exact_duration(status.ttl)]
        if status.max_backfill is not None:
            register += ["--max-backfill", str(status.max_backfill)]
        found.append(Command("change its definition", _line(*register),
                             "edit the schedule, zone, ttl or catch-up bound: register changes the "
                             "options given, and options left out are kept as they are"))
    if state != "crashed":
        found.append(Command("close crashed runs", _line("jobledger", "reap", job),
                             "marks runs whose lease expired as failed"))
    return found
