"""`jobledger demo` (what `make demo` runs), and the embedded PostgreSQL behind a DSN-less command line.

The embedded test runs with no DSN at all (no LEDGER_DSN, no PG* variables)
and a temporary LEDGER_HOME: the server is created there, the ledger
installed, the demo played, and the server stopped when the last command exits.
"""

from __future__ import annotations

import json

from clihelp import environment, jobledger


def _check_demo_output(stdout: str) -> None:
    assert stdout.rstrip("\n").splitlines()[-1] == "audit: ledger.overlaps has 0 rows"
    for promise in ("1 · Three workers, one slot", "rejected by the fence (LD001)", "complete_run refused (LD001)",
                    "closes 1 run as lease_expired", "backfill_limit", "failing", "ledger.job_status"):
        assert promise in stdout, promise
    assert "unexpected" not in stdout and "problem:" not in stdout


def test_demo_on_the_embedded_server_with_no_dsn(tmp_path):
    home = tmp_path / "home"
    env = environment(LEDGER_HOME=str(home))
    result = jobledger("demo", env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _check_demo_output(result.stdout)
    assert "embedded PostgreSQL" in result.stdout
    assert (home / "pgdata" / "PG_VERSION").exists()
    assert not (home / "pgdata" / "postmaster.pid").exists()  # stopped with the last jobledger process

    # The same home from a plain command: the server starts again, the ledger is installed in
    # its own database (not the demo's) on first use, and `where` tells the DSN.
    where = jobledger("where", env=env)
    assert where.returncode == 0, where.stderr
    assert "dbname=jobledger" in where.stdout and str(home) in where.stderr and "embedded" in where.stderr
    assert json.loads(jobledger("status", "--json", env=env).stdout) == {"jobs": [], "alerts": [], "protected_tables": [],
        "schedulers": [], "pools": []}
    run = jobledger("run", "hello", "--ttl", "1m", "--", "sh", "-c", 'echo "run $LEDGER_RUN_ID"', env=env)
    assert (run.returncode, run.stdout) == (0, "run 1\n"), run.stderr
    assert [r["status"] for r in json.loads(jobledger("runs", "hello", "--json", env=env).stdout)] == ["success"]
    # A second demo on the same home starts from a fresh demo database.
    again = jobledger("demo", "--speed", "3", env=env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    _check_demo_output(again.stdout)
    assert not (home / "pgdata" / "postmaster.pid").exists()


def test_demo_on_a_given_database_uses_unique_job_names(dsn, db):
    # A database of yours only when asked: --dsn with --yes-write-here (LEDGER_DSN is not used).
    result = jobledger("demo", "--speed", "3", "--dsn", dsn, "--yes-write-here", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _check_demo_output(result.stdout)
    jobs = [row[0] for row in db.execute("SELECT job FROM ledger.jobs ORDER BY job")]
    assert len(jobs) == 1 and jobs[0].startswith("publish-")
    assert jobledger("demo", "--speed", "3", "--dsn", dsn, "--yes-write-here", timeout=120).returncode == 0  # again
    assert db.execute("SELECT count(*) FROM ledger.overlaps").fetchone() == (0,)
