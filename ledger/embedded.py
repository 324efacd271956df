"""Which database the command line talks to, and the embedded PostgreSQL when none is named.

Order: ``--dsn`` (or ``LEDGER_DSN``), then the standard ``PG*`` variables
(libpq reads them itself: the DSN is ``""``), and only when none of those is
set, an embedded PostgreSQL (the ``embedded`` extra, pgserver) whose data
lives under ``$LEDGER_HOME`` or the user's data directory (platformdirs). So
``jobledger run`` works on one machine with no setup at all.

The embedded server is started on first use by whichever jobledger process
needs it, shared by every concurrent one, and stopped when the last of them
exits (pgserver counts its users). Its database ``jobledger`` gets the ledger
installed, or upgraded to this package's revision, before the first command
uses it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ledger import queries


HOME_ENV = "LEDGER_HOME"
DATABASE = "jobledger"
# `jobledger demo` makes it afresh on each run and leaves it there, for `jobledger web --demo`.
DEMO_DATABASE = "jobledger_demo"
# libpq variables that name a server or a database: any of them means "not embedded".
PG_VARIABLES = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGUSER", "PGSERVICE")

_servers: dict[Path, Any] = {}  # pgdata -> pgserver handle, kept alive until exit


class EmbeddedUnavailable(RuntimeError):
    """The embedded server is needed but cannot be had (the extra is not installed, or it failed to start)."""


class NotInstalled(EmbeddedUnavailable):
    """The `embedded` extra is missing: ``missing`` names the module that did not import."""

    def __init__(self, message: str, missing: str) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Target:
    """The database a command uses and where that choice came from."""

    dsn: str
    source: str  # "option", "LEDGER_DSN", "PG* variables" or "embedded"
    data_dir: Path | None = None  # the embedded server's data, when embedded

    @property
    def embedded(self) -> bool:
        return self.data_dir is not None


def home() -> Path:
    """The ledger's own directory: ``$LEDGER_HOME``, else the user's data directory."""
    configured = os.environ.get(HOME_ENV)
    if configured:
        return Path(configured).expanduser()
    try:
        import platformdirs  # the `embedded` extra
    except ImportError as error:
        raise not_installed(error) from error

    return Path(platformdirs.user_data_dir("jobledger", appauthor=False))


EXTRA_HINT = "pip install 'pg-job-ledger[embedded]'"


def not_installed(error: ImportError) -> NotInstalled:
    """The one-line error for a DSN-less command when the `embedded` extra is missing."""
    missing = error.name or "pgserver"
    return NotInstalled(
        f"no database given and the embedded PostgreSQL is not installed (no module {missing!r}): "
        f"{EXTRA_HINT}, or give --dsn DSN (or set LEDGER_DSN, or the PG* variables)", missing)


def pg_variables_set() -> bool:
    return any(os.environ.get(name) for name in PG_VARIABLES)


def resolve(dsn: str | None, source: str = "option") -> Target:
    """The target for a ``--dsn`` value (None: not given), starting the embedded server if need be."""
    if dsn is not None:
        return Target(dsn, source)
    if pg_variables_set():
        return Target("", "PG* variables")
    data_dir = home() / "pgdata"
    return Target(embedded_dsn(data_dir), "embedded", data_dir)


def embedded_dsn(data_dir: Path, database: str = DATABASE) -> str:
    """Start (or join) the embedded server on ``data_dir``; the DSN of ``database``, ledger installed."""
    server = _server(data_dir)
    base = server.get_uri()
    ensure_database(base, database)
    dsn = with_database(base, database)
    ensure_installed(dsn)
    return dsn


def demo_dsn(data_dir: Path) -> str:
    """The DSN of the demo's ledger on the embedded server, which this process starts or joins and
    so keeps up until it exits. EmbeddedUnavailable when no demo has run on ``data_dir`` yet."""
    base = _server(data_dir).get_uri()
    with psycopg.connect(with_database(base, "postgres"), autocommit=True) as conn:
        found = conn.execute(queries.DATABASE_EXISTS, {"database": DEMO_DATABASE}).fetchone() is not None
    if not found:
        raise EmbeddedUnavailable(f"no demo ledger on the embedded PostgreSQL in {data_dir}: "
                                  "run `jobledger demo` first")
    return with_database(base, DEMO_DATABASE)


def with_database(dsn: str, database: str) -> str:
    return make_conninfo(dsn, dbname=database)


def ensure_database(server_dsn: str, database: str, *, fresh: bool = False) -> None:
    """Create ``database`` on the server unless it exists; with ``fresh``, drop it first."""
    maintenance = with_database(server_dsn, "postgres")
    with psycopg.connect(maintenance, autocommit=True) as conn:
        if fresh:
            conn.execute(sql.SQL(queries.DROP_DATABASE).format(sql.Identifier(database)))
        elif conn.execute(queries.DATABASE_EXISTS, {"database": database}).fetchone() is not None:
            return
        try:
            conn.execute(sql.SQL(queries.CREATE_DATABASE).format(sql.Identifier(database)))
        except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
            pass  # a concurrent jobledger created it first


def ensure_installed(dsn: str) -> list[str]:
    """Install or upgrade the ledger when the database is not at this package's revision."""
    from ledger import migrate  # alembic: only when the embedded server is used

    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(queries.HAS_REVISION_TABLE).fetchone()
        revision = None
        if row and row[0]:
            found = conn.execute(queries.INSTALLED_REVISION).fetchone()
            revision = found[0] if found else None
    if revision == migrate.head():
        return []
    return migrate.upgrade(dsn)


def _server(data_dir: Path) -> Any:
    data_dir = data_dir.expanduser().resolve()
    if data_dir in _servers:
        return _servers[data_dir]
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset; pgserver then uses /tmp, which is fine.
            warnings.simplefilter("ignore")
            from pgserver import postgres_server
            from pgserver.postgres_server import get_server
    except ImportError as error:
        raise not_installed(error) from error
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    _patient_pg_ctl(postgres_server)
    try:
        server = get_server(data_dir, cleanup_mode="stop")
    except Exception as error:
        raise EmbeddedUnavailable(f"the embedded PostgreSQL in {data_dir} did not start: {error}") from error
    _servers[data_dir] = server
    return server


def _patient_pg_ctl(module: Any) -> None:
    """pgserver gives `pg_ctl -w start` a fixed 10 s; a busy laptop or CI
    machine can need longer for the first start (initdb, then recovery)."""
    original = module.pg_ctl
    if getattr(original, "patient", False):
        return

    def pg_ctl(*args: Any, **kwargs: Any) -> Any:
        kwargs["timeout"] = max(kwargs.get("timeout") or 0, 90)
        return original(*args, **kwargs)

    pg_ctl.patient = True  # type: ignore[attr-defined]
    module.pg_ctl = pg_ctl


def describe(target: Target) -> str:
    """One line for people: where the ledger is, without the password."""
    if target.embedded:
        return (f"embedded PostgreSQL, data in {target.data_dir} (started on demand, stopped when "
                "the last jobledger command using it exits)")
    return f"from {target.source}"


def mask_password(dsn: str) -> str:
    """The DSN with its password replaced by ``****``."""
    if not dsn:
        return dsn
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return dsn
    if not params.get("password"):
        return dsn
    params["password"] = "****"
    return make_conninfo("", **params)
