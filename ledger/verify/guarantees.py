"""The checks that exercise the ledger on scratch jobs: racing workers, a zombie, a lost lease, a reconnect.

Each takes a :class:`~ledger.verify._base.Probe` and returns a
:class:`~ledger.verify._base.Check`; they write only to their own scratch
job (``JOBS``), which the runner removes afterwards.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import psycopg

from ledger import queries
from ledger.client import fence
from ledger.errors import LeaseLost, LedgerError
from ledger.text import first_line
from ledger.verify._base import (CHECK_TIMEOUT, JOBS, RESOURCES, Check, Probe, fetch_all, fetch_one, fetch_value,
                                 iso, timed_out, verdict)

# race: two workers on a schedule of one slot a second, until this many slots succeeded.
RACE_SCHEDULE = "1 second"
RACE_SLOTS = 3
RACE_TTL = timedelta(seconds=10)
RACE_BACKFILL = 10  # a worker that stalls for a few slots still catches up: a missed slot is a finding
RACE_HOLD = 0.05  # seconds a run holds its lease: the other worker meets it
RACE_POLL = 0.02
RACE_DEADLINE = 15.0  # seconds for the slots to run, far more than they need

# zombie: a run that stops heartbeating, past a ttl this short.
ZOMBIE_TTL = timedelta(seconds=1)
SUCCESSOR_TTL = timedelta(seconds=30)

# lost-lease: the client's run, its renewals held back by a transaction that holds the lease row.
LOST_TTL = timedelta(seconds=3)
NOTICE_MARGIN = 1.0
"""Seconds after the server's expiry by which the client must have noticed: its timer and threads.

The client's local deadline is the send time of the call that last renewed
the lease plus the time the server granted, so it is never later than the
server's expiry; it fires ``on_lost`` at that deadline (docs/python.md)."""

RECONNECT_TTL = timedelta(seconds=30)


def check_race(probe: Probe) -> Check:
    """Two workers on their own connections race start_due_run on a schedule of a slot a second."""
    job = JOBS["race"]
    with probe.connect() as conn:
        probe.ledger(conn).register_job(job, schedule=RACE_SCHEDULE, ttl=RACE_TTL, max_backfill=RACE_BACKFILL)
        done: set[datetime] = set()
        lock = threading.Lock()
        enough = threading.Event()
        outcomes: list[Counter[str]] = [Counter(), Counter()]
        errors: list[str] = []

        def worker(n: int) -> None:
            try:
                with probe.connect() as own:
                    ledger = probe.ledger(own, f"{probe.owner}:worker-{n + 1}")
                    while not enough.is_set() and not probe.stop.is_set():
                        start = ledger.start_due_run(job, ttl=RACE_TTL)
                        outcomes[n][start.outcome] += 1
                        if not start.started:
                            probe.wait(RACE_POLL)
                            continue
                        assert start.run_id is not None and start.token is not None and start.slot is not None
                        probe.wait(RACE_HOLD)  # the other worker meets the held lease meanwhile
                        ledger.complete_run(start.run_id, start.token)
                        with lock:
                            done.add(start.slot)
                            if len(done) >= RACE_SLOTS:
                                enough.set()
            except Exception as error:
                errors.append(first_line(error))
                enough.set()

        threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(2)]
        for thread in threads:
            thread.start()
        enough.wait(RACE_DEADLINE)
        enough.set()
        for thread in threads:
            thread.join()
        slots = fetch_all(conn, queries.VERIFY_SLOT_RUNS, {"job": job})
        duplicates = fetch_all(conn, queries.VERIFY_DUPLICATES, {"job": job})
        overlaps = fetch_all(conn, queries.OVERLAPS, {"jobs": [job]})
        skipped = fetch_all(conn, queries.SKIPPED_SLOTS, {"job": job})
    succeeded = [row["slot"] for row in slots if row["successes"] >= 1]
    twice = [iso(row["slot"]) for row in slots if row["successes"] > 1]
    missed = _missed(succeeded, skipped, timedelta(seconds=1))
    facts: dict[str, Any] = {
        "job": job, "schedule": RACE_SCHEDULE, "slots": [iso(slot) for slot in succeeded],
        "workers": {f"worker-{n + 1}": dict(counts) for n, counts in enumerate(outcomes)},
        "succeeded_twice": twice, "duplicates": len(duplicates), "overlaps": len(overlaps),
        "missed": missed, "skipped_by_backfill_limit": sum(int(row["slot_count"]) for row in skipped),
        "errors": errors,
    }
    started = ", ".join(f"worker {n + 1} started {counts['started']}" for n, counts in enumerate(outcomes))
    contention = sum(counts["skipped_overlap"] + counts["nothing_due"] for counts in outcomes)
    if errors:
        return verdict("race", "failed", f"a worker stopped: {errors[0]}", facts)
    if twice or duplicates or overlaps:
        what = (f"slot {twice[0]} succeeded twice" if twice else
                f"ledger.duplicates has {len(duplicates)} rows" if duplicates else
                f"ledger.overlaps has {len(overlaps)} rows")
        return verdict("race", "failed", f"{what} ({started})", facts)
    if missed:
        return verdict("race", "failed", f"slot {missed[0]} was never run although later ones were ({started})",
                       facts)
    if len(succeeded) < RACE_SLOTS:
        return verdict("race", "failed", f"only {len(succeeded)} of {RACE_SLOTS} slots ran ({started})", facts)
    return verdict("race", "held", f"{len(succeeded)} slots, each succeeded once ({started}; "
                   f"{contention} answers skipped_overlap or nothing_due)", facts)


