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
``pg_ctl``). PostgreSQL refuses to run as root: when pytest runs as root (a
container, CI), the default's throwaway server is started by this plugin
instead, with ``initdb`` and ``pg_ctl`` run as the ``postgres`` OS user
(``ledger_postgresql_os_user`` / ``--ledger-postgresql-os-user`` names
another). To use a server that is already running, name
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

import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor

from ledger.client import Ledger, conninfo_of
from ledger.migrate import upgrade

__all__ = ["install", "ledger_client", "ledger_dsn", "ledger_postgresql", "ledger_postgresql_as_os_user",
           "ledger_postgresql_proc", "load_ledger"]

_BASE_OPTION = "ledger_postgresql_base"
_OS_USER_OPTION = "ledger_postgresql_os_user"
_DEFAULT_BASE = "postgresql_proc"
_NOPROC_HINT = ("or use a running server instead: --ledger-postgresql-base postgresql_noproc --postgresql-host HOST "
                "--postgresql-port PORT (ledger_postgresql_base = postgresql_noproc in the ini file)")


def pytest_addoption(parser: pytest.Parser) -> None:
    help_text = "pytest-postgresql process fixture that ledger_postgresql builds on (default postgresql_proc)"
    parser.addini(_BASE_OPTION, help=help_text, default=_DEFAULT_BASE)
    parser.addoption("--ledger-postgresql-base", dest=_BASE_OPTION, help=help_text)
    user_help = ("when pytest runs as root, the OS user that runs the default base's throwaway server "
                 "(PostgreSQL refuses root; default postgres)")
    parser.addini(_OS_USER_OPTION, help=user_help, default="postgres")
    parser.addoption("--ledger-postgresql-os-user", dest=_OS_USER_OPTION, help=user_help)


def install(conninfo: str) -> None:
    """Migrate the database at ``conninfo`` to the ledger's newest revision."""
    upgrade(conninfo)


def load_ledger(host: str, port: int | str, user: str, dbname: str, password: str | None = None,
                **_: Any) -> None:
    """A pytest-postgresql loader (``load=[load_ledger]``): install the ledger into ``dbname``."""
    install(make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password or None))


def _setting(request: pytest.FixtureRequest, name: str) -> Any:
    """A pytest-postgresql setting, as its own fixtures read it: the command line, else the ini file."""
    option = f"postgresql_{name}"
    return request.config.getoption(option) or request.config.getini(option)


def _pg_ctl(request: pytest.FixtureRequest) -> str | None:
    """pg_ctl: --postgresql-exec, else next to pg_config's binaries, else on PATH, else Debian's newest."""
    configured = _setting(request, "exec")
    if configured and os.access(str(configured), os.X_OK):
        return str(configured)
    try:
        bindir = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=60,
                                check=True).stdout.strip()
        if os.access(Path(bindir, "pg_ctl"), os.X_OK):
            return str(Path(bindir, "pg_ctl"))
    except (OSError, subprocess.SubprocessError):
        pass
    found = shutil.which("pg_ctl")
    if found:
        return found
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return str(debian[-1]) if debian else None


