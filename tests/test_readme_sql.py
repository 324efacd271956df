"""The README's SQL examples run, as written, through psql."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def sql_blocks(heading: str) -> list[str]:
    text = README.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


@pytest.mark.parametrize("heading", ["From psql (or any SQL client)", "Schedules and bounded catch-up"])
def test_readme_sql_examples_run_through_psql(dsn, db, heading):
    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    blocks = sql_blocks(heading)
    assert blocks, f"no sql blocks under {heading!r}"
    db.execute("CREATE TABLE reports (day date, total integer)")
    for block in blocks:
        result = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", dsn, "-f", "-"],
                                input=block, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    if heading.startswith("From psql"):
        assert db.execute("SELECT status FROM ledger.job_execution_log WHERE run_id = 1").fetchone()[0] == "success"
        assert db.execute("SELECT token FROM ledger.fences WHERE resource = 'reports'").fetchone()[0] == 1
    else:
        assert db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'publish'").fetchone()[0] == 1