def _missed(succeeded: list[datetime], skipped: list[dict[str, Any]], step: timedelta) -> list[str]:
    """Slots between the first and the last that succeeded which neither succeeded nor were dropped on purpose."""
    missed = []
    for before, after in zip(succeeded, succeeded[1:]):
        slot = before + step
        while slot < after:
            if not any(row["first_slot"] <= slot <= row["last_slot"] for row in skipped):
                missed.append(slot.isoformat())
            slot += step
    return missed


def check_zombie(probe: Probe) -> Check:
    """A run that stops heartbeating is refused by the fence once past its ttl, and after a takeover."""
    job, resource = JOBS["zombie"], RESOURCES["zombie"]
    with probe.connect() as conn:
        ledger = probe.ledger(conn)
        zombie = ledger.start_run(job, ttl=ZOMBIE_TTL, owner=f"{probe.owner}:zombie")
        if not zombie.started:
            return verdict("zombie", "failed", f"the zombie's run did not start: {zombie.outcome}", {"job": job})
        assert zombie.run_id is not None and zombie.token is not None
        token = zombie.token
        while ledger.is_current(job, token):  # the zombie is frozen: no heartbeat, the ttl runs out
            if not probe.wait(0.05):
                return timed_out("zombie", CHECK_TIMEOUT)
        expired = _fenced_write(conn, job, resource, token)
        successor = ledger.start_run(job, ttl=SUCCESSOR_TTL, owner=f"{probe.owner}:successor")
        while not successor.started:
            if not probe.wait(0.05):
                return timed_out("zombie", CHECK_TIMEOUT)
            successor = ledger.start_run(job, ttl=SUCCESSOR_TTL, owner=f"{probe.owner}:successor")
        assert successor.run_id is not None and successor.token is not None
        taken = _fenced_write(conn, job, resource, token)
        written = _fenced_write(conn, job, resource, successor.token)
        try:
            ledger.complete_run(zombie.run_id, token)
            end = "accepted"
        except LedgerError as error:
            end = error.sqlstate
        ledger.complete_run(successor.run_id, successor.token)
    facts = {"job": job, "resource": resource, "ttl_seconds": ZOMBIE_TTL.total_seconds(), "zombie_token": token,
             "successor_token": successor.token, "fence_after_expiry": expired["answer"],
             "fence_after_takeover": taken["answer"], "zombie_end": end,
             "successor_write": written["answer"], "write": written["write"]}
    refused = {"after its ttl": expired["answer"], "after the takeover": taken["answer"], "at its end": end}
    wrong = {when: answer for when, answer in refused.items() if answer != "LD001"}
    if written["answer"] != "committed":
        return verdict("zombie", "failed", f"the successor's fenced write did not commit: {written['answer']}", facts)
    if wrong:
        when, answer = next(iter(wrong.items()))
        return verdict("zombie", "failed", f"token {token} was not refused with LD001 {when}: {answer}", facts)
    return verdict("zombie", "held", f"token {token} refused with LD001 after its ttl, after token {successor.token} "
                   f"took over, and at its end; the successor's fenced write committed ({written['write']})", facts)


def _fenced_write(conn: psycopg.Connection[Any], job: str, resource: str, token: int) -> dict[str, str]:
    """The fence and the write it guards, in one transaction: ``committed`` or the SQLSTATE that refused it."""
    write = "a TEMP table of the transaction's own"
    try:
        try:
            with conn.transaction():
                fence(conn, job, resource, token)
                conn.execute(queries.VERIFY_FENCED_WRITE, {"token": token})
        except psycopg.errors.InsufficientPrivilege:  # no TEMP privilege on this database: the fence alone
            write = "none: this role may not create TEMP tables, so the fence alone"
            with conn.transaction():
                fence(conn, job, resource, token)
        return {"answer": "committed", "write": write}
    except LedgerError as error:
        return {"answer": error.sqlstate or type(error).__name__, "write": write}


