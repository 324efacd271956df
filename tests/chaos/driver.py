"""The chaos driver: workers, random faults, and the audit at the end.

On a private cluster (tests/cluster.py), a few worker processes
(tests/chaos/worker.py: some on the Python client, some on the ``jobledger
run`` wrapper) run one scheduled job (interval '1 second', max_backfill 3)
and one unscheduled job with ttls of 1 to 3 s, writing through job-aware
fences into ``public.writes``. The driver, from a fixed seed and for a
bounded number of events, randomly

- SIGKILLs a worker (and starts a new incarnation of it): for a wrapper
  worker either the whole "host" (worker loop, wrapper, CMD) or only the
  ``jobledger run`` process, whose CMD then lives on as an orphan;
- SIGSTOPs a worker (all its processes) for longer than any ttl and then
  SIGCONTs it: a zombie that wakes up and tries to write. For most freezes
  the driver first asks for a pause inside a run (a hold file the worker
  checks between two writes) and stops the worker once it announced it, so
  the freeze lands in a run and the next thing the zombie does is a fenced
  write to its job's main resource, which every run writes (a fence that let
  it through would show as a token going down there);
- restarts PostgreSQL with ``pg_ctl -m immediate stop`` (a crash) and start;

and calls ``ledger.reap_expired()`` every few seconds, as a pg_cron job would.
Then it stops the workers, waits for every lease to expire, reaps, and
checks from the database (and the workers' logs of what they were
acknowledged) the invariants listed in :meth:`Chaos.audit`.

Processes are only ever signalled by pid, and only those that carry this
run's marker in their environment (``LEDGER_CHAOS_MARK``, inherited by the
wrapper and its CMD), so a reused pid is never hit.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

import psycopg
from waiting import wait_for

from .worker import SCHEDULED, TTLS, UNSCHEDULED

WORKER = str(Path(__file__).resolve().parent / "worker.py")
MAX_TTL = max(TTLS)
# A run of a killed process may still end normally if its complete/fail
# statement was already on the wire: the server ends it a moment after the kill.
KILL_SLACK = timedelta(seconds=5)

SETUP = f"""
SELECT ledger.register_job('{SCHEDULED}', '1 second', ttl => '2 seconds', max_backfill => 3);
SELECT ledger.register_job('{UNSCHEDULED}', NULL, ttl => '2 seconds');
CREATE TABLE public.writes (
    id         bigserial PRIMARY KEY,           -- nextval at INSERT, after the fence: see audit()
    job        text        NOT NULL,
    resource   text        NOT NULL,
    token      bigint      NOT NULL,
    slot       timestamptz,
    run_id     bigint      NOT NULL,
    worker     text        NOT NULL,
    tag        text        NOT NULL UNIQUE,
    written_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


@dataclass
class Config:
    mode: str
    seed: int = 20240601
    # Worker 0 uses Ledger(conn), worker 2 Ledger(pool) (index % 4 == 2), 1 and 3 `jobledger run`.
    kinds: tuple[str, ...] = ("client", "wrapper", "client", "wrapper")
    events: int | None = 12          # short mode: exactly this many events (each kind at least once)
    target_runs: int | None = None   # long mode: events go on until the log holds this many runs
    max_events: int = 100_000        # long mode: a bound whatever happens
    max_seconds: float = 4 * 3600    # long mode: a bound whatever happens
    gap: tuple[float, float] = (1.0, 2.5)  # between two events
    pace: float = 0.05  # a wrapper worker waits at most this long between two invocations
    weights: dict[str, float] = field(default_factory=lambda: {
        "kill_client": 0.12, "kill_wrapper": 0.08, "kill_wrapper_only": 0.08, "freeze_zombie_client": 0.15,
        "freeze_zombie_wrapper": 0.12, "freeze": 0.15, "restart": 0.3})

    @classmethod
    def short(cls) -> "Config":
        return cls(mode="short")

    @classmethod
    def long(cls, runs: int) -> "Config":
        return cls(mode="long", events=None, target_runs=runs, gap=(2.0, 6.0), pace=0.3)


@dataclass
class Worker:
    index: int
    kind: str  # "client" or "wrapper"
    incarnation: int = 0
    process: subprocess.Popen[bytes] | None = None
    frozen: bool = False
    mark: str = ""

    @property
    def name(self) -> str:
        """Owner of a client incarnation's runs; prefix of a wrapper incarnation's owners (`<name>-x<n>`)."""
        return f"chaos-w{self.index}-i{self.incarnation}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Kill:
    at: datetime
    owners: list[str]   # exact owners
    prefix: str | None  # and every owner starting with it (a wrapper worker's whole incarnation)
    what: str


def utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def read_log(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass  # cannot happen with one write() per line; tolerated anyway
    return records


def last_event(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().splitlines()
        return json.loads(lines[-1])["e"] if lines else None
    except (OSError, ValueError, KeyError, IndexError):
        return None


# -- processes, by pid and marker only -------------------------------------------

def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def marked(mark: str) -> list[int]:
    """Live pids whose environment carries this marker (a worker, its wrapper, their CMD)."""
    needle = f"LEDGER_CHAOS_MARK={mark}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if _state(pid) not in (None, "Z", "X")]


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0")]
    except OSError:
        return []


def signal_all(mark: str, number: int, *, until: Callable[[int], bool]) -> None:
    """Send `number` to every marked process until each satisfies `until` (new children are caught too)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pending = [pid for pid in marked(mark) if not until(pid)]
        if not pending:
            return
        for pid in pending:
            try:
                os.kill(pid, number)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


# -- the driver ---------------------------------------------------------------------

class Chaos:
    def __init__(self, cluster: Any, workdir: Path, config: Config) -> None:
        self.cluster = cluster
        self.dsn = f"{cluster.dsn()} connect_timeout=5"
        self.workdir = workdir
        self.config = config
        self.rng = random.Random(config.seed)
        self.run_mark = uuid.uuid4().hex[:12]
        self.stop_file = workdir / "stop"
        self.workers = [Worker(i, kind) for i, kind in enumerate(config.kinds)]
        self.kills: list[Kill] = []
        self.events: Counter[str] = Counter()
        self.violations: list[str] = []
        self.pending: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._conn: psycopg.Connection[Any] | None = None
        self.started = time.monotonic()
        self.figures: dict[str, Any] = {}
        self.event_seconds: defaultdict[str, float] = defaultdict(float)
        self.done_by_kind: Counter[str] = Counter()

    # -- database, surviving restarts --------------------------------------------

    def query(self, sql: str, params: Any = None, *, retry: float = 120.0) -> list[tuple[Any, ...]]:
        deadline = time.monotonic() + retry
        while True:
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = psycopg.connect(self.dsn, autocommit=True)
                cur = self._conn.execute(sql, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def runs(self) -> int:
        return int(self.query("SELECT count(*) FROM ledger.job_execution_log")[0][0])

    # -- workers ----------------------------------------------------------------------

    def spawn(self, worker: Worker) -> None:
        worker.incarnation += 1
        worker.frozen = False
        worker.mark = f"{self.run_mark}:{worker.name}"
        env = dict(os.environ, LEDGER_CHAOS_MARK=worker.mark, PYTHONUNBUFFERED="1")
        for key in ("PGHOST", "PGPORT", "PGUSER", "PGPASSWORD", "PGDATABASE", "LEDGER_DSN"):
            env.pop(key, None)
        stem = self.workdir / worker.name
        with open(f"{stem}.stderr", "ab") as stderr:
            worker.process = subprocess.Popen(
                [sys.executable, WORKER, worker.kind, "--dsn", self.dsn, "--log", f"{stem}.log",
                 "--name", worker.name, "--seed", str(self.rng.randrange(2**31)), "--stop", str(self.stop_file),
                 "--pace", str(self.config.pace), *(["--pool"] if worker.index % 4 == 2 else [])],
                env=env, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, start_new_session=True)
        self.events["incarnations"] += 1

    def later(self, delay: float, what: str, action: Callable[[], None]) -> None:
        heapq.heappush(self.pending, (time.monotonic() + delay, next(self._seq), what, action))

    def check_workers(self) -> None:
        """A worker that exits without being killed is a finding (its stderr says why); it is restarted."""
        if self.stop_file.exists():
            return
        for worker in self.workers:
            if worker.process is not None and not worker.alive and worker.process.returncode != -signal.SIGKILL:
                tail = (self.workdir / f"{worker.name}.stderr").read_text(errors="replace")[-1500:]
                self.violations.append(f"worker {worker.name} exited by itself with {worker.process.returncode}: {tail}")
                self.spawn(worker)

    # -- events -----------------------------------------------------------------------------

    def _candidates(self, kind: str | None = None) -> list[Worker]:
        return [w for w in self.workers if w.alive and not w.frozen and kind in (None, w.kind)]

    def kill_host(self, kind: str) -> bool:
        """SIGKILL a worker and everything it started (a host dies); a new incarnation follows."""
        candidates = self._candidates(kind)
        if not candidates:
            return False
        worker = self.rng.choice(candidates)
        assert worker.process is not None
        at = utc(time.time())
        worker.process.kill()  # the worker loop first: it can start nothing more
        signal_all(worker.mark, signal.SIGKILL, until=lambda pid: False)
        worker.process.wait()
        if worker.kind == "client":
            self.kills.append(Kill(at, [worker.name], None, worker.name))
        else:
            self.kills.append(Kill(at, [], f"{worker.name}-x", worker.name))
        self.events[f"kills_{worker.kind}"] += 1
        self.later(self.rng.uniform(0.2, 1.5), f"respawn {worker.index}", lambda: self.spawn(worker))
        return True

    def kill_wrapper_only(self) -> bool:
        """SIGKILL only a `jobledger run` process (the OOM killer, say): its CMD is orphaned and writes on."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for worker in self._candidates("wrapper"):
                for pid in marked(worker.mark):
                    argv = cmdline(pid)
                    if argv[1:4] == ["-m", "ledger", "run"] and "--owner" in argv:
                        at = utc(time.time())
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            continue
                        owner = argv[argv.index("--owner") + 1]
                        self.kills.append(Kill(at, [owner], None, f"jobledger run of {worker.name}"))
                        self.events["kills_wrapper_only"] += 1
                        return True
            self.tick(time.monotonic() + 0.05)
        return False

    def freeze(self, zombie: str | None) -> bool:
        """SIGSTOP a worker and all it started for longer than any ttl, then SIGCONT it.

        A zombie freeze (of a worker of kind `zombie`) first asks for a pause
        inside a run (the hold file) and stops the worker once the pause is
        announced, so the next thing it does on waking is a fenced write with
        the old token. Otherwise it stops wherever the worker is (in a start, an
        end, between runs).
        """
        if len(self._candidates()) <= 1:  # keep at least one worker running
            return False
        candidates = self._candidates(zombie)
        if not candidates:
            return False
        worker: Worker | None = None
        if zombie is not None:
            # Every candidate is asked; the first to announce its pause is frozen in it
            # (another that also took the request only pauses for nothing).
            holds = {w.index: Path(f"{self.workdir / w.name}.log.hold") for w in candidates}
            for hold in holds.values():
                hold.touch()
            deadline = time.monotonic() + 15
            while worker is None and time.monotonic() < deadline:
                self.tick(time.monotonic() + 0.02)
                paused = [w for w in candidates
                          if w.alive and last_event(self.workdir / f"{w.name}.log") == "pause"]
                worker = paused[0] if paused else None
            for hold in holds.values():
                hold.unlink(missing_ok=True)
            if worker is None:
                return False
        else:
            worker = self.rng.choice(candidates)
        assert worker.process is not None
        mid_run = zombie is not None
        os.kill(worker.process.pid, signal.SIGSTOP)
        signal_all(worker.mark, signal.SIGSTOP, until=lambda pid: _state(pid) == "T")
        worker.frozen = True
        self.events["freezes"] += 1
        self.events["freezes_mid_run"] += mid_run
        incarnation = worker.incarnation

        def thaw() -> None:
            if worker.incarnation == incarnation and worker.frozen:
                signal_all(worker.mark, signal.SIGCONT, until=lambda pid: _state(pid) != "T")
                worker.frozen = False

        # Past any ttl (the largest is MAX_TTL), and likely past a reaper call.
        self.later(MAX_TTL + self.rng.uniform(1.0, 3.0), f"thaw {worker.index}", thaw)
        return True

    def restart(self) -> bool:
        self.cluster.stop("immediate")  # pg_ctl -m immediate stop: a crash, no shutdown checkpoint
        time.sleep(self.rng.uniform(0.0, 0.5))
        self.cluster.start()
        self.events["restarts"] += 1
        return True

    def reap(self) -> None:
        try:
            self.query("SELECT ledger.reap_expired()", retry=0)
        except psycopg.Error:
            pass  # the server is down; next time

    # -- the run ------------------------------------------------------------------------------

    def tick(self, until: float) -> None:
        """Run the pending actions (thaws, respawns) and the reaper until `until` (monotonic)."""
        next_reap = time.monotonic()
        while True:
            now = time.monotonic()
            while self.pending and self.pending[0][0] <= now:
                heapq.heappop(self.pending)[3]()
            self.check_workers()
            if now >= next_reap:
                self.reap()
                next_reap = now + 2.0
            if now >= until:
                return
            time.sleep(min(0.05, max(0.0, until - now)))

    def wait_for(self, what: str, condition: Callable[[], bool], timeout: float) -> None:
        """waiting.wait_for with the chaos going on between two polls (0.2 s of tick)."""
        wait_for(condition, timeout, f"chaos: {what}", pause=lambda: self.tick(time.monotonic() + 0.2))

    def plan(self) -> list[str]:
        """Short mode: each kind of event once, a second zombie of the client, then random ones, shuffled."""
        kinds = list(self.config.weights)
        weights = [self.config.weights[k] for k in kinds]
        base = kinds + ["freeze_zombie_client"]
        assert self.config.events is not None and self.config.events >= len(base)
        events = base + self.rng.choices(kinds, weights, k=self.config.events - len(base))
        self.rng.shuffle(events)
        return events

    def run(self) -> dict[str, Any]:
        self.query(SETUP)
        self.started = time.monotonic()
        for worker in self.workers:
            self.spawn(worker)
        self.wait_for("five runs to start", lambda: self.runs() >= 5, timeout=180)
        self.figures["warmup_s"] = round(time.monotonic() - self.started, 1)
        actions: dict[str, Callable[[], bool]] = {
            "kill_client": lambda: self.kill_host("client"),
            "kill_wrapper": lambda: self.kill_host("wrapper"),
            "kill_wrapper_only": self.kill_wrapper_only,
            "freeze_zombie_client": lambda: self.freeze("client"),
            "freeze_zombie_wrapper": lambda: self.freeze("wrapper"),
            "freeze": lambda: self.freeze(None),
            "restart": self.restart,
        }
        kinds = list(self.config.weights)
        weights = [self.config.weights[k] for k in kinds]
        planned = self.plan() if self.config.events is not None else None
        done = 0
        next_progress = time.monotonic() + 60
        while True:
            if planned is not None:
                if not planned:
                    break
                kind = planned[0]
            else:
                assert self.config.target_runs is not None
                if self.runs() >= self.config.target_runs:
                    break
                if done >= self.config.max_events or time.monotonic() - self.started > self.config.max_seconds:
                    self.violations.append(f"long mode gave up after {done} events: {self.runs()} runs")
                    break
                kind = self.rng.choices(kinds, weights)[0]
                if time.monotonic() >= next_progress:  # long mode: a line a minute (with -s)
                    next_progress = time.monotonic() + 60
                    print(f"chaos long: {time.monotonic() - self.started:.0f}s, {self.runs()} runs, "
                          f"{done} events, {len(self.violations)} violations so far", flush=True)
            self.tick(time.monotonic() + self.rng.uniform(*self.config.gap))
            began = time.monotonic()
            succeeded = actions[kind]()
            self.event_seconds[kind] += time.monotonic() - began
            if succeeded:
                done += 1
                self.done_by_kind[kind] += 1
                if planned is not None:
                    planned.pop(0)
        self.figures["events"] = done
        self.tick(time.monotonic())
        while self.pending:  # the last thaws and respawns
            self.tick(self.pending[0][0])
        self.figures["chaos_s"] = round(time.monotonic() - self.started, 1)
        self.drain()
        return self.audit()

    def drain(self) -> None:
        """Stop the workers (they finish their run), wait for every lease to expire, reap."""
        self.stop_file.touch()
        for hold in self.workdir.glob("*.hold"):
            hold.unlink(missing_ok=True)
        # A wrapper on the 1-second schedule whose runs take longer than a second (a
        # loaded machine) never runs out of due slots: after a while it is told to stop
        # the way a service manager would, SIGTERM (forwarded to CMD, run cancelled).
        deadline = time.monotonic() + 8
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            self.tick(time.monotonic() + 0.2)
        for worker in self.workers:
            if worker.alive:
                for pid in marked(worker.mark):
                    if cmdline(pid)[1:4] == ["-m", "ledger", "run"]:
                        try:
                            os.kill(pid, signal.SIGTERM)
                        except ProcessLookupError:
                            pass
                        self.events["wrappers_stopped_with_sigterm"] += 1
        deadline = time.monotonic() + 60
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            self.tick(time.monotonic() + 0.2)
        for worker in self.workers:
            if worker.alive:
                self.violations.append(f"worker {worker.name} did not stop within 68 s of being asked "
                                       f"(processes {[cmdline(pid)[:6] for pid in marked(worker.mark)]})")
                signal_all(worker.mark, signal.SIGKILL, until=lambda pid: False)
                assert worker.process is not None
                worker.process.kill()
                worker.process.wait()
        # Orphaned CMDs (their wrapper was killed) end by themselves within seconds.
        marks = {f"{self.run_mark}:chaos-w{w.index}-i{i}" for w in self.workers for i in range(1, w.incarnation + 1)}
        deadline = time.monotonic() + 60
        while any(marked(m) for m in marks) and time.monotonic() < deadline:
            time.sleep(0.2)
        for mark in marks:
            signal_all(mark, signal.SIGKILL, until=lambda pid: False)
        # A killed client's last statement may still be running in its backend (a start
        # that commits after the kill): wait until no other client is connected, so the
        # final reap cannot race with such a start.
        self.wait_for("every backend of a stopped worker to end", lambda: not self.query(
            "SELECT FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND backend_type = 'client backend'"), timeout=60)
        self.wait_for("every lease to end", lambda: not self.query(
            "SELECT FROM ledger.leases WHERE released_at IS NULL AND expires_at > clock_timestamp()"), timeout=60)
        self.query("SELECT ledger.reap_expired()")
        self.figures["duration_s"] = round(time.monotonic() - self.started, 1)

    # -- the audit ---------------------------------------------------------------------------------

    def audit(self) -> dict[str, Any]:
        """Every invariant, from the database and the workers' logs; each breach is a violation.

        Commit order of the writes: ``writes.id`` is a bigserial filled by the
        INSERT, and every worker calls ``ledger.fence(job, resource, token)``
        BEFORE that INSERT in the same transaction. The fence locks the
        resource's row of ``ledger.fences`` (SELECT ... FOR UPDATE, or the
        INSERT of a new row, on which a concurrent first writer waits) until
        the transaction ends. So two committed writes of one resource are
        serialized by that lock: the later one took its id only after the
        earlier one committed, and a sequence never goes back (also not after
        a crash: a committed nextval is in the WAL before the commit). Hence,
        per resource, id order IS commit order (across resources it is only
        approximate, and is not used), and "accepted tokens strictly increase
        in commit order" becomes: a resource's token never goes down in id
        order (the lenient fence lets one token write several times, so equal
        neighbours are that token's own writes; a token never comes back
        once a higher one wrote, which is the strict increase of the accepted
        tokens). ``ledger.fences`` keeps no history, so its final token is
        checked against the highest written instead.
        """
        v = self.violations

        def each(sql: str, what: str, params: Any = None) -> None:
            for row in self.query(sql, params):
                v.append(f"{what}: {row}")

        # Fences: token order per resource, the final fence, the job.
        each("""SELECT resource, id, token, prev_id, prev FROM (
                    SELECT resource, id, token, lag(id) OVER w AS prev_id, lag(token) OVER w AS prev
                      FROM public.writes WINDOW w AS (PARTITION BY resource ORDER BY id)) s
                 WHERE token < prev""", "a resource's token went down in commit order")
        each("""SELECT coalesce(f.resource, w.resource), f.job, f.token, w.job, w.top
                  FROM ledger.fences f
                  FULL JOIN (SELECT resource, min(job) AS job, max(job) AS job2, max(token) AS top
                               FROM public.writes GROUP BY resource) w ON w.resource = f.resource
                 WHERE f.token IS DISTINCT FROM w.top OR f.job IS DISTINCT FROM w.job OR w.job <> w.job2""",
             "fence and writes disagree")
        # Tokens: one run per token, in the log and in the writes; the lease's high-water mark.
        each("""SELECT job, token, count(*) FROM ledger.job_execution_log
                 GROUP BY job, token HAVING count(*) > 1""", "a token issued twice (log)")
        each("""SELECT job, token, array_agg(DISTINCT run_id) FROM public.writes
                 GROUP BY job, token HAVING count(DISTINCT run_id) > 1""", "two runs wrote with one token")
        each("""SELECT w.id, w.job, w.token, w.run_id, w.slot, r.job, r.token, r.slot
                  FROM public.writes w LEFT JOIN ledger.job_execution_log r ON r.run_id = w.run_id
                 WHERE r.run_id IS NULL OR r.job <> w.job OR r.token <> w.token
                    OR r.slot IS DISTINCT FROM w.slot""", "a write does not match its run")
        each("""SELECT l.job, l.token, r.top FROM ledger.leases l
                  JOIN (SELECT job, max(token) AS top FROM ledger.job_execution_log GROUP BY job) r USING (job)
                 WHERE l.token < r.top""", "a lease's token is below a run's")
        # Slots and keys: none succeeded twice, none is running and done.
        each("""SELECT job, slot, count(*) FROM ledger.job_execution_log
                 WHERE slot IS NOT NULL AND status IN ('running', 'success')
                 GROUP BY job, slot HAVING count(*) > 1""", "a slot succeeded twice")
        each("""SELECT job, idempotency_key, count(*) FROM ledger.job_execution_log
                 WHERE idempotency_key IS NOT NULL AND status IN ('running', 'success')
                 GROUP BY job, idempotency_key HAVING count(*) > 1""", "a key succeeded twice")
        each("SELECT job, run_id, other_run_id FROM ledger.overlaps", "ledger.overlaps")
        each("""SELECT r.run_id, r.job, r.owner, r.token, r.started_at, r.heartbeat_at, l.token, l.owner,
                       l.expires_at, l.released_at, clock_timestamp(),
                       (SELECT array_agg(a.pid || ' ' || a.state || ' ' || left(a.query, 80))
                          FROM pg_stat_activity a WHERE a.datname = current_database() AND a.pid <> pg_backend_pid())
                  FROM ledger.job_execution_log r JOIN ledger.leases l USING (job)
                 WHERE r.status = 'running'""",
             "a run still running after the final reap")
        # Killed runs: ended by a takeover or the reaper, unless they had ended before the kill
        # (or just after it: an end already on the wire). A start that the killed client's
        # backend committed after the kill cannot have been ended by anyone else.
        for kill in self.kills:
            each("""SELECT run_id, owner, status, failure_reason, completed_at FROM ledger.job_execution_log
                     WHERE (owner = ANY(%(owners)s::text[]) OR starts_with(owner, %(prefix)s::text))
                       AND NOT (status = 'failure' AND failure_reason IN ('lease_expired', 'superseded'))
                       AND NOT coalesce(started_at < %(at)s AND completed_at <= %(until)s, false)""",
                 f"a run killed at {kill.at.isoformat()} ({kill.what}) did not end lease_expired/superseded",
                 {"owners": kill.owners, "prefix": kill.prefix, "at": kill.at,
                  "until": kill.at + KILL_SLACK})

        # What the workers were acknowledged.
        records = [r for path in sorted(self.workdir.glob("*.log")) for r in read_log(path)]
        runs = {row[0]: row[1:] for row in self.query(
            "SELECT run_id, job, token, status, failure_reason FROM ledger.job_execution_log")}
        tags = {row[0]: row[1:] for row in self.query("SELECT tag, job, resource, token FROM public.writes")}
        seen_tokens: dict[tuple[str, int], set[int]] = defaultdict(set)
        by_event: Counter[str] = Counter()
        rejected: Counter[str] = Counter()
        for r in records:
            by_event[r["e"]] += 1
            if r["e"] == "start":
                seen_tokens[(r["job"], r["token"])].add(r["run"])
                got = runs.get(r["run"])
                if got is None or got[:2] != (r["job"], r["token"]):
                    v.append(f"a committed start was lost: worker saw {r}, the log has {got}")
            elif r["e"] == "write":
                got = tags.get(r["tag"])
                if got != (r["job"], r["resource"], r["token"]):
                    v.append(f"a committed write was lost: worker saw {r}, writes has {got}")
            elif r["e"] == "rejected":
                rejected[r["code"]] += 1
                if r["tag"] in tags:
                    v.append(f"a write the fence rejected was committed: {r}")
            elif r["e"] == "end":
                got = runs.get(r["run"])
                if got is None or got[2:] != (r["status"], r["reason"]):
                    v.append(f"a committed end was lost: worker saw {r}, the log has {got}")
        for (job, token), run_ids in seen_tokens.items():
            if len(run_ids) > 1:
                v.append(f"token {token} of {job} acknowledged to runs {sorted(run_ids)}")

        counters = {row[0]: row[1:] for row in self.query(
            "SELECT job, runs_started, successes, failures, skipped_overlap, skipped_backfill, leases_lost "
            "FROM ledger.job_counters")}
        outcomes = Counter({f"{status}/{reason}" if reason else status: n for status, reason, n in self.query(
            "SELECT status, failure_reason, count(*) FROM ledger.job_execution_log GROUP BY 1, 2")})
        self.figures.update({
            "mode": self.config.mode,
            "seed": self.config.seed,
            "workers": "+".join(self.config.kinds),
            "runs": sum(outcomes.values()),
            "runs_by_job": {job: c[0] for job, c in counters.items()},
            "outcomes": dict(sorted(outcomes.items())),
            "skipped_overlap": sum(c[3] for c in counters.values()),
            "skipped_backfill": sum(c[4] for c in counters.values()),
            "writes": int(self.query("SELECT count(*) FROM public.writes")[0][0]),
            "kills": self.events["kills_client"] + self.events["kills_wrapper"] + self.events["kills_wrapper_only"],
            "kills_client": self.events["kills_client"],
            "kills_wrapper": self.events["kills_wrapper"],
            "kills_wrapper_only": self.events["kills_wrapper_only"],
            "freezes": self.events["freezes"],
            "freezes_mid_run": self.events["freezes_mid_run"],
            "restarts": self.events["restarts"],
            "incarnations": self.events["incarnations"],
            "acknowledged": {k: by_event[k] for k in ("start", "write", "end")},
            "zombie_writes_rejected": dict(rejected),
            "connection_errors_seen_by_workers": by_event["dberror"],
            "wrappers_stopped_with_sigterm": self.events["wrappers_stopped_with_sigterm"],
            "events_by_kind": dict(sorted(self.done_by_kind.items())),
            "seconds_in_events": {k: round(t, 1) for k, t in self.event_seconds.items()},
            "violations": len(v),
        })
        (self.workdir / "summary.json").write_text(json.dumps({**self.figures, "violation_list": v}, indent=2,
                                                              default=str))
        return self.figures

    def summary_line(self) -> str:
        f = self.figures
        rejected = sum(f["zombie_writes_rejected"].values())
        return (f"chaos {f['mode']}: seed={f['seed']} workers={f['workers']} events={f['events']} "
                f"duration={f['duration_s']}s (warm-up {f['warmup_s']}s, chaos {f['chaos_s']}s) "
                f"runs={f['runs']} {f['outcomes']} writes={f['writes']} "
                f"kills={f['kills']} (client={f['kills_client']} wrapper={f['kills_wrapper']} "
                f"wrapper-only={f['kills_wrapper_only']}) freezes={f['freezes']} "
                f"(mid-run={f['freezes_mid_run']}) zombie-writes-rejected={rejected} "
                f"{f['zombie_writes_rejected']} restarts={f['restarts']} "
                f"skipped_overlap={f['skipped_overlap']} skipped_backfill={f['skipped_backfill']} "
                f"violations={f['violations']}")

    def close(self) -> None:
        """Nothing of ours may outlive the test: every marked process, by pid."""
        self.stop_file.touch()
        for worker in self.workers:
            for i in range(1, worker.incarnation + 1):
                signal_all(f"{self.run_mark}:chaos-w{worker.index}-i{i}", signal.SIGKILL, until=lambda pid: False)
            if worker.process is not None and worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()
        if self._conn is not None:
            self._conn.close()
