"""`jobledger run JOB -- CMD`: the wrapper, as cron runs it: a real subprocess on a real database.

Exit codes, the run's log row, the environment CMD gets, the skip path,
lease loss (SIGTERM then SIGKILL to CMD), signal forwarding (the run is
recorded cancelled), the catch-up loop (CMD once per due slot), the time
limit (--timeout), retries (--retries, --backoff) and the message for a host
that races another for a due slot.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time

import pytest
from clihelp import JOBLEDGER, environment, jobledger, runs_of, running_run, start

from ledger.wrapper import ERROR_CHARS
from repo import DOCS
from waiting import wait_for

# CMD that records its ledger environment as JSON lines in $OUT.
RECORD_ENV = (
    'printf \'{"job":"%s","run_id":"%s","token":"%s","slot":"%s","owner":"%s"}\\n\' '
    '"$LEDGER_JOB" "$LEDGER_RUN_ID" "$LEDGER_FENCING_TOKEN" "$LEDGER_SLOT" "$LEDGER_OWNER" >> "$OUT"'
)

# CMD that announces it is ready, notes every SIGTERM it gets, and ignores it.
STUBBORN = ('trap "echo TERM >> $MARKS" TERM; echo $$ > $READY; '
            'while :; do sleep 0.1; done')


def test_success_gives_cmd_the_run_and_exits_0(dsn, db, tmp_path):
    out = tmp_path / "env.jsonl"
    result = jobledger("run", "report", "--ttl", "1m", "--", "sh", "-c", RECORD_ENV,
                       env=environment(dsn, OUT=str(out)))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # quiet on success: cron mails nothing
    seen = json.loads(out.read_text())
    [run] = runs_of(db, "report")
    assert run["status"] == "success"
    assert seen == {"job": "report", "run_id": str(run["run_id"]), "token": str(run["token"]), "slot": "",
                    "owner": run["owner"]}
    assert run["detail"]["exit_code"] == 0
    assert run["detail"]["command"] == ["sh", "-c", RECORD_ENV]


def test_failure_exits_with_cmd_code_and_keeps_a_bounded_stderr_tail(dsn, db):
    noisy = "i=0; while [ $i -lt 3000 ]; do echo \"noise line $i\" >&2; i=$((i+1)); done; echo 'disk full' >&2; exit 3"
    result = jobledger("run", "export", "--ttl", "1m", "--", "sh", "-c", noisy, dsn=dsn)
    assert result.returncode == 3
    assert "disk full" in result.stderr  # CMD's stderr passes through
    assert "jobledger: run 1 failed (error): exit code 3" in result.stderr
    [run] = runs_of(db, "export")
    assert (run["status"], run["failure_reason"]) == ("failure", "error")
    assert "exit code 3" in run["error"]
    assert run["error"].rstrip().endswith("disk full")
    assert len(run["error"]) < ERROR_CHARS + 200
    assert "noise line 0\n" not in run["error"]


def test_a_missing_command_is_a_recorded_failure_with_exit_127(dsn, db):
    result = jobledger("run", "typo", "--ttl", "1m", "--", "./no-such-script.sh", dsn=dsn)
    assert result.returncode == 127
    [run] = runs_of(db, "typo")
    assert run["status"] == "failure" and "command not found" in run["error"]


def test_ledger_errors_exit_125_without_running_cmd(dsn, tmp_path):
    marker = tmp_path / "ran"
    # An unregistered job needs --ttl: the ledger refuses to start it.
    result = jobledger("run", "no-ttl", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 125
    assert "ttl is required" in result.stderr and "--ttl" in result.stderr
    # No database at all.
    result = jobledger("run", "job", "--ttl", "1m", "--", "touch", str(marker),
                       dsn="host=127.0.0.1 port=1 connect_timeout=2")
    assert result.returncode == 125
    assert len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_an_overlap_skips_with_exit_0_or_the_chosen_code(dsn, db, tmp_path):
    db.execute("SELECT ledger.start_run(job => 'publish', owner => 'host-1', ttl => '1 minute')")
    marker = tmp_path / "ran"
    result = jobledger("run", "publish", "--ttl", "1m", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 0
    assert "skipped: held by host-1 until " in result.stderr
    result = jobledger("run", "publish", "--ttl", "1m", "--skip-exit-code", "75", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 75
    assert not marker.exists()
    counters = db.execute("SELECT skipped_overlap, failures FROM ledger.job_counters WHERE job = 'publish'").fetchone()
    assert counters == (2, 0)


def test_a_paused_job_does_not_run(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'nightly', ttl => '1 minute')")
    db.execute("SELECT ledger.pause_job(job => 'nightly')")
    marker = tmp_path / "ran"
    result = jobledger("run", "nightly", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 0
    assert "paused: job nightly is paused" in result.stderr
    assert not marker.exists() and runs_of(db, "nightly") == []


def test_lease_loss_sends_sigterm_then_sigkill_to_cmd(dsn, db, tmp_path):
    marks, ready = tmp_path / "marks", tmp_path / "ready"
    wrapper = start("run", "sync", "--ttl", "1.5s", "--grace", "0.6s", "--", "sh", "-c", STUBBORN,
                    env=environment(dsn, MARKS=str(marks), READY=str(ready)))
    try:
        wait_for(lambda: ready.exists() and ready.read_text().strip(), what="CMD to start")
        child = int(ready.read_text())
        run = running_run(db, "sync")
        assert run is not None
        # Steal the lease: expire it and start another owner's run in one
        # transaction, so the wrapper's heartbeat cannot renew in between.
        with db.transaction():
            db.execute("UPDATE ledger.leases SET expires_at = clock_timestamp() - interval '1 second' "
                       "WHERE job = 'sync'")
            outcome = db.execute("SELECT outcome FROM ledger.start_run(job => 'sync', owner => 'thief', "
                                 "ttl => '1 minute')").fetchone()
        assert outcome == ("started",)
        stolen_at = time.monotonic()
        stdout, stderr = wrapper.communicate(timeout=60)
        took = time.monotonic() - stolen_at
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
    assert wrapper.returncode == 124, stderr
    assert "lease lost" in stderr
    assert marks.read_text().splitlines()[0] == "TERM"  # asked first...
    assert took >= 0.6  # ...and killed only after the grace
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # SIGKILL: CMD ignored SIGTERM and is gone anyway
    runs = {r["owner"]: r for r in runs_of(db, "sync")}
    lost = runs[run["owner"]]
    assert (lost["status"], lost["failure_reason"]) == ("failure", "lease_expired")  # the takeover's verdict
    assert runs["thief"]["status"] == "running"


@pytest.mark.parametrize(("sent", "script", "code"), [
    (signal.SIGTERM, 'trap "echo TERM >> $MARKS; exit 7" TERM; echo $$ > $READY; while :; do sleep 0.1; done', 7),
    (signal.SIGINT, "echo $$ > $READY; exec sleep 30", 128 + signal.SIGINT),
])
def test_a_signal_to_the_wrapper_is_forwarded_and_the_run_cancelled(dsn, db, tmp_path, sent, script, code):
    marks, ready = tmp_path / "marks", tmp_path / "ready"
    wrapper = start("run", "backup", "--ttl", "1m", "--", "sh", "-c", script,
                    env=environment(dsn, MARKS=str(marks), READY=str(ready)))
    try:
        wait_for(lambda: ready.exists() and ready.read_text().strip(), what="CMD to start")
        wrapper.send_signal(sent)
        stdout, stderr = wrapper.communicate(timeout=60)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
    assert wrapper.returncode == code, stderr  # the wrapper exits with CMD's code
    if sent == signal.SIGTERM:
        assert marks.read_text() == "TERM\n"  # CMD got it, once
    [run] = runs_of(db, "backup")
    assert (run["status"], run["failure_reason"]) == ("failure", "cancelled")
    assert f"{signal.Signals(sent).name} received and forwarded" in run["error"]
    assert db.execute("SELECT holder FROM ledger.job_status WHERE job = 'backup'").fetchone() == (None,)


def _backdated_success(db, job: str, seconds_ago: int) -> None:
    """A run that served the slot `seconds_ago` ago (start_run takes an explicit slot)."""
    row = db.execute(
        "SELECT s.run_id, s.token FROM ledger.start_run(job => %(job)s, owner => 'earlier', "
        "slot => date_trunc('second', clock_timestamp()) - make_interval(secs => %(ago)s)) AS s",
        {"job": job, "ago": seconds_ago}).fetchone()
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", row)


def test_a_scheduled_job_catches_up_once_per_due_slot(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'rollup', schedule => '1 second', ttl => '1 minute', "
               "max_backfill => 3)")
    _backdated_success(db, "rollup", 8)
    out = tmp_path / "env.jsonl"
    result = jobledger("run", "rollup", "--", "sh", "-c", RECORD_ENV, env=environment(dsn, OUT=str(out)))
    assert result.returncode == 0, result.stderr
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    runs = [r for r in runs_of(db, "rollup") if r["owner"] != "earlier"]
    assert len(seen) == len(runs) >= 3  # the newest max_backfill slots, and any that came due meanwhile
    assert [s["slot"] for s in seen] == [r["slot"].isoformat() for r in runs]
    assert [s["run_id"] for s in seen] == [str(r["run_id"]) for r in runs]
    assert all(r["status"] == "success" for r in runs)
    assert runs == sorted(runs, key=lambda r: r["slot"])
    dropped = db.execute("SELECT sum(slot_count) FROM ledger.skipped_slots WHERE job = 'rollup'").fetchone()[0]
    assert dropped >= 4  # 8 slots missed, 3 run: the rest recorded as dropped


def test_the_catch_up_stops_at_a_failing_slot(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'flaky', schedule => '1 second', ttl => '1 minute', "
               "max_backfill => 3)")
    _backdated_success(db, "flaky", 6)
    count = tmp_path / "count"
    script = f'echo x >> {count}; [ "$(wc -l < {count})" -lt 2 ]'  # the second slot fails
    result = jobledger("run", "flaky", "--", "sh", "-c", script, dsn=dsn)
    assert result.returncode == 1
    statuses = [r["status"] for r in runs_of(db, "flaky") if r["owner"] != "earlier"]
    assert statuses == ["success", "failure"]  # the third slot waits for the next run


def test_verbose_says_each_run(dsn):
    result = jobledger("run", "chatty", "--ttl", "1m", "-v", "--", "true", dsn=dsn)
    assert result.returncode == 0
    assert "run 1 of job chatty started (token 1)" in result.stderr
    assert "run 1 succeeded" in result.stderr


def test_durations_are_checked_before_anything_runs(dsn, tmp_path):
    result = jobledger("run", "job", "--ttl", "soon", "--", "true", dsn=dsn)
    assert result.returncode == 2
    assert "cannot read 'soon' as a duration" in result.stderr


def test_the_help_of_run_names_the_environment_the_job_aware_fence_needs():
    result = jobledger("run", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for name in ("LEDGER_JOB", "LEDGER_FENCING_TOKEN", "LEDGER_DSN", "ledger.fence(job =>"):
        assert name in text, name


CLI_PAGE = DOCS / "cli.md"  # its examples marked executed by this file


def _readme_fencing_script() -> str:
    readme = CLI_PAGE.read_text()
    section = readme.split("\n## Wrapping a command: `jobledger run`\n", 1)[1].split("\n## ", 1)[0]
    [script] = [block for block in re.findall(r"```sh\n(.*?)```", section, re.S) if "ledger.fence(" in block]
    return script


def test_cmd_fences_its_write_with_ledger_job_and_a_stale_or_foreign_token_writes_nothing(dsn, db, tmp_path):
    """The README's fencing command: CMD fences with LEDGER_JOB and LEDGER_FENCING_TOKEN."""
    db.execute("CREATE TABLE feed (published_at timestamptz, token bigint)")
    script = tmp_path / "publish.sh"
    script.write_text(_readme_fencing_script())
    script.chmod(0o755)
    result = jobledger("run", "publish", "--ttl", "1m", "--", "./publish.sh", cwd=tmp_path,
                       env=environment(dsn))
    assert result.returncode == 0, result.stderr
    [run] = runs_of(db, "publish")
    assert run["status"] == "success"
    assert db.execute("SELECT token FROM feed").fetchall() == [(run["token"],)]
    assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'feed'").fetchone() == \
        ("publish", run["token"])

    # The same command by hand, later, with the old run's facts: a zombie. The fence refuses it.
    zombie = subprocess.run(["./publish.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env=environment(dsn, LEDGER_JOB="publish", LEDGER_FENCING_TOKEN=str(run["token"])))
    assert zombie.returncode == 3 and "lease superseded" in zombie.stderr, zombie.stderr
    # Another job's run of it: "feed" belongs to job publish (LD006), CMD fails, the run with it.
    other = jobledger("run", "republish", "--ttl", "1m", "--", "./publish.sh", cwd=tmp_path,
                      env=environment(dsn))
    assert other.returncode == 3, other.stderr
    [failed] = runs_of(db, "republish")
    assert failed["status"] == "failure" and "fence of another job" in failed["error"]
    assert db.execute("SELECT token FROM feed").fetchall() == [(run["token"],)]


def _readme_crontab_job_line() -> str:
    readme = CLI_PAGE.read_text()
    block = readme.split("```crontab\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip() and not line.startswith("#") and "=" not in
             line.split()[0]]
    return lines[0]


def test_the_readme_crontab_line_runs_once_and_skips_the_concurrent_copy(dsn, db, tmp_path):
    line = _readme_crontab_job_line()
    fields = line.split(None, 5)
    assert len(fields) == 6 and fields[5].startswith("jobledger run ")
    command = fields[5].replace("jobledger", shlex.join(JOBLEDGER), 1)
    script = tmp_path / "publish.sh"
    # The first copy holds the lease until the test has seen the second one skip
    # (a file, not a fixed sleep: a busy machine starts the second copy late).
    script.write_text("#!/bin/sh\necho published >> ran\n"
                      "i=0; while [ ! -f done ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done\n")
    script.chmod(0o755)
    env = environment(dsn)
    # cron runs the line with sh, from the crontab owner's home: here tmp_path.
    first = subprocess.Popen(["sh", "-c", command], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / "ran").exists(), what="the first copy to start")
    second = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    (tmp_path / "done").touch()
    _, first_err = first.communicate(timeout=60)
    assert first.returncode == 0, first_err
    assert second.returncode == 0, second.stderr
    assert "skipped: held by " in second.stderr
    assert (tmp_path / "ran").read_text() == "published\n"
    job = fields[5].split()[2]
    assert [r["status"] for r in runs_of(db, job)] == ["success"]


# -- time limit, retries, the racing host -----------------------------------------------------------

def test_timeout_stops_cmd_and_records_a_failure_with_exit_123(dsn, db, tmp_path):
    marks, ready = tmp_path / "marks", tmp_path / "ready"
    result = jobledger("run", "slow", "--ttl", "1m", "--timeout", "1s", "--grace", "0.5s", "--", "sh", "-c", STUBBORN,
                       env=environment(dsn, MARKS=str(marks), READY=str(ready)))
    assert result.returncode == 123, result.stderr
    assert "timeout: the command ran longer than 1s: stopping it" in result.stderr
    assert marks.read_text().splitlines()[0] == "TERM"
    with pytest.raises(ProcessLookupError):
        os.kill(int(ready.read_text()), 0)  # it ignored SIGTERM: SIGKILL after the grace
    [run] = runs_of(db, "slow")
    assert (run["status"], run["failure_reason"]) == ("failure", "error")
    assert "timeout: ran longer than 1s; command stopped with SIGTERM, then SIGKILL after the grace" in run["error"]
    assert run["detail"]["timeout_seconds"] == 1.0 and run["detail"]["exit_code"] == 123


def test_a_command_within_its_timeout_is_not_stopped(dsn, db):
    result = jobledger("run", "quick", "--ttl", "1m", "--timeout", "30m", "--", "true", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert [r["status"] for r in runs_of(db, "quick")] == ["success"]


def _cli_page_retry_line() -> str:
    section = CLI_PAGE.read_text().split("\n## Wrapping a command: `jobledger run`\n", 1)[1].split("\n## ", 1)[0]
    [block] = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S) if "--retries" in b]
    [line] = [line for line in block.splitlines() if line.startswith("jobledger ")]
    return line


