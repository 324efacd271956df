"""Every code example of the docs is executed: README.md, docs/*.md and the
root pages the site includes (RELIABILITY.md, BENCHMARKS.md, CHANGELOG.md).

The rule, for each fenced block of those pages:

- A ```python or ```sql block runs here. A page is one scenario: its blocks
  run in document order against one fresh ledger database (LEDGER_DSN names
  it); a python block is exec'd in a namespace of its own, an sql block goes
  through ``psql -v ON_ERROR_STOP=1 -X -q``. SETUP and CHECKS below hold a
  page's preparation and what must hold after its blocks ran.
- Unless the last non-blank line before the block is a marker:
  ``<!-- executed by tests/test_x.py ... -->``: that test runs the block, with
  checks of its own; the file must exist and name the page;
  ``<!-- not executed: REASON -->``: nobody runs it, and REASON says why.
- A block in another language (sh, crontab, yaml, a bare fence) is prose and
  not run, unless an ``executed by`` marker names the test that runs it.

test_the_examples_are_counted says how many blocks run, and fails when fewer
do than when the examples moved out of the README.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from clihelp import JOBLEDGER, environment, jobledger_on_path, runs_of
from waiting import wait_for

from ledger.resources import sql_files
from docpages import MARKER, MARKER_LIKE, Block, all_blocks, page_blocks, pages, pages_with_examples_here
from repo import ROOT

SCHEDULES = any("ledger.start_due_run" in path.read_text() for path in sql_files())
THIS = "tests/docs/test_docs_examples.py"

# Blocks executed before the examples moved out of the README into docs/:
# README.md's 6 python, 2 sql, its `jobledger run` fencing script, crontab and
# report examples, and docs/pg_cron.md's 3 cron lines (14). Since then README.md
# runs its own sql, python and command line examples too (17).
EXECUTED_AT_LEAST = 17

# -- the rule itself -----------------------------------------------------------------------------


def test_every_marker_is_well_formed_and_stands_right_before_a_block():
    for page in pages():
        lines = (ROOT / page).read_text().splitlines()
        fence_lines = {block.line for block in page_blocks(page)}
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not MARKER_LIKE.match(text):
                continue
            marker = MARKER.match(text)
            assert marker, f"{page}:{number}: not a marker of the rule: {text}"
            if marker.group("reason") is not None:
                assert marker.group("reason").strip(), f"{page}:{number}: `not executed` needs a reason"
            following = next((n for n in range(number + 1, len(lines) + 1) if lines[n - 1].strip()), None)
            assert following in fence_lines, f"{page}:{number}: the marker stands before no code block"


def test_every_executed_by_marker_names_a_test_that_reads_the_page():
    for block in all_blocks():
        if block.executed_by is None:
            continue
        test = ROOT / block.executed_by
        assert test.is_file(), f"{block.where}: {block.executed_by} does not exist"
        assert Path(block.page).name in test.read_text(), \
            f"{block.where}: {block.executed_by} never names {Path(block.page).name}"


def test_the_examples_are_counted():
    blocks = all_blocks()
    here = [b for b in blocks if b.runs_here]
    elsewhere = Counter(b.executed_by for b in blocks if b.executed_by)
    skipped = [b for b in blocks if b.not_executed]
    executed = len(here) + sum(elsewhere.values())
    print(f"\nexecuted: {executed} blocks ({len(here)} here, "
          + ", ".join(f"{n} by {test}" for test, n in sorted(elsewhere.items()))
          + f"); not executed, with a reason: {len(skipped)}")
    assert executed >= EXECUTED_AT_LEAST, "an example stopped being executed"
    assert len(here) >= 7  # README.md's sql and python, docs/python.md's six


# -- the pages' scenarios --------------------------------------------------------------------------


def needs_schedules(block: Block) -> bool:
    return "catch_up" in block.body or ".job(" in block.body or "register_job" in block.body


def run_python(block: Block) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_example_{block.line}"}
    # Padded so that a traceback names the page's own line numbers.
    code = compile("\n" * block.line + block.body, block.page, "exec")
    try:
        exec(code, namespace)
    finally:
        for value in namespace.values():
            if isinstance(value, psycopg.Connection):
                value.close()


def run_sql(block: Block, dsn: str) -> None:
    result = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", dsn, "-f", "-"],
                            input=block.body, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{block.where}: {result.stderr}"


def check_readme(db: psycopg.Connection) -> None:
    statuses = dict(db.execute("SELECT job, status FROM ledger.job_execution_log").fetchall())
    assert statuses == {"nightly": "success", "nightly-export": "success"}
    assert db.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
    assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'reports'").fetchone() == ("nightly", 1)
    [(token,)] = db.execute("SELECT token FROM exports").fetchall()
    assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'exports'").fetchone() == \
        ("nightly-export", token)


def check_python_page(db: psycopg.Connection) -> None:
    # The examples really ran the jobs, and none of them failed.
    statuses = dict(db.execute("SELECT job, status FROM ledger.job_execution_log").fetchall())
    assert statuses.get("nightly-report") == "success"
    assert statuses.get("export") == "success"
    assert "failure" not in statuses.values()
    assert statuses.get("nightly-report-async") == "success"
    if SCHEDULES:
        assert statuses.get("daily-digest") == "success"
    assert db.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
    # Each example fences its own resources under its own job (a resource belongs to one job).
    fences = dict(db.execute("SELECT resource, job FROM ledger.fences").fetchall())
    assert fences.get("reports") == "nightly-report"
    assert fences.get("async-reports") == "nightly-report-async"
    assert fences.get("inventory") == "inventory-sync"


SETUP: dict[str, str] = {}  # README.md's first SQL block makes its own table
CHECKS: dict[str, Callable[[psycopg.Connection], None]] = {
    "README.md": check_readme,
    "docs/python.md": check_python_page,
}
AT_LEAST: dict[str, int] = {"README.md": 2, "docs/python.md": 6 if SCHEDULES else 5}


@pytest.mark.parametrize("page", pages_with_examples_here())
def test_the_examples_of_the_page_run(page, dsn, db, monkeypatch):
    blocks = [block for block in page_blocks(page) if block.runs_here]
    if any(block.lang == "sql" for block in blocks) and shutil.which("psql") is None:
        pytest.skip("needs psql (apt-get install postgresql-client)")
    monkeypatch.setenv("LEDGER_DSN", dsn)
    if page in SETUP:
        db.execute(SETUP[page])
    ran = 0
    for block in blocks:
        if needs_schedules(block) and not SCHEDULES:
            continue  # the schedule functions are not in sql/ yet
        if block.lang == "python":
            run_python(block)
        else:
            run_sql(block, dsn)
        ran += 1
    assert ran >= AT_LEAST.get(page, 1)
    if page in CHECKS:
        CHECKS[page](db)


def test_the_python_page_has_the_promised_examples():
    text = "\n".join(block.body for block in page_blocks("docs/python.md") if block.runs_here)
    for promise in ("run.fence(", "on_lost=", ".lease(", "catch_up(", "@ledger.job(", "AsyncLedger", "ledger.testing"):
        assert promise in text, promise


def test_the_readme_command_line_example_runs(dsn, db, tmp_path):
    [block] = [b for b in page_blocks("README.md") if b.executed_by == THIS]
    commands = [line for line in block.body.splitlines() if line.strip() and not line.startswith("#")]
    assert commands and all(line.startswith("jobledger ") for line in commands)
    script = tmp_path / "nightly-report.sh"
    script.write_text("#!/bin/sh\necho ran >> ran.txt\n")
    script.chmod(0o755)
    outputs = []
    for line in commands:
        command = line.replace("jobledger", shlex.join(JOBLEDGER), 1)
        result = subprocess.run(["sh", "-c", command], cwd=tmp_path, env=environment(dsn), capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, (line, result.stderr)
        outputs.append(result.stdout)
    assert (tmp_path / "ran.txt").read_text() == "ran\n"
    assert [run["status"] for run in runs_of(db, "nightly-report")] == ["success"]
    assert "nightly-report" in outputs[-1]  # jobledger status lists the job


def _page(url: str) -> str | None:
    """The page's text once the dashboard answers it; None while it does not yet."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode() if response.status == 200 else None
    except (urllib.error.URLError, ConnectionError):
        return None


