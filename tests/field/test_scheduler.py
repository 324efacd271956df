"""`jobledger scheduler --jobs FILE`: real scheduler processes over one file, on a real database.

Interval schedules of two seconds, a fixed number of slots, invariants only: each slot succeeds
once across the schedulers (no duplicate, no gap); a scheduler killed (SIGKILL) loses no slot; one
stopped (SIGSTOP) past its ttl has its late run's fenced write refused; a trigger is picked; a job
removed from the file is paused; an invalid file changes nothing; SIGTERM ends as promised; the
`skip` overlap policy is respected end to end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from clihelp import JOBLEDGER, environment, jobledger
from waiting import wait_for

SLOT = timedelta(seconds=2)


def write_jobs(path: Path, text: str) -> None:
    """Replace the file in one rename, so a scheduler never reads half of it."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(textwrap.dedent(text))
    os.replace(temporary, path)


class Schedulers:
    """Scheduler processes of one test; each one's stderr in a file (read when a test fails)."""

    def __init__(self, dsn: str, tmp_path: Path) -> None:
        self.dsn = dsn
        self.tmp_path = tmp_path
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, jobs: Path, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"scheduler-{len(self.processes)}.log", "wb")
        process = subprocess.Popen([*JOBLEDGER, "scheduler", "--jobs", str(jobs), "-v", *args],
                                   env=environment(self.dsn), stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def log(self, index: int) -> str:
        return (self.tmp_path / f"scheduler-{index}.log").read_text(errors="replace")

    def stop_all(self) -> list[int]:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.terminate()
        return [process.wait(timeout=90) for process in self.processes]

    def kill_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


@pytest.fixture
def schedulers(dsn, tmp_path):
    group = Schedulers(dsn, tmp_path)
    yield group
    group.kill_all()


def successes(db: psycopg.Connection, job: str) -> list[tuple]:
    return db.execute("SELECT slot, owner FROM ledger.job_execution_log WHERE job = %s AND status = 'success' "
                      "AND slot IS NOT NULL ORDER BY slot", (job,)).fetchall()


def assert_each_slot_once(db: psycopg.Connection, job: str) -> list:
    """Every slot from the first success to the last succeeded exactly once."""
    slots = [row[0] for row in successes(db, job)]
    assert len(slots) == len(set(slots)), f"a slot succeeded twice: {slots}"
    assert db.execute("SELECT count(*) FROM ledger.duplicates WHERE job = %s", (job,)).fetchone()[0] == 0
    gaps = [(a, b) for a, b in zip(slots, slots[1:]) if b - a != SLOT]
    assert not gaps, f"slots missing between {gaps}"
    return slots


def tick_file(tmp_path: Path, out: Path, **extra: str) -> Path:
    jobs = tmp_path / "jobs.toml"
    options = "\n".join(f"{key} = {value}" for key, value in extra.items())
    write_jobs(jobs, f"""
        [jobs.tick]
        schedule = "2 seconds"
        ttl = "4s"
        max_backfill = 20
        command = 'echo "$LEDGER_SLOT $LEDGER_OWNER" >> {out}'
        {options}
        """)
    return jobs


def test_three_schedulers_run_each_slot_exactly_once(db, tmp_path, schedulers):
    out = tmp_path / "out.txt"
    jobs = tick_file(tmp_path, out)
    for _ in range(3):
        schedulers.start(jobs)
    wait_for(lambda: len(successes(db, "tick")) >= 8, what="8 slots of tick", explain=lambda: schedulers.log(0))
    assert schedulers.stop_all() == [0, 0, 0]
    slots = assert_each_slot_once(db, "tick")
    lines = out.read_text().split("\n")
    printed = [line.split()[0] for line in lines if line]
    assert len(printed) == len(set(printed)) >= len(slots)  # each command ran once per slot
    assert db.execute("SELECT count(*) FROM ledger.schedulers").fetchone()[0] == 0


def test_sigkill_of_one_scheduler_loses_no_slot(db, tmp_path, schedulers):
    jobs = tick_file(tmp_path, tmp_path / "out.txt")
    victim = schedulers.start(jobs)
    for _ in range(2):
        schedulers.start(jobs)
    wait_for(lambda: len(successes(db, "tick")) >= 3, what="3 slots before the kill")
    victim.kill()
    victim.wait(timeout=30)
    killed_at = len(successes(db, "tick"))
    wait_for(lambda: len(successes(db, "tick")) >= killed_at + 5, what="5 slots after the kill",
             explain=lambda: schedulers.log(1))
    assert schedulers.stop_all()[1:] == [0, 0]
    assert_each_slot_once(db, "tick")


def test_a_scheduler_stopped_past_its_ttl_has_its_late_fenced_write_refused(db, dsn, tmp_path, schedulers):
    go, result = tmp_path / "go", tmp_path / "result"
    started = tmp_path / "started"
    jobs = tmp_path / "jobs.toml"
    # The first run waits for the test's go, then writes through the fence with its token.
    script = (f'[ -e {started} ] && exit 0; echo "$LEDGER_FENCING_TOKEN" > {started}; '
              f'while [ ! -e {go} ]; do sleep 0.1; done; '
              f'if psql "$LEDGER_DSN" -X -q -v ON_ERROR_STOP=1 -c "SELECT ledger.fence(job => \'fenced\', '
              f'resource => \'r\', token => $LEDGER_FENCING_TOKEN)" 2>> {result}; '
              f'then echo accepted >> {result}; else echo refused >> {result}; fi')
    write_jobs(jobs, f"""
        [jobs.fenced]
        schedule = "2 seconds"
        ttl = "3s"
        command = {json.dumps(script)}
        """)
    first = schedulers.start(jobs)
    wait_for(started.exists, what="the first run to start")
    os.kill(first.pid, signal.SIGSTOP)  # its heartbeats stop; its command goes on
    token = int(started.read_text())
    schedulers.start(jobs)
    wait_for(lambda: db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'fenced' "
                                "AND token > %s", (token,)).fetchone()[0] > 0,
             what="another scheduler's run with a newer token", explain=lambda: schedulers.log(1))
    go.touch()
    wait_for(lambda: result.exists() and ("refused" in result.read_text() or "accepted" in result.read_text()),
             what="the late run's fenced write")
    assert "refused" in result.read_text(), result.read_text()
    os.kill(first.pid, signal.SIGCONT)
    schedulers.stop_all()


