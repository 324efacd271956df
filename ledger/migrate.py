"""Install and upgrade the ledger's schema: alembic over raw SQL revisions.

Alembic is configured in code (no alembic.ini needed, so this works from a
wheel), and its version table lives in schema ``ledger`` beside everything
else: ``downgrade(dsn, "base")`` leaves nothing behind. Database errors reach
the caller as psycopg errors, not SQLAlchemy's wrappers.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

import psycopg
import sqlalchemy.exc
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import URL

from ledger import resources

SCHEMA = "ledger"
VERSION_TABLE = "alembic_version"
# Every migrator holds this advisory lock for its whole transaction, so
# concurrent upgrades run one after the other. 'ledger' in ASCII; advisory
# locks are per database, so one key serves every database of a cluster.
LOCK_KEY = int.from_bytes(b"ledger", "big")

# The version table exactly as alembic creates it (the catalog test keeps the
# two equal). It comes before the install so that it gets the same grants as
# in an upgrade, where alembic creates it before revision 0001 runs.
_VERSION_TABLE_SQL = f"""\
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE {SCHEMA}.{VERSION_TABLE} (
    version_num VARCHAR(32) NOT NULL,
    CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num)
);
"""

# alembic's `context` and `op` are process-wide proxies: one command at a time
# per process (other processes wait on LOCK_KEY instead).
_alembic_lock = threading.Lock()


# A migration waits at most 2 s for a table lock (migrations/env.py), so that
# the runners queued behind it wait no longer; a busy ledger may need a few
# tries. Each try is one transaction, undone whole when it gives up, or when
# the server broke a deadlock with a runner that took two of its tables in
# the other order by aborting it.
LOCK_TRIES = 5


def _tries(attempt: Callable[[], None]) -> None:
    for number in range(1, LOCK_TRIES + 1):
        try:
            with _alembic_lock, _psycopg_errors():
                attempt()
            return
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):
            if number == LOCK_TRIES:
                raise
            time.sleep(0.2 * number)  # let the queue behind the given-up lock drain


def upgrade(dsn: str, revision: str = "head") -> list[str]:
    """Install the ledger, or bring it up to `revision`: the revisions applied,
    oldest first; none when already there (or another migrator just did it).
    A table lock not had within 2 s is tried again, LOCK_TRIES times in all."""
    cfg = config(dsn)

    def attempt() -> None:
        cfg.attributes["applied"] = []  # what env.py records: a try given up applied nothing
        command.upgrade(cfg, revision)

    _tries(attempt)
    return list(cfg.attributes.get("applied", []))


def downgrade(dsn: str, revision: str) -> None:
    """Go back to `revision`; "base" uninstalls: schema ledger, and the roles nothing else uses.
    A table lock not had within 2 s is tried again, as for upgrade."""
    _tries(lambda: command.downgrade(config(dsn), revision))


def offline_script(revision: str = "head") -> str:
    """The SQL that an upgrade from an empty database to `revision` runs (`alembic upgrade --sql`)."""
    output = io.StringIO()
    with _alembic_lock:
        command.upgrade(config(output=output), revision, sql=True)
    return output.getvalue()


def upgrade_script(release: str) -> str:
    """The SQL that takes a database installed at `release` (a version, e.g.
    "0.1.0") to head, for psql users (`jobledger sql --upgrade-from`). It
    refuses, changing nothing, a database at any other revision."""
    if release not in RELEASES:
        known = ", ".join(sorted(RELEASES))
        raise ValueError(f"unknown release {release!r}: this package knows {known}")
    start = RELEASES[release]
    if start == head():
        return f"-- pg-job-ledger {release} is at revision {start}, the newest: nothing to upgrade\n"
    output = io.StringIO()
    with _alembic_lock:
        command.upgrade(config(output=output), f"{start}:head", sql=True)
    return output.getvalue()


def current(dsn: str) -> str | None:
    """The database's revision, or None when the ledger is not installed."""
    engine = create_engine(sqlalchemy_url(dsn), poolclass=pool.NullPool)
    try:
        with _psycopg_errors(), engine.connect() as connection:
            migration = MigrationContext.configure(
                connection, opts={"version_table_schema": SCHEMA, "version_table": VERSION_TABLE})
            return migration.get_current_revision()
    finally:
        engine.dispose()


