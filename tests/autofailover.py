"""A pg_auto_failover formation for tests, and load that runs the ledger on it.

``Formation``: a monitor and two Postgres nodes (a primary and a secondary)
managed by ``pg_autoctl``, each on a free 127.0.0.1 port, in a temporary
directory owned by the ``postgres`` OS user. pg_autoctl refuses to run as
root, so when the tests run as root every pg_autoctl process runs as
``postgres`` (``subprocess.Popen(user=...)``, which is what ``runuser -u
postgres --`` does, but leaves us the pid of pg_autoctl itself). Everything
listens on 127.0.0.1 only (``--listen 127.0.0.1``, ``--auth trust``,
``--no-ssl``); the pg_autoctl configuration and state files go under the
same directory (``XDG_CONFIG_HOME``, ``XDG_DATA_HOME``), never into
``~postgres``. Clients use the formation's multi-host DSN,
``host=127.0.0.1,127.0.0.1 port=P1,P2 ... target_session_attrs=read-write``.

``Load``: the ledger's two kinds of clients on that DSN, for the duration of
a failure:

- Python clients (this file run as ``py-client``, one process each, never
  restarted), looping on ``with ledger.run(job, ttl=..., idempotency_key=...)``
  and writing through ``run.fence(conn, resource)`` into a table;
- ``jobledger run`` loops (one thread each, one wrapper process per
  iteration) on a job with a 2-second schedule, whose CMD (``bash`` +
  ``psql``) writes through ``ledger.fence(job => $LEDGER_JOB, ...,
  token => $LEDGER_FENCING_TOKEN)``.

Both record what they were told (tokens, outcomes, exit codes) with local
timestamps; ``Facts`` puts that next to what the database says afterwards,
and its methods name every broken invariant (tests/field/test_failover.py asserts
that each list is empty).

The figures of RELIABILITY.md ("High availability") come from this file run as a script::

    .venv/bin/python tests/autofailover.py measure --tries 3
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from waiting import wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TWO_32 = 2**32
EXIT_LEDGER_ERROR = 125  # jobledger run: could not start or end the run
DBNAME = "ledger"  # the formation's database: pg_autoctl create postgres --dbname (its default is "postgres")


# -- what is needed ----------------------------------------------------------------------------

def pg_autoctl() -> str | None:
    return shutil.which("pg_autoctl") or ("/usr/bin/pg_autoctl" if Path("/usr/bin/pg_autoctl").exists() else None)


def pg_bindir() -> Path | None:
    """Server binaries that have the pgautofailover extension next to them (Debian: one per major)."""
    candidates = []
    if os.environ.get("LEDGER_TEST_PG_BINDIR"):
        candidates.append(Path(os.environ["LEDGER_TEST_PG_BINDIR"]))
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for bindir in candidates:
        if not (bindir / "pg_ctl").exists():
            continue
        try:
            libdir = subprocess.run([str(bindir / "pg_config"), "--pkglibdir"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
        if (Path(libdir) / "pgautofailover.so").exists():
            return bindir
    return None


def missing() -> str | None:
    """Why a formation cannot be built here, or None."""
    if pg_autoctl() is None:
        return "needs pg_autoctl (apt-get install pg-auto-failover-cli postgresql-NN-auto-failover)"
    if pg_bindir() is None:
        return "needs the pgautofailover extension (apt-get install postgresql-NN-auto-failover)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "needs a postgres OS user (apt-get install postgresql): as root, pg_autoctl runs as postgres"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def jobledger() -> str:
    beside = Path(sys.executable).parent / "jobledger"
    return str(beside) if beside.exists() else (shutil.which("jobledger") or "jobledger")


# -- the formation -------------------------------------------------------------------------------

@dataclass
class Node:
    name: str
    port: int
    pgdata: Path
    log: Path
    keeper: subprocess.Popen[bytes] | None = None  # `pg_autoctl run` for this node

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


class Formation:
    """A monitor and two nodes; ``create()`` builds and starts them, ``stop()`` ends every process it started."""

    def __init__(self, root: Path, dbname: str = DBNAME) -> None:
        ctl, bindir = pg_autoctl(), pg_bindir()
        assert ctl is not None and bindir is not None, missing()
        self.ctl_path, self.bindir = ctl, bindir
        self.root = root
        self.dbname = dbname
        for sub in ("sock", "config", "share", "run"):
            (root / sub).mkdir(exist_ok=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            self._user: dict[str, Any] = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
            for path in [root, *root.iterdir()]:
                os.chown(path, pw.pw_uid, pw.pw_gid)
        else:
            self._user = {}
        self.monitor = Node("monitor", free_port(), root / "monitor", root / "monitor.log")
        self.nodes = [Node(f"node{i}", free_port(), root / f"node{i}", root / f"node{i}.log") for i in (1, 2)]

    # -- processes --

    @property
    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.bindir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "XDG_CONFIG_HOME": str(self.root / "config"),
            "XDG_DATA_HOME": str(self.root / "share"),
            "XDG_RUNTIME_DIR": str(self.root / "run"),
            "PGHOST": str(self.root / "sock"),
            "PG_REGRESS_SOCK_DIR": str(self.root / "sock"),  # where pg_autoctl puts the servers' sockets
        }

    def autoctl(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.ctl_path, *args], env=self.env, cwd=self.root, capture_output=True, text=True,
                              errors="replace",
                              timeout=timeout, **self._user)
        if check and done.returncode != 0:
            raise RuntimeError(f"pg_autoctl {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done

    def _serve(self, node: Node) -> None:
        """``pg_autoctl run`` for the node, in its own session (its pid is its process group)."""
        with open(node.log, "ab") as log:
            node.keeper = subprocess.Popen([self.ctl_path, "run", "--pgdata", str(node.pgdata)], env=self.env,
                                           cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True, **self._user)

    @property
    def monitor_uri(self) -> str:
        return f"postgres://autoctl_node@127.0.0.1:{self.monitor.port}/pg_auto_failover?sslmode=disable"

    def create(self) -> None:
        common = ["--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--auth", "trust", "--no-ssl",
                  "--pgctl", str(self.bindir / "pg_ctl")]
        self.autoctl("create", "monitor", "--pgdata", str(self.monitor.pgdata), "--pgport", str(self.monitor.port),
                     *common)
        self._serve(self.monitor)
        self.wait(lambda: self._monitor_answers(), 60, "the monitor to answer")
        for node in self.nodes:
            self.autoctl("create", "postgres", "--pgdata", str(node.pgdata), "--pgport", str(node.port),
                         "--name", node.name, "--dbname", self.dbname, "--monitor", self.monitor_uri, *common)
            self._serve(node)
            if node is self.nodes[0]:
                self.wait(lambda: self.states().get("node1", ("", ""))[0] == "single", 60, "node1 to run as single")
        self.wait_stable()

    def stop(self) -> None:
        """SIGTERM to each `pg_autoctl run` group (a fast shutdown of its Postgres), SIGKILL what is left."""
        everyone = [self.monitor, *self.nodes]
        for node in everyone:
            self._signal_group(node, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for node in everyone:
            if node.keeper is not None:
                try:
                    node.keeper.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                self._signal_group(node, signal.SIGKILL)
            pid = node.postmaster_pid()
            if pid is not None and _alive(pid) and _is_postmaster_of(pid, node.pgdata):
                os.kill(pid, signal.SIGKILL)

    @staticmethod
    def _signal_group(node: Node, number: int) -> None:
        if node.keeper is not None and node.keeper.returncode is None:
            try:
                os.killpg(node.keeper.pid, number)
            except ProcessLookupError:
                pass

    # -- the monitor's view --

    def _monitor_answers(self) -> bool:
        try:
            with psycopg.connect(self.monitor_dsn(), connect_timeout=2) as conn:
                conn.execute("SELECT 1 FROM pgautofailover.formation")
            return True
        except psycopg.Error:
            return False

    def monitor_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.monitor.port} dbname=pg_auto_failover user=autoctl_node"

    def states(self) -> dict[str, tuple[str, str]]:
        """Node name -> (reported state, goal state), as the monitor sees them."""
        with psycopg.connect(self.monitor_dsn(), connect_timeout=3) as conn:
            rows = conn.execute("SELECT nodename, reportedstate::text, goalstate::text FROM pgautofailover.node "
                                "ORDER BY nodeid").fetchall()
        return {name: (reported, goal) for name, reported, goal in rows}

    def stable(self) -> bool:
        try:
            states = sorted(self.states().values())
        except psycopg.Error:
            return False
        if states != [("primary", "primary"), ("secondary", "secondary")]:
            return False
        try:
            with self.connect() as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def serving(self) -> bool:
        """A node is primary (alone: wait_primary) and the multi-host DSN reaches it."""
        try:
            if not any(goal in ("primary", "wait_primary") and reported == goal
                       for reported, goal in self.states().values()):
                return False
            with self.connect() as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False

    def wait_stable(self, timeout: float = 120) -> None:
        self.wait(self.stable, timeout, "a primary and a secondary")

    def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        wait_for(predicate, timeout, what, interval=0.25,
                 explain=lambda: f"monitor says {self._safe_states()}\n{self.tail_logs()}")

    def _safe_states(self) -> Any:
        try:
            return self.states()
        except psycopg.Error as error:
            return f"(monitor unreachable: {error})"

    def tail_logs(self, chars: int = 1500) -> str:
        parts = []
        for node in [self.monitor, *self.nodes]:
            try:
                parts.append(f"--- {node.log.name}\n{node.log.read_text(errors='replace')[-chars:]}")
            except OSError:
                pass
        return "\n".join(parts)

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.name == name)

    def primary(self) -> Node:
        return self.node(next(name for name, (reported, goal) in self.states().items()
                              if (reported, goal) == ("primary", "primary")))

    # -- clients --

    def dsn(self, **extra: object) -> str:
        """The multi-host DSN: whichever node is read-write."""
        hosts = ",".join("127.0.0.1" for _ in self.nodes)
        ports = ",".join(str(node.port) for node in self.nodes)
        options = " ".join(f"{key}={value}" for key, value in extra.items())
        return (f"host={hosts} port={ports} dbname={self.dbname} user=postgres "
                f"target_session_attrs=read-write connect_timeout=3 {options}").strip()

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn(), autocommit=True, **kwargs)

    def install_ledger(self) -> None:
        from ledger.migrate import install_script
        with self.connect() as conn:
            conn.execute(install_script())

    def timeline(self) -> int:
        with self.connect() as conn:
            return int(conn.execute("SELECT ledger._timeline()").fetchone()[0])  # type: ignore[index]

    # -- replication modes --

    def set_synchronous(self, synchronous: bool) -> None:
        """Synchronous (pg_auto_failover's default: replication-quorum true, ``ANY 1 (...)``) or asynchronous.

        Asynchronous is ``replication-quorum false`` on both nodes (so it stays
        so after a failover); number-sync-standbys stays 0, its default.
        """
        value = "true" if synchronous else "false"
        for node in self.nodes:
            self.autoctl("set", "node", "replication-quorum", value, "--pgdata", str(node.pgdata))

        def applied() -> bool:
            if not self.stable():
                return False
            with self.connect() as conn:
                names = conn.execute("SHOW synchronous_standby_names").fetchone()[0]  # type: ignore[index]
            return bool(names.strip("' ")) == synchronous

        self.wait(applied, 60, f"synchronous_standby_names to be {'set' if synchronous else 'empty'}")

    def synchronous_standby_names(self) -> str:
        with self.connect() as conn:
            return str(conn.execute("SHOW synchronous_standby_names").fetchone()[0])  # type: ignore[index]

    def tune_monitor(self, **settings: int) -> None:
        """``ALTER SYSTEM SET pgautofailover.<name> = <value>`` on the monitor, then a reload.

        The tests shorten the monitor's patience (it is their failures that
        are slow, not their assertions); the measurements keep the defaults.
        """
        with psycopg.connect(f"host=127.0.0.1 port={self.monitor.port} dbname=pg_auto_failover user=postgres",
                             autocommit=True) as conn:
            for name, value in settings.items():
                conn.execute(f"ALTER SYSTEM SET pgautofailover.{name} = {int(value)}")
            conn.execute("SELECT pg_reload_conf()")

    # -- failures --

    def perform_failover(self) -> None:
        """``pg_autoctl perform failover``: returns once the monitor reports the new primary."""
        self.autoctl("perform", "failover", "--pgdata", str(self.monitor.pgdata), timeout=180)

    def kill_postmaster(self, node: Node) -> None:
        """SIGKILL to the node's postmaster (pid from postmaster.pid); its pg_autoctl stays up."""
        pid = node.postmaster_pid()
        assert pid is not None and _alive(pid), f"{node.name} has no running postmaster"
        os.kill(pid, signal.SIGKILL)

    def kill_node(self, node: Node) -> None:
        """SIGKILL to the node's whole process group: its pg_autoctl, its postmaster and backends (the host is gone)."""
        assert node.keeper is not None
        os.killpg(node.keeper.pid, signal.SIGKILL)
        node.keeper.wait(10)
        pid = node.postmaster_pid()
        if pid is not None and _alive(pid) and _is_postmaster_of(pid, node.pgdata):
            os.kill(pid, signal.SIGKILL)

    def restart_node(self, node: Node) -> None:
        """``pg_autoctl run`` again on a killed node: it rejoins as a secondary (pg_rewind)."""
        self._serve(node)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_postmaster_of(pid: int, pgdata: Path) -> bool:
    try:
        return str(pgdata) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def scratch_dir() -> str | None:
    """Where the formation's data goes: $LEDGER_TEST_HA_DIR, else /dev/shm (tmpfs: an fsync costs nothing there,
    and the failures injected here kill processes, never the machine, so nothing depends on it), else $TMPDIR."""
    chosen = os.environ.get("LEDGER_TEST_HA_DIR")
    if chosen:
        return chosen
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


