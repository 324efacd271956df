"""One truth per job (issue 22): one state word per job, owned by SQL, the same in
ledger.job_health and ledger.job_status; one alert per job and cause; a state row
that purge never counts down nor overwrites; no ghost after unregister; and
ledger.verify_state, the audit that the stored state is the log's."""

from __future__ import annotations

import threading
from collections import defaultdict
from datetime import timedelta
from typing import Any

import psycopg

from situations import TROUBLE, build_situations
from sqlhelp import one, rows, value

STATES = {"crashed", "overrun", "paused", "running", "down", "late", "failing", "never_run", "ok"}


def alerts_by_job(db: psycopg.Connection) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for row in rows(db, "SELECT alert, job FROM ledger.alerts ORDER BY job, alert"):
        found[row["job"]].append(row["alert"])
    return dict(found)


def start(db: psycopg.Connection, job: str, ttl: str = "1 minute") -> dict[str, Any]:
    started = one(db, "SELECT * FROM ledger.start_run(job => %s, owner => 'w', ttl => %s)", (job, ttl))
    assert started is not None
    return started


def end(db: psycopg.Connection, started: dict[str, Any], how: str) -> None:
    call = {"complete": "ledger.complete_run(%s, %s)", "fail": "ledger.fail_run(%s, %s, 'boom')",
            "cancel": "ledger.cancel_run(%s, %s)"}[how]
    db.execute(f"SELECT {call}", (started["run_id"], started["token"]))


def verify(db: psycopg.Connection) -> list[dict[str, Any]]:
    return rows(db, "SELECT * FROM ledger.verify_state()")


def test_eight_situations_get_one_state_word_in_job_health_and_job_status_and_one_alert_each(db, ledger_clock):
    expected = build_situations(db, ledger_clock)
    health = {r["job"]: r["state"] for r in rows(db, "SELECT job, state FROM ledger.job_health")}
    assert health == expected
    status = {r["job"]: r["state"] for r in rows(db, "SELECT job, state FROM ledger.job_status")}
    assert status == expected
    assert set(health.values()) <= STATES
    # one job, one cause, one alert: the job's state when it is trouble, nothing else
    assert alerts_by_job(db) == {job: [alert] for job, alert in TROUBLE.items()}
    # overdue stays for older clients, said by the state
    overdue = {r["job"]: r["overdue"] for r in rows(db, "SELECT job, overdue FROM ledger.job_status")}
    assert {job for job, late in overdue.items() if late} == {"late", "down"}
    assert verify(db) == []


def test_a_killed_runner_is_crashed_within_one_ttl_without_a_reaper(db, ledger_clock):
    db.execute("SELECT ledger.register_job('nightly', ttl => '1 minute')")
    run = start(db, "nightly")  # its wrapper is SIGKILLed: no heartbeat, no end, the row stays running
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'nightly'") == "running"
    ledger_clock.advance(timedelta(seconds=61))
    row = one(db, "SELECT state, since, reason FROM ledger.job_health WHERE job = 'nightly'")
    assert row is not None and row["state"] == "crashed"
    assert row["since"] == value(db, "SELECT expires_at FROM ledger.leases WHERE job = 'nightly'")
    assert f"run {run['run_id']} is still marked running" in row["reason"]
    assert value(db, "SELECT state FROM ledger.job_status WHERE job = 'nightly'") == "crashed"
    [alert] = rows(db, "SELECT alert, run_id FROM ledger.alerts WHERE job = 'nightly'")
    assert alert == {"alert": "crashed", "run_id": run["run_id"]}
    # the reaper closes it: a lost lease is a failure
    assert value(db, "SELECT ledger.reap_expired()") == 1
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'nightly'") == "failing"
    assert verify(db) == []


def test_a_cancel_is_its_own_outcome_not_a_failure(db):
    db.execute("SELECT ledger.register_job('c', ttl => '1 minute', pause_after_failures => 1)")
    end(db, start(db, "c"), "complete")
    end(db, start(db, "c"), "cancel")
    row = one(db, "SELECT state, consecutive_failures FROM ledger.job_health WHERE job = 'c'")
    assert row == {"state": "ok", "consecutive_failures": 0}
    assert value(db, "SELECT paused FROM ledger.jobs WHERE job = 'c'") is False  # no pause after a cancel
    assert alerts_by_job(db) == {}
    # neither adds to a streak nor resets it
    db.execute("SELECT ledger.register_job('d', ttl => '1 minute')")
    end(db, start(db, "d"), "fail")
    end(db, start(db, "d"), "cancel")
    assert one(db, "SELECT state, consecutive_failures FROM ledger.job_health WHERE job = 'd'") == {
        "state": "failing", "consecutive_failures": 1}
    assert verify(db) == []