def test_the_cli_page_retry_example_retries_a_failed_run_as_a_run_of_its_own(dsn, db, tmp_path):
    line = _cli_page_retry_line()
    script = tmp_path / "export.sh"
    script.write_text("#!/bin/sh\necho x >> attempts\n[ \"$(wc -l < attempts)\" -ge 2 ] || { echo 'network down' >&2; "
                      "exit 4; }\n")
    script.chmod(0o755)
    command = line.replace("jobledger", shlex.join(JOBLEDGER), 1)
    result = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=environment(dsn), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "attempt 1 of 3 failed: retrying in 1s" in result.stderr
    job = line.split()[2]
    runs = runs_of(db, job)
    assert [(r["status"], r["detail"]["attempt"]) for r in runs] == [("failure", 1), ("success", 2)]
    assert "network down" in runs[0]["error"]
    assert runs[0]["token"] < runs[1]["token"]  # each attempt started (and fenced) on its own


def test_retries_end_after_n_more_attempts_with_the_last_code_and_a_doubling_backoff(dsn, db):
    result = jobledger("run", "broken", "--ttl", "1m", "--retries", "2", "--backoff", "100ms", "--",
                       "sh", "-c", "exit 3", dsn=dsn)
    assert result.returncode == 3, result.stderr
    assert "attempt 1 of 3 failed: retrying in 100ms" in result.stderr
    assert "attempt 2 of 3 failed: retrying in 200ms" in result.stderr
    runs = runs_of(db, "broken")
    assert [(r["status"], r["detail"]["attempt"]) for r in runs] == [("failure", 1), ("failure", 2), ("failure", 3)]