@contextmanager
def formation(root: Path | None = None) -> Iterator[Formation]:
    """A created, running formation with the ledger installed on the primary; stopped and removed at the end."""
    own = root is None
    root = root or Path(tempfile.mkdtemp(prefix="ledger-autofailover-", dir=scratch_dir()))
    built = Formation(root)
    try:
        built.create()
        built.install_ledger()
        yield built
    finally:
        built.stop()
        if own:
            shutil.rmtree(root, ignore_errors=True)


# -- the load ----------------------------------------------------------------------------------------

# CMD of the wrapper: `writes` fenced writes, `gap` seconds apart. A failed
# connection (psql exit 2: the primary is going or coming) is retried on the
# multi-host DSN, so a run whose lease survives the failover goes on writing
# on the new primary; an SQL error (exit 3: the fence said LD001/LD002) ends
# CMD with 3, "the fence found the lease lost".
WRITER = r"""
set -u
if [ -n "${HA_GO:-}" ]; then while [ ! -e "$HA_GO" ]; do sleep 0.1; done; fi
echo "{\"t\": $(date +%s.%N), \"token\": $LEDGER_FENCING_TOKEN, \"run_id\": $LEDGER_RUN_ID, \"slot\": \"$LEDGER_SLOT\"}" >> "$HA_CMD_LOG"
for n in $(seq 1 "$HA_WRITES"); do
  tries=0
  until out=$(psql "$LEDGER_DSN" -X -q -A -t -v ON_ERROR_STOP=1 -v VERBOSITY=verbose \
        -v job="$LEDGER_JOB" -v resource="$HA_RESOURCE" -v token="$LEDGER_FENCING_TOKEN" \
        -v run_id="$LEDGER_RUN_ID" -v slot="$LEDGER_SLOT" -v n="$n" 2>&1 <<'SQL'
BEGIN;
SELECT ledger.fence(job => :'job', resource => :'resource', token => :token);
INSERT INTO ha_writes (job, resource, token, run_id, slot, writer, n)
VALUES (:'job', :'resource', :token, :run_id, nullif(:'slot', '')::timestamptz, 'cmd', :n);
COMMIT;
SQL
); do
    rc=$?
    if [ "$rc" -eq 3 ]; then echo "$out" >&2; exit 3; fi
    tries=$((tries + 1))
    if [ "$tries" -gt 600 ]; then echo "$out" >&2; exit 4; fi
    sleep 0.1
  done
  sleep "$HA_GAP"
done
"""

