"""Upgrading from 0.1.0: online (`jobledger install`), through psql (`jobledger
sql --upgrade-from 0.1.0`), and back down. Each path must end with the same
catalog as a fresh install of the version it reaches, and keep the data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from catalog import snapshot_of
from ledger import migrate, resources

RELEASE = "0.1.0"


def _psql() -> str:
    found = shutil.which("psql") or next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))), None)
    if found is None:
        pytest.skip("needs the psql client (apt-get install postgresql-client)")
    return str(found)


def psql(dsn: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn], input=script,
                          capture_output=True, text=True, timeout=120)


def jobledger(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger", *args], capture_output=True, text=True,
                          timeout=120, env=os.environ.copy())


def differences(expected: dict, actual: dict) -> list[str]:
    return [f"{section}: {row}" for section in expected.keys() | actual.keys()
            for row in set(map(repr, expected.get(section, []))) ^ set(map(repr, actual.get(section, [])))]


def history(dsn: str) -> list[tuple]:
    """What a user's ledger holds: runs, tokens, fences (not the catalog)."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT r.job, r.token, r.status, f.resource, f.token FROM ledger.job_execution_log r "
            "LEFT JOIN ledger.fences f ON f.job = r.job ORDER BY r.run_id").fetchall()


def functions(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        return {name for (name,) in conn.execute(
            "SELECT proname::text FROM pg_proc WHERE pronamespace = 'ledger'::regnamespace")}


def signatures(dsn: str) -> dict[str, tuple[str, str]]:
    """Each ledger function's signature (regprocedure) and its (name, identity arguments)."""
    with psycopg.connect(dsn) as conn:
        return {signature: (name, arguments) for signature, name, arguments in conn.execute(
            "SELECT oid::regprocedure::text, proname::text, pg_get_function_identity_arguments(oid) "
            "FROM pg_proc WHERE pronamespace = 'ledger'::regnamespace")}


def left_in_place_after(revision: str) -> set[str]:
    """The signatures the downgrades of the revisions after `revision` declare they leave in place."""
    names: set[str] = set()
    for path in sorted((resources.migrations_dir() / "versions").glob("*.downgrade.sql")):
        if path.name.split("_", 1)[0] <= revision:
            continue
        text = path.read_text()
        if "-- Left in place" in text:
            listed = text[text.index("-- Left in place"):].splitlines()[1:]
            names |= {line.removeprefix("--   ").strip() for line in listed if line.startswith("--   ledger.")}
    return names


def at_release_with_history(dsn: str) -> None:
    migrate.upgrade(dsn, migrate.RELEASES[RELEASE])
    with psycopg.connect(dsn, autocommit=True) as conn:
        run_id, token = conn.execute(
            "SELECT run_id, token FROM ledger.start_run('nightly', 'host-1', '1 hour')").fetchone()
        conn.execute("SELECT ledger.fence('nightly', 'reports', %s)", [token])
        conn.execute("SELECT ledger.complete_run(%s, %s)", [run_id, token])
        conn.execute("SELECT ledger.start_run('hourly', 'host-2', '1 hour')")


def test_head_is_past_the_release_so_there_is_an_upgrade_to_test():
    assert migrate.head() != migrate.RELEASES[RELEASE]


def test_upgrade_script_through_psql_gives_a_fresh_install_and_keeps_the_history(new_database):
    fresh, upgraded = new_database(), new_database()
    migrate.upgrade(fresh)
    at_release_with_history(upgraded)
    before = history(upgraded)

    printed = jobledger("sql", "--upgrade-from", RELEASE)
    assert printed.returncode == 0, printed.stderr
    applied = psql(upgraded, printed.stdout)

    assert applied.returncode == 0, applied.stderr
    assert migrate.current(upgraded) == migrate.head()
    assert differences(snapshot_of(fresh), snapshot_of(upgraded)) == []
    assert history(upgraded) == before
    with psycopg.connect(upgraded, autocommit=True) as conn:  # the tokens go on from where they were
        assert conn.execute("SELECT token FROM ledger.acquire('nightly', 'host-3', '1 hour')").fetchone() == (2,)


@pytest.mark.parametrize("where", ["no ledger", "already upgraded"])
def test_upgrade_script_refuses_a_database_at_another_revision_and_changes_nothing(new_database, where):
    dsn = new_database()
    if where == "already upgraded":
        migrate.upgrade(dsn)

    def state() -> object:
        with psycopg.connect(dsn) as conn:
            if conn.execute("SELECT to_regnamespace('ledger')").fetchone() == (None,):
                return "no schema ledger"
        return snapshot_of(dsn)

    before = state()

    applied = psql(dsn, jobledger("sql", "--upgrade-from", RELEASE).stdout)

    assert applied.returncode != 0
    expected = "no ledger" if where == "no ledger" else f"revision {migrate.head()}"
    assert f"this script upgrades a ledger at revision {migrate.RELEASES[RELEASE]}; " \
           f"this database is at {expected}" in applied.stderr
    assert state() == before  # not even schema ledger was left behind


def test_upgrade_from_an_unknown_release_is_a_usage_error_naming_the_option():
    printed = jobledger("sql", "--upgrade-from", "0.0.9")
    assert printed.returncode == 2
    assert "--upgrade-from" in printed.stderr and "0.1.0" in printed.stderr
    assert printed.stdout == ""


def test_online_upgrade_from_the_release_applies_only_the_later_revisions(new_database):
    dsn = new_database()
    at_release_with_history(dsn)
    before = history(dsn)

    applied = migrate.upgrade(dsn)

    released = migrate.revisions().index(migrate.RELEASES[RELEASE])
    assert applied == migrate.revisions()[released + 1:] != []
    assert history(dsn) == before


def test_downgrade_to_the_release_gives_its_catalog_and_keeps_the_history(new_database):
    released, downgraded = new_database(), new_database()
    migrate.upgrade(released, migrate.RELEASES[RELEASE])
    at_release_with_history(downgraded)
    migrate.upgrade(downgraded)
    before = history(downgraded)

    at_head = new_database()
    migrate.upgrade(at_head)
    added = functions(at_head) - functions(released)

    migrate.downgrade(downgraded, migrate.RELEASES[RELEASE])

    assert migrate.current(downgraded) == migrate.RELEASES[RELEASE]
    # What each later revision's downgrade says it leaves in place (for the
    # calls in flight across it: newer bodies call them) stays; everything
    # else is the release's.
    kept = signatures(downgraded).keys() - signatures(released).keys()
    assert {signatures(downgraded)[signature][0] for signature in kept} <= added | functions(released)
    assert kept == left_in_place_after(migrate.RELEASES[RELEASE]) - signatures(released).keys()
    snapshot = snapshot_of(downgraded)
    pairs = {signatures(downgraded)[signature] for signature in kept}
    snapshot["functions"] = [row for row in snapshot["functions"] if (row[0], row[1]) not in pairs]
    assert differences(snapshot_of(released), snapshot) == []
    assert history(downgraded) == before


def test_jobledger_downgrade_to_the_release_and_install_again_go_back_and_forth(new_database):
    dsn = new_database()
    at_release_with_history(dsn)
    migrate.upgrade(dsn)
    before = history(dsn)

    refused = jobledger("downgrade", "--dsn", dsn, "--to", RELEASE)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert migrate.current(dsn) == migrate.head()
    unknown = jobledger("downgrade", "--dsn", dsn, "--to", "0.0.9", "--yes")
    assert unknown.returncode == 2 and "--to" in unknown.stderr

    done = jobledger("downgrade", "--dsn", dsn, "--to", RELEASE, "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ledger at revision {migrate.RELEASES[RELEASE]} ({RELEASE}): was {migrate.head()}"
    again = jobledger("downgrade", "--dsn", dsn, "--to", RELEASE, "--yes")
    assert again.returncode == 0 and "already at or below" in again.stdout
    assert history(dsn) == before

    assert jobledger("install", "--dsn", dsn).returncode == 0
    assert migrate.current(dsn) == migrate.head()
