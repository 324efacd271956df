"""No caller can stall the ledger, and no ordinary race answers an
undocumented SQLSTATE (hardening, round three).

Each interleaving is forced with real locks held by real sessions, so each
test reproduces its race every time; the mixed-call test at the end runs a
fixed number of random operator calls from many threads and checks that every
error it met is a documented one.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from sqlhelp import one, value
from waiting import wait_for

# What the contract documents for the calls below (docs/contract.md: the LD
# codes, 22023/22004 for arguments, 55P03 for a lock wait given up).
DOCUMENTED = {"LD001", "LD002", "LD003", "LD004", "LD005", "LD006", "22023", "22004", "55P03"}


def waiting_on_a_lock(observer: psycopg.Connection, pid: int) -> bool:
    return bool(value(observer, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", [pid]))


class Call(threading.Thread):
    """One SQL call in a connection of its own; its result or its SQLSTATE."""

    def __init__(self, connect: Callable[..., psycopg.Connection], query: str, params: Any = None,
                 setup: str | None = None) -> None:
        super().__init__(daemon=True)
        self.conn = connect()
        if setup:
            self.conn.execute(setup)  # type: ignore[arg-type]
        self.pid = self.conn.info.backend_pid
        self.query, self.params = query, params
        self.result: Any = None
        self.sqlstate: str | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = one(self.conn, self.query, self.params)
        except psycopg.Error as error:
            self.sqlstate = error.sqlstate

    def outcome(self, timeout: float = 60) -> Any:
        self.join(timeout)
        assert not self.is_alive(), f"{self.query} did not return"
        return self.sqlstate or self.result


# 1. configure_events behind an idle transaction ---------------------------

def test_configure_events_behind_an_idle_transaction_gives_up_with_55p03_and_never_queues_the_starts(connect, db):
    idle = connect(autocommit=False)
    idle.execute("SELECT * FROM ledger.start_run('careless', 'h', '1 minute')")  # and stays open
    settings_before = one(db, "SELECT run_events, notify FROM ledger.event_settings")

    configure = Call(connect, "SELECT * FROM ledger.configure_events(run_events => false)",
                     setup="SET statement_timeout = '20s'")
    # Starts and ends of other jobs meanwhile, each bounded by a statement
    # timeout: one that queued behind the ALTER TABLE would hit it.
    worker = connect()
    worker.execute("SET statement_timeout = '10s'")
    for i in range(20):
        started = one(worker, "SELECT run_id, token FROM ledger.start_run(%s, 'w', '1 minute')", [f"other-{i}"])
        worker.execute("SELECT ledger.complete_run(%s, %s)", [started["run_id"], started["token"]])

    assert configure.outcome() == "55P03"
    assert one(db, "SELECT run_events, notify FROM ledger.event_settings") == settings_before  # nothing changed
    assert value(db, "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'job_execution_log_%_event' "
                     "AND tgenabled = 'D'") == 0
    idle.rollback()
    assert one(db, "SELECT run_events FROM ledger.configure_events(run_events => false)") == {"run_events": False}


def test_the_55p03_of_configure_events_names_the_table_and_the_blocking_backend(connect):
    idle = connect(autocommit=False)
    idle.execute("SELECT * FROM ledger.start_run('careless', 'h', '1 minute')")
    caller = connect()
    caller.execute("SET statement_timeout = '20s'")  # a wait without a bound fails, it does not hang
    with pytest.raises(psycopg.errors.LockNotAvailable) as refused:
        caller.execute("SELECT ledger.configure_events(run_events => false)")
    diag = refused.value.diag
    assert "ledger.job_execution_log" in (diag.message_primary or "")
    assert "nothing changed" in (diag.message_primary or "")
    assert str(idle.info.backend_pid) in (diag.message_detail or "")


# 2. ordinary races -------------------------------------------------------

def hold_lease_row(connect: Callable[..., psycopg.Connection], job: str) -> psycopg.Connection:
    holder = connect(autocommit=False)
    holder.execute("SELECT FROM ledger.leases WHERE job = %s FOR UPDATE", [job])
    return holder


@pytest.mark.parametrize("end", ["complete_run", "fail_run", "heartbeat"])
def test_a_call_on_a_run_deleted_while_it_waited_for_the_lease_row_answers_ld004(connect, db, end):
    # What a purge (of an ended run) or `unregister_job --with-history` does
    # to a run whose end or heartbeat is already waiting on the lease row.
    run = one(db, "SELECT run_id, token FROM ledger.start_run('nightly', 'h', '1 minute')")
    if end != "heartbeat":
        db.execute("SELECT ledger.complete_run(%s, %s)", [run["run_id"], run["token"]])
    holder = hold_lease_row(connect, "nightly")
    call = {"complete_run": "SELECT * FROM ledger.complete_run(%s, %s)",
            "fail_run": "SELECT * FROM ledger.fail_run(%s, %s, 'again')",
            "heartbeat": "SELECT ledger.heartbeat(%s, %s) AS alive"}[end]
    waiting = Call(connect, call, [run["run_id"], run["token"]])
    wait_for(lambda: waiting_on_a_lock(db, waiting.pid), what=f"{end} to wait for the lease row")
    holder.execute("DELETE FROM ledger.job_execution_log WHERE run_id = %s", [run["run_id"]])
    holder.commit()

    assert waiting.outcome() == "LD004"
    assert value(db, "SELECT count(*) FROM ledger.counters WHERE job IS NULL") == 0


def test_start_due_run_while_unregister_job_commits_answers_ld005_and_starts_nothing(connect, db, ledger_clock):
    db.execute("SELECT ledger.register_job('minutely', schedule => '1 minute', ttl => '30 seconds', "
               "max_backfill => 1)")
    first = one(db, "SELECT run_id, token FROM ledger.start_due_run('minutely', 'h')")
    db.execute("SELECT ledger.complete_run(%s, %s)", [first["run_id"], first["token"]])
    ledger_clock.advance(timedelta(minutes=10))  # nine slots due: the bound drops eight of them

    # The start waits for the lease row for at most ledger._lock_wait() (1 s)
    # and then answers as busy; on a loaded machine the commit below may come
    # after that, so the interleaving is tried until it happened.
    for _ in range(5):
        unregister = connect(autocommit=False)
        unregister.execute("SELECT ledger.unregister_job('minutely')")
        start = Call(connect, "SELECT outcome FROM ledger.start_due_run('minutely', 'h')")
        wait_for(lambda: waiting_on_a_lock(db, start.pid), what="the start to wait for the lease row")
        unregister.commit()
        outcome = start.outcome()
        if outcome != {"outcome": "skipped_overlap"}:
            break
        db.execute("SELECT ledger.register_job('minutely', schedule => '1 minute', ttl => '30 seconds', "
                   "max_backfill => 1)")
    assert outcome == "LD005"
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE job = 'minutely' AND status = 'running'") == 0
    assert value(db, "SELECT count(*) FROM ledger.skipped_slots WHERE job = 'minutely'") == 0


def test_a_registration_in_progress_never_makes_a_starts_foreign_key_check_wait(connect, db):
    # The deadlock of start_due_run against register_job: the start holds the
    # job's counters and checks its foreign keys on the jobs row (FOR KEY
    # SHARE), while the registration holds the jobs row and waits for the
    # counters. A registration's lock must not conflict with a key share.
    db.execute("SELECT ledger.register_job('hourly', schedule => '1 hour', ttl => '1 minute')")
    registering = connect(autocommit=False)
    registering.execute("SELECT ledger.register_job('hourly', ttl => '2 minutes')")  # and stays open

    key_share = Call(connect, "SELECT job FROM ledger.jobs WHERE job = 'hourly' FOR KEY SHARE",
                     setup="SET lock_timeout = '5s'")

    assert key_share.outcome() == {"job": "hourly"}
    registering.rollback()


def test_mixed_operator_calls_from_many_threads_answer_only_documented_sqlstates(connect, db, dsn):
    jobs = ["mix-a", "mix-b"]
    for job in jobs:
        db.execute("SELECT ledger.register_job(%s, schedule => '1 second', ttl => '2 seconds', max_backfill => 2)",
                   [job])
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET statement_timeout = '20s'")
            for _ in range(40):
                job = rng.choice(jobs)
                kind = rng.choice(["start_due", "start_due", "start_due", "register", "unregister",
                                   "purge", "pause", "resume", "force_release", "reap"])
                try:
                    if kind == "start_due":
                        started = one(conn, "SELECT outcome, run_id, token FROM ledger.start_due_run(%s, %s)",
                                      [job, f"w{seed}"])
                        if started and started["outcome"] == "started":
                            end = rng.choice(["complete_run", "fail_run"])
                            args = "%s, %s" if end == "complete_run" else "%s, %s, 'x'"
                            conn.execute(f"SELECT ledger.{end}({args})", [started["run_id"], started["token"]])
                    elif kind == "register":
                        conn.execute("SELECT ledger.register_job(%s, schedule => '1 second', ttl => %s)",
                                     [job, rng.choice(["2 seconds", "3 seconds"])])
                    elif kind == "unregister":
                        conn.execute("SELECT ledger.unregister_job(%s, with_history => %s)",
                                     [job, rng.random() < 0.5])
                    elif kind == "purge":
                        conn.execute("SELECT ledger.purge_log('1 microsecond')")
                    elif kind in ("pause", "resume"):
                        conn.execute(f"SELECT ledger.{kind}_job(%s)", [job])
                    elif kind == "force_release":
                        conn.execute("SELECT ledger.force_release(%s)", [job])
                    else:
                        conn.execute("SELECT ledger.reap_expired(%s)", [job])
                    outcome = "ok"
                except psycopg.Error as error:
                    outcome = error.sqlstate or "none"
                with lock:
                    seen[outcome] += 1

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)

    assert sum(seen.values()) == 12 * 40
    assert set(seen) - {"ok"} <= DOCUMENTED, seen
    assert value(db, "SELECT count(*) FROM ledger.overlaps") == 0
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 0  # purge, takeovers and reaps beside


# 4. an idle transaction after sync_alerts --------------------------------

def test_an_idle_transaction_after_sync_alerts_holds_back_other_pollers_only_until_the_idle_limit(connect, db):
    idle = connect(autocommit=False)
    idle.execute("SELECT * FROM ledger.sync_alerts()")  # takes the lock, then sits idle
    idle_pid = idle.info.backend_pid
    failed = one(db, "SELECT run_id, token FROM ledger.start_run('flaky', 'h', '1 minute')")
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", [failed["run_id"], failed["token"]])

    poller = connect()
    raised = wait_for(lambda: [e for e in poller.execute(
        "SELECT kind, job FROM ledger.sync_alerts()").fetchall() if e == ("alert_raised", "flaky")],
        what="another poller to record the alert", timeout=90)

    assert raised == [("alert_raised", "flaky")]
    # The idle session was ended by the server, not left holding the lock.
    assert value(db, "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [idle_pid]) == 0
    with pytest.raises(psycopg.Error) as ended:
        idle.execute("SELECT 1")
    assert ended.value.sqlstate == "25P03"  # idle_in_transaction_session_timeout


def test_sync_alerts_keeps_a_stricter_idle_limit_of_the_caller(connect):
    caller = connect(autocommit=False)
    caller.execute("SET idle_in_transaction_session_timeout = '2s'")
    caller.execute("SELECT * FROM ledger.sync_alerts()")
    assert value(caller, "SHOW idle_in_transaction_session_timeout") == "2s"
    caller.rollback()
    other = connect(autocommit=False)
    other.execute("SELECT * FROM ledger.sync_alerts()")
    assert value(other, "SHOW idle_in_transaction_session_timeout") == "5s"
    other.rollback()
    assert value(other, "SHOW idle_in_transaction_session_timeout") == "0"  # for that transaction only
