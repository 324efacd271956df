"""The `jobledger` commands other than `run` and `demo`, as real subprocesses on a real database:
register/pause/resume, status, runs, purge, reap, where; durations; help; errors in one line."""

from __future__ import annotations

import importlib
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
from datetime import timedelta

import click
import pytest
from click.testing import CliRunner
from clihelp import jobledger, runs_of, start

from ledger.cli import COMMAND_MODULES, main
from ledger.durations import format_duration, parse_duration
from ledger.wrapper import EXIT_CODES
from repo import DOCS
from waiting import wait_for


@pytest.mark.parametrize(("text", "expected"), [
    ("10s", timedelta(seconds=10)),
    ("80m", timedelta(minutes=80)),
    ("90d", timedelta(days=90)),
    ("1h30m", timedelta(hours=1, minutes=30)),
    ("1.5h", timedelta(minutes=90)),
    ("500ms", timedelta(milliseconds=500)),
    ("2w", timedelta(weeks=2)),
    ("45", timedelta(seconds=45)),
    ("80 minutes", timedelta(minutes=80)),
    ("1 day 2 hours", timedelta(days=1, hours=2)),
    ("2 hours 30 mins", timedelta(hours=2, minutes=30)),
    ("01:30:00", timedelta(hours=1, minutes=30)),
    ("3 days 04:05:06.5", timedelta(days=3, hours=4, minutes=5, seconds=6.5)),
    ("@ 1 hour", timedelta(hours=1)),
    ("0.900 seconds", timedelta(milliseconds=900)),
])
def test_durations_read_compact_and_postgresql_forms(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize(("text", "reason"), [
    ("", "empty"), ("soon", "cannot read"), ("3 months", "no fixed length"), ("1y", "no fixed length"),
    ("10 parsecs", "unknown unit"), ("1:xx", "cannot read"),
])
def test_durations_refuse_what_they_cannot_read(text, reason):
    with pytest.raises(ValueError, match=reason):
        parse_duration(text)


def test_durations_print_short():
    assert [format_duration(timedelta(seconds=s)) for s in (0.12, 1.5, 45, 4800, 90061)] == \
        ["120ms", "1.5s", "45s", "1h 20m", "1d 1h"]


def test_the_command_table_names_each_modules_commands_and_nothing_else():
    """The group imports a command's module when it runs (COMMAND_MODULES): the table is the
    commands each module defines, no more, no fewer."""
    defined = {command.name: module for module in set(COMMAND_MODULES.values())
               for command in importlib.import_module(f"ledger.cli.{module}").COMMANDS}
    assert defined == COMMAND_MODULES


def test_a_command_loads_only_its_own_module():
    """`jobledger run` (a cron line's) imports the wrapper, not sqlglot, prometheus_client or the dashboard."""
    probe = ("import sys; from ledger.cli import main; main(['run', '--help'], standalone_mode=False); "
             "print(sorted(m for m in ('sqlglot', 'prometheus_client', 'starlette', 'ledger.cli.report', "
             "'ledger.cli.metrics', 'ledger.cli.web', 'ledger.cli.run') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "['ledger.cli.run']", done.stdout


def test_every_command_has_help():
    runner = CliRunner()
    names = main.list_commands(click.Context(main))
    assert {"install", "sql", "register", "pause", "resume", "run", "status", "runs", "purge", "reap",
            "where", "demo", "next"} <= set(names)
    for name in names:
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)
        assert "Usage: " in result.output and "--help" in result.output


def test_the_cli_page_documents_every_exit_code_of_run():
    page = (DOCS / "cli.md").read_text()
    section = page.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    table = re.findall(r"^\| ([0-9+N-]+) \|", section, re.MULTILINE)
    assert set(EXIT_CODES) <= set(table)
    assert {"0", "1", "2"} <= set(table)


def test_register_pause_resume(dsn, db):
    result = jobledger("register", "nightly", "--schedule", "30 2 * * *", "--ttl", "80m", "--max-backfill", "2",
                       "--tz", "Europe/Berlin", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("registered nightly: schedule '30 2 * * *' (Europe/Berlin), ttl 1h 20m")
    job = db.execute("SELECT schedule, ttl, max_backfill, time_zone, paused FROM ledger.jobs "
                     "WHERE job = 'nightly'").fetchone()
    assert job == ("30 2 * * *", timedelta(minutes=80), 2, "Europe/Berlin", False)

    assert jobledger("pause", "nightly", dsn=dsn).stdout == "paused nightly\n"
    assert jobledger("pause", "nightly", dsn=dsn).stdout == "nightly was already paused\n"
    assert db.execute("SELECT paused FROM ledger.jobs WHERE job = 'nightly'").fetchone() == (True,)
    assert jobledger("resume", "nightly", dsn=dsn).stdout == "resumed nightly\n"
    assert db.execute("SELECT paused FROM ledger.jobs WHERE job = 'nightly'").fetchone() == (False,)

    registered = json.loads(jobledger("register", "hourly", "--schedule", "1 hour", "--json", dsn=dsn).stdout)
    assert (registered["job"], registered["schedule"], registered["ttl"], registered["max_backfill"]) == \
        ("hourly", "1 hour", None, 1)


def test_ledger_errors_are_one_line_and_exit_1(dsn):
    for args in (["pause", "never-registered"], ["register", "bad", "--schedule", "every tuesday"],
                 ["register", "bad", "--tz", "Mars/Olympus"]):
        result = jobledger(*args, dsn=dsn)
        assert result.returncode == 1, args
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("Error: "), result.stderr
    assert "job not found" in jobledger("pause", "never-registered", dsn=dsn).stderr
    unreachable = jobledger("status", dsn="host=127.0.0.1 port=1 connect_timeout=2")
    assert unreachable.returncode == 1 and len(unreachable.stderr.strip().splitlines()) == 1


def _fail_three_times(db, job: str) -> None:
    for attempt in range(3):
        run_id, token = db.execute(
            "SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'w', ttl => '1 minute')",
            (job,)).fetchone()
        db.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => %s)",
                   (run_id, token, f"exit code 1 (attempt {attempt})"))


