"""`jobledger run --fenced RESOURCE` and $LEDGER_FENCED_FILE (issue 21, point 3): the wrapper names
the resources CMD fences to complete_run, so a CMD whose fenced write did not commit (psql's
transaction rolled back, as a lost COMMIT leaves it) exits 0 and yet the run is a failure, exit 122."""

from __future__ import annotations

import pytest

from clihelp import environment, jobledger, runs_of, shell

# CMD's psql fences and writes in one transaction, then COMMIT or ROLLBACK ($END).
PSQL = ("printf '%s\\n' 'BEGIN;' \"SELECT ledger.fence(:'job', 'exports', :token);\" "
        "'INSERT INTO exports VALUES (:token);' \"$END;\" "
        '| psql "$LEDGER_DSN" -X -q -v ON_ERROR_STOP=1 -v job="$LEDGER_JOB" -v token="$LEDGER_FENCING_TOKEN"')


@pytest.fixture
def exports(db):
    db.execute("CREATE TABLE exports (token bigint)")


def run_export(dsn, *options, end="COMMIT", report=""):
    return jobledger("run", "export", "--ttl", "1m", *options, "--", *shell(f"{report}{PSQL}"),
                     env=environment(dsn, END=end))


def test_a_fenced_write_that_rolled_back_fails_the_run_with_exit_122(dsn, db, exports):
    result = run_export(dsn, "--fenced", "exports", end="ROLLBACK")
    assert result.returncode == 122, result.stderr
    assert "fence not committed" in result.stderr
    [run] = runs_of(db, "export")
    assert run["status"] == "failure" and str(run["error"]).startswith("fence not committed: exports")
    assert db.execute("SELECT count(*) FROM exports").fetchone() == (0,)


def test_a_committed_fenced_write_is_a_success(dsn, db, exports):
    result = run_export(dsn, "--fenced", "exports")
    assert result.returncode == 0, result.stderr
    [run] = runs_of(db, "export")
    assert run["status"] == "success"


def test_without_fenced_the_lost_write_is_not_seen(dsn, db, exports):
    """The limit, pinned: the wrapper sees no write of CMD's; a resource named nowhere is not checked."""
    result = run_export(dsn, end="ROLLBACK")
    assert result.returncode == 0, result.stderr
    assert runs_of(db, "export")[0]["status"] == "success"


def test_cmd_reports_its_resources_in_ledger_fenced_file(dsn, db, exports):
    report = 'echo exports >> "$LEDGER_FENCED_FILE" && '
    assert run_export(dsn, end="ROLLBACK", report=report).returncode == 122
    assert run_export(dsn, report=report).returncode == 0
    assert [run["status"] for run in runs_of(db, "export")] == ["failure", "success"]


def test_a_bad_line_in_ledger_fenced_file_fails_the_run(dsn, db, exports):
    report = "printf 'exports\\n\\n%0201d\\n' 0 >> \"$LEDGER_FENCED_FILE\" && "
    result = run_export(dsn, report=report)
    assert result.returncode == 122, result.stderr
    [run] = runs_of(db, "export")
    assert run["status"] == "failure" and "LEDGER_FENCED_FILE line 3 names no valid resource" in str(run["error"])