def test_the_failure_streak_survives_a_purge_and_pauses_the_job(db):
    n = 5
    db.execute("SELECT ledger.register_job('flaky', ttl => '1 minute', pause_after_failures => %s)", (n,))
    for _ in range(n - 1):
        end(db, start(db, "flaky"), "fail")
    assert value(db, "SELECT ledger.purge_log('1 microsecond')") > 0
    assert value(db, "SELECT consecutive_failures FROM ledger.job_health WHERE job = 'flaky'") == n - 1
    outcomes = []
    for _ in range(4):  # n + 3 failures in all, if nothing paused the job
        started = start(db, "flaky")
        outcomes.append(started["outcome"])
        if started["outcome"] == "started":
            end(db, started, "fail")
    assert outcomes == ["started", "paused", "paused", "paused"]
    row = one(db, "SELECT state, pause_reason, consecutive_failures FROM ledger.job_health WHERE job = 'flaky'")
    assert row == {"state": "paused", "pause_reason": "failures", "consecutive_failures": n}
    assert alerts_by_job(db) == {"flaky": ["paused"]}  # paused by failures: one alert, not also failing
    assert verify(db) == []


def test_a_purge_keeps_the_longest_success_and_the_last_success_it_may_not_count_down(db):
    db.execute("SELECT ledger.register_job('etl', ttl => '1 hour')")
    first = start(db, "etl", ttl="1 hour")
    end(db, first, "complete")
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '2 hours' "
               "WHERE run_id = %s", (first["run_id"],))  # the longest success (a write past the functions)
    for _ in range(3):
        end(db, start(db, "etl"), "complete")
    before = one(db, "SELECT longest_success, last_success_at, successes FROM ledger.counters WHERE job = 'etl'")
    assert value(db, "SELECT ledger.purge_log('1 microsecond')") == 3
    assert one(db, "SELECT longest_success, last_success_at, successes FROM ledger.counters WHERE job = 'etl'") == before
    assert verify(db) == []


