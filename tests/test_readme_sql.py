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
        assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'reports'").fetchone() == \
            ("nightly", 1)
        assert db.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
    else:
        assert db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'publish'").fetchone()[0] == 1


def fenced_transactions(heading: str) -> list[str]:
    """Every BEGIN ... COMMIT of the section's SQL blocks that calls a fence."""
    found = []
    for block in sql_blocks(heading):
        for transaction in re.findall(r"^BEGIN;\n.*?^COMMIT;\n", block, re.S | re.M):
            if re.search(r"ledger\.(advance_)?fence\(", transaction):
                found.append(transaction)
    return found


def test_every_readme_sql_fence_is_job_aware_and_inside_the_transaction_of_its_write():
    text = "\n".join(sql_blocks("From psql (or any SQL client)") + sql_blocks("Schedules and bounded catch-up"))
    calls = re.findall(r"ledger\.(?:advance_)?fence\((.*?)\)", text)
    assert calls, "the README shows no fence"
    for arguments in calls:
        assert re.match(r"job => '[^']+', resource => '[^']+', token => ", arguments), arguments
    transactions = fenced_transactions("From psql (or any SQL client)")
    assert len(transactions) == len(calls)  # no fence outside a BEGIN ... COMMIT
    for transaction in transactions:
        statements = [line for line in transaction.splitlines() if line and not line.startswith("--")]
        assert "fence(" in statements[1] and "INSERT" in statements[2], transaction  # fence first, then the write


def test_the_readme_fenced_write_replayed_by_a_zombie_writes_nothing(dsn, db):
    """The README's transaction again, after the run ended: the fence refuses the token (LD001)."""
    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    db.execute("CREATE TABLE reports (day date, total integer)")
    for block in sql_blocks("From psql (or any SQL client)"):
        subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", dsn, "-f", "-"],
                       input=block, capture_output=True, text=True, timeout=60, check=True)
    [transaction] = fenced_transactions("From psql (or any SQL client)")
    # Without ON_ERROR_STOP too: the failed fence aborts the transaction, COMMIT rolls it back.
    for stop in ("1", "0"):
        result = subprocess.run(["psql", "-v", f"ON_ERROR_STOP={stop}", "-X", "-q", "-d", dsn, "-f", "-"],
                                input=transaction, capture_output=True, text=True, timeout=60)
        assert "lease superseded" in result.stderr, result.stderr
        if stop == "1":
            assert result.returncode != 0
    assert db.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