def test_status_shows_jobs_and_alerts(dsn, db):
    db.execute("SELECT ledger.register_job(job => 'hourly', schedule => '1 hour', ttl => '10 minutes')")
    db.execute("SELECT ledger.start_run(job => 'busy', owner => 'host-1', ttl => '1 minute')")
    _fail_three_times(db, "broken")

    status = json.loads(jobledger("status", "--json", dsn=dsn).stdout)
    jobs = {row["job"]: row for row in status["jobs"]}
    assert set(jobs) == {"hourly", "busy", "broken"}
    assert jobs["busy"]["holder"] == "host-1" and jobs["busy"]["running_run_id"] is not None
    assert jobs["broken"]["consecutive_failures"] == 3 and jobs["broken"]["last_status"] == "failure"
    assert jobs["hourly"]["schedule"] == "1 hour" and jobs["hourly"]["ttl"] == 600.0
    assert jobs["hourly"]["next_slot"] is not None
    assert [(a["alert"], a["job"]) for a in status["alerts"]] == [("failing", "broken")]  # one job, one cause

    only = json.loads(jobledger("status", "broken", "--json", dsn=dsn).stdout)
    assert [row["job"] for row in only["jobs"]] == ["broken"]

    table = jobledger("status", dsn=dsn)
    assert table.returncode == 0, table.stderr
    assert "ledger.job_status" in table.stdout and "ledger.alerts" in table.stdout
    assert "⚠ broken" in table.stdout  # the job with an alert is marked
    assert "3 failures in a row" in table.stdout
    assert re.search(r"busy .* running ", table.stdout) and "host-1 (1)" in table.stdout


def test_status_of_an_empty_ledger(dsn):
    assert json.loads(jobledger("status", "--json", dsn=dsn).stdout) == {"jobs": [], "alerts": [], "protected_tables": [],
        "schedulers": [], "pools": []}
    assert "no jobs yet" in jobledger("status", dsn=dsn).stdout


def test_runs_lists_recent_runs_newest_first(dsn, db):
    _fail_three_times(db, "broken")
    db.execute("SELECT ledger.start_run(job => 'broken', owner => 'w2', ttl => '1 minute')")
    rows = json.loads(jobledger("runs", "broken", "--json", dsn=dsn).stdout)
    assert [r["status"] for r in rows] == ["running", "failure", "failure", "failure"]
    assert rows[1]["error"] == "exit code 1 (attempt 2)" and rows[1]["failure_reason"] == "error"
    assert isinstance(rows[1]["duration"], float) and rows[0]["completed_at"] is None
    assert [r["run_id"] for r in json.loads(jobledger("runs", "broken", "--limit", "2", "--json", dsn=dsn).stdout)] \
        == [rows[0]["run_id"], rows[1]["run_id"]]
    table = jobledger("runs", "broken", dsn=dsn).stdout
    assert "failure (error)" in table and "exit code 1 (attempt 0)" in table
    db.execute("SELECT ledger.register_job(job => 'nothing-here')")  # a known job without runs (unknown: exit 1)
    assert jobledger("runs", "nothing-here", dsn=dsn).stdout == "no runs of nothing-here\n"


