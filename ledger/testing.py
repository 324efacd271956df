"""A pytest plugin: a database with the ledger installed, for your own tests.

Built on pytest-postgresql. Enable it in your ``conftest.py``::

    pytest_plugins = ["ledger.testing"]

and use the fixtures:

- ``ledger_postgresql``: a psycopg Connection to a fresh database per test,
  cloned from a template into which the ledger was migrated once per session
  (``ledger.migrate.upgrade``, exactly as in production);
- ``ledger_dsn``: that database's conninfo string (for a pool, a subprocess);
- ``ledger_client``: a :class:`ledger.Ledger` over ``ledger_postgresql``.

The server comes from a pytest-postgresql process fixture, by default
``postgresql_proc`` (pytest-postgresql starts a throwaway server, which needs
``pg_ctl``). To use a server that is already running, name
``postgresql_noproc`` instead, in the ini file or on the command line::

    [pytest]
    ledger_postgresql_base = postgresql_noproc
    postgresql_host = 127.0.0.1

    pytest --ledger-postgresql-base postgresql_noproc

Every ``--postgresql-*`` option of pytest-postgresql applies as usual. To
migrate a database of your own, pytest-postgresql loaders take
``ledger.testing:load_ledger`` (``--postgresql-load ledger.testing:load_ledger``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor

from ledger.client import Ledger, conninfo_of
from ledger.migrate import upgrade

__all__ = ["install", "ledger_client", "ledger_dsn", "ledger_postgresql", "ledger_postgresql_proc", "load_ledger"]

_BASE_OPTION = "ledger_postgresql_base"


def pytest_addoption(parser: pytest.Parser) -> None:
    help_text = "pytest-postgresql process fixture that ledger_postgresql builds on (default postgresql_proc)"
    parser.addini(_BASE_OPTION, help=help_text, default="postgresql_proc")
    parser.addoption("--ledger-postgresql-base", dest=_BASE_OPTION, help=help_text)


def install(conninfo: str) -> None:
    """Migrate the database at ``conninfo`` to the ledger's newest revision."""
    upgrade(conninfo)


def load_ledger(host: str, port: int | str, user: str, dbname: str, password: str | None = None,
                **_: Any) -> None:
    """A pytest-postgresql loader (``load=[load_ledger]``): install the ledger into ``dbname``."""
    install(make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password or None))


@pytest.fixture(scope="session")
def ledger_postgresql_proc(request: pytest.FixtureRequest) -> Iterator[NoopExecutor]:
    """The base process fixture's server, with a template database the ledger is migrated into once."""
    base_name = request.config.getoption(_BASE_OPTION) or request.config.getini(_BASE_OPTION)
    base = request.getfixturevalue(str(base_name))
    # Older pytest-postgresql releases have no maintenance database setting.
    maintenance: dict[str, Any] = {}
    if hasattr(base, "maintenance_dbname"):
        maintenance["maintenance_dbname"] = base.maintenance_dbname
    executor = NoopExecutor(host=base.host, port=base.port, user=base.user, options=base.options,
                            dbname=f"{base.dbname}_ledger", password=base.password, **maintenance)
    # Cloned from the base's template: whatever the base loads (your own schema) comes along.
    janitor = DatabaseJanitor(user=executor.user, host=executor.host, port=executor.port,
                              dbname=executor.template_dbname, template_dbname=base.template_dbname,
                              password=executor.password, as_template=True, **maintenance)
    with janitor:
        janitor.load(load_ledger)
        yield executor


ledger_postgresql = factories.postgresql("ledger_postgresql_proc")
"""A connection to a fresh database per test, cloned from the ledger template."""


@pytest.fixture
def ledger_dsn(ledger_postgresql: psycopg.Connection[Any]) -> str:
    """The conninfo of the test's database."""
    return conninfo_of(ledger_postgresql)


@pytest.fixture
def ledger_client(ledger_postgresql: psycopg.Connection[Any]) -> Ledger:
    """A Ledger over the test's connection."""
    return Ledger(ledger_postgresql)
