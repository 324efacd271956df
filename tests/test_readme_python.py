"""The README's Python section is tested: every ```python block under
"## Python" runs, in order, against a fresh ledger database (LEDGER_DSN)."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg

from ledger.resources import sql_files

README = Path(__file__).resolve().parent.parent / "README.md"
SCHEDULES = any("ledger.start_due_run" in path.read_text() for path in sql_files())


def python_blocks() -> list[str]:
    text = README.read_text()
    heading = "\n## Python\n"
    start = text.index(heading) + len(heading)
    # The section ends at the next heading or the next section owner's marker.
    end = re.search(r"^(## |<!-- )", text[start:], re.MULTILINE)
    section = text[start: start + end.start()] if end else text[start:]
    return re.findall(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)


def needs_schedules(block: str) -> bool:
    return "catch_up" in block or ".job(" in block or "register_job" in block


def test_the_python_section_has_the_promised_examples():
    blocks = python_blocks()
    text = "\n".join(blocks)
    for promise in ("run.fence(", "on_lost=", ".lease(", "catch_up(", "@ledger.job(", "AsyncLedger", "ledger.testing"):
        assert promise in text, promise


def test_the_python_examples_run(dsn, db, monkeypatch, capsys):
    monkeypatch.setenv("LEDGER_DSN", dsn)
    ran = 0
    for number, block in enumerate(python_blocks(), 1):
        if needs_schedules(block) and not SCHEDULES:
            continue  # the schedule functions are not in sql/ yet
        namespace: dict[str, object] = {"__name__": f"readme_block_{number}"}
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        finally:
            for value in namespace.values():
                if isinstance(value, psycopg.Connection):
                    value.close()
        ran += 1
    assert ran >= (6 if SCHEDULES else 5)
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