def test_a_trigger_is_picked_by_a_listening_scheduler(db, dsn, tmp_path, schedulers):
    out = tmp_path / "out.txt"
    jobs = tmp_path / "jobs.toml"
    write_jobs(jobs, f"""
        [jobs.manual]
        schedule = "0 0 1 1 *"
        ttl = "1m"
        command = 'echo "$LEDGER_RUN_ID" >> {out}'
        """)
    schedulers.start(jobs)
    wait_for(lambda: db.execute("SELECT count(*) FROM ledger.schedulers").fetchone()[0] == 1,
             what="the scheduler's row")
    result = jobledger("trigger", "manual", dsn=dsn)
    assert result.returncode == 0, result.stderr
    run = wait_for(lambda: db.execute("SELECT status, detail FROM ledger.job_execution_log WHERE job = 'manual' "
                                      "AND status = 'success'").fetchone(),
                   what="the manual run", explain=lambda: schedulers.log(0))
    assert run[1]["trigger"] == "manual"
    assert schedulers.stop_all() == [0]


def test_trigger_here_runs_the_command_in_the_cli(db, dsn, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'here', schedule => '0 0 1 1 *', ttl => '1 minute')")
    out = tmp_path / "token"
    result = jobledger("trigger", "here", "--here", "--", "sh", "-c", f'echo "$LEDGER_FENCING_TOKEN" > {out}',
                       dsn=dsn)
    assert result.returncode == 0, result.stderr
    row = db.execute("SELECT token, detail FROM ledger.job_execution_log WHERE job = 'here'").fetchone()
    assert row[0] == int(out.read_text()) and row[1]["trigger"] == "manual"


def test_a_job_removed_from_the_file_is_paused(db, tmp_path, schedulers):
    jobs = tmp_path / "jobs.toml"
    body = """
        [jobs.stays]
        schedule = "2 seconds"
        ttl = "10s"
        command = "true"
        """
    write_jobs(jobs, body + """
        [jobs.goes]
        schedule = "2 seconds"
        ttl = "10s"
        command = "true"
        """)
    schedulers.start(jobs)
    wait_for(lambda: db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'goes' "
                                "AND status = 'success'").fetchone()[0] >= 1, what="a run of goes")
    write_jobs(jobs, body)
    wait_for(lambda: db.execute("SELECT paused FROM ledger.jobs WHERE job = 'goes'").fetchone()[0],
             what="goes paused", explain=lambda: schedulers.log(0))
    assert db.execute("SELECT pause_reason FROM ledger.jobs WHERE job = 'goes'").fetchone()[0] == "removed"
    assert not db.execute("SELECT paused FROM ledger.jobs WHERE job = 'stays'").fetchone()[0]
    assert schedulers.stop_all() == [0]


def test_an_invalid_file_changes_nothing_and_the_last_good_one_keeps_running(db, tmp_path, schedulers):
    jobs = tick_file(tmp_path, tmp_path / "out.txt")
    schedulers.start(jobs)
    wait_for(lambda: len(successes(db, "tick")) >= 2, what="2 slots of tick")
    write_jobs(jobs, """
        [jobs.tick]
        schedule = "5 minutes"
        ttl = "4s"
        colour = "blue"
        command = "true"

        [jobs.newcomer]
        schedule = "2 seconds"
        ttl = "4s"
        command = "true"
        """)
    wait_for(lambda: "key colour" in schedulers.log(0), what="the refusal, said loudly")
    before = len(successes(db, "tick"))
    wait_for(lambda: len(successes(db, "tick")) >= before + 2, what="tick running on its last good definition")
    assert db.execute("SELECT schedule FROM ledger.jobs WHERE job = 'tick'").fetchone()[0] == "2 seconds"
    assert db.execute("SELECT count(*) FROM ledger.jobs WHERE job = 'newcomer'").fetchone()[0] == 0
    assert schedulers.stop_all() == [0]


