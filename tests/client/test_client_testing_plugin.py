"""ledger.testing: the pytest plugin gives a user's own tests a migrated database."""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = '''
from datetime import timedelta

from ledger import Ledger


def test_the_database_has_the_ledger(ledger_postgresql):
    revision = ledger_postgresql.execute("SELECT version_num FROM ledger.alembic_version").fetchone()
    assert revision is not None


def test_the_client_fixture_runs_a_job(ledger_client, ledger_postgresql):
    with ledger_client.run("nightly", ttl=timedelta(minutes=1)) as run:
        assert run.started and run.token == 1
    assert run.result.status == "success"


def test_each_test_gets_a_fresh_database(ledger_dsn):
    with Ledger(ledger_dsn) as ledger:
        with ledger.run("nightly", ttl=timedelta(minutes=1)) as run:
            assert run.token == 1
'''


def test_the_plugin_installs_the_ledger_for_user_tests(pytester: pytest.Pytester, pg_server) -> None:
    # What a user writes: the plugin enabled in the root conftest, then plain tests.
    pytester.makeconftest('pytest_plugins = ["ledger.testing"]')
    pytester.makepyfile(test_user=USER_TESTS)
    dbname = f"ledger_plugin_{os.getpid()}"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider",
        "--ledger-postgresql-base", "postgresql_noproc",
        "--postgresql-host", pg_server.host, "--postgresql-port", str(pg_server.port),
        "--postgresql-user", pg_server.user, "--postgresql-dbname", dbname,
        *(["--postgresql-password", pg_server.password] if pg_server.password else []),
    )
    result.assert_outcomes(passed=3)
