"""Operator commands (issue 12): unregister_job, force_release, request_cancel,
as SQL, through the Python client, and as `jobledger unregister/release/cancel`
subprocesses."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime, timedelta

import psycopg
import pytest

from clihelp import jobledger, running_run, runs_of, start
from ledger.client import Ledger
from ledger.errors import LeaseLost, LeaseSuperseded
from repo import ROOT
from sqlhelp import one, value
from waiting import wait_for


def started(db: psycopg.Connection, job: str, owner: str = "h", ttl: str = "1 hour") -> dict:
    row = one(db, "SELECT * FROM ledger.start_run(job => %s, owner => %s, ttl => %s)", (job, owner, ttl))
    assert row["outcome"] == "started", row
    return row


def test_unregister_keeps_the_runs_and_with_history_deletes_them_never_the_token_mark(dsn, db):
    db.execute("SELECT ledger.register_job('old', '1 hour', ttl => '1 minute')")
    run = started(db, "old")
    done = jobledger("unregister", "old", dsn=dsn)
    assert done.returncode == 1 and "is live: cancel it" in done.stderr, done.stderr
    db.execute("SELECT ledger.complete_run(%s, %s)", (run["run_id"], run["token"]))
    done = jobledger("unregister", "old", dsn=dsn)
    assert done.returncode == 0 and done.stdout.strip() == "unregistered old (its runs stay)", done.stderr
    assert value(db, "SELECT count(*) FROM ledger.jobs WHERE job = 'old'") == 0
    assert len(runs_of(db, "old")) == 1
    done = jobledger("unregister", "old", "--with-history", dsn=dsn)
    assert done.returncode == 0 and "deleted its history" in done.stdout, done.stderr
    assert runs_of(db, "old") == [] and value(db, "SELECT count(*) FROM ledger.counters WHERE job = 'old'") == 0
    # the token mark stays: the next token is above the old one
    assert started(db, "old", ttl="1 minute")["token"] > run["token"]
    done = jobledger("unregister", "never", dsn=dsn)
    assert done.returncode == 1 and "never was never registered" in done.stderr
    assert "--with-history" in jobledger("unregister", "--help").stdout


def test_force_release_supersedes_the_holders_token_and_closes_its_run(dsn, db):
    run = started(db, "stuck")
    db.execute("SELECT ledger.fence('stuck', 'table-x', %s)", (run["token"],))
    done = jobledger("release", "stuck", dsn=dsn)
    assert done.returncode == 0, done.stderr
    token = int(re.search(r"token (\d+) supersedes", done.stdout).group(1))  # type: ignore[union-attr]
    assert token > run["token"]
    [row] = runs_of(db, "stuck")
    assert (row["status"], row["failure_reason"]) == ("failure", "superseded")
    assert value(db, "SELECT ledger.heartbeat(%s, %s)", (run["run_id"], run["token"])) is None
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.fence('stuck', 'table-x', %s)", (run["token"],))
    assert caught.value.sqlstate == "LD001"
    assert value(db, "SELECT leases_lost FROM ledger.job_counters WHERE job = 'stuck'") == 1
    # the job is free: anyone may start it
    assert started(db, "stuck", owner="other")["token"] > token
    assert jobledger("release", "nobody", dsn=dsn).returncode == 1
    db.execute("SELECT ledger.register_job('unleased', ttl => '1 minute')")
    assert jobledger("release", "unleased", dsn=dsn).stdout.strip() == "unleased has no lease"


def test_cancel_asks_jobledger_run_to_stop_cmd_and_the_run_is_recorded_cancelled(dsn, db):
    wrapper = start("run", "long", "--ttl", "3s", "--grace", "1s", "--", "sleep", "60", dsn=dsn)
    try:
        run = wait_for(lambda: running_run(db, "long"), what="the run to start")
        done = jobledger("cancel", str(run["run_id"]), dsn=dsn)  # type: ignore[index]
        assert done.returncode == 0 and "asked run" in done.stdout, done.stderr
        # asked again: "asked already", or "already ended" once a heartbeat ended it (a race)
        again = jobledger("cancel", str(run["run_id"]), dsn=dsn)  # type: ignore[index]
        assert "was asked to stop already" in again.stdout or "already ended" in again.stderr, again
        code = wrapper.wait(timeout=60)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
    stderr = wrapper.stderr.read() if wrapper.stderr else ""
    assert code == 124, stderr  # the lease is lost to it: CMD stopped
    # it says an operator cancelled it, and the end the ledger recorded, not a failure to record one
    assert "cancelled by an operator: stopping the command" in stderr, stderr
    assert "an operator cancelled the run (ledger.request_cancel)" in stderr, stderr
    assert "could not record its end" not in stderr, stderr
    [row] = runs_of(db, "long")
    assert f"run {row['run_id']} cancelled: " in stderr, stderr
    assert (row["status"], row["failure_reason"]) == ("failure", "cancelled")
    assert str(row["error"]).startswith("cancelled by an operator") and row["cancel_requested_at"] is not None
    ended = jobledger("cancel", str(row["run_id"]), dsn=dsn)
    assert ended.returncode == 1 and "already ended" in ended.stderr
    assert jobledger("cancel", "999999", dsn=dsn).returncode == 1


def test_the_python_client_marks_a_cancelled_run_lost_and_calls_on_lost(dsn, db):
    lost: list[LeaseLost] = []
    seen = threading.Event()

    def on_lost(error: LeaseLost) -> None:
        lost.append(error)
        seen.set()

    with psycopg.connect(dsn, autocommit=True) as conn:
        ledger = Ledger(conn, owner="worker")
        with pytest.raises(LeaseLost):
            with ledger.run("py", ttl=timedelta(seconds=30), heartbeat_interval=timedelta(milliseconds=100),
                            on_lost=on_lost) as run:
                assert Ledger(db).request_cancel(run.run_id) is True  # type: ignore[arg-type]
                assert seen.wait(10) and run.lost.is_set()
    assert len(lost) == 1 and lost[0].reason == "an operator cancelled the run (ledger.request_cancel)"
    # the run's end as the ledger recorded it
    assert run.result is not None and (run.result.status, run.result.failure_reason) == ("failure", "cancelled")
    [row] = runs_of(db, "py")
    assert (row["status"], row["failure_reason"]) == ("failure", "cancelled")


def test_the_operator_functions_refuse_bad_input_and_change_nothing(db):
    for call, sqlstate in [("ledger.unregister_job(NULL)", "22004"), ("ledger.unregister_job('j', NULL)", "22004"),
                           ("ledger.force_release(NULL)", "22004"), ("ledger.force_release('')", "22023"),
                           ("ledger.request_cancel(NULL)", "22004"), ("ledger.request_cancel(0)", "22023"),
                           ("ledger.request_cancel(42)", "LD004"), ("ledger.force_release('nope')", "LD005")]:
        with pytest.raises(psycopg.Error) as caught:
            db.execute(f"SELECT {call}")
        assert caught.value.sqlstate == sqlstate, call
        if sqlstate == "22023":
            assert "argument" in json.loads(caught.value.diag.message_detail or "{}")


def test_the_operations_page_example_runs(dsn):
    page = (ROOT / "docs" / "operations.md").read_text()
    [block] = re.findall(r"<!-- executed by tests/sql/test_operator\.py[^>]*-->\n```console\n(.*?)```", page, re.S)
    commands = [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    assert [c.split()[1] for c in commands] == ["run", "cancel", "release", "unregister"]
    import shlex
    db = psycopg.connect(dsn, autocommit=True)
    try:
        wrapper = start(*shlex.split(commands[0])[1:-1], dsn=dsn)  # without the trailing `&`
        run = wait_for(lambda: running_run(db, "nightly-export"), what="the run to start")
        cancel = shlex.split(commands[1].replace("RUN_ID", str(run["run_id"])))  # type: ignore[index]
        assert jobledger(*cancel[1:], dsn=dsn).returncode == 0
        assert wrapper.wait(timeout=60) == 124
        for command in commands[2:]:
            done = jobledger(*shlex.split(command)[1:], dsn=dsn)
            assert done.returncode == 0, (command, done.stderr)
        assert value(db, "SELECT count(*) FROM ledger.jobs WHERE job = 'nightly-export'") == 0
    finally:
        db.close()
    time.sleep(0)


def _slot(db: psycopg.Connection, job: str, back: str):  # type: ignore[no-untyped-def]
    return value(db, "SELECT ledger._slot_at_or_before(j.schedule_spec, j.time_zone, now() - %s::interval) "
                     "FROM ledger.jobs j WHERE j.job = %s", (back, job))


def test_backfill_runs_the_slots_of_a_range_oldest_first_never_one_that_succeeded(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job('hourly', '1 hour', ttl => '1 minute')")
    done = one(db, "SELECT * FROM ledger.start_run('hourly', 'h', slot => %s)", (_slot(db, "hourly", "3 hours"),))
    db.execute("SELECT ledger.complete_run(%s, %s)", (done["run_id"], done["token"]))
    first, last = _slot(db, "hourly", "5 hours"), _slot(db, "hourly", "0")
    marks = tmp_path / "slots"
    result = jobledger("backfill", "hourly", "--from", first.isoformat(), "--to", last.isoformat(), "--",
                       "sh", "-c", f'echo "$LEDGER_SLOT" >> {marks}', dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "backfill of job hourly: 5 slots run; none left" in result.stderr
    ran = [line for line in marks.read_text().splitlines()]
    expected = [first + timedelta(hours=n) for n in range(6) if n != 2]
    assert [datetime.fromisoformat(line) for line in ran] == expected
    slots = [r["slot"] for r in runs_of(db, "hourly") if r["status"] == "success"]
    assert sorted(slots) == sorted([*expected, done["slot"]]) and len(set(slots)) == 6
    again = jobledger("backfill", "hourly", "--from", first.isoformat(), "--to", last.isoformat(), "--",
                      "sh", "-c", f'echo "$LEDGER_SLOT" >> {marks}', dsn=dsn)
    assert again.returncode == 0 and "0 slots run" in again.stderr and len(marks.read_text().splitlines()) == 5
    assert "--from" in jobledger("backfill", "--help").stdout


def test_backfill_in_sql_stops_at_a_failure_and_refuses_bad_ranges(db):
    db.execute("SELECT ledger.register_job('b', '1 hour', ttl => '1 minute')")
    first, last = _slot(db, "b", "2 hours"), _slot(db, "b", "1 hour")
    row = one(db, "SELECT * FROM ledger.backfill('b', 'h', %s, %s)", (first, last))
    assert (row["outcome"], row["slot"]) == ("started", first)
    assert one(db, "SELECT * FROM ledger.backfill('b', 'other', %s, %s)", (first, last))["outcome"] == "skipped_overlap"
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (row["run_id"], row["token"]))
    row = one(db, "SELECT * FROM ledger.backfill('b', 'h', %s, %s)", (first, last))
    assert row["slot"] == first  # a failed slot is retried
    db.execute("SELECT ledger.complete_run(%s, %s)", (row["run_id"], row["token"]))
    row = one(db, "SELECT * FROM ledger.backfill('b', 'h', %s, %s)", (first, last))
    db.execute("SELECT ledger.complete_run(%s, %s)", (row["run_id"], row["token"]))
    assert row["slot"] == last
    assert one(db, "SELECT * FROM ledger.backfill('b', 'h', %s, %s)", (first, last))["outcome"] == "nothing_due"
    for args, argument in [((last, first), "to_slot"), ((first - timedelta(days=100), last), "to_slot")]:
        with pytest.raises(psycopg.Error) as caught:
            db.execute("SELECT ledger.backfill('b', 'h', %s, %s)", args)
        assert caught.value.sqlstate == "22023"
        assert json.loads(caught.value.diag.message_detail or "{}")["argument"] == argument
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.backfill('unscheduled', 'h', %s, %s)", (first, last))
    assert caught.value.sqlstate == "LD005"
