"""Clocks: host clocks do not matter.

Three `jobledger run` wrappers take turns on one scheduled job (a 3-second
interval, max_backfill 1): one on a host whose wall clock is three hours
ahead, one three hours behind (libfaketime), one on the real clock. Each
call is `jobledger run JOB --ttl 10s -v --skip-exit-code 75 -- <bash + psql>`,
whose CMD records LEDGER_SLOT, LEDGER_FENCING_TOKEN and its own wall clock
through the job-aware fence. A fixed number of rounds, one per wrapper as
the holder: the holder's first run is held open (its CMD waits for a go
file) until the next slot is due; then the two others are called and must
be skipped (held by the holder: exit 75); then the holder is let go and
catches up, running the newest due slot and recording the slots it had to
drop. So every wrapper wins slots and is skipped, whatever its clock.

From the database afterwards: every run the wrappers reported is in the log
and succeeded, no slot succeeded twice, every skip they reported is counted
(skipped_overlap), every slot from the first run to the last was either run
once or counted as dropped by the catch-up bound (skipped_backfill),
ledger.overlaps is empty, the fenced writes are in token order and carry the
slot and token the database gave, and the CMDs' own clocks really were three
hours off.

Which clock libfaketime fakes
-----------------------------
libfaketime fakes CLOCK_MONOTONIC too, unless FAKETIME_DONT_FAKE_MONOTONIC=1.
The wrapper's heartbeat keeps its deadline on time.monotonic() and sleeps
between beats in Event.wait() (CLOCK_MONOTONIC); only its messages use the
wall clock. A host whose wall clock is hours off still has a true monotonic
clock (it counts since boot; setting the date does not move it), so the
faithful simulation fakes the wall clock only: FAKETIME_DONT_FAKE_MONOTONIC=1.
With the monotonic clock faked as well, Python 3.11's timed waits never time
out (libfaketime 0.9.10 does not intercept sem_clockwait: the wait's deadline
is computed on the faked clock and compared by the kernel with the real one):
the heartbeat thread never beats, and a run longer than its ttl is reported
lost (exit 124) by the wrapper's local deadline. That is libfaketime, not the
host clock; test_the_heartbeat_keeps_the_lease_on_hosts_whose_clocks_are_hours_off
shows the heartbeat renewing normally under a faked wall clock.

libfaketime 0.9.10 has one more bug in that mode (wolfcw/libfaketime#426):
clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME), which Python 3.11's
time.sleep() uses (and so subprocess.Popen.wait(timeout), in the wrapper's
supervision loop), gets the wall-clock offset applied and fails with EINVAL.
So the faked wrappers run `python -c SHIM run ...`: the CLI's own main()
after replacing time.sleep by an equivalent select() wait; nothing else in
the wrapper changes. The real-clock wrapper is the plain `jobledger` script.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from waiting import wait_for

FAKETIME = shutil.which("faketime")
PSQL = shutil.which("psql")
JOBLEDGER = str(Path(sys.executable).parent / "jobledger")
SKIP_EXIT = 75  # --skip-exit-code: held by another owner, nothing ran
OFFSET = 3 * 3600
SLOT = timedelta(seconds=3)
SCHEDULE = "3 seconds"
JOB = "clocked"
RESOURCE = f"{JOB}-table"

# The wrapper's own main(), with time.sleep as a select() wait (see the module docstring: libfaketime#426).
SHIM = ("import select, time; time.sleep = lambda s: select.select([], [], [], max(0.0, s)) and None; "
        "from ledger.cli import main; main(prog_name='jobledger')")

# CMD: optionally held until $CLOCK_GO exists (only while $CLOCK_HOLD exists: the first run of a call),
# optionally a sleep, then one fenced write of what it was given and of its own wall clock.
WRITER = r"""
set -eu
if [ -n "${CLOCK_HOLD:-}" ] && [ -e "$CLOCK_HOLD" ]; then
  rm -f "$CLOCK_HOLD"
  while [ ! -e "$CLOCK_GO" ]; do sleep 0.1; done