WRITES_TABLE = """
CREATE TABLE IF NOT EXISTS ha_writes (
    id bigserial PRIMARY KEY,
    job text NOT NULL,
    resource text NOT NULL,
    token bigint NOT NULL,
    run_id bigint,
    slot timestamptz,
    idempotency_key text,
    writer text NOT NULL,
    n int NOT NULL,
    timeline int NOT NULL DEFAULT ledger._timeline(),
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

_STARTED = re.compile(r"run (\d+) of job (\S+) started \(token (\d+)(?:, slot ([^)]+))?\)")
_SUCCEEDED = re.compile(r"^jobledger: run (\d+) succeeded", re.M)


@dataclass
class WrapperCall:
    """One `jobledger run` process: when, its exit code, the runs it started and which of them succeeded."""

    loop: str
    launched: float
    ended: float
    rc: int
    stderr: str
    started: dict[int, int] = field(default_factory=dict)  # run_id -> token
    succeeded: set[int] = field(default_factory=set)

    @classmethod
    def parse(cls, loop: str, launched: float, ended: float, rc: int, stderr: str) -> WrapperCall:
        call = cls(loop, launched, ended, rc, stderr)
        for match in _STARTED.finditer(stderr):
            call.started[int(match.group(1))] = int(match.group(3))
        call.succeeded = {int(m.group(1)) for m in _SUCCEEDED.finditer(stderr)}
        return call


class Load:
    """Python clients and wrapper loops on one formation; ``tag`` names this load's jobs and resources."""

    def __init__(self, dsn: str, tag: str, workdir: Path, *, py_clients: tuple[str, ...] = ("a", "b"),
                 wrapper_loops: tuple[str, ...] = ("w1", "w2"), ttl: float = 6.0, py_writes: int = 4,
                 py_gap: float = 0.4, cmd_writes: int = 2, cmd_gap: float = 0.2,
                 schedule: str = "3 seconds") -> None:
        self.dsn = dsn
        self.tag = tag
        self.py_job, self.sh_job = f"py-{tag}", f"sh-{tag}"
        self.py_resource, self.sh_resource = f"py-res-{tag}", f"sh-res-{tag}"
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.py_names, self.loop_names = py_clients, wrapper_loops
        self.ttl, self.schedule = ttl, schedule
        self.py_writes, self.py_gap, self.cmd_writes, self.cmd_gap = py_writes, py_gap, cmd_writes, cmd_gap
        self.stop_file = workdir / f"stop-{tag}"
        self.cmd_log = workdir / f"cmd-{tag}.jsonl"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._current: dict[str, subprocess.Popen[bytes]] = {}
        self.clients: dict[str, subprocess.Popen[bytes]] = {}
        self.calls: list[WrapperCall] = []
        self._lock = threading.Lock()

    def events_file(self, name: str) -> Path:
        return self.workdir / f"py-{self.tag}-{name}.jsonl"

    def prepare(self) -> None:
        with _retrying_connect(self.dsn) as conn:
            conn.execute(WRITES_TABLE)
            conn.execute("SELECT ledger.register_job(%s, ttl => %s)", (self.py_job, timedelta(seconds=self.ttl)))
            conn.execute("SELECT ledger.register_job(%s, %s, ttl => %s, max_backfill => 1)",
                         (self.sh_job, self.schedule, timedelta(seconds=self.ttl)))

    def start(self) -> None:
        self.stop_file.unlink(missing_ok=True)
        for index, name in enumerate(self.py_names):
            args = [sys.executable, str(Path(__file__).resolve()), "py-client", "--dsn", self.dsn,
                    "--job", self.py_job, "--resource", self.py_resource, "--name", name,
                    "--events", str(self.events_file(name)), "--stop", str(self.stop_file),
                    "--ttl", str(self.ttl), "--writes", str(self.py_writes), "--gap", str(self.py_gap)]
            if index % 2 == 1:
                args.append("--check-connections")  # one client with the pool's check, one without
            with open(self.workdir / f"py-{self.tag}-{name}.log", "ab") as log:
                self.clients[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                                      env={**os.environ, "PYTHONPATH": str(REPO)})
        for name in self.loop_names:
            thread = threading.Thread(target=self._wrapper_loop, args=(name,), name=f"wrapper-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _wrapper_loop(self, name: str) -> None:
        env = {**os.environ, "HA_CMD_LOG": str(self.cmd_log), "HA_RESOURCE": self.sh_resource,
               "HA_WRITES": str(self.cmd_writes), "HA_GAP": str(self.cmd_gap), "PYTHONPATH": str(REPO)}
        argv = [jobledger(), "run", self.sh_job, "--ttl", f"{self.ttl:g}s", "--grace", "2s", "-v",
                "--dsn", self.dsn, "--", "bash", "-c", WRITER]
        while not self._stop.is_set():
            launched = time.time()
            process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
            with self._lock:
                self._current[name] = process
            _, err = process.communicate()
            ended = time.time()
            with self._lock:
                self._current.pop(name, None)
                self.calls.append(WrapperCall.parse(name, launched, ended, process.returncode,
                                                    err.decode(errors="replace")))
            self._stop.wait(0.1)

    def stop(self, timeout: float = 60) -> None:
        """Ask everyone to stop after the current iteration; a wrapper still busy after ``timeout`` gets SIGTERM."""
        self.stop_file.touch()
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        with self._lock:
            stuck = list(self._current.values())
        for process in stuck:  # a catch-up that would not end: cancel it, as an operator would
            process.terminate()
        for thread in self._threads:
            thread.join(30)
        for name, client in self.clients.items():
            try:
                client.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                client.terminate()
                client.wait(10)

    def py_events(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for name in self.py_names:
            path = self.events_file(name)
            lines = path.read_text().splitlines() if path.exists() else []
            out[name] = [json.loads(line) for line in lines if line.strip()]
        return out

    def cmd_starts(self) -> list[dict[str, Any]]:
        lines = self.cmd_log.read_text().splitlines() if self.cmd_log.exists() else []
        return [json.loads(line) for line in lines if line.strip()]

    # -- waiting on the load --

    def running_now(self) -> set[str]:
        """The jobs of this load that have a run in progress (from the database)."""
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3) as conn:
                rows = conn.execute("SELECT DISTINCT job FROM ledger.job_execution_log "
                                    "WHERE status = 'running' AND job = ANY(%s)",
                                    ([self.py_job, self.sh_job],)).fetchall()
            return {row[0] for row in rows}
        except psycopg.Error:
            return set()

    def starts_since(self, since: float) -> dict[str, int]:
        """Per Python client: runs it started after ``since``; per wrapper loop: calls the ledger answered."""
        counts: dict[str, int] = {name: 0 for name in (*self.py_names, *self.loop_names)}
        for name, events in self.py_events().items():
            counts[name] = sum(1 for e in events if e["event"] == "started" and e["t_req"] > since)
        with self._lock:
            calls = list(self.calls)
        for call in calls:
            if call.launched > since and call.rc != EXIT_LEDGER_ERROR:
                counts[call.loop] += 1  # an answer from the ledger (a start, a skip, nothing due)
        return counts

    def successes_since(self, since: float) -> dict[str, int]:
        """Per job: successful runs requested after ``since`` (as the clients were told)."""
        counts = {self.py_job: 0, self.sh_job: 0}
        for events in self.py_events().values():
            counts[self.py_job] += sum(1 for e in events if e["event"] == "completed" and e["t_req"] > since
                                       and e.get("status") == "success")
        with self._lock:
            calls = list(self.calls)
        counts[self.sh_job] += sum(len(call.succeeded) for call in calls if call.launched > since)
        return counts

    def wait_for_progress(self, since: float, timeout: float, what: str, *, every_client: bool = True) -> None:
        """Until each job has a success requested after ``since`` and (``every_client``) each client a start."""
        def done() -> bool:
            return (all(n >= 1 for n in self.successes_since(since).values())
                    and (not every_client or all(n >= 1 for n in self.starts_since(since).values())))

        self.wait_until(done, timeout, what,
                        lambda: f"successes {self.successes_since(since)}, starts {self.starts_since(since)}; "
                                "last wrapper calls: "
                                + "; ".join(f"{c.loop} rc={c.rc} {_last_lines(c.stderr, 2)}" for c in self.calls[-4:]))

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str,
                   describe: Callable[[], str] = lambda: "") -> None:
        """wait_for, failing at once when a Python client exited."""
        def holds() -> bool:
            if predicate():
                return True
            for name, client in self.clients.items():
                if client.poll() is not None:
                    raise AssertionError(f"python client {name} exited ({client.returncode}) while waiting for {what}"
                                         f": {(self.workdir / f'py-{self.tag}-{name}.log').read_text()[-2000:]}")
            return False

        wait_for(holds, timeout, what, interval=0.2, explain=describe)

    def facts(self, failed_at: float, recovered_at: float, promoted: bool) -> Facts:
        with _retrying_connect(self.dsn) as conn:
            runs = conn.execute(
                "SELECT run_id, job, owner, token, slot, idempotency_key, status, failure_reason, "
                "       extract(epoch FROM started_at)::float8, extract(epoch FROM completed_at)::float8 "
                "  FROM ledger.job_execution_log WHERE job = ANY(%s) ORDER BY started_at, run_id",
                ([self.py_job, self.sh_job],)).fetchall()
            writes = conn.execute("SELECT id, job, resource, token, run_id, writer FROM ha_writes "
                                  "WHERE job = ANY(%s) ORDER BY id", ([self.py_job, self.sh_job],)).fetchall()
            overlaps = conn.execute("SELECT job, run_id, other_run_id FROM ledger.overlaps WHERE job = ANY(%s)",
                                    ([self.py_job, self.sh_job],)).fetchall()
            fences = dict(conn.execute("SELECT resource, token FROM ledger.fences WHERE resource = ANY(%s)",
                                       ([self.py_resource, self.sh_resource],)).fetchall())
        with self._lock:
            calls = list(self.calls)
        return Facts(load=self, failed_at=failed_at, recovered_at=recovered_at, promoted=promoted,
                     runs=[Run(*row) for row in runs], writes=writes, overlaps=overlaps, fences=fences,
                     py=self.py_events(), calls=calls, cmd_starts=self.cmd_starts(),
                     client_exits={name: c.returncode for name, c in self.clients.items()})


