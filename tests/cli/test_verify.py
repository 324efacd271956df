"""`jobledger verify`: the guarantees checked against a real database, directly and behind a real PgBouncer.

Every run is the command as a user runs it (a subprocess, ``--json`` read
back): its exit code (0 when nothing failed, warnings allowed; 1 when a
check failed), which checks it names, and the verdicts that the setting
decides: a login that is a plain ledger_client holds everything, a
superuser is warned about, a login without ledger_client fails with a way
to reproduce it, a transaction pooler is detected and its broken prepared
statements reported, a held snapshot is named by its pid. What a verify
leaves behind is read from the database afterwards: no registration, no run,
no state row (no job that status lists), no table; only the scratch jobs' lease rows and fences (the token high-water
marks), the same ones after a second run. Only invariants are asserted,
never how long a check took.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from clihelp import jobledger
from pgbouncer import pgbouncer  # noqa: F401 - the fixture
from psycopg.conninfo import make_conninfo
from waiting import wait_for

from ledger.verify import CHECKS, GUARD, JOBS, RESOURCES
from ledger.verify.environment import IDLE_HOLDER

GUARANTEES = ("race", "zombie", "lost-lease", "reconnect")  # the checks that exercise the ledger
SCRATCH = [*JOBS.values(), GUARD]


def verify(dsn: str, *args: str) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]]]:
    """``jobledger verify --json``: its exit code, its report, and its checks by name."""
    done = jobledger("verify", "--json", *args, dsn=dsn, timeout=120)
    assert done.stdout, done.stderr
    report = json.loads(done.stdout)
    return done.returncode, report, {check["name"]: check for check in report["checks"]}


@pytest.fixture
def login(db: psycopg.Connection, dsn: str) -> Iterator[Callable[..., str]]:
    """``login(*roles)``: the DSN of a new login that is a member of ``roles`` (roles are cluster-wide: unique)."""
    made: list[str] = []

    def make(*roles: str) -> str:
        name = f"test_verify_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        db.execute(f'CREATE ROLE "{name}" LOGIN')
        made.append(name)
        for role in roles:
            db.execute(f'GRANT "{role}" TO "{name}"')
        return make_conninfo(dsn, user=name)

    yield make
    for name in made:
        db.execute(f'DROP OWNED BY "{name}"')
        db.execute(f'DROP ROLE "{name}"')


def statuses(checks: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {name: check["status"] for name, check in checks.items()}


def test_a_plain_ledger_client_holds_every_guarantee_on_a_direct_connection(login):
    code, report, checks = verify(login("ledger_client"))
    assert code == 0, report
    assert list(checks) == list(CHECKS)  # every check, named, in the report's order
    assert all(checks[name]["status"] == "held" for name in (*GUARANTEES, "role", "path")), statuses(checks)
    assert "failed" not in statuses(checks).values()
    race = checks["race"]["facts"]
    assert len(race["slots"]) >= 3 and race["succeeded_twice"] == [] and race["duplicates"] == 0
    assert checks["zombie"]["facts"]["fence_after_takeover"] == "LD001"
    lost = checks["lost-lease"]["facts"]
    assert lost["noticed_after_expiry_seconds"] <= lost["margin_seconds"]
    first, second = checks["reconnect"]["facts"]["tokens"]
    assert second > first
    assert checks["path"]["facts"]["transaction_pooling"] is False


def test_a_superuser_is_warned_about_and_still_exits_0(dsn):
    code, report, checks = verify(dsn)  # the suite connects as a superuser
    assert code == 0, report
    assert checks["role"]["status"] == "warn"
    assert checks["role"]["facts"]["superuser"] is True
    assert "ledger_client" in checks["role"]["advice"]
    assert all(checks[name]["status"] == "held" for name in GUARANTEES), statuses(checks)


def test_a_login_without_ledger_client_fails_with_a_way_to_reproduce_it(login):
    nobody = login()
    code, report, checks = verify(nobody)
    assert code == 1
    role = checks["role"]
    assert role["status"] == "failed"
    assert role["how_to_reproduce"] and "psql" in role["how_to_reproduce"]
    assert "GRANT ledger_client TO" in role["advice"]
    assert all(checks[name]["status"] == "skipped" for name in GUARANTEES), statuses(checks)
    text = jobledger("verify", dsn=nobody, timeout=120)  # the same for people
    assert text.returncode == 1
    assert "FAILED" in text.stdout and "to reproduce:" in text.stdout and "GRANT ledger_client TO" in text.stdout


def test_a_reader_login_fails_too(login):
    code, _, checks = verify(login("ledger_reader"))
    assert code == 1
    assert checks["role"]["status"] == "failed" and "ledger_reader" in checks["role"]["summary"]


def test_behind_a_transaction_pooler_it_is_detected_and_prepared_statements_are_reported(pgbouncer, dsn):
    code, report, checks = verify(pgbouncer(dsn))
    assert code == 0, report
    path = checks["path"]
    assert path["status"] == "held"
    assert path["facts"]["transaction_pooling"] is True and path["facts"]["statement_pooling"] is False
    assert path["facts"]["server_prepared_statements"]  # PgBouncer 1.18 tracks none: usually "break: 26000 ..."
    assert "transaction pooler" in path["summary"]
    assert "prepare_threshold=None" in path["facts"]["safe_settings"]
    assert all(checks[name]["status"] == "held" for name in GUARANTEES), statuses(checks)


def test_it_leaves_no_registration_no_run_and_no_table_only_the_token_high_water_marks(db, dsn):
    code, report, _ = verify(dsn)
    assert code == 0, report
    assert report["cleanup"]["errors"] == {}
    assert _remains(db) == {"jobs": 0, "runs": 0, "counters": 0, "tables": 0, "leases": len(SCRATCH),
                            "fences": len(RESOURCES), "live": 0}
    tokens = _tokens(db)
    code, report, _ = verify(dsn)  # a second run: the same names, nothing piles up, tokens go on
    assert code == 0, report
    assert _remains(db)["leases"] == len(SCRATCH)
    assert all(_tokens(db)[job] > token for job, token in tokens.items())
    # no job left that status, health or the alerts list (the guard too is forgotten once released)
    for view in ("job_status", "job_health", "alerts"):
        assert db.execute(f"SELECT count(*) FROM ledger.{view} WHERE job = ANY(%s)", (SCRATCH,)).fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM ledger.verify_state()").fetchone() == (0,)


def test_a_verify_that_died_is_tidied_up_by_the_next(db, dsn):
    # What a verify killed mid-way leaves: a live run of a scratch job and a registration.
    db.execute("SELECT ledger.register_job(job => %s, schedule => '1 second', ttl => '1 minute')", (JOBS["race"],))
    db.execute("SELECT ledger.start_run(job => %s, owner => 'a verify that died', ttl => '10 minutes')",
               (JOBS["zombie"],))
    code, report, checks = verify(dsn)
    assert code == 0, report
    assert all(checks[name]["status"] == "held" for name in GUARANTEES), statuses(checks)
    assert _remains(db)["runs"] == 0 and _remains(db)["jobs"] == 0


def test_a_second_verify_at_once_does_not_share_the_scratch_jobs(db, dsn):
    db.execute("SELECT ledger.acquire(job => %s, owner => 'another verify', ttl => '1 minute')", (GUARD,))
    code, _, checks = verify(dsn)
    assert code == 1
    for name in GUARANTEES:
        assert checks[name]["status"] == "failed" and "another verify" in checks[name]["summary"]
    assert _remains(db)["runs"] == 0  # it touched none of them


def test_a_held_snapshot_is_an_mvcc_risk_named_by_its_pid(connect, db, dsn):
    holder = connect(autocommit=False)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM ledger.leases")  # takes the snapshot; the session then sits idle in it
    pid = holder.info.backend_pid
    wait_for(lambda: db.execute("SELECT clock_timestamp() - state_change > make_interval(secs => %s) "
                                "FROM pg_stat_activity WHERE pid = %s", (IDLE_HOLDER, pid)).fetchone()[0],
             what="the holder to sit idle in its transaction past the threshold")
    code, report, checks = verify(dsn)
    assert code == 0, report  # a warning, not a failure
    mvcc = checks["mvcc"]
    assert mvcc["status"] == "warn"
    assert f"pid {pid} " in mvcc["summary"]
    assert pid in [holder_["pid"] for holder_ in mvcc["facts"]["holders"]]


def _remains(db: psycopg.Connection) -> dict[str, int]:
    row = db.execute(
        "SELECT (SELECT count(*) FROM ledger.jobs WHERE job = ANY(%(jobs)s)),"
        "       (SELECT count(*) FROM ledger.job_execution_log WHERE job = ANY(%(jobs)s)),"
        "       (SELECT count(*) FROM ledger.counters WHERE job = ANY(%(jobs)s)),"
        "       (SELECT count(*) FROM pg_class WHERE relname LIKE 'jobledger%%'),"
        "       (SELECT count(*) FROM ledger.leases WHERE job = ANY(%(jobs)s)),"
        "       (SELECT count(*) FROM ledger.fences WHERE resource = ANY(%(resources)s)),"
        "       (SELECT count(*) FROM ledger.leases WHERE job = ANY(%(jobs)s)"
        "           AND released_at IS NULL AND expires_at > clock_timestamp())",
        {"jobs": SCRATCH, "resources": list(RESOURCES.values())}).fetchone()
    assert row is not None
    return dict(zip(("jobs", "runs", "counters", "tables", "leases", "fences", "live"), row))


def _tokens(db: psycopg.Connection) -> dict[str, int]:
    return dict(db.execute("SELECT job, token FROM ledger.leases WHERE job = ANY(%s)", (SCRATCH,)).fetchall())