def test_purge_deletes_old_runs_but_the_newest_success(dsn, db):
    for _ in range(3):
        run_id, token = db.execute(
            "SELECT run_id, token FROM ledger.start_run(job => 'old', owner => 'w', ttl => '1 minute')").fetchone()
        db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    # Age the log (the test is the table owner; clients cannot do this).
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '100 days', "
               "heartbeat_at = heartbeat_at - interval '100 days', completed_at = completed_at - interval '100 days'")
    result = jobledger("purge", "--older-than", "90d", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "purged 2 runs older than 90d\n"
    assert len(runs_of(db, "old")) == 1
    assert jobledger("purge", "--older-than", "'120 days'", dsn=dsn).returncode == 2  # quotes are not interval text
    assert jobledger("purge", "--older-than", "120 days", dsn=dsn).stdout == "purged 0 runs older than 120d\n"
    # All or nothing, in one transaction (ledger.purge_log): the same purge.
    db.execute("UPDATE ledger.job_execution_log SET started_at = started_at - interval '30 days', "
               "heartbeat_at = heartbeat_at - interval '30 days', completed_at = completed_at - interval '30 days'")
    complete_old = db.execute(
        "SELECT run_id, token FROM ledger.start_run(job => 'old', owner => 'w', ttl => '1 minute')").fetchone()
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", complete_old)
    result = jobledger("purge", "--older-than", "90d", "--one-transaction", dsn=dsn)
    assert result.stdout == "purged 1 run older than 90d\n", result.stderr
    assert [r["run_id"] for r in runs_of(db, "old")] == [complete_old[0]]
    assert jobledger("purge", dsn=dsn).returncode == 2  # --older-than is required


def test_reap_closes_runs_whose_lease_expired(dsn, db):
    db.execute("SELECT ledger.start_run(job => 'crashed', owner => 'gone', ttl => '50 milliseconds')")
    db.execute("SELECT ledger.start_run(job => 'alive', owner => 'here', ttl => '1 minute')")
    db.execute("SELECT pg_sleep(0.1)")
    assert jobledger("reap", "alive", dsn=dsn).stdout == "reaped 0 runs of alive\n"
    assert jobledger("reap", dsn=dsn).stdout == "reaped 1 run\n"
    [run] = runs_of(db, "crashed")
    assert (run["status"], run["failure_reason"]) == ("failure", "lease_expired")
    assert runs_of(db, "alive")[0]["status"] == "running"


def test_where_prints_the_dsn_in_use(dsn):
    result = jobledger("where", dsn=dsn)
    assert result.returncode == 0
    assert result.stdout == dsn + "\n"
    assert "LEDGER_DSN" in result.stderr
    option = jobledger("where", "--dsn", "postgresql://app:s3cret@db.example/ops")
    assert "s3cret" not in option.stdout and "****" in option.stdout and "db.example" in option.stdout
    assert "from option" in option.stderr
    shown = jobledger("where", "--show-password", "--dsn", "postgresql://app:s3cret@db.example/ops")
    assert shown.stdout == "postgresql://app:s3cret@db.example/ops\n"


# -- status --watch --------------------------------------------------------------------------------

def _watch(args: list[str], dsn: str, frames: int, is_frame) -> tuple[int, list[str], str]:
    """Start `jobledger ARGS`, wait for `frames` frames on stdout, Ctrl-C it: (exit code, stdout lines, stderr)."""
    watcher = start(*args, dsn=dsn)
    lines: list[str] = []
    assert watcher.stdout is not None
    reader = threading.Thread(target=lambda: lines.extend(iter(watcher.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_for(lambda: sum(1 for line in list(lines) if is_frame(line)) >= frames, timeout=60,
                 what=f"{frames} frames of {' '.join(args)}")
        watcher.send_signal(signal.SIGINT)
        _, stderr = watcher.communicate(timeout=60)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    reader.join(5)
    return watcher.returncode, [line.rstrip("\n") for line in lines], stderr


def test_the_cli_page_status_watch_redraws_until_ctrl_c(dsn, db):
    page = (DOCS / "cli.md").read_text()
    section = page.split("\n## Watching: `jobledger status --watch`\n", 1)[1].split("\n## ", 1)[0]
    [command] = [line for block in re.findall(r"```sh\n(.*?)```", section, re.S) for line in block.splitlines()
                 if line.startswith("jobledger ")]
    db.execute("SELECT ledger.register_job(job => 'hourly', schedule => '1 hour', ttl => '10 minutes')")
    # Three headers: the first two frames are then whole (a frame's table follows its header).
    code, lines, stderr = _watch(shlex.split(command)[1:], dsn, 3, lambda line: line.startswith("jobledger status"))
    assert code == 0, stderr  # Ctrl-C is the way a watch ends: no "Aborted!", no traceback
    assert "Traceback" not in stderr and "Aborted" not in stderr
    headers = [line for line in lines if line.startswith("jobledger status")]
    assert len(headers) >= 2 and all(re.match(r"jobledger status, every 1s \(.*; Ctrl-C to stop\)$", h)
                                     for h in headers)
    assert sum("hourly" in line for line in lines) >= 2  # each frame shows the job


def test_status_watch_json_is_one_object_a_line(dsn, db):
    db.execute("SELECT ledger.start_run(job => 'busy', owner => 'host-1', ttl => '1 minute')")
    code, lines, stderr = _watch(["status", "--watch", "--json", "--interval", "200ms", "busy"], dsn, 3,
                                 lambda line: line.startswith("{"))
    assert code == 0, stderr
    frames = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(frames) >= 3
    assert all([job["job"] for job in frame["jobs"]] == ["busy"] and frame["jobs"][0]["holder"] == "host-1"
               for frame in frames)


@pytest.mark.parametrize(("args", "message"), [
    (["status", "--interval", "2s"], "--interval goes with --watch"),
    (["status", "--watch", "--interval", "10ms"], "at least 100ms"),
])
def test_status_watch_options_are_checked(dsn, args, message):
    result = jobledger(*args, dsn=dsn)
    assert result.returncode == 2 and message in result.stderr, result.stderr