def revisions() -> list[str]:
    """Every revision this package carries, oldest first: what an install applies."""
    return [script.revision for script in reversed(list(ScriptDirectory.from_config(config()).walk_revisions()))]


def head() -> str:
    """The newest revision this package carries."""
    revision = ScriptDirectory.from_config(config()).get_current_head()
    assert revision is not None, "migrations/versions holds no revision"
    return revision


# Every release and the revision its schema is at. A released revision never
# changes again (tests/release/test_frozen.py holds the hash of each file):
# an upgrade from a release is the revisions after its own.
RELEASES: dict[str, str] = {"0.1.0": "0001"}


# A second run of the install script would fail on "relation already
# exists" half-way; say instead what to do. (An upgrade is a migration.)
_ALREADY_INSTALLED_SQL = f"""\
DO $installed$
BEGIN
    IF pg_catalog.to_regclass('{SCHEMA}.{VERSION_TABLE}') IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '42P07',
            MESSAGE = 'the ledger is already installed in this database: upgrade it with '
                      '`jobledger install --dsn ...` (or uninstall with `jobledger uninstall --dsn ... --yes`)';
    END IF;
END
$installed$;
"""


def install_script() -> str:
    """The current install for psql users: sql/ (the truth) plus the version
    table stamped at head, so that `upgrade` can take the database on later."""
    return "\n".join([
        "-- pg-job-ledger install script: psql -v ON_ERROR_STOP=1 -f FILE",
        "BEGIN;",
        _ALREADY_INSTALLED_SQL,
        _VERSION_TABLE_SQL,
        resources.install_sql(),
        f"INSERT INTO {SCHEMA}.{VERSION_TABLE} (version_num) VALUES ('{head()}');",
        "COMMIT;",
        "",
    ])


def execute_sql(migration: MigrationContext, sql: str) -> None:
    """Run a SQL script verbatim, for env.py and the revisions.

    Never through text(): it reads `:word` after any non-word character as a
    bind parameter (in a string, a JSON literal, a comment: NULL offline) and
    doubles `%` for psycopg. Online the script goes to psycopg without
    parameters (no placeholder parsing, and the simple protocol runs many
    statements); offline it is copied out as is.
    """
    if migration.as_sql:
        migration.impl.static_output(sql)
    else:
        assert migration.connection is not None
        migration.connection.exec_driver_sql(sql, execution_options={"no_parameters": True})


def config(dsn: str | None = None, output: TextIO | None = None) -> Config:
    """Alembic's configuration, built in code: the packaged migrations, and the database."""
    cfg = Config(output_buffer=output)
    # set_main_option interpolates: a literal % must be doubled.
    cfg.set_main_option("script_location", str(resources.migrations_dir()).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    if dsn is not None:
        cfg.attributes["url"] = sqlalchemy_url(dsn)
    return cfg


def sqlalchemy_url(dsn: str) -> URL:
    """The SQLAlchemy URL (driver psycopg) of a libpq conninfo string or URI.

    The conninfo reaches psycopg.connect(conninfo=...) untouched, so every
    libpq form works (several hosts, sockets, service files; "" = the PG*
    defaults and ~/.pgpass). Only a password moves to the URL's own field,
    which SQLAlchemy masks whenever it prints a URL.
    """
    params = conninfo_to_dict(dsn)
    password = params.pop("password", None)
    return URL.create("postgresql+psycopg", password=None if password is None else str(password),
                      query={"conninfo": make_conninfo("", **params)})


@contextmanager
def _psycopg_errors() -> Iterator[None]:
    # SQLAlchemy wraps driver errors; callers of this package deal in psycopg's.
    try:
        yield
    except sqlalchemy.exc.DBAPIError as error:
        if isinstance(error.orig, psycopg.Error):
            raise error.orig from error
        raise