def _traversable(path: Path, account: pwd.struct_passwd) -> bool:
    """Whether ``account`` can reach into ``path`` (its ancestors are all searchable to it)."""
    for directory in [path, *path.parents]:
        info = directory.stat()
        if info.st_uid == account.pw_uid:
            bit = 0o100
        elif info.st_gid == account.pw_gid or info.st_gid in os.getgrouplist(account.pw_name, account.pw_gid):
            bit = 0o010
        else:
            bit = 0o001
        if not info.st_mode & bit:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _as_user(account: pwd.struct_passwd, command: Sequence[str], cwd: Path, what: str,
             check: bool = True, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LC_ALL": "C.UTF-8", "LC_CTYPE": "C.UTF-8", "LANG": "C.UTF-8",
           "HOME": str(cwd), "USER": account.pw_name, "LOGNAME": account.pw_name}
    env.pop("PGDATA", None)
    result = subprocess.run(list(command), user=account.pw_uid, group=account.pw_gid, extra_groups=[],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        told = (result.stderr or result.stdout) + (log.read_text(errors="replace") if log and log.exists() else "")
        output = " ".join(told.split())[-600:]  # the server log says why a start failed
        pytest.fail(f"ledger.testing: {what} as the {account.pw_name!r} OS user failed (exit "
                    f"{result.returncode}): {shlex.join(command)}: {output}. Fix that, {_NOPROC_HINT}",
                    pytrace=False)
    return result


@pytest.fixture(scope="session")
def ledger_postgresql_as_os_user(request: pytest.FixtureRequest) -> Iterator[NoopExecutor]:
    """For root, what ``postgresql_proc`` does: a throwaway server, ``initdb`` and ``pg_ctl`` run as
    the ``ledger_postgresql_os_user`` (default ``postgres``), with pytest-postgresql's settings
    (user, password, host, port, dbname, postgres options, load) and a template ``<dbname>_tmpl``."""
    os_user = str(request.config.getoption(_OS_USER_OPTION) or request.config.getini(_OS_USER_OPTION))
    try:
        account: pwd.struct_passwd | None = pwd.getpwnam(os_user)
    except KeyError:
        account = None
    if account is None:  # outside the except: no "during handling of KeyError" in the report
        pytest.fail(f"ledger.testing: PostgreSQL refuses to run as root, and there is no {os_user!r} OS user "
                    "to run the throwaway server as: run pytest as another user, or create that user, or name "
                    "another with --ledger-postgresql-os-user USER (ledger_postgresql_os_user in the ini file), "
                    f"{_NOPROC_HINT}", pytrace=False)
    if account.pw_uid == 0:
        pytest.fail(f"ledger.testing: the OS user {os_user!r} is root, and PostgreSQL refuses to run as root: "
                    f"name another with --ledger-postgresql-os-user USER, {_NOPROC_HINT}", pytrace=False)
    pg_ctl = _pg_ctl(request)
    if pg_ctl is None:
        pytest.fail("ledger.testing: no pg_ctl found (PostgreSQL server binaries): install them or give "
                    f"--postgresql-exec /path/to/pg_ctl, {_NOPROC_HINT}", pytrace=False)
    parent = Path(tempfile.gettempdir())
    if not _traversable(parent, account):
        parent = Path("/tmp")
    root = Path(tempfile.mkdtemp(prefix="ledger-pytest-pg-", dir=parent))
    os.chown(root, account.pw_uid, account.pw_gid)
    datadir, logfile = root / "data", root / "postgresql.log"
    host = str(_setting(request, "host") or "127.0.0.1")
    configured_port = _setting(request, "port")
    port = int(configured_port) if configured_port and str(configured_port).isdigit() else _free_port()
    user = str(_setting(request, "user") or "postgres")
    password = _setting(request, "password") or None
    dbname = str(_setting(request, "dbname") or "tests")
    auth = ["--auth=trust"]
    if password:
        pwfile = root / "pwfile"
        pwfile.write_text(str(password))
        os.chown(pwfile, account.pw_uid, account.pw_gid)
        auth = ["--auth=password", f"--pwfile={pwfile}"]
    started = False
    try:
        _as_user(account, [pg_ctl, "initdb", "-D", str(datadir), "-o",
                           shlex.join([f"--username={user}", *auth, "--no-sync"])], root, "initdb")
        server_options = (f"-F -p {port} -c listen_addresses='{host}' -c unix_socket_directories='{root}' "
                          f"{_setting(request, 'postgres_options') or ''}")
        _as_user(account, [pg_ctl, "start", "-w", "-t", "120", "-D", str(datadir), "-l", str(logfile),
                           "-o", server_options], root, "pg_ctl start", log=logfile)
        started = True
        executor = NoopExecutor(host=host, port=port, user=user, options=str(_setting(request, "options") or ""),
                                dbname=dbname, password=password)
        janitor = DatabaseJanitor(user=user, host=host, port=port, dbname=executor.template_dbname,
                                  password=password, as_template=True)
        janitor.init()
        from pytest_postgresql.config import get_config  # its loaders (--postgresql-load), as parsed there

        loaders = get_config(request)
        for element in loaders["load"] if isinstance(loaders, dict) else loaders.load:
            janitor.load(element)
        yield executor
    finally:
        if started:
            _as_user(account, [pg_ctl, "stop", "-D", str(datadir), "-m", "fast", "-w"], root, "pg_ctl stop",
                     check=False)
        shutil.rmtree(root, ignore_errors=True)


def _base(request: pytest.FixtureRequest) -> Any:
    """The base process fixture's executor; for root, the default's server run as another OS user."""
    base_name = str(request.config.getoption(_BASE_OPTION) or request.config.getini(_BASE_OPTION))
    if base_name == _DEFAULT_BASE and hasattr(os, "geteuid") and os.geteuid() == 0:
        return request.getfixturevalue("ledger_postgresql_as_os_user")
    try:
        return request.getfixturevalue(base_name)
    except subprocess.CalledProcessError as error:  # pg_ctl/initdb, from pytest-postgresql: a bare traceback
        failed = error
    output = failed.output.decode(errors="replace") if isinstance(failed.output, bytes) else failed.output
    detail = " ".join(str(output or "").split())[-600:]
    command = failed.cmd if isinstance(failed.cmd, str) else shlex.join(map(str, failed.cmd))
    root = ""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        root = (f"PostgreSQL refuses to run as root: the default base ({_DEFAULT_BASE}) runs it as the "
                "postgres OS user (--ledger-postgresql-os-user). ")
    pytest.fail(f"ledger.testing: {base_name} could not start PostgreSQL: {command} exited "
                f"{failed.returncode}{': ' + detail if detail else ''}. {root}Fix that, {_NOPROC_HINT}",
                pytrace=False)


@pytest.fixture(scope="session")
def ledger_postgresql_proc(request: pytest.FixtureRequest) -> Iterator[NoopExecutor]:
    """The base process fixture's server, with a template database the ledger is migrated into once."""
    base = _base(request)
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
