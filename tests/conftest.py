"""Test harness: a real PostgreSQL, a template database with the ledger
installed once per session, and a fresh clone of it for every test.

The server is the one named by the standard PG* variables (default
127.0.0.1:5432, user postgres). When none answers, the embedded server from
the `embedded` extra (pgserver) is started, so the suite also runs on a laptop
without PostgreSQL.

With LEDGER_TEST_PG_BINDIR=/path/to/bin, the session instead starts a private
cluster from the server binaries there (tests/matrix.py: PrivateServer; that
is how `make test-matrix` runs the suite on every supported major version) and
stops it at the end; tests/cluster.py then uses the same binaries.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from pytest_postgresql.janitor import DatabaseJanitor

from clockseam import LedgerClock
from skips import skip_reason, skip_summary
from ledger.migrate import install_script


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    user: str
    password: str | None
    embedded: bool = False

    def dsn(self, dbname: str, **extra: object) -> str:
        return make_conninfo(
            host=self.host, port=self.port, user=self.user, password=self.password or None,
            dbname=dbname, **extra)


def _running_server() -> Server | None:
    server = Server(
        host=os.environ.get("PGHOST", "127.0.0.1"),
        port=int(os.environ.get("PGPORT", "5432")),
        user=os.environ.get("PGUSER", "postgres"),
        password=os.environ.get("PGPASSWORD"),
    )
    if os.environ.get("LEDGER_TEST_EMBEDDED"):
        return None
    try:
        with psycopg.connect(server.dsn("postgres", connect_timeout=3)):
            return server
    except psycopg.OperationalError:
        return None


def _private_server(bindir: str) -> Iterator[Server]:
    from matrix import PrivateServer  # tests/matrix.py

    try:
        private = PrivateServer(bindir)
    except OSError as error:
        pytest.exit(f"LEDGER_TEST_PG_BINDIR={bindir}: {error}", returncode=3)
    try:
        private.start()
    except (OSError, RuntimeError) as error:
        private.stop()
        pytest.exit(f"LEDGER_TEST_PG_BINDIR={bindir}: cannot start a private server: {error}", returncode=3)
    # Anything that falls back on the PG* variables must reach this server too.
    saved = {key: os.environ.get(key) for key in ("PGHOST", "PGPORT", "PGUSER", "PGPASSWORD")}
    os.environ.update(PGHOST="127.0.0.1", PGPORT=str(private.port), PGUSER="postgres")
    os.environ.pop("PGPASSWORD", None)
    try:
        yield Server(host="127.0.0.1", port=private.port, user="postgres", password=None)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        private.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    bindir = os.environ.get("LEDGER_TEST_PG_BINDIR")
    if bindir:
        yield from _private_server(bindir)
        return
    server = _running_server()
    if server is not None:
        yield server
        return
    try:
        import pgserver  # the `embedded` extra
    except ImportError:  # pragma: no cover - depends on the machine
        pytest.exit("no PostgreSQL answers at PGHOST/PGPORT and pgserver is not installed "
                    "(pip install -e '.[embedded,test]')", returncode=3)
    datadir = tempfile.mkdtemp(prefix="ledger-test-pg-")
    embedded = pgserver.get_server(datadir, cleanup_mode="stop")
    info = psycopg.conninfo.conninfo_to_dict(embedded.get_uri())
    yield Server(host=str(info.get("host")), port=int(info.get("port") or 5432),
                 user=str(info.get("user") or "postgres"), password=None, embedded=True)
    embedded.cleanup()


_counter = itertools.count()


def _janitor(server: Server, dbname: str, **kwargs: object) -> DatabaseJanitor:
    return DatabaseJanitor(user=server.user, host=server.host, port=server.port,
                           password=server.password, dbname=dbname, **kwargs)  # type: ignore[arg-type]


def _load_ledger(host: str, port: int, user: str, dbname: str, password: str | None, **_: object) -> None:
    # What psql users get: sql/ plus the version table stamped at head. The
    # script has its own BEGIN/COMMIT, hence autocommit.
    with psycopg.connect(host=host, port=port, user=user, dbname=dbname, password=password,
                         autocommit=True) as conn:
        conn.execute(install_script())  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def ledger_template(pg_server: Server) -> Iterator[str]:
    """A template database with the ledger installed, built once per session."""
    name = f"ledger_tmpl_{os.getpid()}"
    janitor = _janitor(pg_server, name, as_template=True)
    with janitor:
        janitor.load(_load_ledger)
        yield name


@dataclass
class Drops:
    """The tests' databases, dropped behind them on a thread of the worker's own, one at a time: a
    DROP DATABASE waits for a checkpoint (about 100 ms, 2,200 times a suite), and the next test
    need not wait for it. The session's end waits for every drop, and fails on one that failed."""

    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "drop-test-database"))
    pending: list[Future[None]] = field(default_factory=list)

    def drop(self, janitor: DatabaseJanitor) -> None:
        self.pending.append(self.pool.submit(janitor.drop))

    def wait(self) -> None:
        self.pool.shutdown(wait=True)
        for done in self.pending:
            done.result()  # a drop that failed fails here, with its error


@pytest.fixture(scope="session")
def drops(pg_server: Server) -> Iterator[Drops]:
    """Torn down before pg_server (it depends on it): every drop done before the server stops."""
    found = Drops()
    yield found
    found.wait()


