"""A private PostgreSQL cluster for tests that crash or promote a server.

PostgreSQL refuses to run as root, so when the tests run as root the server
binaries run as the `postgres` user, in a temporary directory it owns.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from ledger.migrate import install_script
from waiting import wait_for


def _bindir() -> Path | None:
    if os.environ.get("LEDGER_TEST_PG_BINDIR"):  # the server under test (tests/matrix.py)
        return Path(os.environ["LEDGER_TEST_PG_BINDIR"])
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return debian[-1].parent if debian else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    def __init__(self, root: Path, name: str) -> None:
        bindir = _bindir()
        if bindir is None:
            pytest.skip("needs initdb and pg_ctl (apt-get install postgresql): a private cluster")
        self.bindir = bindir
        self.datadir = root / name
        self.logfile = root / f"{name}.log"
        self.port = _free_port()
        self.root = root
        self.started = False

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = list(args)
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def initdb(self) -> "Cluster":
        self._run(str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres",
                  "--auth=trust", "--no-sync")
        return self

    def configure(self, **settings: object) -> None:
        with open(self.datadir / "postgresql.auto.conf", "a") as conf:
            for key, val in settings.items():
                conf.write(f"{key} = '{val}'\n")

    def start(self) -> None:
        # The free port may be taken between _free_port() and the server's bind (the
        # suite runs in parallel: another worker's cluster, a PgBouncer): then another,
        # on the first start only (a restart keeps the port its DSNs were made with).
        attempts = 1 if self.started else 5
        for attempt in range(attempts):
            done = self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.logfile), "-w",
                             "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start",
                             check=False)
            if done.returncode == 0:
                self.started = True
                return
            log = self.logfile.read_text(errors="replace") if self.logfile.exists() else ""
            if "already in use" not in log[-2000:] or attempt == attempts - 1:
                raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                    done.stderr + log[-2000:])
            self.port = _free_port()

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-m", mode, "-w", "stop", check=False)

    def promote(self) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-w", "promote")

    def basebackup_into(self, standby: "Cluster") -> None:
        self._run(str(self.bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                  "-D", str(standby.datadir), "-R", "-X", "stream", "--no-sync")

    def dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def connect(self, **kwargs: object) -> psycopg.Connection:
        return psycopg.connect(self.dsn(), autocommit=True, **kwargs)  # type: ignore[arg-type]

    def install_ledger(self) -> None:
        with self.connect() as conn:
            conn.execute(install_script())  # type: ignore[arg-type]

    def wait_ready(self, timeout: float = 60.0) -> None:
        def writable() -> bool:
            try:
                with self.connect() as conn:
                    return not conn.execute("SELECT pg_is_in_recovery()").fetchone()[0]  # type: ignore[index]
            except psycopg.OperationalError:
                return False

        wait_for(writable, timeout, f"the cluster on port {self.port} to accept writes", interval=0.1,
                 explain=lambda: self.logfile.read_text()[-2000:])


@pytest.fixture
def cluster_root():
    root = Path(tempfile.mkdtemp(prefix="ledger-cluster-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    clusters: list[Cluster] = []

    def make(name: str) -> Cluster:
        cluster = Cluster(root, name)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop("immediate")
    shutil.rmtree(root, ignore_errors=True)