fi
sleep "${CLOCK_SLEEP:-0}"
psql "$LEDGER_DSN" -X -q -A -t -v ON_ERROR_STOP=1 -v VERBOSITY=verbose \
  -v job="$LEDGER_JOB" -v token="$LEDGER_FENCING_TOKEN" -v run_id="$LEDGER_RUN_ID" -v slot="$LEDGER_SLOT" \
  -v wrapper="$CLOCK_NAME" -v host_clock="$(date +%s.%N)" <<'SQL'
BEGIN;
SELECT ledger.fence(job => :'job', resource => :'job' || '-table', token => :token);
INSERT INTO clock_writes (wrapper, job, slot, token, run_id, host_clock)
VALUES (:'wrapper', :'job', nullif(:'slot', '')::timestamptz, :token, :run_id, :host_clock);
COMMIT;
SQL
"""

WRAPPERS = {"ahead": f"+{OFFSET}s", "behind": f"-{OFFSET}s", "real": None}
EXPECTED_SHIFT = {"ahead": OFFSET, "behind": -OFFSET, "real": 0}

pytestmark = [pytest.mark.skipif(FAKETIME is None, reason="needs faketime (apt-get install faketime)"),
              pytest.mark.skipif(PSQL is None, reason="needs psql (apt-get install postgresql-client)")]


def wrapper_argv(offset: str | None) -> list[str]:
    """``jobledger`` as run on a host whose wall clock is ``offset`` away (None: the real clock)."""
    if offset is None:
        return [JOBLEDGER]
    assert FAKETIME is not None
    return [FAKETIME, "-f", offset, sys.executable, "-c", SHIM]


def faked_env(offset: str | None, **extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    if offset is not None:
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"  # a wrong wall clock; the monotonic clock stays true
    return env


@pytest.fixture(scope="module", autouse=True)
def libfaketime_works_with_this_python() -> None:
    assert FAKETIME is not None
    for offset, sign in (("+3h", 1), ("-3h", -1)):
        out = subprocess.run([FAKETIME, "-f", offset, sys.executable, "-c", "import time; print(time.time())"],
                             env=faked_env(offset), capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            pytest.skip(f"needs faketime (apt-get install faketime): installed, faketime -f {offset} "
                        f"{sys.executable} failed: {out.stderr.strip()[-300:]}")
        shift = float(out.stdout) - time.time()
        if abs(shift - sign * OFFSET) > 600:
            pytest.skip(f"needs faketime (apt-get install faketime): installed, libfaketime does not shift "
                        f"this python's clock, faketime {offset}: {shift:+.0f}s")


@pytest.fixture
def table(db: psycopg.Connection) -> None:
    db.execute("CREATE TABLE clock_writes (id bigserial PRIMARY KEY, wrapper text NOT NULL, job text NOT NULL, "
               "slot timestamptz, token bigint NOT NULL, run_id bigint NOT NULL, "
               "host_clock double precision NOT NULL, written_at timestamptz NOT NULL DEFAULT clock_timestamp())")


_STARTED = re.compile(r"^jobledger: run (\d+) of job \S+ started \(token (\d+)(?:, slot ([^)]+))?\)$", re.M)
_SUCCEEDED = re.compile(r"^jobledger: run (\d+) succeeded$", re.M)
_ENDINGS = {
    "skipped_overlap": re.compile(r"^jobledger: skipped: held by ", re.M),
    "already_done": re.compile(r"^jobledger: already done: ", re.M),
    "nothing_due": re.compile(r"^jobledger: (nothing due|caught up): ", re.M),
}


@dataclass
class Call:
    """One `jobledger run`: its exit code, the runs it started and succeeded, and how its catch-up ended."""

    wrapper: str
    rc: int
    stderr: str
    started: dict[int, int] = field(default_factory=dict)
    succeeded: set[int] = field(default_factory=set)
    endings: Counter[str] = field(default_factory=Counter)

    @classmethod
    def parse(cls, wrapper: str, rc: int, stderr: str) -> Call:
        call = cls(wrapper, rc, stderr)
        call.started = {int(m.group(1)): int(m.group(2)) for m in _STARTED.finditer(stderr)}
        call.succeeded = {int(m.group(1)) for m in _SUCCEEDED.finditer(stderr)}
        for outcome, pattern in _ENDINGS.items():
            call.endings[outcome] = len(pattern.findall(stderr))
        return call


def launch(name: str, dsn: str, job: str, **env: str) -> subprocess.Popen[str]:
    offset = WRAPPERS[name]
    argv = [*wrapper_argv(offset), "run", job, "--ttl", "10s", "-v", "--skip-exit-code", str(SKIP_EXIT),
            "--dsn", dsn, "--", "bash", "-c", WRITER]
    return subprocess.Popen(argv, env=faked_env(offset, CLOCK_NAME=name, **env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(name: str, process: subprocess.Popen[str]) -> Call:
    _, stderr = process.communicate(timeout=120)
    return Call.parse(name, process.returncode, stderr)


def test_wrappers_on_hosts_hours_apart_run_each_slot_once_and_count_every_skip(
        dsn: str, db: psycopg.Connection, table: None, tmp_path: Path) -> None:
    db.execute("SELECT ledger.register_job(%s, %s, ttl => '10 seconds', max_backfill => 1)", (JOB, SCHEDULE))

    def running_slot() -> object:
        row = db.execute("SELECT slot FROM ledger.job_execution_log WHERE job = %s AND status = 'running'",
                         (JOB,)).fetchone()
        return None if row is None else row[0]

    calls: list[Call] = []
    for holder in WRAPPERS:  # one round per wrapper as the holder: each wrapper is called once per round
        wait_for(lambda: db.execute("SELECT count(*) FROM ledger.due_slots(%s)", (JOB,)).fetchone()[0], 30,
                 "a due slot")
        hold, go = tmp_path / f"hold-{holder}", tmp_path / f"go-{holder}"
        hold.touch()
        held = launch(holder, dsn, JOB, CLOCK_HOLD=str(hold), CLOCK_GO=str(go))
        wait_for(lambda: running_slot() is not None and not hold.exists(), 120, f"{holder}'s run to start")
        slot = running_slot()
        # The next slot is due (by the database's clock) while the holder still holds the lease...
        wait_for(lambda: db.execute("SELECT clock_timestamp() > %s + %s", (slot, SLOT)).fetchone()[0], 30,
                 "the next slot")
        others = {name: launch(name, dsn, JOB) for name in WRAPPERS if name != holder}
        for name, process in others.items():
            calls.append(finish(name, process))
            # ...so the others are skipped: held by the holder, nothing ran.
            assert calls[-1].rc == SKIP_EXIT and calls[-1].endings["skipped_overlap"] == 1, calls[-1]
        go.touch()
        calls.append(finish(holder, held))
        # The holder's run succeeds, and its catch-up runs the newest due slot, then stops.
        assert calls[-1].rc == 0 and len(calls[-1].started) >= 2, calls[-1]

    # Every call answered, and said how it stopped, exactly once.
    for call in calls:
        assert call.succeeded == set(call.started), call
        assert sum(call.endings.values()) == 1, call

    runs = db.execute("SELECT run_id, token, slot, status FROM ledger.job_execution_log WHERE job = %s "
                      "ORDER BY started_at", (JOB,)).fetchall()
    writes = db.execute("SELECT wrapper, slot, token, run_id, host_clock, extract(epoch FROM written_at) "
                        "FROM clock_writes WHERE job = %s ORDER BY id", (JOB,)).fetchall()
    counters = db.execute("SELECT runs_started, successes, failures, skipped_overlap, skipped_backfill "
                          "FROM ledger.job_counters WHERE job = %s", (JOB,)).fetchone()
    assert counters is not None
    runs_started, successes, failures, skipped_overlap, skipped_backfill = counters

    # The log holds exactly the runs the wrappers reported, all successes, and no slot twice.
    reported = {run_id: token for call in calls for run_id, token in call.started.items()}
    assert {run_id: token for run_id, token, _, _ in runs} == reported
    assert all(status == "success" for _, _, _, status in runs)
    slot_counts = Counter(slot for _, _, slot, _ in runs)
    assert max(slot_counts.values()) == 1, [slot for slot, n in slot_counts.items() if n > 1]
    assert (runs_started, successes, failures) == (len(runs), len(runs), 0)
    assert db.execute("SELECT count(*) FROM ledger.overlaps WHERE job = %s", (JOB,)).fetchone()[0] == 0

    # Every skip a wrapper reported is counted; every slot from the first run to the last was run once or
    # counted as dropped by max_backfill 1 (one range per drop in ledger.skipped_slots).
    assert skipped_overlap == sum(call.endings["skipped_overlap"] for call in calls) == 2 * len(WRAPPERS)
    slots = sorted(slot_counts)
    dropped = db.execute("SELECT coalesce(sum(slot_count), 0) FROM ledger.skipped_slots WHERE job = %s",
                         (JOB,)).fetchone()[0]
    assert len(slots) + dropped == int((slots[-1] - slots[0]) / SLOT) + 1
    assert dropped == skipped_backfill

    # One fenced write per run, in token order, carrying the slot and token the database gave.
    assert [(run_id, token, slot) for _, slot, token, run_id, _, _ in writes] == \
        [(run_id, token, slot) for run_id, token, slot, _ in runs]
    tokens = [token for _, _, token, _, _, _ in writes]
    assert tokens == sorted(set(tokens))
    assert db.execute("SELECT token FROM ledger.fences WHERE resource = %s", (RESOURCE,)).fetchone()[0] == tokens[-1]

    # Every wrapper ran slots, and its CMD's clock really was that far from the database's.
    shift = defaultdict(list)
    for wrapper, _, _, _, host_clock, db_clock in writes:
        shift[wrapper].append(host_clock - float(db_clock))
    assert set(shift) == set(WRAPPERS)
    for wrapper, values in shift.items():
        assert all(abs(value - EXPECTED_SHIFT[wrapper]) < 600 for value in values), (wrapper, values)


def test_the_heartbeat_keeps_the_lease_on_hosts_whose_clocks_are_hours_off(
        dsn: str, db: psycopg.Connection, table: None) -> None:
    """A CMD that outlives the ttl (3 s) fences after 4 s: only a lease the heartbeat renewed lets it.

    Both faked wrappers at once, each on its own job. (With libfaketime's
    monotonic clock faked too, the heartbeat thread never wakes and both
    exit 124: "the lease's local deadline passed before a heartbeat renewed it".)
    """
    names = ("ahead", "behind")
    for name in names:
        db.execute("SELECT ledger.register_job(%s, ttl => '3 seconds')", (f"long-{name}",))
    processes = {
        name: subprocess.Popen([*wrapper_argv(WRAPPERS[name]), "run", f"long-{name}", "--ttl", "3s", "-v",
                                "--dsn", dsn, "--", "bash", "-c", WRITER],
                               env=faked_env(WRAPPERS[name], CLOCK_NAME=name, CLOCK_SLEEP="4"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name in names}
    for name, process in processes.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, (name, stderr)
        row = db.execute("SELECT status, heartbeat_at > started_at + interval '0.5 seconds', "
                         "completed_at - started_at > interval '4 seconds' "
                         "FROM ledger.job_execution_log WHERE job = %s", (f"long-{name}",)).fetchone()
        assert row == ("success", True, True), (name, row, stderr)
        assert db.execute("SELECT count(*) FROM clock_writes WHERE job = %s", (f"long-{name}",)).fetchone()[0] == 1
