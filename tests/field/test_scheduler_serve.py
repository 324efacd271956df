"""``ledger.serve`` / ``ledger.serve_async``: the scheduler's loop in-process, for functions.

The asyncio example of docs/scheduler.md runs as written (a process of its own); two processes
serving one function split its slots, each slot once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from clihelp import environment
from docpages import page_blocks
from waiting import wait_for

import ledger

PAGE = "docs/scheduler.md"


def test_the_asyncio_example_of_the_scheduler_page_runs_its_job(db, dsn):
    [block] = [block for block in page_blocks(PAGE) if block.executed_by == "tests/field/test_scheduler_serve.py"]
    result = subprocess.run([sys.executable, "-c", block.body], env=environment(dsn), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "report for slot" in result.stdout
    rows = db.execute("SELECT status, count(*) FROM ledger.job_execution_log WHERE job = 'report' "
                      "GROUP BY status").fetchall()
    assert dict(rows).get("success", 0) >= 1 and set(dict(rows)) <= {"success"}, rows


SERVER = textwrap.dedent("""
    import sys, threading, ledger
    @ledger.job("shared", schedule="2 seconds", ttl="10s", max_backfill=20)
    def shared(run):
        print(run.slot.isoformat(), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    ledger.serve(sys.argv[1], [shared], source="shared-app", stop=stop)
""")


def test_two_processes_serving_one_function_run_each_slot_once(db, dsn):
    servers = [subprocess.Popen([sys.executable, "-c", SERVER, dsn], env=environment(dsn), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        wait_for(lambda: db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'shared' "
                                    "AND status = 'success'").fetchone()[0] >= 6, what="6 slots of shared")
    finally:
        outputs = [server.communicate(input="", timeout=90) for server in servers]
    assert [server.returncode for server in servers] == [0, 0], [err for _, err in outputs]
    slots = [row[0] for row in db.execute("SELECT slot FROM ledger.job_execution_log WHERE job = 'shared' "
                                          "AND status = 'success' ORDER BY slot")]
    assert len(slots) == len(set(slots))
    assert all((b - a).total_seconds() == 2 for a, b in zip(slots, slots[1:])), slots
    printed = [line for out, _ in outputs for line in out.split()]
    assert len(printed) == len(set(printed))


def test_a_job_option_mistake_is_refused_at_the_decorator():
    try:
        ledger.job("bad", schedule="every day", ttl="1h")
    except ValueError as error:
        assert "job bad, key schedule" in str(error)
    else:
        raise AssertionError("an invalid schedule was accepted")


def test_serve_stops_when_told(dsn):
    @ledger.job("stoppable", schedule="1 hour", ttl="1m")
    def stoppable(run):
        return None

    stop = threading.Event()
    stop.set()
    scheduler = ledger.serve(dsn, [stoppable], stop=stop, source="stoppable-app")
    assert scheduler.stats.calls.get("scheduler_stop") == 1