def test_a_scheduled_job_retries_the_same_slot_then_goes_on(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'daily', schedule => '1 day', ttl => '1 minute')")
    count = tmp_path / "count"
    script = f'echo x >> {count}; [ "$(wc -l < {count})" -ge 2 ]'  # the first attempt fails
    result = jobledger("run", "daily", "--retries", "3", "--backoff", "100ms", "--", "sh", "-c", script, dsn=dsn)
    assert result.returncode == 0, result.stderr
    runs = runs_of(db, "daily")
    assert [r["status"] for r in runs] == ["failure", "success"]
    assert runs[0]["slot"] == runs[1]["slot"] is not None


def test_a_command_that_cannot_start_is_not_retried(dsn, db):
    result = jobledger("run", "typo", "--ttl", "1m", "--retries", "3", "--backoff", "100ms", "--",
                       "./no-such-script.sh", dsn=dsn)
    assert result.returncode == 127
    assert len(runs_of(db, "typo")) == 1


def test_sigterm_during_the_backoff_ends_the_retries(dsn, db):
    wrapper = start("run", "flaky", "--ttl", "1m", "--retries", "5", "--backoff", "30s", "--", "sh", "-c", "exit 1",
                    dsn=dsn)
    try:
        wait_for(lambda: [r["status"] for r in runs_of(db, "flaky")] == ["failure"], timeout=30,
                 what="the first attempt to fail")
        wrapper.send_signal(signal.SIGTERM)
        _, stderr = wrapper.communicate(timeout=60)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
    assert wrapper.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM received: no more retries" in stderr
    assert len(runs_of(db, "flaky")) == 1


def test_the_racing_host_is_told_who_runs_the_due_slot(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'nightly', schedule => '1 day', ttl => '1 minute')")
    started = db.execute("SELECT outcome, slot FROM ledger.start_due_run(job => 'nightly', owner => 'host-1')").fetchone()
    assert started[0] == "started"
    marker = tmp_path / "ran"
    result = jobledger("run", "nightly", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert re.search(r"nothing due: slot \S+ of job nightly is being run by host-1 \(lease until \S+\)",
                     result.stderr), result.stderr
    result = jobledger("run", "nightly", "--skip-exit-code", "75", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 75
    assert not marker.exists()
    [run] = runs_of(db, "nightly")
    assert run["owner"] == "host-1" and run["status"] == "running"
