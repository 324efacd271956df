"""docs/limits.md's command line block runs as written (each line a `jobledger` command, in order,
against one ledger) and leaves what the page says: the jobs registered, the pool resized, then
dropped with its jobs detached. Its sql and python blocks run in tests/docs/test_docs_examples.py."""

from __future__ import annotations

import subprocess

from clihelp import environment, jobledger_on_path

from docpages import page_blocks
from repo import ROOT

PAGE = "docs/limits.md"


def test_the_limits_page_command_lines_run(dsn, db, tmp_path):
    [block] = [b for b in page_blocks(PAGE) if b.executed_by == "tests/docs/test_limits_page.py"]
    lines = [line for line in block.body.splitlines() if line.strip()]
    assert lines and all(line.startswith("jobledger ") for line in lines)
    env = jobledger_on_path(tmp_path / "bin", environment(dsn))
    outputs = []
    for line in lines:
        result = subprocess.run(["/bin/sh", "-c", line], env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, (line, result.stderr)
        outputs.append(result.stdout)
        if line == "jobledger pool resize heavy 2":
            assert db.execute("SELECT size, jobs FROM ledger.pool_status WHERE pool = 'heavy'").fetchone() == (2, 2)
    listed = outputs[lines.index("jobledger pools")]
    assert "heavy" in listed and "ledger.pool_status" in listed
    assert db.execute("SELECT count(*) FROM ledger.pools").fetchone() == (0,)
    assert dict(db.execute("SELECT job, pool FROM ledger.jobs").fetchall()) == {
        "nightly-sales": None, "nightly-stock": None}
