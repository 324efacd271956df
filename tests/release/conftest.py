"""Fixtures of the release tests: empty databases to install and upgrade."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

_counter = itertools.count()


@pytest.fixture
def new_database(pg_server) -> Iterator[Callable[[], str]]:
    """Make empty databases (from template0); their conninfo. Dropped at teardown."""
    names: list[str] = []

    def admin() -> psycopg.Connection:
        return psycopg.connect(pg_server.dsn("postgres"), autocommit=True)

    def make() -> str:
        name = f"ledger_rel_{os.getpid()}_{next(_counter)}"
        with admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        names.append(name)
        return pg_server.dsn(name)

    yield make
    with admin() as conn:
        for name in names:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
