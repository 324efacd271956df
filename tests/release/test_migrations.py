"""The install and upgrade paths.

A psql install of install_script(), an online `alembic upgrade head` and the
offline `upgrade head --sql` script applied with psql must give one and the
same catalog (procrastinate's migration test): that is what lets sql/ be the
truth while migrations/ stays frozen history.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psycopg
import pytest
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from catalog import Snapshot, snapshot_of
from cluster import cluster_root  # noqa: F401  (fixture)
from ledger import migrate, resources
from repo import ROOT

FROZEN_0001 = resources.migrations_dir() / "versions" / "0001_initial.sql"


def _psql_binary() -> str:
    found = shutil.which("psql") or next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))), None)
    if found is None:
        pytest.skip("needs psql (apt-get install postgresql-client)")
    return str(found)


def psql(dsn: str, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """psql as a user runs it; fails the test, with psql's output, when psql fails."""
    done = subprocess.run([_psql_binary(), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, *args],
                          input=input, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"psql failed:\n{done.stderr}"
    return done


def jobledger(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def assert_same_catalog(expected: Snapshot, actual: Snapshot, what: str) -> None:
    differences = []
    for section, rows in expected.items():
        others = actual.get(section, [])
        if rows != others:
            differences += [f"  {section}: only in the fresh install: {row}" for row in rows if row not in others]
            differences += [f"  {section}: only in {what}: {row}" for row in others if row not in rows]
            if sorted(map(repr, rows)) == sorted(map(repr, others)):
                differences.append(f"  {section}: same rows in another order")
    assert not differences, (
        f"{what} differs from a fresh install of sql/ (a schema change needs a new revision: "
        "make revision REV=... MESSAGE=...):\n" + "\n".join(differences))


def schema_exists(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT FROM pg_namespace WHERE nspname = 'ledger'").fetchone() is not None


def test_fresh_install_online_upgrade_and_offline_script_give_the_same_catalog(new_database, tmp_path):
    fresh, online, offline = new_database(), new_database(), new_database()
    (tmp_path / "install.sql").write_text(migrate.install_script())
    psql(fresh, "-f", str(tmp_path / "install.sql"))
    assert migrate.upgrade(online) == migrate.revisions()
    (tmp_path / "offline.sql").write_text(migrate.offline_script())
    psql(offline, "-f", str(tmp_path / "offline.sql"))

    expected = snapshot_of(fresh)
    # The snapshot really holds the ledger, including what text() would have
    # mangled (format()'s %s, doubled for psycopg) and what psql might have.
    functions = {row[0]: row for row in expected["functions"]}
    assert {"acquire", "start_run", "fence"} <= functions.keys()
    assert any("_is_visible_text" in row[3] for row in expected["constraints"])
    assert any("\\u2028-\\u202F" in row[14] for row in expected["functions"])  # backslashes intact
    assert any("%s" in row[14] for row in expected["functions"])
    assert "alembic_version" in {row[0] for row in expected["relations"]}
    assert expected["version"] == [(migrate.head(),)]

    assert_same_catalog(expected, snapshot_of(online), "alembic upgrade head")
    assert_same_catalog(expected, snapshot_of(offline), "the offline script (upgrade head --sql)")


def test_offline_script_carries_the_revision_sql_verbatim():
    frozen = FROZEN_0001.read_text()
    assert "%s" in frozen and "::text" in frozen and "\\u2028-\\u202F" in frozen
    script = migrate.offline_script()
    assert frozen in script
    assert script.index("pg_advisory_xact_lock") < script.index("CREATE TABLE ledger.alembic_version")


# What SQLAlchemy's text() would change: `:word` after a non-word character
# is a bind parameter (NULL or an error offline), and % is doubled for psycopg.
HAZARDS = """\
CREATE TEMP TABLE hazards AS
SELECT '{"a":1}'::jsonb AS j, format('%s|%%', 'x') AS f, ':name' AS n, 'x' ~ '[[:alpha:]]' AS r;
"""


def test_execute_sql_passes_colons_and_percents_through_online_and_offline(dsn):
    output = io.StringIO()
    offline = MigrationContext.configure(dialect_name="postgresql", opts={"as_sql": True, "output_buffer": output})
    migrate.execute_sql(offline, HAZARDS)
    assert output.getvalue().strip() == HAZARDS.strip()

    engine = create_engine(migrate.sqlalchemy_url(dsn), poolclass=NullPool)
    try:
        with engine.begin() as connection:
            migrate.execute_sql(MigrationContext.configure(connection), HAZARDS)
            row = connection.exec_driver_sql("SELECT j, f, n, r FROM hazards").one()
    finally:
        engine.dispose()
    assert tuple(row) == ({"a": 1}, "x|%", ":name", True)


def test_sql_piped_to_psql_installs_a_working_ledger_that_install_then_leaves_alone(new_database):
    dsn = new_database()
    printed = jobledger("sql")
    assert printed.returncode == 0, printed.stderr
    psql(dsn, input=printed.stdout)
    with psycopg.connect(dsn, autocommit=True) as conn:
        token = conn.execute("SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')").fetchone()
    assert token == (1,)
    before = snapshot_of(dsn)

    installed = jobledger("install", LEDGER_DSN=dsn)

    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.strip() == f"ledger at revision {migrate.head()}: already current"
    assert_same_catalog(before, snapshot_of(dsn), "the database after `install`")
    with psycopg.connect(dsn, autocommit=True) as conn:  # the data is untouched too
        assert conn.execute("SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')").fetchone() == (2,)


def test_downgrade_base_removes_schema_and_version_table_but_keeps_roles_in_use(
        new_database, ledger_template):
    dsn = new_database()
    migrate.upgrade(dsn)
    assert migrate.current(dsn) == migrate.head()

    migrate.downgrade(dsn, "base")

    assert not schema_exists(dsn)
    assert migrate.current(dsn) is None
    with psycopg.connect(dsn) as conn:  # the session's template database still uses them
        roles = conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'ledger%' ORDER BY 1").fetchall()
    assert roles == [("ledger_client",), ("ledger_owner",), ("ledger_reader",)]
    assert migrate.upgrade(dsn) == migrate.revisions()  # and it installs again
    assert schema_exists(dsn)


def test_concurrent_installs_wait_for_each_other_and_the_second_does_no_harm(new_database):
    dsn = new_database()
    key_high, key_low = migrate.LOCK_KEY >> 32, migrate.LOCK_KEY & 0xFFFFFFFF
    with psycopg.connect(dsn, autocommit=True) as holder:
        # Hold the migrators' lock so that both installs start and queue up.
        holder.execute("SELECT pg_advisory_lock(%s)", [migrate.LOCK_KEY])
        installs = [subprocess.Popen([sys.executable, "-m", "ledger", "install", "--dsn", dsn],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    for _ in range(2)]
        deadline = time.monotonic() + 30
        while holder.execute(
                """SELECT count(*) FROM pg_locks
                    WHERE locktype = 'advisory' AND NOT granted AND classid = %s AND objid = %s
                      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())""",
                [key_high, key_low]).fetchone()[0] < 2:
            assert all(p.poll() is None for p in installs), [p.communicate() for p in installs]
            assert time.monotonic() < deadline, "the installs never queued on the advisory lock"
            time.sleep(0.05)
        holder.execute("SELECT pg_advisory_unlock(%s)", [migrate.LOCK_KEY])
        outputs = [p.communicate(timeout=60) for p in installs]

    assert [p.returncode for p in installs] == [0, 0], outputs
    head = migrate.head()
    assert sorted(out.strip() for out, _ in outputs) == [
        f"ledger at revision {head}: already current", f"ledger at revision {head}: applied {', '.join(migrate.revisions())}"]
    assert migrate.current(dsn) == head
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')").fetchone() == (1,)


def test_install_exit_codes_database_error_is_one_line_and_usage_is_2():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    failed = jobledger("install", "--dsn", f"host=127.0.0.1 port={port} connect_timeout=5")
    assert failed.returncode == 1
    assert failed.stderr.startswith("Error: ") and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert jobledger("install", "--no-such-option").returncode == 2


@pytest.mark.cluster
def test_downgrade_base_drops_the_roles_only_once_nothing_uses_them(cluster_root):
    # Roles are cluster-wide: only a private cluster can show them going away.
    server = cluster_root("roles").initdb()
    server.start()
    with server.connect() as conn:
        conn.execute("CREATE DATABASE other")
    one, other = server.dsn(), server.dsn("other")
    migrate.upgrade(one)
    migrate.upgrade(other)

    def roles() -> list[str]:
        with server.connect() as conn:
            return [r for (r,) in conn.execute(
                "SELECT rolname FROM pg_roles WHERE rolname LIKE 'ledger%' ORDER BY 1")]

    migrate.downgrade(one, "base")
    assert roles() == ["ledger_client", "ledger_owner", "ledger_reader"]  # `other` still uses them
    with server.connect() as conn:
        conn.execute("CREATE ROLE dashboard IN ROLE ledger_reader")
    migrate.downgrade(other, "base")
    assert roles() == ["ledger_reader"]  # granted to a role: it stays
    assert not schema_exists(one) and not schema_exists(other)


def test_wheel_carries_the_sql_and_the_migrations_and_works_without_alembic_ini(tmp_path):
    built = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    assert {f"ledger/_sql/{path.name}" for path in resources.sql_files()} <= names
    assert {"ledger/_migrations/env.py", "ledger/_migrations/script.py.mako",
            "ledger/_migrations/versions/0001_initial.py",
            "ledger/_migrations/versions/0001_initial.sql"} <= names

    # From the unpacked wheel (and away from the source tree), the package
    # finds its own copies: the same install script and offline script.
    probe = subprocess.run(
        [sys.executable, "-c",
         "import ledger, ledger.migrate as m; print(ledger.__file__); print(m.install_script() + m.offline_script())"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True, text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr
    where, _, scripts = probe.stdout.partition("\n")
    assert where.startswith(str(tmp_path / "site"))
    assert scripts == migrate.install_script() + migrate.offline_script() + "\n"