def check_lost_lease(probe: Probe) -> Check:
    """The client's run, its renewals held back: ``on_lost`` must fire by the server's expiry (+ the margin).

    A second heartbeat of the same run in a transaction that stays open holds
    the lease row, so no renewal of the client's can commit (as a pooler that
    stops forwarding, or a lock queue, would do); the committed expiry is then
    read beside it.
    """
    job = JOBS["lost-lease"]
    noticed: list[float] = []
    reasons: list[str] = []

    def on_lost(error: LeaseLost) -> None:
        noticed.append(time.monotonic())
        reasons.append(error.reason)

    facts: dict[str, Any] = {"job": job, "ttl_seconds": LOST_TTL.total_seconds(), "margin_seconds": NOTICE_MARGIN}
    with probe.connect() as conn, probe.connect() as blocker:
        ledger = probe.ledger(conn, f"{probe.owner}:lost-lease")
        try:
            began = time.monotonic()
            try:
                with ledger.run(job, ttl=LOST_TTL, on_lost=on_lost) as run:
                    if not run.started:
                        return verdict("lost-lease", "failed", f"the run did not start: {run.outcome}", facts)
                    assert run.run_id is not None and run.token is not None
                    with blocker.transaction():
                        beat = {"run_id": run.run_id, "token": run.token, "ttl": LOST_TTL}
                        blocker.execute(queries.HEARTBEAT, beat)  # the lease row, locked until the rollback
                        left = fetch_value(conn, queries.VERIFY_LEASE_TIME_LEFT, {"job": job, "token": run.token})
                        expiry = time.monotonic() + float(left)  # this host's clock, at the latest
                        bound = expiry + NOTICE_MARGIN
                        while not run.lost.is_set() and time.monotonic() < bound + 2 * NOTICE_MARGIN:
                            if not probe.wait(0.02):
                                break
                        try:
                            run.check()
                            facts["check_raises"] = False
                        except LeaseLost:
                            facts["check_raises"] = True
                        raise psycopg.Rollback()  # let the renewals through again
            except LeaseLost:
                pass  # the exit after a loss: the run recorded as failed, then LeaseLost
            # Close with a success, so that the job is not left failing until the cleanup.
            closing = ledger.start_run(job, ttl=LOST_TTL, owner=f"{probe.owner}:lost-lease")
            if closing.started and closing.run_id is not None and closing.token is not None:
                ledger.complete_run(closing.run_id, closing.token)
        finally:
            ledger.close()
    facts["expiry_after_start_seconds"] = round(expiry - began, 3)
    if not noticed:
        return verdict("lost-lease", "failed", f"on_lost never fired, {bound + 2 * NOTICE_MARGIN - expiry:.1f} s "
                       "past the lease's expiry on the server", facts)
    late = noticed[0] - expiry
    facts.update(noticed_after_start_seconds=round(noticed[0] - began, 3),
                 noticed_after_expiry_seconds=round(late, 3), reason=reasons[0])
    when = f"{-late:.2f} s before" if late <= 0 else f"{late:.2f} s after"
    summary = (f"on_lost fired {noticed[0] - began:.2f} s into a run of ttl {LOST_TTL.total_seconds():g} s whose "
               f"renewals could not commit, {when} the server's expiry (bound: {NOTICE_MARGIN:g} s after it)")
    if noticed[0] > bound:
        return verdict("lost-lease", "failed", summary, facts)
    if not facts.get("check_raises"):
        return verdict("lost-lease", "failed", "on_lost fired but run.check() did not raise LeaseLost", facts)
    return verdict("lost-lease", "held", summary, facts)


def check_reconnect(probe: Probe) -> Check:
    """Acquire, drop the connection, connect again through the same DSN, acquire: a higher token."""
    job = JOBS["reconnect"]
    leases, servers = [], []
    for _ in range(2):
        with probe.connect() as conn:
            ledger = probe.ledger(conn)
            lease = ledger.acquire(job, RECONNECT_TTL)
            if lease is None:
                return verdict("reconnect", "failed", f"{job} is held by another owner", {"job": job})
            leases.append(lease.token)
            row = fetch_one(conn, queries.VERIFY_TARGET)
            servers.append(f"{row['server_addr'] or 'socket'}:{row['server_port'] or ''} "
                           f"(via {conn.info.host}:{conn.info.port})")
            ledger.release(job, lease.token)
    first, second = leases
    # A token's high 32 bits count the server's timeline: they grow when a standby is promoted.
    facts = {"job": job, "tokens": leases, "servers": servers, "timeline_epochs": [token >> 32 for token in leases]}
    where = "the same server" if servers[0] == servers[1] else f"{servers[0]}, then {servers[1]}"
    if second <= first:
        return verdict("reconnect", "failed", f"token {second} after token {first} on a new connection ({where})",
                       facts)
    return verdict("reconnect", "held", f"token {first}, then {second} on a new connection ({where})", facts)


