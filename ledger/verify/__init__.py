"""Checking the ledger's guarantees where it runs: ``jobledger verify`` (docs/operations.md).

The contract's guarantees are tested here on a direct connection; a user's
database is reached through their own pooler, HA DSN, role and settings, and
that path is what breaks guarantees in the field (a transaction pooler that
moves prepared statements away, a superuser login, an asynchronous standby,
a session that holds the xmin horizon). :func:`verify` runs each check
against that database and returns a :class:`Report` of :class:`Check` rows,
each ``held``, ``warn``, ``failed`` or ``skipped``, with its facts and, for a
failure, how to reproduce it by hand:

- ``ledger.verify.guarantees``: the checks that exercise the ledger on
  scratch jobs (racing workers, a zombie, a lost lease, a reconnect);
- ``ledger.verify.environment``: the checks of what surrounds it (the role,
  the clock, the path, replication, the xmin horizon, the audit of the
  jobs' state rows), which only read.

The checks that write use scratch jobs named ``jobledger-verify:...``
(:data:`JOBS`), the same names on every run, guarded by a lease of their own
(:data:`GUARD`): two verifies at once never share them, and a verify that
died is tidied up by the next. At the end each scratch job is removed with
``ledger.unregister_job(job, with_history => true)``, and so is the guard
once released; their lease rows and fences stay, by design: they are the
jobs' token high-water marks, which the ledger never deletes. No job is
left for ``jobledger status`` to list (a job unregistered with its history
is no longer known).
No table is left either: the zombie check's fenced write goes into a TEMP
table that its own transaction creates and drops (``ON COMMIT DROP``), which
is safe behind a transaction pooler, where a TEMP table that outlives its
transaction is not.

Every check is bounded (:data:`CHECK_TIMEOUT`); the four that wait on the
ledger's clock run at once, so a verify takes seconds, well under a minute.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from ledger import queries
from ledger.errors import InvalidArgument, JobNotFound, LedgerError
from ledger.text import first_line
from ledger.verify._base import (APPLICATION_NAME, CHECK_TIMEOUT, GUARANTEES, JOBS, REPRODUCE, RESOURCES, Check,
                                 CheckFunction, Probe, Status, dsn_params, fetch_one, iso, timed_out, verdict)
from ledger.verify.environment import check_clock, check_mvcc, check_path, check_replication, check_role, check_state
from ledger.verify.guarantees import check_lost_lease, check_race, check_reconnect, check_zombie

__all__ = ["CHECKS", "CHECK_TIMEOUT", "GUARANTEES", "GUARD", "JOBS", "REPRODUCE", "RESOURCES", "Check", "Report",
           "Status", "verify"]

GUARD = "jobledger-verify"
"""The lease a verify holds while it uses the scratch jobs: a second verify at once waits for none of them."""

GUARD_TTL = timedelta(minutes=5)  # longer than a verify can take (each check is bounded)


@dataclass
class Report:
    """Every check, where they ran, and what the scratch jobs left."""

    target: dict[str, Any]
    checks: list[Check]
    cleanup: dict[str, Any]
    seconds: float

    @property
    def failed(self) -> bool:
        return any(check.status == "failed" for check in self.checks)

    def counts(self) -> Counter[str]:
        return Counter(check.status for check in self.checks)

    def as_json(self) -> dict[str, Any]:
        return {"target": self.target, "ok": not self.failed, "seconds": round(self.seconds, 3),
                "counts": dict(self.counts()), "checks": [check.as_json() for check in self.checks],
                "cleanup": self.cleanup}


CHECKS: dict[str, CheckFunction] = {
    "race": check_race,
    "zombie": check_zombie,
    "lost-lease": check_lost_lease,
    "reconnect": check_reconnect,
    "clock": check_clock,
    "path": check_path,
    "role": check_role,
    "replication": check_replication,
    "mvcc": check_mvcc,
    "state": check_state,
}
"""Every check by name, in the order of the report."""


def verify(dsn: str, *, timeout: float = CHECK_TIMEOUT) -> Report:
    """Run every check against the database of ``dsn``; the scratch jobs are removed at the end.

    Raises only when the database cannot be reached at all (LedgerUnavailable);
    whatever goes wrong after that is a failed check.
    """
    began = time.monotonic()
    quiet = _Quiet()
    logging.getLogger("ledger").addFilter(quiet)
    try:
        return _verify(dsn, timeout, began)
    finally:
        logging.getLogger("ledger").removeFilter(quiet)


class _Quiet(logging.Filter):
    """The client's warnings about the lost-lease check's own run: the loss it is made to notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        job = JOBS["lost-lease"]  # also the name of the check's thread, and in its heartbeat thread's
        return job not in record.getMessage() and job not in (record.threadName or "")