@contextmanager
def _retrying_connect(dsn: str, timeout: float = 60) -> Iterator[psycopg.Connection[Any]]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = psycopg.connect(dsn, autocommit=True)
            break
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    with conn:
        yield conn


@dataclass
class Run:
    run_id: int
    job: str
    owner: str
    token: int
    slot: datetime | None
    key: str | None
    status: str
    failure_reason: str | None
    started: float
    completed: float | None


@dataclass
class Issued:
    """A token as its receiver was told it: requested no earlier than ``requested``, known by ``acknowledged``."""

    job: str
    token: int
    requested: float
    acknowledged: float
    who: str


@dataclass
class Facts:
    """What the clients were told and what the database says, after one failure; each method lists violations."""

    load: Load
    failed_at: float
    recovered_at: float
    promoted: bool
    runs: list[Run]
    writes: list[tuple[Any, ...]]
    overlaps: list[tuple[Any, ...]]
    fences: dict[str, int]
    py: dict[str, list[dict[str, Any]]]
    calls: list[WrapperCall]
    cmd_starts: list[dict[str, Any]]
    client_exits: dict[str, int | None]
    phases: dict[str, float] = field(default_factory=dict)  # seconds each step of under_load took
    long: dict[str, LongVerdict] = field(default_factory=dict)  # LongRuns' verdicts, by kind

    # -- tokens --

    def issued(self) -> list[Issued]:
        """Every token a client was handed, from the clients' own records (also those the database lost)."""
        out = [Issued(self.load.py_job, e["token"], e["t_req"], e["t_ack"], f"py-{name}")
               for name, events in self.py.items() for e in events if e["event"] == "started"]
        by_token = {start["token"]: start["t"] for start in self.cmd_starts}
        for call in self.calls:
            for token in call.started.values():
                out.append(Issued(self.load.sh_job, token, call.launched, by_token.get(token, call.ended),
                                  f"wrapper-{call.loop}"))
        return out

    def token_order_problems(self) -> list[str]:
        """A token handed out after another was known must be higher: across clients, across the failure."""
        problems = []
        for job in (self.load.py_job, self.load.sh_job):
            issued = sorted((i for i in self.issued() if i.job == job), key=lambda i: i.acknowledged)
            for earlier in issued:
                for later in issued:
                    if later.requested > earlier.acknowledged and later.token <= earlier.token:
                        problems.append(f"{job}: {later.who} was given token {later.token} after {earlier.who} "
                                        f"had been given {earlier.token}")
            tokens_in_start_order = [run.token for run in self.runs if run.job == job]
            if tokens_in_start_order != sorted(set(tokens_in_start_order)):
                problems.append(f"{job}: the log's tokens do not rise with started_at: {tokens_in_start_order}")
        return problems

    def before_and_after(self, job: str) -> tuple[list[int], list[int]]:
        """Tokens handed out before the failure, and those handed out after recovery (requested after it)."""
        issued = [i for i in self.issued() if i.job == job]
        return ([i.token for i in issued if i.acknowledged < self.failed_at],
                [i.token for i in issued if i.requested > self.recovered_at])

    def timeline_jump_problems(self) -> list[str]:
        problems = []
        for job in (self.load.py_job, self.load.sh_job):
            before, after = self.before_and_after(job)
            if not before or not after:
                problems.append(f"{job}: tokens before ({len(before)}) and after ({len(after)}) the failure needed")
                continue
            if min(after) <= max(before):
                problems.append(f"{job}: token {min(after)} issued after the failure is not above {max(before)}")
            if self.promoted and min(after) // TWO_32 <= max(before) // TWO_32:
                problems.append(f"{job}: a standby was promoted but the tokens did not jump by 2^32 "
                                f"({max(before)} -> {min(after)})")
        return problems

    # -- slots, keys, overlaps, fences --

    def twice_problems(self) -> list[str]:
        problems = []
        for attr, job in (("key", self.load.py_job), ("slot", self.load.sh_job)):
            done = defaultdict(list)
            for run in self.runs:
                if run.job == job and run.status == "success":
                    done[getattr(run, attr)].append(run.run_id)
            problems += [f"{job}: {attr} {value} succeeded twice in the log: runs {ids}"
                         for value, ids in done.items() if len(ids) > 1]
        # What the clients were told: a key or slot acknowledged as a success twice.
        told: dict[str, list[str]] = defaultdict(list)
        for name, events in self.py.items():
            for e in events:
                if e["event"] == "completed" and e.get("status") == "success":
                    told[e["key"]].append(name)
        problems += [f"{self.load.py_job}: key {key} was reported completed to {who}" for key, who in told.items()
                     if len(who) > 1]
        slot_of = {run.run_id: run.slot for run in self.runs if run.job == self.load.sh_job}
        slots: dict[Any, int] = defaultdict(int)
        for call in self.calls:
            for run_id in call.succeeded:
                slots[slot_of.get(run_id, ("unknown run", run_id))] += 1
        problems += [f"{self.load.sh_job}: slot {slot} reported succeeded {n} times by the wrappers"
                     for slot, n in slots.items() if n > 1]
        return problems

    def lost_success_problems(self) -> list[str]:
        """Every success a client was told about is a success in the log (not guaranteed with async replication)."""
        status = {(run.job, run.run_id): run.status for run in self.runs}
        problems = []
        for name, events in self.py.items():
            for e in events:
                if e["event"] == "completed" and e.get("status") == "success" \
                        and status.get((self.load.py_job, e["run_id"])) != "success":
                    problems.append(f"py-{name}: run {e['run_id']} (key {e['key']}) was reported a success, "
                                    f"the log says {status.get((self.load.py_job, e['run_id']))}")
        for call in self.calls:
            for run_id in call.succeeded:
                if status.get((self.load.sh_job, run_id)) != "success":
                    problems.append(f"wrapper {call.loop}: run {run_id} was reported a success, "
                                    f"the log says {status.get((self.load.sh_job, run_id))}")
        return problems

    def overlap_problems(self) -> list[str]:
        return [f"ledger.overlaps: {row}" for row in self.overlaps]

    def fence_order_problems(self) -> list[str]:
        problems = []
        last: dict[str, int] = {}
        for _id, job, resource, token, run_id, writer in self.writes:
            if token < last.get(resource, 0):
                problems.append(f"{resource}: write {_id} (run {run_id}, {writer}) carries token {token} "
                                f"after token {last[resource]} wrote")
            last[resource] = max(token, last.get(resource, 0))
        for resource, token in last.items():
            if self.fences.get(resource) != token:
                problems.append(f"{resource}: fence at {self.fences.get(resource)}, highest write {token}")
        return problems

    # -- runs in flight, reconnection --

    def in_flight(self) -> tuple[list[tuple[str, dict[str, Any]]], list[WrapperCall]]:
        """Python runs and wrapper calls that had a run started before the failure and ended after it."""
        py = []
        for name, events in self.py.items():
            for index, e in enumerate(events):
                if e["event"] != "started" or e["t_ack"] >= self.failed_at:
                    continue
                end = next((x for x in events[index + 1:] if x["event"] in ("completed", "lost", "error")), None)
                if end is None or end["t"] > self.failed_at:
                    py.append((name, {"start": e, "end": end}))
        started = {run.run_id: run.started for run in self.runs if run.job == self.load.sh_job}
        by_token = {start["token"]: start["t"] for start in self.cmd_starts}
        calls = [call for call in self.calls if call.ended > self.failed_at
                 and any(started.get(run_id, by_token.get(token, call.ended)) < self.failed_at
                         for run_id, token in call.started.items())]
        return py, calls

    def in_flight_safety_problems(self) -> list[str]:
        """A run in flight is never reported a success the log does not hold, nor lost when the log says success."""
        status = {(run.job, run.run_id): run.status for run in self.runs}
        problems = []
        py, calls = self.in_flight()
        for name, flight in py:
            start, end = flight["start"], flight["end"]
            logged = status.get((self.load.py_job, start["run_id"]))
            if end is None:
                problems.append(f"py-{name}: run {start['run_id']} (token {start['token']}) never ended")
            elif end["event"] == "completed" and (end.get("status") != "success" or logged != "success"):
                problems.append(f"py-{name}: run {start['run_id']} completed as {end.get('status')}, "
                                f"the log says {logged}")
            elif end["event"] == "lost" and logged == "success":
                problems.append(f"py-{name}: run {start['run_id']} was reported lost but is a success in the log")
        for call in calls:
            verdicts = {run_id: status.get((self.load.sh_job, run_id)) for run_id in call.started}
            if call.rc == 0 and any(value != "success" for value in verdicts.values()):
                problems.append(f"wrapper {call.loop}: exit 0 but the log says {verdicts}")
            if call.rc == 124 and list(verdicts.values())[-1:] == ["success"]:
                problems.append(f"wrapper {call.loop}: exit 124 (lost) but the log says {verdicts}")
        return problems

    def in_flight_verdict_problems(self) -> list[str]:
        """A run in flight either went on (and succeeded) or was reported lost (LeaseLost, exit 124); nothing else."""
        problems = []
        py, calls = self.in_flight()
        for name, flight in py:
            start, end = flight["start"], flight["end"]
            if end is not None and end["event"] not in ("completed", "lost"):
                problems.append(f"py-{name}: run {start['run_id']} (token {start['token']}) was neither completed "
                                f"nor reported lost: {end.get('error_type')}: {end.get('error')}")
        for call in calls:
            if call.rc not in (0, 124, 3):  # 124: the wrapper saw the lease lost; 3: CMD's fence did (LD001/LD002)
                problems.append(f"wrapper {call.loop}: a run in flight ended with exit {call.rc}, neither "
                                f"continued nor reported lost (124): {_last_lines(call.stderr)}")
        return problems

    def reconnect_problems(self) -> list[str]:
        """Every Python client started a new run after the failure in the same process; every wrapper loop got
        answers from the ledger again, and the wrapper job started runs again."""
        problems = []
        for name, events in self.py.items():
            pids = {e["pid"] for e in events}
            if len(pids) != 1:
                problems.append(f"py-{name}: events from several processes {pids}")
            if not any(e["event"] == "started" and e["t_req"] > self.failed_at for e in events):
                problems.append(f"py-{name}: no run started after the failure")
            if self.client_exits.get(name) not in (0, None):
                problems.append(f"py-{name}: the client process exited {self.client_exits.get(name)}")
        for loop in self.load.loop_names:
            if not any(call.loop == loop and call.launched > self.failed_at and call.rc != EXIT_LEDGER_ERROR
                       for call in self.calls):
                problems.append(f"wrapper loop {loop}: no answer from the ledger after the failure")
        if not any(call.launched > self.failed_at and call.started for call in self.calls):
            problems.append(f"{self.load.sh_job}: no wrapper started a run after the failure")
        return problems

    def all_problems(self, *, durable_acks: bool = True) -> dict[str, list[str]]:
        checks = {
            "token order": self.token_order_problems(),
            "timeline jump": self.timeline_jump_problems(),
            "twice": self.twice_problems(),
            "overlaps": self.overlap_problems(),
            "fence order": self.fence_order_problems(),
            "in flight (safety)": self.in_flight_safety_problems(),
            "in flight (verdict)": self.in_flight_verdict_problems(),
            "reconnect": self.reconnect_problems(),
        }
        if durable_acks:
            checks["lost successes"] = self.lost_success_problems()
        return checks

    # -- the figures --

    def first_start_after(self, job: str) -> float | None:
        """Seconds from the failure until a client was told of a run started on the serving primary.

        Python clients: when ``ledger.run`` returned the started run; wrappers:
        when CMD began (a little after the wrapper was told). After a
        promotion only tokens that jumped count (the old primary may start
        runs until it is demoted); after a restart in place, any start told
        after the failure.
        """
        if job == self.load.py_job:
            told = [(e["t_ack"], e["token"]) for events in self.py.values() for e in events
                    if e["event"] == "started"]
        else:
            told = [(start["t"], start["token"]) for start in self.cmd_starts]
        # Before: told before the failure, or started before it (a CMD may begin just after its run started).
        before = max([token for at, token in told if at < self.failed_at]
                     + [run.token for run in self.runs if run.job == job and run.started < self.failed_at],
                     default=0)
        after = [at for at, token in told if at > self.failed_at and token > before
                 and (not self.promoted or token // TWO_32 > before // TWO_32)]
        return min(after) - self.failed_at if after else None

    def first_logged_start_after(self, job: str) -> float | None:
        """The same from the log's started_at (the call's start: a commit that waited is not counted)."""
        before = max((run.token for run in self.runs if run.job == job and run.started < self.failed_at), default=0)
        for run in self.runs:
            if run.job == job and run.started > self.failed_at \
                    and (not self.promoted or run.token // TWO_32 > before // TWO_32):
                return run.started - self.failed_at
        return None

    def summary(self) -> dict[str, Any]:
        py, calls = self.in_flight()
        return {
            "py_next_start_s": _round(self.first_start_after(self.load.py_job)),
            "wrapper_next_start_s": _round(self.first_start_after(self.load.sh_job)),
            "py_next_logged_start_s": _round(self.first_logged_start_after(self.load.py_job)),
            "wrapper_next_logged_start_s": _round(self.first_logged_start_after(self.load.sh_job)),
            "promoted": self.promoted,
            "read_write_back_s": round(self.recovered_at - self.failed_at, 2),
            "py_in_flight": [f"{f['end']['event'] if f['end'] else 'none'}" for _, f in py],
            "wrapper_in_flight_exit": [call.rc for call in calls],
            "py_errors_after_failure": sum(1 for events in self.py.values() for e in events
                                           if e["event"] == "error" and e["t"] > self.failed_at),
            "wrapper_exits_after_failure": sorted(call.rc for call in self.calls if call.launched > self.failed_at),
            "runs": len(self.runs),
            "writes": len(self.writes),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _last_lines(text: str, n: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


# -- runs in flight for sure ---------------------------------------------------------------------------

LONG_KINDS = {
    "pool": "Python, Ledger(dsn), heartbeat every second",
    "pool-no-beat": "Python, Ledger(dsn), no heartbeat between the failure and the end",
    "conn": "Python, Ledger(conn), heartbeat every second",
    "conn+hb": "Python, Ledger(conn, heartbeat_conninfo=dsn), heartbeat every second",
    "wrapper": "jobledger run --ttl 300s (heartbeat every 100 s: none between the failure and the end)",
}
LONG_TTL = 300.0  # far beyond the failure: a run's local deadline never decides its verdict


@dataclass
class LongVerdict:
    """How one long run (in flight across the whole failure) ended, as its client says and as the log says."""

    kind: str
    job: str
    outcome: str  # completed | lost | error | exit N
    detail: str
    logged: str | None  # the run's status in the log

    def problems(self) -> list[str]:
        continued = self.outcome in ("completed", "exit 0") and self.logged == "success"
        lost = self.outcome in ("lost", "exit 124", "exit 3") and self.logged != "success"
        if continued or lost:
            return []
        return [f"{LONG_KINDS[self.kind]}: the run in flight ended '{self.outcome}' ({self.detail}), "
                f"the log says {self.logged}: neither continued on the new primary nor reported lost"]


class LongRuns:
    """One run per client kind, started before the failure and held open (CMD or body waits for a go file)
    until the formation has recovered; then each does one fenced write and ends. So each is surely in flight."""

    def __init__(self, dsn: str, tag: str, workdir: Path, ttl: float = LONG_TTL) -> None:
        self.dsn, self.tag, self.workdir, self.ttl = dsn, tag, workdir, ttl
        self.go = workdir / f"go-{tag}"
        self.jobs = {kind: f"long-{kind.replace('+', '-')}-{tag}" for kind in LONG_KINDS}
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.wrapper_stderr = workdir / f"long-wrapper-{tag}.err"

    def events_file(self, kind: str) -> Path:
        return self.workdir / f"long-{kind}-{self.tag}.jsonl"

    def start(self) -> None:
        with _retrying_connect(self.dsn) as conn:
            for job in self.jobs.values():
                conn.execute("SELECT ledger.register_job(%s, ttl => %s)", (job, timedelta(seconds=self.ttl)))
        self.go.unlink(missing_ok=True)
        for kind, job in self.jobs.items():
            if kind == "wrapper":
                env = {**os.environ, "HA_GO": str(self.go), "HA_CMD_LOG": str(self.workdir / f"long-{self.tag}.cmd"),
                       "HA_RESOURCE": f"res-{job}", "HA_WRITES": "1", "HA_GAP": "0", "PYTHONPATH": str(REPO)}
                argv = [jobledger(), "run", job, "--ttl", f"{self.ttl:g}s", "-v", "--dsn", self.dsn,
                        "--", "bash", "-c", WRITER]
                with open(self.wrapper_stderr, "wb") as err:
                    self.processes[kind] = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                                            cwd=REPO)
            else:
                argv = [sys.executable, str(Path(__file__).resolve()), "long-run", "--dsn", self.dsn, "--job", job,
                        "--resource", f"res-{job}", "--mode", kind, "--go", str(self.go),
                        "--events", str(self.events_file(kind)), "--ttl", str(self.ttl),
                        "--heartbeat", "1000" if kind == "pool-no-beat" else "1"]
                with open(self.workdir / f"long-{kind}-{self.tag}.log", "wb") as log:
                    self.processes[kind] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                                            env={**os.environ, "PYTHONPATH": str(REPO)})

    def started(self) -> bool:
        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=3) as conn:
                running = conn.execute("SELECT count(DISTINCT job) FROM ledger.job_execution_log "
                                       "WHERE status = 'running' AND job = ANY(%s)",
                                       (list(self.jobs.values()),)).fetchone()[0]  # type: ignore[index]
        except psycopg.Error:
            return False
        return bool(running == len(self.jobs))

    def release(self) -> None:
        self.go.touch()

    def finish(self, timeout: float = 120) -> dict[str, LongVerdict]:
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
                process.wait(30)
        with _retrying_connect(self.dsn) as conn:
            logged = dict(conn.execute("SELECT DISTINCT ON (job) job, status FROM ledger.job_execution_log "
                                       "WHERE job = ANY(%s) ORDER BY job, started_at DESC",
                                       (list(self.jobs.values()),)).fetchall())
        verdicts = {}
        for kind, job in self.jobs.items():
            if kind == "wrapper":
                rc = self.processes[kind].returncode
                verdicts[kind] = LongVerdict(kind, job, f"exit {rc}",
                                             _last_lines(self.wrapper_stderr.read_text(errors="replace")),
                                             logged.get(job))
                continue
            path = self.events_file(kind)
            events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            end = next((e for e in reversed(events) if e["event"] in ("completed", "lost", "error")), None)
            outcome = "none" if end is None else end["event"]
            if end is not None and end["event"] == "completed" and end.get("status") != "success":
                outcome = f"completed as {end.get('status')}"
            detail = "" if end is None else f"{end.get('error_type', '')} {end.get('error', '')}".strip()
            verdicts[kind] = LongVerdict(kind, job, outcome, detail, logged.get(job))
        return verdicts


def long_run(args: argparse.Namespace) -> int:
    """One run held open until the go file appears, then one fenced write (the Python kinds of LongRuns)."""
    from ledger import Ledger
    from ledger.errors import LeaseLost

    events = open(args.events, "a", buffering=1)

    def record(event: str, **facts: Any) -> None:
        events.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **facts}) + "\n")

    owner = f"long-{args.mode}"
    if args.mode.startswith("pool"):
        ledger = Ledger(args.dsn, owner=owner)
    else:
        conn = psycopg.connect(args.dsn, autocommit=True)
        ledger = Ledger(conn, owner=owner, heartbeat_conninfo=args.dsn if args.mode == "conn+hb" else None)
    go = Path(args.go)
    try:
        with ledger.run(args.job, ttl=timedelta(seconds=args.ttl),
                        heartbeat_interval=timedelta(seconds=args.heartbeat)) as run:
            record("started", token=run.token, run_id=run.run_id)
            while not go.exists():
                time.sleep(0.1)
            _fenced_write(run, args.dsn, args.job, args.resource, "long", 0)
        record("completed", run_id=run.run_id, status=None if run.result is None else run.result.status)
    except LeaseLost as error:
        record("lost", error=str(error)[:300])
    except Exception as error:
        record("error", error_type=type(error).__name__, error=str(error)[:300])
    return 0