def test_a_purge_never_overwrites_an_end_that_commits_while_it_runs(db, connect):
    """The end of a run commits between a purge's read of the log and its write: forced by a third session
    that holds the job's state row, so that the end queues first and the purge reads the run still running."""
    db.execute("SELECT ledger.register_job('j', ttl => '1 hour')")
    old = start(db, "j", ttl="1 hour")
    end(db, old, "complete")
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '1 hour' WHERE run_id = %s",
               (old["run_id"],))  # its longest success: a purge of it touches the job's state
    end(db, start(db, "j", ttl="1 hour"), "complete")
    run = start(db, "j", ttl="1 hour")
    holder, ender, purger = connect(autocommit=False), connect(), connect()
    holder.execute("SELECT FROM ledger.counters WHERE job = 'j' FOR UPDATE")
    done: dict[str, Any] = {}

    def call(name: str, conn: psycopg.Connection, sql: str, params: Any = None) -> threading.Thread:
        thread = threading.Thread(target=lambda: done.__setitem__(name, value(conn, sql, params)))
        thread.start()
        return thread

    def waits_or_done(name: str, conn: psycopg.Connection) -> None:
        for _ in range(3000):
            if name in done or value(db, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                                     (conn.info.backend_pid,)):
                return
            threading.Event().wait(0.01)
        raise AssertionError(f"{name} neither waits nor ends")

    threads = [call("end", ender, "SELECT status FROM ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))]
    waits_or_done("end", ender)  # the end waits for the state row, its run row updated: the run reads as running
    threads.append(call("purge", purger, "SELECT ledger.purge_log('1 microsecond')"))
    waits_or_done("purge", purger)
    holder.commit()
    for thread in threads:
        thread.join(30)
    assert done == {"end": "success", "purge": 1}
    status = one(db, "SELECT running_run_id, last_status FROM ledger.job_status WHERE job = 'j'")
    assert status == {"running_run_id": None, "last_status": "success"}  # not an ended run shown running
    assert value(db, "SELECT state FROM ledger.job_status WHERE job = 'j'") == "ok"
    assert verify(db) == []


def test_a_purge_loop_beside_starting_and_failing_workers_leaves_the_state_the_logs(dsn, db):
    """Workers each own a job (so each knows its job's streak) and share one; a purger purges all the while.
    Fixed iterations, no timing: what is asserted holds however the threads interleave."""
    workers, iterations = 3, 40
    tallies: dict[str, int] = {}
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                own, streak = f"own-{worker}", 0
                for i in range(iterations):
                    how = ("fail", "fail", "cancel", "complete", "fail")[(i * (worker + 1)) % 5]
                    for job in (own, "shared"):
                        started = one(conn, "SELECT * FROM ledger.start_run(job => %s, owner => %s, ttl => '1 minute')",
                                      (job, f"w{worker}"))
                        assert started is not None
                        if started["outcome"] != "started":
                            continue
                        try:
                            end(conn, started, how)
                        except psycopg.Error as error:  # the shared job taken over meanwhile
                            assert job == "shared" and error.sqlstate in ("LD001", "LD003"), error
                            continue
                        if job == own:
                            streak = 0 if how == "complete" else streak + (how == "fail")
                tallies[own] = streak
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    def purge() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for i in range(iterations):
                    if i % 2:
                        conn.execute("SELECT ledger.purge_log('1 microsecond')")
                    else:
                        conn.execute("SELECT * FROM ledger.purge_log_batch('1 microsecond')")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)] + [threading.Thread(target=purge)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    streaks = {r["job"]: r["consecutive_failures"] for r in rows(db, "SELECT job, consecutive_failures "
                                                                     "FROM ledger.job_health WHERE job LIKE 'own-%'")}
    assert streaks == tallies
    assert value(db, "SELECT count(*) FROM ledger.job_status WHERE running_run_id IS NOT NULL") == 0
    assert verify(db) == []


def test_unregister_with_history_leaves_no_ghost(db):
    db.execute("SELECT ledger.register_job('gone', '1 hour', ttl => '1 minute')")
    end(db, start(db, "gone"), "fail")
    assert value(db, "SELECT ledger.unregister_job('gone', with_history => true)") is True
    for view in ("job_status", "job_health", "alerts", "ttl_advice"):
        assert rows(db, f"SELECT * FROM ledger.{view} WHERE job = 'gone'") == [], view
    assert value(db, "SELECT count(*) FROM ledger.leases WHERE job = 'gone'") == 1  # its token mark stays
    assert verify(db) == []
    # known again once it takes a lease, and only then
    db.execute("SELECT ledger.acquire('gone', 'h', '1 minute')")
    assert value(db, "SELECT state FROM ledger.job_status WHERE job = 'gone'") == "never_run"


def test_a_run_past_max_runtime_raises_overrun_alone_not_also_long_running(db):
    db.execute("SELECT ledger.register_job('slow', ttl => '1 hour', max_runtime => '1 minute')")
    end(db, start(db, "slow", ttl="1 hour"), "complete")
    run = start(db, "slow", ttl="1 hour")
    # both an hour earlier (writes past the functions): the run has run for an hour
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '1 hour',"
               " completed_at = completed_at - interval '1 hour' WHERE run_id < %s", (run["run_id"],))
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '1 hour' WHERE run_id = %s",
               (run["run_id"],))
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'slow'") == "overrun"
    assert [(r["alert"], r["run_id"]) for r in rows(db, "SELECT alert, run_id FROM ledger.alerts")] == [
        ("overrun", run["run_id"])]


def test_job_health_job_status_and_alerts_read_no_log_and_evaluate_no_schedule(db):
    db.execute("SELECT ledger.register_job('cron', '*/5 * * * *', ttl => '1 minute', time_zone => 'Europe/Berlin')")
    db.execute("UPDATE ledger.jobs SET created_at = now() - interval '10 years'")  # far behind
    for view in ("job_health", "job_status", "alerts"):
        plan = "\n".join(r[0] for r in db.execute(f"EXPLAIN (VERBOSE) SELECT * FROM ledger.{view}").fetchall())
        for evaluator in ("ledger._slot", "ledger._cron", "ledger._interval", "ledger._due_marks"):
            assert evaluator not in plan, (view, evaluator)
        assert "Seq Scan on ledger.job_execution_log" not in plan, (view, plan)
        if view != "alerts":  # alerts looks up the overlap run of a job that has one, by its primary key
            assert "job_execution_log" not in plan, (view, plan)
    assert value(db, "SELECT state FROM ledger.job_health WHERE job = 'cron'") == "down"


def test_verify_state_reports_a_state_row_that_differs_from_the_log(db):
    db.execute("SELECT ledger.register_job('j', ttl => '1 minute')")
    end(db, start(db, "j"), "fail")
    assert verify(db) == []
    db.execute("UPDATE ledger.counters SET consecutive_failures = 0 WHERE job = 'j'")  # a state row gone wrong
    [row] = verify(db)
    assert row["job"] == "j" and row["state"] == "ok"
    assert row["differences"] == {"consecutive_failures": {"stored": 0, "expected": 1}}
    db.execute("SET ROLE ledger_reader")  # a monitor may run it
    assert value(db, "SELECT count(*) FROM ledger.verify_state()") == 1