def test_the_dashboard_page_shows_the_demo_ledger_as_written(tmp_path):
    """docs/dashboard.md's demo recipe, on an embedded server of its own (no DSN, no PG* variables, a
    fresh LEDGER_HOME): the demo, then the dashboard on its ledger, the server up until it stops."""
    [block] = [b for b in page_blocks("docs/dashboard.md") if b.executed_by == THIS]
    commands = [re.sub(r"\s+#.*$", "", line) for line in block.body.splitlines()
                if line.strip() and not line.startswith("#")]
    *before, dashboard = commands
    assert dashboard.startswith("jobledger web"), dashboard
    home = tmp_path / "home"
    env = jobledger_on_path(tmp_path / "bin", environment(LEDGER_HOME=str(home)))
    for line in before:
        result = subprocess.run(["sh", "-e", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, (line, result.stdout, result.stderr)
    said = tmp_path / "web.stderr"
    with said.open("w") as stderr:
        # The one change to the line: a free port, since 8187 may be another dashboard's on this machine.
        web = subprocess.Popen(["sh", "-c", f"exec {dashboard} --port 0"], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        def serving() -> re.Match[str] | None:
            assert web.poll() is None, f"{dashboard} exited {web.returncode}: {said.read_text()}"
            return re.search(r"serving the dashboard on (http://\S+?)/,", said.read_text())

        found = wait_for(serving, timeout=120, what="the dashboard to listen")
        assert isinstance(found, re.Match)
        jobs = str(wait_for(lambda: _page(f"{found.group(1)}/"), timeout=120, what="the jobs page"))
        assert "publish" in jobs and "nightly-report" in jobs  # the demo's two jobs
        assert (home / "pgdata" / "postmaster.pid").exists()  # the dashboard holds the embedded server up
    finally:
        web.send_signal(signal.SIGTERM)
        web.wait(timeout=60)
    assert web.returncode == 0, said.read_text()
    assert not (home / "pgdata" / "postmaster.pid").exists()  # stopped with the last jobledger process


def test_the_design_notes_tell_re_registering_as_the_contract_does():
    """docs/design.md said a re-register replaces the definition well after the contract made it
    change only the options given (the behaviour: tests/sql/test_health.py)."""
    contract = (ROOT / "docs" / "contract.md").read_text()
    entry = contract.split("- `ledger.register_job(", 1)[1].split("\n- `", 1)[0]
    assert "change the options given" in entry
    [row] = [line for line in (ROOT / "docs" / "design.md").read_text().splitlines()
             if line.startswith("| `register_job` on an existing job |")]
    assert "changes only the options given" in row, row
    assert "replaces the definition" not in row, row