# -- one failure under load ----------------------------------------------------------------------------

KINDS = ("failover", "kill-postmaster", "kill-node")


def under_load(form: Formation, kind: str, tag: str, workdir: Path, *, recovery_timeout: float = 150,
               rejoin: bool = True, long_runs: bool = False) -> Facts:
    """Start the load, wait until both jobs have a run in progress, fail, wait until every client made progress.

    After the failure: a read-write node on the multi-host DSN (``recovered_at``),
    a run started by every Python client and an answer to every wrapper loop,
    and a success of each job requested after ``recovered_at``.

    ``kind``: ``failover`` (pg_autoctl perform failover), ``kill-postmaster``
    (SIGKILL to the primary's postmaster; pg_autoctl restarts it),
    ``kill-node`` (SIGKILL to the primary's pg_autoctl and Postgres: the
    monitor fails over; with ``rejoin`` the node is started again afterwards
    and rejoins as a secondary; without, the survivor serves alone). With
    ``long_runs``, one run per client kind (LongRuns) is held open across the
    failure and released at ``recovered_at``.
    """
    assert kind in KINDS, kind
    load = Load(form.dsn(), tag, workdir)
    load.prepare()
    timeline_before = form.timeline()
    victim = form.primary()
    phases: dict[str, float] = {}
    clock = time.monotonic()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.monotonic()
        phases[name] = round(now - clock, 1)
        clock = now

    longs = LongRuns(form.dsn(), tag, workdir) if long_runs else None
    verdicts: dict[str, LongVerdict] = {}
    load.start()
    if longs is not None:
        longs.start()
    try:
        def warm() -> bool:
            return (all(n >= 1 for n in load.starts_since(0).values()) and bool(load.cmd_starts())
                    and load.running_now() == {load.py_job, load.sh_job}
                    and (longs is None or longs.started()))

        load.wait_until(warm, 120, "every client to start a run, and a run of each job in progress")
        phase("warm-up")
        failed_at = time.time()
        if kind == "failover":
            form.perform_failover()
        elif kind == "kill-postmaster":
            form.kill_postmaster(victim)
        else:
            form.kill_node(victim)
        time.sleep(0.2)
        phase("failure")
        form.wait(form.serving, recovery_timeout, "a read-write node on the multi-host DSN after the failure")
        recovered_at = time.time()
        phase("recovery")
        if longs is not None:
            longs.release()
        load.wait_for_progress(failed_at, 90, "a run of every client after the failure", every_client=True)
        load.wait_for_progress(recovered_at, 90, "a success of each job after the recovery", every_client=False)
        phase("progress")
    finally:
        load.stop()
        if longs is not None:
            longs.release()
            verdicts = longs.finish()
        phase("stop")
    if kind == "kill-node" and rejoin:
        form.restart_node(victim)
    if kind == "kill-node" and not rejoin:
        form.wait(lambda: form.serving(), 120, "the survivor to serve writes")
    else:
        form.wait_stable(180)
    phase("stable")
    promoted = form.timeline() != timeline_before
    facts = load.facts(failed_at, recovered_at, promoted)
    facts.phases = phases
    facts.long = verdicts
    return facts


