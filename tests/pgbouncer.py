"""A real PgBouncer in transaction mode in front of the test server, for the tests of tests/field/test_pgbouncer.py.

``pgbouncer`` (session scope) starts ``pgbouncer`` (Debian's 1.18: no
prepared-statement support) on a free loopback port with ``pool_mode =
transaction`` and ``default_pool_size = 2``, so that several clients really
share two server connections per database: a client's next transaction
may run on another server connection, where a statement it prepared does not
exist. ``[databases]`` is the wildcard ``* = host=... port=...``, so every
test database (a fresh clone per test) is reachable by its own name. Clients
are not authenticated (``auth_type = trust``); the server is reached as the
client's user.

The fixture yields a :class:`Bouncer`: call it with a test database's
conninfo for the same database through the bouncer. Tests that use it are
skipped, with the reason, when pgbouncer is not installed. As root (the
bouncer refuses to run as root) it runs as the ``postgres`` OS user, with its
configuration in a temporary directory that user owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

CANDIDATES = ("pgbouncer", "/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer")
POOL_SIZE = 2


def pgbouncer_binary() -> str | None:
    for candidate in CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


@dataclass
class Bouncer:
    host: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes]

    def __call__(self, conninfo: str) -> str:
        """``conninfo`` (a test database's) with host and port replaced by the bouncer's."""
        params: dict[str, Any] = conninfo_to_dict(conninfo)
        params.pop("hostaddr", None)
        params.update(host=self.host, port=str(self.port))
        return make_conninfo(**params)

    def admin(self, command: str, user: str) -> list[tuple[Any, ...]]:
        """A command of the admin console (``SHOW POOLS``, ...): its rows."""
        conninfo = make_conninfo(host=self.host, port=self.port, user=user, dbname="pgbouncer")
        with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as conn:
            cur = psycopg.ClientCursor(conn)  # the console speaks the simple query protocol only
            cur.execute(command)
            return cur.fetchall() if cur.description else []

    @property
    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _config(server: Any, directory: Path, port: int) -> str:
    target = f"host={server.host} port={server.port}"
    return "\n".join([
        "[databases]",
        f"* = {target}",
        "",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = trust",
        f"auth_file = {directory / 'userlist.txt'}",
        f"admin_users = {server.user}",
        "pool_mode = transaction",
        f"default_pool_size = {POOL_SIZE}",
        "min_pool_size = 0",
        "reserve_pool_size = 0",
        "max_client_conn = 100",
        "ignore_startup_parameters = extra_float_digits",
        "server_lifetime = 3600",
        "server_idle_timeout = 60",
        f"logfile = {directory / 'pgbouncer.log'}",
        "",
    ])


def _wait_listening(bouncer: Bouncer, user: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if bouncer.process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited with {bouncer.process.returncode}:\n{bouncer.log}")
        try:
            bouncer.admin("SHOW VERSION", user)
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="session")
def pgbouncer(pg_server: Any) -> Iterator[Bouncer]:
    """A PgBouncer in transaction mode in front of the test server (skipped when not installed)."""
    binary = pgbouncer_binary()
    if binary is None:
        pytest.skip("needs pgbouncer (apt-get install pgbouncer): the pooler tests need a real one")
    as_postgres = os.geteuid() == 0
    directory = Path(tempfile.mkdtemp(prefix="ledger-pgbouncer-"))
    run_as: dict[str, Any] = {}
    if as_postgres:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("needs a postgres OS user (apt-get install postgresql): as root, pgbouncer runs as it")
        os.chown(directory, account.pw_uid, account.pw_gid)
        run_as = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    (directory / "userlist.txt").write_text(f'"{pg_server.user}" "{pg_server.password or ""}"\n')
    bouncer: Bouncer | None = None
    try:
        for _attempt in range(5):  # the free port may be taken between the check and the bind
            port = _free_port()
            config = directory / "pgbouncer.ini"
            config.write_text(_config(pg_server, directory, port))
            if as_postgres:
                for path in directory.iterdir():
                    os.chown(path, run_as["user"], run_as["group"])
            process = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, cwd=directory, **run_as)
            bouncer = Bouncer("127.0.0.1", port, directory, process)
            try:
                _wait_listening(bouncer, pg_server.user)
                break
            except (RuntimeError, psycopg.OperationalError):
                _stop(process)
                bouncer = None
        if bouncer is None:
            pytest.fail(f"pgbouncer did not start:\n{(directory / 'pgbouncer.log').read_text(errors='replace')}")
        yield bouncer
    finally:
        if bouncer is not None:
            _stop(bouncer.process)
        shutil.rmtree(directory, ignore_errors=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()  # by its pid: the one we started
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
