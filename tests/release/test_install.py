"""Installing where users run it: as a plain database owner (hosted
PostgreSQL: no superuser, no extension, no CREATEROLE once the roles exist),
as an owner with CREATEROLE, as a superuser; a second psql install; uninstall
and reinstall."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql

from cluster import cluster_root  # noqa: F401  (fixture)
from ledger import migrate
from test_migrations import jobledger, schema_exists

_counter = itertools.count()


def _owned_by_ledger_owner(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        return conn.execute("""
            SELECT bool_and(proowner = 'ledger_owner'::regrole) FROM pg_proc
             WHERE pronamespace = 'ledger'::regnamespace""").fetchone()[0] is True


def _works(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = conn.execute("SELECT outcome, run_id, token FROM ledger.start_run('nightly', 'host-1', '1 hour')"
                               ).fetchone()
        assert started[0] == "started"
        assert conn.execute("SELECT ledger.fence('nightly', 'reports', %s)", (started[2],)).fetchone()[0] == started[2]
        conn.execute("SELECT ledger.complete_run(%s, %s)", started[1:])


@pytest.fixture
def owner_database(pg_server) -> Iterator[Callable[..., str]]:
    """A login role without superuser or CREATEROLE that owns a new database: a hosted customer."""
    made: list[tuple[str, str]] = []

    def admin() -> psycopg.Connection:
        return psycopg.connect(pg_server.dsn("postgres"), autocommit=True)

    def make(grant_owner_role: bool = True) -> str:
        n = next(_counter)
        role, database = f"test_host_{os.getpid()}_{n}", f"ledger_hosted_{os.getpid()}_{n}"
        with admin() as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB").format(
                sql.Identifier(role)))
            conn.execute(sql.SQL("CREATE DATABASE {} OWNER {} TEMPLATE template0").format(
                sql.Identifier(database), sql.Identifier(role)))
            # What the administrator runs once (the roles already exist in
            # this cluster: the session's template database installed them).
            if grant_owner_role:
                conn.execute(sql.SQL("GRANT ledger_owner TO {}").format(sql.Identifier(role)))
        made.append((role, database))
        return psycopg.conninfo.make_conninfo(pg_server.dsn(database), user=role)

    yield make
    with admin() as conn:
        for role, database in made:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_a_database_owner_without_createrole_installs_when_the_roles_exist(owner_database):
    dsn = owner_database()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
                            ).fetchone()[0] is False
    assert migrate.upgrade(dsn) == migrate.revisions()
    assert _owned_by_ledger_owner(dsn)
    _works(dsn)


def test_a_psql_install_as_a_database_owner_works_too(owner_database):
    from test_migrations import psql

    dsn = owner_database()
    psql(dsn, input=migrate.install_script())
    assert migrate.current(dsn) == migrate.head()
    _works(dsn)


def test_without_the_owner_role_granted_the_install_says_what_the_administrator_runs(owner_database):
    dsn = owner_database(grant_owner_role=False)
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(migrate.install_script())  # type: ignore[arg-type]
    assert "member of ledger_owner" in caught.value.diag.message_primary
    assert "GRANT ledger_owner TO" in caught.value.diag.message_hint
    assert not schema_exists(dsn)  # one transaction: nothing is left half-installed


def test_a_second_psql_install_stops_with_one_line_that_says_what_to_do(owner_database):
    from test_migrations import _psql_binary
    import subprocess

    dsn = owner_database()
    script = migrate.install_script()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(script)  # type: ignore[arg-type]
    again = subprocess.run([_psql_binary(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn],
                           input=script, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0
    errors = [line for line in again.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "already installed" in errors[0] and "jobledger install" in errors[0], again.stderr
    _works(dsn)  # and the first install is untouched


def test_uninstall_then_reinstall(owner_database):
    dsn = owner_database()
    assert jobledger("install", "--dsn", dsn).returncode == 0
    refused = jobledger("uninstall", "--dsn", dsn)
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert schema_exists(dsn)
    done = jobledger("uninstall", "--dsn", dsn, "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ledger uninstalled"
    assert not schema_exists(dsn)
    assert jobledger("uninstall", "--dsn", dsn, "--yes").stdout.strip() == "no ledger installed here: nothing to do"
    assert jobledger("install", "--dsn", dsn).returncode == 0
    _works(dsn)


@pytest.mark.cluster
def test_createrole_owner_superuser_and_two_databases_on_a_fresh_cluster(cluster_root):
    """Roles are cluster-wide: only a fresh cluster shows who may create them."""
    server = cluster_root("hosted").initdb()
    server.start()
    with server.connect() as conn:
        conn.execute("CREATE ROLE plain LOGIN")
        conn.execute("CREATE DATABASE plain_db OWNER plain")
        conn.execute("CREATE ROLE maker LOGIN CREATEROLE")
        conn.execute("CREATE DATABASE maker_db OWNER maker")
        conn.execute("CREATE DATABASE second_db")
    plain = f"host=127.0.0.1 port={server.port} user=plain dbname=plain_db"
    maker = f"host=127.0.0.1 port={server.port} user=maker dbname=maker_db"
    superuser_second = server.dsn("second_db")

    # No roles yet, no CREATEROLE: refused with the administrator's statements.
    with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
        migrate.upgrade(plain)
    assert "may not create it" in caught.value.diag.message_primary
    assert "CREATE ROLE ledger_owner NOLOGIN" in caught.value.diag.message_hint
    assert not schema_exists(plain)

    # A CREATEROLE owner creates the three roles and grants itself the owner.
    assert migrate.upgrade(maker) == migrate.revisions()
    assert _owned_by_ledger_owner(maker)
    _works(maker)

    # Now that the roles exist, the plain owner needs only the administrator's grant.
    with server.connect() as conn:
        conn.execute("GRANT ledger_owner TO plain")
    assert migrate.upgrade(plain) == migrate.revisions()
    _works(plain)

    # A superuser, in a third database of the same cluster.
    assert migrate.upgrade(superuser_second) == migrate.revisions()
    _works(superuser_second)

    # Uninstalling one database leaves the roles the others use.
    migrate.downgrade(maker, "base")
    with server.connect() as conn:
        roles = [r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'ledger%' ORDER BY 1")]
    assert roles == ["ledger_client", "ledger_owner", "ledger_reader"]
    _works(plain)
    _works(superuser_second)