# -- the Python client process -------------------------------------------------------------------------

def py_client(args: argparse.Namespace) -> int:
    """Loop on ``with ledger.run(job, ttl, idempotency_key)`` until the stop file appears; one JSON line per event."""
    import logging

    from psycopg_pool import ConnectionPool

    from ledger import Ledger
    from ledger.errors import LeaseLost

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    stop = Path(args.stop)
    events = open(args.events, "a", buffering=1)
    pid = os.getpid()

    def record(event: str, **facts: Any) -> None:
        events.write(json.dumps({"event": event, "t": time.time(), "pid": pid, **facts}) + "\n")

    pool_kwargs: dict[str, Any] = {}
    if args.check_connections:
        pool_kwargs["check"] = ConnectionPool.check_connection
    ledger = None
    while ledger is None:  # the first connection is the client's own business; only its start needs a primary
        try:
            ledger = Ledger(args.dsn, owner=f"py-{args.name}", pool_kwargs=pool_kwargs)
        except psycopg.OperationalError as error:
            record("error", t_req=time.time(), error_type=type(error).__name__, error=str(error)[:300])
            time.sleep(0.5)
    ttl = timedelta(seconds=args.ttl)
    n = 1
    while not stop.exists():
        key = f"key-{n}"
        t_req = time.time()
        try:
            with ledger.run(args.job, ttl=ttl, idempotency_key=key) as run:
                t_ack = time.time()
                if not run.started:
                    record("not_started", t_req=t_req, t_ack=t_ack, key=key, outcome=run.outcome)
                    if run.outcome == "already_done":
                        n += 1
                    else:
                        time.sleep(0.05)
                    continue
                record("started", t_req=t_req, t_ack=t_ack, key=key, token=run.token, run_id=run.run_id)
                for i in range(args.writes):
                    _fenced_write(run, args.dsn, args.job, args.resource, key, i)
                    time.sleep(args.gap)
            result = run.result
            record("completed", t_req=t_req, key=key, token=run.token, run_id=run.run_id,
                   status=None if result is None else result.status)
            n += 1
            time.sleep(random.uniform(0.1, 0.5))  # let the other clients win a start now and then
        except LeaseLost as error:
            record("lost", t_req=t_req, key=key, error=str(error)[:300])
        except Exception as error:  # the database is away: retry the same key
            record("error", t_req=t_req, key=key, error_type=type(error).__name__, error=str(error)[:300])
            time.sleep(0.1)
    ledger.close()
    return 0