@pytest.fixture
def dsn(pg_server: Server, ledger_template: str, drops: Drops) -> Iterator[str]:
    """A fresh clone of the template for this test; its conninfo string. Dropped after the test,
    in the background (:class:`Drops`): the test's own connections are closed by then."""
    name = f"ledger_test_{os.getpid()}_{next(_counter)}"
    janitor = _janitor(pg_server, name, template_dbname=ledger_template)
    janitor.init()
    try:
        yield pg_server.dsn(name)
    finally:
        drops.drop(janitor)


@pytest.fixture
def connect(dsn: str) -> Iterator[Callable[..., psycopg.Connection]]:
    """Open more connections to the test database; all closed at teardown."""
    opened: list[psycopg.Connection] = []

    def _connect(autocommit: bool = True, **kwargs: object) -> psycopg.Connection:
        conn = psycopg.connect(dsn, autocommit=autocommit, **kwargs)  # type: ignore[arg-type]
        opened.append(conn)
        return conn

    yield _connect
    for conn in opened:
        conn.close()


@pytest.fixture
def db(connect: Callable[..., psycopg.Connection]) -> psycopg.Connection:
    """An autocommit connection to a fresh ledger database."""
    return connect()


@pytest.fixture
def ledger_clock(connect: Callable[..., psycopg.Connection]) -> LedgerClock:  # tests/clockseam.py
    """Move the test database's ledger clock forward: `ledger_clock.advance(timedelta(hours=1))`."""
    return LedgerClock(connect())


# -- running in parallel (make test: pytest-xdist, --dist loadfile) ---------------------------------
#
# Every test gets its own database, and whatever else it makes on the shared server
# has a name of its own: databases and roles carry the worker's pid (roles are
# cluster-wide, and a role a test makes is named test_..., never ledger..., which
# tests/release/test_migrations.py lists), clusters and PgBouncers a free port of
# their own, and no test changes a server-wide setting. A file runs whole on one
# worker (--dist loadfile): many share a module fixture that is expensive or not
# shareable (a pg_auto_failover formation, pg_cron's cluster, chromium, `npm ci`
# into examples/node, a seeded ledger). Not --dist loadgroup: with pytest 9.2 it
# no longer groups anything (pytest-xdist#1386).
#
# The files that take longest go first, so that the run does not end with one of
# them on one worker while the others are done (seconds, serial, on the 2-core
# machine of the release; docs/development.md). The controller hands the files
# out in this order with --no-loadscope-reorder.
SLOW_FIRST = (
    "client/test_client_deadlines.py",  # 110 s: partitions that wait out leases
    "field/test_failover.py",           # 60 s: one formation, three failures
    "release/test_upgrade_live.py",     # 45 s: workers through an upgrade, a downgrade and an upgrade
    "sql/test_races_and_lock_waits.py", # 20 s: races forced with held locks, 12 threads of mixed calls
    "cli/test_cli_events.py",           # 45 s
    "chaos/test_chaos.py",              # 40 s in one test
    "field/test_durability.py",         # 35 s
    "sql/test_health.py",               # 25 s
    "cli/test_first_contact.py",        # 22 s
    "docs/test_demo.py",                # 21 s
    "sql/test_hardening.py",            # 20 s
    "client/test_imports.py",           # 20 s
    "client/test_client_async.py",      # 20 s
    "field/test_clocks.py",             # 20 s
    "client/test_client.py",            # 20 s
    "field/test_pgbouncer.py",          # 18 s
    "cli/test_cli_run.py",              # 18 s
    "sql/test_fuzz.py",                 # 18 s
    "sql/test_preview.py",              # 17 s
    "web/test_web_browser.py",          # 16 s
    "field/test_pg_cron.py",            # 10 s, up to a minute (pg_cron fires on the minute)
)


def _part_path(item: pytest.Item) -> str:
    """<part>/<file> of an item, as SLOW_FIRST names it."""
    return item.nodeid.split("::", 1)[0].removeprefix("tests/")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: the order does not matter
        return
    rank = {path: n for n, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(_part_path(item), len(rank)))  # stable: each file in its order


# -- the skip summary: the last line of the run -------------------------------------------------------
#
def pytest_unconfigure(config: pytest.Config) -> None:
    # After pytest's own last line ("N passed, M skipped in ..."); in the xdist controller
    # (the workers' reports reach it), or in the one process of a serial run.
    if hasattr(config, "workerinput") or config.option.collectonly or getattr(config.option, "help", False):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or not hasattr(reporter, "stats"):
        return
    skipped = [skip_reason(report) for report in reporter.stats.get("skipped", [])]
    reporter.write_line(skip_summary(skipped))


@pytest.fixture
def app_role(db: psycopg.Connection) -> Iterator[str]:
    """A role of the application, member of ledger_client (roles are cluster-wide: unique name)."""
    name = f"test_app_{os.getpid()}"
    db.execute(f"DROP ROLE IF EXISTS {name}")
    db.execute(f"CREATE ROLE {name} NOLOGIN IN ROLE ledger_client")
    yield name
    db.execute("RESET ROLE")
    db.execute(f"DROP OWNED BY {name}")
    db.execute(f"DROP ROLE {name}")
