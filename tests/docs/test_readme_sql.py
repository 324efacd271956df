"""The SQL tour's examples (docs/sql.md) run, as written, through psql.

The page marks them ``<!-- executed by tests/docs/test_readme_sql.py -->`` (the rule
is in tests/docs/test_docs_examples.py). The file keeps its name from when the tour
was in the README: tests/matrix.py runs it on every PostgreSQL version.

And what a reader does who pastes README.md's or docs/sql.md's SQL into psql:
every ```sql block of the page, in order, whoever else runs it, into a fresh
ledger database and nothing else (no table made for it), each page in its own.
A block that cannot run so says why in a ``<!-- not executed: REASON -->``
marker, and is left out.
"""

import re
import shutil
import subprocess

import pytest
from docpages import page_blocks

PAGE = "docs/sql.md"
PASTED = ("README.md", PAGE)
RUN = "A run, step by step"
SCHEDULES = "Schedules and bounded catch-up"


def sql_blocks(heading: str) -> list[str]:
    """The page's sql blocks under ``## heading`` that this file is marked to run."""
    return [block.body for block in page_blocks(PAGE)
            if block.lang == "sql" and block.section == heading and block.executed_by == "tests/docs/test_readme_sql.py"]


@pytest.mark.parametrize("heading", [RUN, SCHEDULES])
def test_the_sql_examples_run_through_psql(dsn, db, heading):
    if shutil.which("psql") is None:
        pytest.skip("needs psql (apt-get install postgresql-client)")
    blocks = sql_blocks(heading)
    assert blocks, f"no sql blocks under {heading!r}"
    for block in blocks:
        result = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", dsn, "-f", "-"],
                                input=block, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    if heading == RUN:
        assert db.execute("SELECT status FROM ledger.job_execution_log WHERE run_id = 1").fetchone()[0] == "success"
        assert db.execute("SELECT job, token FROM ledger.fences WHERE resource = 'reports'").fetchone() == \
            ("nightly", 1)
        assert db.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
    else:
        assert db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE job = 'publish'").fetchone()[0] == 1


@pytest.mark.parametrize("page", PASTED)
def test_every_sql_block_of_the_page_runs_pasted_in_order_into_a_fresh_ledger(dsn, db, page):
    if shutil.which("psql") is None:
        pytest.skip("needs psql (apt-get install postgresql-client)")
    blocks = [block for block in page_blocks(page) if block.lang == "sql"]
    pasted = [block for block in blocks if block.not_executed is None]
    assert pasted, f"{page} shows no SQL"
    for block in pasted:
        result = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", dsn, "-f", "-"],
                                input=block.body, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{block.where}: {result.stderr}"
    # The first block's fenced write committed, into the table the block made itself.
    assert db.execute("SELECT day = current_date, total, token FROM reports").fetchall() == [(True, 42, 1)]


def fenced_transactions(heading: str) -> list[str]:
    """Every BEGIN ... COMMIT of the section's SQL blocks that calls a fence."""
    found = []
    for block in sql_blocks(heading):
        for transaction in re.findall(r"^BEGIN;\n.*?^COMMIT;\n", block, re.S | re.M):
            if re.search(r"ledger\.(advance_)?fence\(", transaction):
                found.append(transaction)
    return found


def test_every_sql_fence_of_the_page_is_job_aware_and_inside_the_transaction_of_its_write():
    text = "\n".join(sql_blocks(RUN) + sql_blocks(SCHEDULES))
    calls = re.findall(r"ledger\.(?:advance_)?fence\((.*?)\)", text)
    assert calls, "the page shows no fence"
    for arguments in calls:
        assert re.match(r"job => '[^']+', resource => '[^']+', token => ", arguments), arguments
    transactions = fenced_transactions(RUN)
    assert len(transactions) == len(calls)  # no fence outside a BEGIN ... COMMIT
    for transaction in transactions:
        statements = [line for line in transaction.splitlines() if line and not line.startswith("--")]
        assert "fence(" in statements[1] and "INSERT" in statements[2], transaction  # fence first, then the write


def test_the_fenced_write_of_the_page_replayed_by_a_zombie_writes_nothing(dsn, db):
    """The page's transaction again, after the run ended: the fence refuses the token (LD001)."""
    if shutil.which("psql") is None:
        pytest.skip("needs psql (apt-get install postgresql-client)")
    for block in sql_blocks(RUN):
        subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-d", dsn, "-f", "-"],
                       input=block, capture_output=True, text=True, timeout=60, check=True)
    [transaction] = fenced_transactions(RUN)
    # Without ON_ERROR_STOP too: the failed fence aborts the transaction, COMMIT rolls it back.
    for stop in ("1", "0"):
        result = subprocess.run(["psql", "-v", f"ON_ERROR_STOP={stop}", "-X", "-q", "-d", dsn, "-f", "-"],
                                input=transaction, capture_output=True, text=True, timeout=60)
        assert "lease superseded" in result.stderr, result.stderr
        if stop == "1":
            assert result.returncode != 0
    assert db.execute("SELECT count(*) FROM reports").fetchone()[0] == 1