def test_an_invalid_file_at_start_is_refused_before_connecting(tmp_path):
    jobs = tmp_path / "jobs.toml"
    write_jobs(jobs, '[jobs.a]\nschedule = "61 * * * *"\ncommand = "true"\n')
    result = jobledger("scheduler", "--jobs", str(jobs), dsn="host=/nonexistent dbname=none")
    assert result.returncode == 1
    assert "job a, key schedule" in result.stderr


def test_sigterm_lets_a_live_run_finish_within_the_grace(db, tmp_path, schedulers):
    started = tmp_path / "started"
    jobs = tmp_path / "jobs.toml"
    write_jobs(jobs, f"""
        [jobs.slow]
        schedule = "0 0 1 1 *"
        ttl = "30s"
        command = 'touch {started}; sleep 2'
        """)
    process = schedulers.start(jobs, "--grace", "60s")
    wait_for(lambda: db.execute("SELECT count(*) FROM ledger.schedulers").fetchone()[0] == 1, what="the row")
    assert jobledger("trigger", "slow", dsn=schedulers.dsn).returncode == 0
    wait_for(started.exists, what="the run to start")
    process.terminate()
    assert process.wait(timeout=90) == 0
    statuses = db.execute("SELECT status FROM ledger.job_execution_log WHERE job = 'slow'").fetchall()
    assert statuses == [("success",)]
    assert db.execute("SELECT count(*) FROM ledger.schedulers").fetchone()[0] == 0


def test_sigterm_cancels_a_live_run_after_the_grace(db, tmp_path, schedulers):
    started = tmp_path / "started"
    jobs = tmp_path / "jobs.toml"
    write_jobs(jobs, f"""
        [jobs.stuck]
        schedule = "0 0 1 1 *"
        ttl = "30s"
        command = 'touch {started}; exec sleep 600'
        """)
    process = schedulers.start(jobs, "--grace", "1s")
    wait_for(lambda: db.execute("SELECT count(*) FROM ledger.schedulers").fetchone()[0] == 1, what="the row")
    assert jobledger("trigger", "stuck", dsn=schedulers.dsn).returncode == 0
    wait_for(started.exists, what="the run to start")
    process.terminate()
    assert process.wait(timeout=90) == 0
    row = db.execute("SELECT status, failure_reason FROM ledger.job_execution_log WHERE job = 'stuck'").fetchone()
    assert row == ("failure", "cancelled")


def test_the_skip_overlap_policy_is_respected_end_to_end(db, tmp_path, schedulers):
    jobs = tmp_path / "jobs.toml"
    write_jobs(jobs, """
        [jobs.long]
        schedule = "2 seconds"
        ttl = "30s"
        overlap_policy = "skip"
        max_backfill = 20
        command = "sleep 5"
        """)
    for _ in range(2):
        schedulers.start(jobs)
    wait_for(lambda: db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'long' "
                                "AND status = 'success'").fetchone()[0] >= 2, what="2 runs of long",
             explain=lambda: schedulers.log(0))
    assert schedulers.stop_all() == [0, 0]
    skipped = db.execute("SELECT coalesce(sum(slot_count), 0) FROM ledger.skipped_slots "
                         "WHERE job = 'long' AND reason = 'overlap'").fetchone()[0]
    assert skipped >= 1
    runs = db.execute("SELECT started_at, completed_at FROM ledger.job_execution_log WHERE job = 'long' "
                      "AND status <> 'running' ORDER BY started_at").fetchall()
    assert all(later[0] >= earlier[1] for earlier, later in zip(runs, runs[1:])), "two runs overlapped"


def test_two_files_that_disagree_about_a_job_last_writer_wins_loudly(db, tmp_path, schedulers):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    write_jobs(first / "jobs.toml", 'source = "host-a"\n[jobs.shared]\nschedule = "1 hour"\nttl = "1m"\n'
                                    'command = "true"\n')
    write_jobs(second / "jobs.toml", 'source = "host-b"\n[jobs.shared]\nschedule = "2 hours"\nttl = "1m"\n'
                                     'command = "true"\n')
    schedulers.start(first / "jobs.toml")
    wait_for(lambda: db.execute("SELECT schedule FROM ledger.jobs WHERE job = 'shared'").fetchone(),
             what="the first file synced")
    schedulers.start(second / "jobs.toml")
    wait_for(lambda: "overrides another source" in schedulers.log(1), what="the override, said",
             explain=lambda: schedulers.log(1))
    assert db.execute("SELECT schedule FROM ledger.jobs WHERE job = 'shared'").fetchone()[0] == "2 hours"
    assert db.execute("SELECT count(*) FROM ledger.events WHERE kind = 'job_redefined' "
                      "AND job = 'shared'").fetchone()[0] == 1
    assert schedulers.stop_all() == [0, 0]