def _verify(dsn: str, timeout: float, began: float) -> Report:
    probe = Probe(dsn, f"{APPLICATION_NAME}:{socket.gethostname()[:100] or 'localhost'}:{os.getpid()}")
    with probe.connect() as conn:
        target = _target(conn, dsn)
        results: dict[str, Check] = {}
        results["role"] = _bounded("role", check_role, probe, timeout)
        for name in ("clock", "path", "replication"):
            results[name] = _bounded(name, CHECKS[name], probe, timeout)
        writers = ("race", "zombie", "lost-lease", "reconnect")
        cleanup: dict[str, Any] = {}
        can_run = bool(results["role"].facts.get("can_run"))
        if not can_run:
            for name in writers:
                results[name] = verdict(name, "skipped", "not run: the role cannot run jobs (see role)")
        else:
            guard = _take_guard(conn, probe)
            if isinstance(guard, str):
                for name in writers:
                    results[name] = verdict(name, "failed", f"not run: {guard}",
                                            how_to_reproduce="wait for the other verify to end, then run again")
            else:
                try:
                    _remove_scratch(conn, probe)  # what a verify that died left
                    results.update(_concurrently(writers, probe, timeout))
                finally:
                    cleanup = _remove_scratch(conn, probe)
                    _release_guard(conn, probe, guard)
        results["mvcc"] = _bounded("mvcc", CHECKS["mvcc"], probe, timeout)  # after the writers: none of ours is open
        results["state"] = _bounded("state", CHECKS["state"], probe, timeout)  # after the scratch jobs are gone
    order = ("race", "zombie", "lost-lease", "reconnect", "clock", "path", "role", "replication", "mvcc", "state")
    return Report(target, [results[name] for name in order], cleanup, time.monotonic() - began)


def _target(conn: psycopg.Connection[Any], dsn: str) -> dict[str, Any]:
    row = fetch_one(conn, queries.VERIFY_TARGET)
    params = dsn_params(dsn)
    return {"host": conn.info.host, "port": conn.info.port, "dbname": row["dbname"], "role": row["role"],
            "server_version": row["server_version"], "server_addr": row["server_addr"],
            "server_port": row["server_port"], "dsn_hosts": params["hosts"]}


def _bounded(name: str, function: CheckFunction, probe: Probe, timeout: float) -> Check:
    return _concurrently((name,), probe, timeout, {name: function})[name]


def _concurrently(names: tuple[str, ...], probe: Probe, timeout: float,
                  functions: Mapping[str, CheckFunction] | None = None) -> dict[str, Check]:
    """Run the checks at once, each in a thread of its own, within ``timeout`` seconds in all.

    A check still running then is reported failed and told to stop (the
    batch's own stop flag ends its waits); its daemon thread is left behind.
    """
    functions = functions or CHECKS
    probe = Probe(probe.dsn, probe.owner)  # a stop flag of this batch's own
    results: dict[str, Check] = {}
    threads: dict[str, threading.Thread] = {}

    def run(name: str) -> None:
        began = time.monotonic()
        try:
            check = functions[name](probe)
        except Exception as error:  # a check that raised is a failed check, with the error
            check = verdict(name, "failed", f"the check stopped with an error: {first_line(error)}",
                            {"error": first_line(error), "sqlstate": getattr(error, "sqlstate", None)})
        check.seconds = time.monotonic() - began
        results.setdefault(name, check)  # not over a timeout already reported

    for name in names:
        threads[name] = threading.Thread(target=run, args=(name,), name=f"{APPLICATION_NAME}:{name}", daemon=True)
        threads[name].start()
    deadline = time.monotonic() + timeout
    for name, thread in threads.items():
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            results[name] = timed_out(name, timeout)
    probe.stop.set()
    return results


# -- the scratch jobs --------------------------------------------------------------------

def _take_guard(conn: psycopg.Connection[Any], probe: Probe) -> int | str:
    """The guard's token, or why it is not free (another verify holds it)."""
    ledger = probe.ledger(conn)
    lease = ledger.acquire(GUARD, GUARD_TTL)
    if lease is not None:
        return lease.token
    status = ledger.job_status(GUARD)
    holder = status.holder if status is not None else None
    until = iso(status.lease_expires_at) if status is not None else None
    return f"another jobledger verify holds the scratch jobs ({GUARD}: {holder}, until {until})"


def _release_guard(conn: psycopg.Connection[Any], probe: Probe, token: int) -> None:
    """Release the guard and forget it, as the scratch jobs are: a verify leaves no job that status lists.

    One transaction: the release keeps the guard's lease row locked until the
    unregister commits, so a second verify cannot take the guard in between
    and lose its state row. Only the lease row stays (its token high-water mark).
    """
    ledger = probe.ledger(conn)
    try:
        with conn.transaction():
            if ledger.release(GUARD, token):  # else another verify holds it now, and forgets it
                ledger.unregister_job(GUARD, with_history=True)
    except (LedgerError, psycopg.Error):
        pass  # it expires by itself (GUARD_TTL); the next verify forgets it


def _remove_scratch(conn: psycopg.Connection[Any], probe: Probe) -> dict[str, Any]:
    """Unregister every scratch job with its history (a live run first force-released); what is left."""
    ledger = probe.ledger(conn)
    removed, errors = [], {}
    for job in JOBS.values():
        try:
            try:
                gone = ledger.unregister_job(job, with_history=True)
            except InvalidArgument:  # a run of it is live (a check that ran out of time): end it first
                ledger.force_release(job)
                gone = ledger.unregister_job(job, with_history=True)
            if gone:
                removed.append(job)
        except JobNotFound:
            pass  # never used: no lease row, nothing to remove
        except (LedgerError, psycopg.Error) as error:
            errors[job] = first_line(error)
    remains = fetch_one(conn, queries.VERIFY_SCRATCH_REMAINS,
                        {"jobs": [*JOBS.values(), GUARD], "resources": list(RESOURCES.values())})
    return {"removed": removed, "errors": errors, "jobs_left": remains["jobs"], "runs_left": remains["runs"],
            "lease_rows_kept": remains["leases"], "fences_kept": remains["fences"],
            "kept_by_design": "the scratch jobs' lease rows and fences: their tokens are the high-water marks, "
                              "never deleted, so a token is never issued twice"}