def _fenced_write(run: Any, dsn: str, job: str, resource: str, key: str, n: int) -> None:
    """One fenced write; a connection failure is retried (on the new primary) while the lease is not known lost."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with psycopg.connect(dsn, connect_timeout=3) as conn:
                run.fence(conn, resource)
                conn.execute("INSERT INTO ha_writes (job, resource, token, run_id, idempotency_key, writer, n) "
                             "VALUES (%s, %s, %s, %s, %s, 'py', %s)", (job, resource, run.token, run.run_id, key, n))
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            run.check()  # LeaseLost once the heartbeat gave the lease up
            time.sleep(0.1)


# -- the measurements ------------------------------------------------------------------------------------

def measure(args: argparse.Namespace) -> int:
    reason = missing()
    if reason:
        print(f"cannot measure: {reason}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="ledger-ha-measure-"))
    with formation() as form:
        for mode in args.modes:
            form.set_synchronous(mode == "sync")
            for kind in args.kinds:
                for attempt in range(args.tries):
                    tag = f"{mode}-{kind}-{attempt}".replace("-", "_")
                    started = time.monotonic()
                    row: dict[str, Any] = {"mode": mode, "kind": kind, "try": attempt,
                                           "sync_names": form.synchronous_standby_names()}
                    try:
                        facts = under_load(form, kind, tag, workdir)
                    except Exception as error:  # record it, get the formation back, go on
                        row["error"] = f"{type(error).__name__}: {str(error)[:500]}"
                        form.wait_stable(300)
                    else:
                        row.update(facts.summary())
                        row["phases"] = facts.phases
                        row["problems"] = {k: v for k, v in facts.all_problems(durable_acks=mode == "sync").items()
                                           if v}
                        row["lost_successes"] = facts.lost_success_problems()
                    row["wall_s"] = round(time.monotonic() - started, 1)
                    results.append(row)
                    print(json.dumps(row, default=str), flush=True)
    print()
    print("| failure | replication | promoted | read-write DSN back (s) | next Python-client start (s) "
          "| next wrapper CMD start (s) | tries |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for kind in args.kinds:
            rows = [r for r in results if r["mode"] == mode and r["kind"] == kind and "error" not in r]
            cells = []
            for key in ("read_write_back_s", "py_next_start_s", "wrapper_next_start_s"):
                values = [r[key] for r in rows if r.get(key) is not None]
                cells.append(f"{_median(values)} ({_span(values)})")
            promoted = "/".join(sorted({"yes" if r["promoted"] else "no" for r in rows})) or "-"
            failed = sum(1 for r in results if r["mode"] == mode and r["kind"] == kind and "error" in r)
            print(f"| {kind} | {mode} | {promoted} | {' | '.join(cells)} | {len(rows)}"
                  + (f" (+{failed} failed)" if failed else "") + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


def _span(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    client = sub.add_parser("py-client", help="one Python client of the load (started by Load)")
    client.add_argument("--dsn", required=True)
    client.add_argument("--job", required=True)
    client.add_argument("--resource", required=True)
    client.add_argument("--name", required=True)
    client.add_argument("--events", required=True)
    client.add_argument("--stop", required=True)
    client.add_argument("--ttl", type=float, default=6.0)
    client.add_argument("--writes", type=int, default=4)
    client.add_argument("--gap", type=float, default=0.4)
    client.add_argument("--check-connections", action="store_true")
    held = sub.add_parser("long-run", help="one run held open across a failure (started by LongRuns)")
    held.add_argument("--dsn", required=True)
    held.add_argument("--job", required=True)
    held.add_argument("--resource", required=True)
    held.add_argument("--mode", required=True, choices=[k for k in LONG_KINDS if k != "wrapper"])
    held.add_argument("--go", required=True)
    held.add_argument("--events", required=True)
    held.add_argument("--ttl", type=float, default=LONG_TTL)
    held.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats")
    bench = sub.add_parser("measure", help="time from each failure to the next successful start")
    bench.add_argument("--tries", type=int, default=3)
    bench.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    bench.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    bench.add_argument("--json", help="also write every try's facts to this file")
    args = parser.parse_args(argv)
    if args.command == "py-client":
        return py_client(args)
    if args.command == "long-run":
        return long_run(args)
    return measure(args)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
