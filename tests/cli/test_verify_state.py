"""`jobledger verify`'s state check: ledger.verify_state() on the command line. Held on a ledger whose state
rows are their logs'; failed, naming the job and the columns, with how to see it by hand, once a state row
is written past the ledger's functions (as the owner: no trigger recomputes it)."""

from __future__ import annotations

import json
from typing import Any

from clihelp import jobledger


def verify(dsn: str) -> tuple[int, dict[str, dict[str, Any]]]:
    done = jobledger("verify", "--json", dsn=dsn, timeout=120)
    assert done.stdout, done.stderr
    return done.returncode, {check["name"]: check for check in json.loads(done.stdout)["checks"]}


def test_the_state_check_holds_when_every_state_row_is_its_logs(db, dsn):
    db.execute("SELECT ledger.register_job('nightly', '1 day', ttl => '1 minute')")
    _, checks = verify(dsn)
    assert checks["state"]["status"] == "held", checks["state"]
    assert checks["state"]["facts"]["jobs_differing"] == 0


def test_the_state_check_fails_naming_the_job_whose_state_row_differs(db, dsn):
    db.execute("SELECT ledger.register_job('nightly', '1 day', ttl => '1 minute')")
    db.execute("SET ROLE ledger_owner")  # past the functions, and past the trigger that would recompute it
    db.execute("UPDATE ledger.counters SET consecutive_failures = 7 WHERE job = 'nightly'")
    db.execute("RESET ROLE")
    code, checks = verify(dsn)
    assert code == 1
    state = checks["state"]
    assert state["status"] == "failed"
    assert "nightly (consecutive_failures)" in state["summary"]
    assert state["facts"]["first"][0]["differences"]["consecutive_failures"] == {"stored": 7, "expected": 0}
    assert "ledger.verify_state()" in state["how_to_reproduce"]
