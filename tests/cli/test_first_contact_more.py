"""First contact, more of it: what a newcomer types first gets a working answer or one line saying what to do.

- ``jobledger web --dsn "host=... dbname=..."``: a libpq keyword DSN serves
  the dashboard; a host that cannot even be looked up (``db..example``, a
  label over 63 characters: psycopg lets the ``idna`` codec's UnicodeError
  through) is one line, exit 1, as every other DSN that does not answer, for
  every command (``ledger.connect`` turns it into LedgerUnavailable).
- ``jobledger web --refresh 15s``, as docs/cli.md shows it: a duration, as
  the other duration options take, in whole seconds from 1s to 1h.
- A database without the ledger: ``jobledger status`` and the other commands
  that read it (they share the one-line error path, ``ledger.cli._output``)
  say to run ``jobledger install``, and so does ``jobledger run`` (its own
  exit code, 125).
- ``ledger.embedded.ensure_database`` sees a database that exists (it used
  to ask for an empty row, which is falsy, and so always tried to create it:
  harmless as a superuser, refused to a role without CREATEDB).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import urllib.request
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from clihelp import environment, jobledger, start
from ledger.connect import connect
from ledger.embedded import ensure_database
from ledger.errors import LedgerUnavailable

_counter = itertools.count()

#: A host no resolver is ever asked about: an empty label.
UNRESOLVABLE = "host=db..example dbname=ledger connect_timeout=2"


@pytest.fixture
def empty_database(pg_server) -> Iterator[Callable[[], str]]:
    """Databases without the ledger (from template0); their conninfo. Dropped at teardown."""
    names: list[str] = []

    def make() -> str:
        name = f"ledger_empty_{os.getpid()}_{next(_counter)}"
        with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        names.append(name)
        return pg_server.dsn(name)

    yield make
    with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as admin:
        for name in names:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# -- jobledger web --dsn, --refresh ------------------------------------------------------

def _serve(*args: str) -> tuple[str, str]:
    """Start `jobledger web ARGS`, fetch its front page, stop it: (the page, its stderr)."""
    proc = start("web", "--port", "0", *args, env=environment())
    try:
        line = proc.stderr.readline() if proc.stderr else ""
        found = re.search(r"serving the dashboard on (http://\S+?)/,", line)
        assert found, line + (proc.stderr.read() if proc.stderr and proc.poll() is not None else "")
        with urllib.request.urlopen(found.group(1) + "/", timeout=30) as response:
            page = response.read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return page, err


def test_web_serves_a_keyword_dsn_with_a_refresh_written_as_a_duration(dsn):
    assert not dsn.startswith("postgres")  # host=... port=... dbname=...: not a URI
    page, _ = _serve("--dsn", dsn, "--refresh", "15s")
    assert 'data-refresh="15"' in page and "refreshed every 15s" in page
    page, _ = _serve("--dsn", dsn, "--refresh", "1m")
    assert 'data-refresh="60"' in page


@pytest.mark.parametrize("refresh", ["1500ms", "2h", "0s"])
def test_web_refuses_a_refresh_it_cannot_keep(refresh):
    result = jobledger("web", "--port", "0", "--refresh", refresh, "--dsn", UNRESOLVABLE)
    assert result.returncode == 2, result.stderr
    assert "--refresh" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["web", "--port", "0"], ["status"], ["runs", "nightly"]])
def test_a_host_that_cannot_be_looked_up_is_one_line(command):
    result = jobledger(*command, "--dsn", UNRESOLVABLE)
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("Error: cannot connect to the ledger's database at host db..example, port 5432: ")
    assert "not a host name that can be looked up" in line


def test_the_library_raises_ledger_unavailable_for_such_a_host():
    long_label = "host=" + "a" * 64 + ".example connect_timeout=2"
    for conninfo in (UNRESOLVABLE, long_label):
        with pytest.raises(LedgerUnavailable, match="not a host name that can be looked up"):
            connect(conninfo)


# -- a database without the ledger -------------------------------------------------------

READS = [["status"], ["status", "nightly"], ["runs", "nightly"], ["health"], ["next", "nightly"], ["events"],
         ["metrics"], ["register", "nightly", "--ttl", "1m"]]


@pytest.mark.parametrize("command", READS, ids=" ".join)
def test_a_database_without_the_ledger_says_to_install_it(empty_database, command):
    result = jobledger(*command, "--dsn", empty_database())
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("Error: this database has no ledger, or an older one (")
    assert line.endswith("run `jobledger install` to install or upgrade it")


def test_run_on_a_database_without_the_ledger_says_to_install_it(empty_database, tmp_path):
    marker = tmp_path / "ran"
    result = jobledger("run", "nightly", "--ttl", "1m", "--dsn", empty_database(), "--", "touch", str(marker))
    assert result.returncode == 125, result.stderr
    assert "run `jobledger install`" in _one_line(result.stderr)
    assert not marker.exists()


def test_install_then_status_works(empty_database):
    target = empty_database()
    assert jobledger("install", "--dsn", target).returncode == 0
    result = jobledger("status", "--dsn", target)
    assert result.returncode == 0, result.stderr


# -- the embedded server's database --------------------------------------------------------

def test_ensure_database_sees_a_database_that_exists(pg_server, empty_database):
    """As a role that may not create databases: asking to create one that exists would be refused."""
    existing = psycopg.conninfo.conninfo_to_dict(empty_database())["dbname"]
    role = f"test_no_createdb_{os.getpid()}"  # roles are cluster-wide: test_..., never ledger... (parallel runs)
    with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN NOCREATEDB").format(sql.Identifier(role)))
    try:
        server = psycopg.conninfo.make_conninfo(pg_server.dsn("postgres"), user=role)
        ensure_database(server, existing)  # before the fix: permission denied to create database
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            ensure_database(server, existing + "_new")  # a missing one is still created (here: refused)
    finally:
        with psycopg.connect(pg_server.dsn("postgres"), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
