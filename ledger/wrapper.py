"""``jobledger run JOB -- CMD ...``: a shell command as a run of the ledger.

What ``flock -n`` does on one host, across hosts and with a log: the wrapper
starts a run (``start_run``; for a job with a schedule it loops on
``start_due_run``, one run per due slot), runs CMD with the run's facts in its
environment, keeps the lease alive meanwhile (the client's heartbeat, every
ttl/3), and ends the run with CMD's verdict.

- CMD's environment: ``LEDGER_JOB``, ``LEDGER_RUN_ID``, ``LEDGER_FENCING_TOKEN``,
  ``LEDGER_SLOT``, ``LEDGER_OWNER`` and ``LEDGER_DSN``: what the job-aware
  fence needs, ``ledger.fence(job => <LEDGER_JOB>, resource => '...', token =>
  <LEDGER_FENCING_TOKEN>)`` in the transaction of each write. With
  ``--pgoptions`` also ``PGOPTIONS`` (:func:`carried_options`): CMD's psql
  sessions carry ``ledger.job`` and ``ledger.token``, which is what a table
  that ``ledger.protect`` guards asks of a write.

- CMD runs in its own process group, so a signal reaches the whole tree it
  starts (a shell script and its children), and a terminal's Ctrl-C reaches
  it once, through the wrapper.
- The wrapper killed (SIGKILL, the OOM killer, a crash): CMD's group dies
  with it (SIGTERM, SIGKILL after the grace), from a reaper of the group's
  own, :class:`Reaper`. Only what left the group (``setsid``, a daemon) stays.
- Lease lost (the heartbeat found the job taken over, or the run closed), or
  its local deadline passed (no heartbeat renewed it in time, even one stuck
  in a call of a silent partition; see ``ledger.heartbeat``): SIGTERM to
  CMD's group, SIGKILL after the grace, exit 124. Its late writes are the
  fence's business; stopping it early is ours.
- SIGTERM/SIGINT/SIGHUP to the wrapper: forwarded to CMD (SIGKILL after the
  grace), the run is recorded ``cancelled``, the wrapper exits with CMD's code.
- ``--timeout``: CMD running longer gets SIGTERM, SIGKILL after the grace; the
  run fails with ``timeout: ran longer than ...``, exit 123. The job's
  registered ``max_runtime`` does the same; the smaller of the two wins.
- ``--retries N --backoff B``: a failed attempt (CMD's own non-zero exit or a
  timeout; not a lost lease, a cancellation or a CMD that could not start) is
  tried again, up to N more times, each attempt a run of its own (a new
  ``start_run`` for the same slot, under the same lease rules: another owner
  holding the job, or the slot done meanwhile, ends the retries). Between
  attempts the wrapper waits B, doubled after each attempt, at most
  :data:`ledger._backoff.BACKOFF_CAP` (or B when longer); a signal then ends the retries.
- CMD's stderr passes through; its tail (bounded) goes into the run's error.
- The safety net for a write that did not commit (docs/contract.md): the
  completion names the resources CMD fenced, those of ``--fenced`` and those
  CMD wrote into the file ``LEDGER_FENCED_FILE`` names (one per line; the
  wrapper removes the file after the run), and the ledger records success only
  when each fence holds the run's token. When one does not, the run is
  recorded as failure and the wrapper exits 122. The wrapper fences nothing
  itself and cannot see CMD's writes: a resource named in neither place is
  not checked.

Exit codes are in :data:`EXIT_CODES` (and the README).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import FrameType, TracebackType
from typing import IO, Any

import psycopg

from ledger import queries
from ledger._backoff import BACKOFF_CAP, backoff_delay  # noqa: F401 - BACKOFF_CAP: kept importable here
from ledger.client import Ledger, RunContext
from ledger.durations import format_duration
from ledger.errors import FenceNotCommitted, InvalidArgument, LeaseLost, LedgerError, missing_ledger
from ledger.heartbeat import LOST_REASONS
from ledger.scheduler.jobsfile import JobDefinition
from ledger.text import first_line

EXIT_FENCE_NOT_COMMITTED = 122
EXIT_TIMEOUT = 123
EXIT_LEASE_LOST = 124
EXIT_LEDGER_ERROR = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

EXIT_CODES: dict[str, str] = {
    "0": "CMD succeeded (every due slot, for a scheduled job); or nothing ran: nothing due, job paused, "
         "held by another owner (`skipped: held by ...`) or its pool full (`skipped: pool P of job J is "
         "full ...`), see --skip-exit-code",
    "1-121": "CMD's own exit code: it failed, the run is recorded as failure with its stderr tail",
    "122": "CMD exited 0, but a fence it named (--fenced, LEDGER_FENCED_FILE) does not hold the run's token: "
           "its fenced write did not commit, and the run is recorded as failure (`fence not committed: ...`); "
           "or LEDGER_FENCED_FILE named no valid resource",
    "123": "--timeout: CMD ran longer and was stopped (SIGTERM, SIGKILL after --grace); "
           "the run is recorded as failure, `timeout: ran longer than ...`",
    "124": "the lease was lost while CMD ran, or an operator cancelled the run (jobledger cancel): CMD was "
           "stopped (SIGTERM, SIGKILL after --grace), the run is not a success",
    "125": "the wrapper could not start or end the run (database unreachable, ledger error): "
           "CMD did not run, or its end is not recorded",
    "126": "CMD is not executable (the run is recorded as failure)",
    "127": "CMD was not found (the run is recorded as failure)",
    "128+N": "CMD was killed by signal N (e.g. 143 after SIGTERM, also when the wrapper forwarded it: "
             "the run is then recorded as cancelled)",
}

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
TAIL_BYTES = 64 * 1024  # kept from CMD's stderr
ERROR_CHARS = 2000  # of which the run's error keeps this many
_POLL = 0.05


@dataclass(frozen=True)
class Options:
    job: str
    argv: Sequence[str]
    ttl: timedelta | None = None
    grace: timedelta = timedelta(seconds=10)
    skip_exit_code: int = 0
    verbose: bool = False
    dsn: str = ""  # handed to CMD as LEDGER_DSN (when not empty), so it can fence its writes
    timeout: timedelta | None = None  # CMD is stopped after running this long
    retries: int = 0  # a failed attempt is tried again up to this many times
    backoff: timedelta = timedelta(seconds=30)  # the wait before the first retry, doubled each time
    backfill: tuple[datetime, datetime] | None = None  # `jobledger backfill`: the slots of this range
    pgoptions: bool = False  # CMD's libpq sessions carry the token too (PGOPTIONS): protected tables accept them
    fenced: tuple[str, ...] = ()  # resources CMD fences: complete_run records success only when each holds the token
    env: Mapping[str, str] = field(default_factory=dict)  # added to CMD's environment (a jobs file's env)
    cwd: str | None = None  # CMD's working directory (a jobs file's cwd)


def carried_options(pgoptions: str, job: str, token: int | None) -> str:
    """``pgoptions`` (the caller's PGOPTIONS) plus ``-c ledger.job=JOB -c ledger.token=N``.

    Session settings of every libpq connection CMD opens without an ``options``
    of its own (psql, pg_dump, ...), so a table that ``ledger.protect`` guards
    accepts its writes while the token is live. Whitespace and backslashes in
    the job's name are escaped as libpq's options want.
    """
    escaped = re.sub(r"([\\\s])", r"\\\1", job)
    carried = f"-c ledger.job={escaped} -c ledger.token={token}"
    return f"{pgoptions} {carried}" if pgoptions.strip() else carried


class CommandFailed(Exception):
    """CMD ended without success (its exit code, a lost lease, or it could not start)."""


class Cancelled(BaseException):
    """The wrapper was told to stop (a signal): the run is recorded ``cancelled``."""


@dataclass
class _Ending:
    """How CMD ended, and what the run's log row should say about it."""

    code: int
    error: str = ""
    lost: bool = False
    cancelled_by: int | None = None
    timed_out: bool = False
    unstartable: bool = False  # CMD could not be started (not found, not executable)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.lost or self.cancelled_by is not None or self.code != 0

    @property
    def retryable(self) -> bool:
        """CMD's own failure or a timeout: another attempt may succeed (a lost lease, a cancellation or a
        CMD that could not start is not tried again)."""
        return self.failed and not self.lost and self.cancelled_by is None and not self.unstartable


def exit_code(returncode: int) -> int:
    """A shell's view of a child's status: 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def clean_text(text: str) -> str:
    """Text a PostgreSQL text column accepts (no NUL)."""
    return text.replace("\x00", "\\0")


class Signals:
    """Records SIGTERM/SIGINT/SIGHUP for the supervisor instead of dying of them.

    Signals the wrapper was started with ignored (``nohup``, a background job)
    stay ignored, so that CMD inherits them ignored too.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Signals:
        if threading.current_thread() is threading.main_thread():
            for number in FORWARDED_SIGNALS:
                if signal.getsignal(number) != signal.SIG_IGN:
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        self.received.append(number)


class StderrTail:
    """Copies CMD's stderr to ours as it comes, keeping the last TAIL_BYTES."""

    def __init__(self, stream: IO[bytes], sink: IO[bytes] | None) -> None:
        self._stream = stream
        self._sink = sink
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._thread = threading.Thread(target=self._pump, name="jobledger-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        read = getattr(self._stream, "read1", self._stream.read)
        while True:
            try:
                chunk = read(65536)
            except (OSError, ValueError):
                return
            if not chunk:
                return
            if self._sink is not None:
                try:
                    self._sink.write(chunk)
                    self._sink.flush()
                except (OSError, ValueError):
                    self._sink = None  # our stderr is gone; keep the tail anyway
            self._chunks.append(chunk)
            self._size += len(chunk)
            while self._size - len(self._chunks[0]) >= TAIL_BYTES:
                self._size -= len(self._chunks.popleft())

    def text(self, wait: float = 2.0) -> str:
        """The tail, cut to ERROR_CHARS at a line start; waits a little for the pipe to close
        (a grandchild that keeps it open does not hold the wrapper up)."""
        self._thread.join(wait)
        raw = b"".join(list(self._chunks))[-TAIL_BYTES:]
        text = raw.decode("utf-8", errors="replace").rstrip()
        if len(text) > ERROR_CHARS:
            text = text[-ERROR_CHARS:]
            newline = text.find("\n")
            if 0 <= newline < ERROR_CHARS // 2:
                text = text[newline + 1:]
            text = "…" + text
        return clean_text(text)


class Reaper:
    """The leader of CMD's process group, there to kill the group when the wrapper dies unannounced.

    A ``/bin/sh`` started before CMD, in a process group of its own that CMD then joins: its stdin is a
    pipe whose only writer is the wrapper (close-on-exec, so CMD does not hold it). The kernel closes
    it however the wrapper dies, SIGKILL included; the reaper then reads end-of-file and sends the
    group SIGTERM, and SIGKILL ``grace`` later, the way the wrapper stops CMD itself. An end the
    wrapper saw writes ``done`` first: the reaper exits, and what CMD left running is left alone.

    It ignores the signals the wrapper forwards to the group, and lives in CMD's group, not the
    wrapper's: a supervisor that kills the wrapper's group kills the wrapper only. What no POSIX
    means covers: a process that left the group (``setsid``, a daemon), and the reaper itself killed
    together with the wrapper (by pid): then the fence is what stops CMD's writes.
    """

    SCRIPT = ('trap "" HUP INT QUIT TERM; read -r word; [ "$word" = done ] && exit 0; '
              'kill -s TERM 0; [ "$1" = 0 ] || sleep "$1"; kill -s KILL 0')

    def __init__(self, process: subprocess.Popen[bytes], writer: int) -> None:
        self.process = process
        self._writer: int | None = writer

    @classmethod
    def start(cls, grace: timedelta) -> Reaper | None:
        """The reaper, running; None where it cannot start (no ``/bin/sh``): CMD then runs without."""
        seconds = f"{max(grace.total_seconds(), 0):.3f}".rstrip("0").rstrip(".")
        reader, writer = os.pipe()  # neither inheritable: the reaper gets the reader as its stdin only
        group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                                 else {"preexec_fn": os.setpgrp})
        try:
            process = subprocess.Popen(["/bin/sh", "-c", cls.SCRIPT, "jobledger-reaper", seconds or "0"],
                                       stdin=reader, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       cwd="/", env={"PATH": os.environ.get("PATH") or os.defpath}, **group)
        except OSError:
            os.close(writer)
            return None
        finally:
            os.close(reader)
        return cls(process, writer)

    @property
    def group(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, *, done: bool) -> None:
        """``done``: the wrapper saw CMD end, the reaper exits; else it stops the group now."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        try:
            if done:
                os.write(writer, b"done\n")
        except OSError:
            pass  # killed with the group already (the SIGKILL after the grace)
        finally:
            os.close(writer)
        if done:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


class Wrapper:
    """Runs ``options.argv`` as runs of ``options.job``; :meth:`run` returns the exit code.

    ``conn`` (autocommit) answers whether the job has a schedule; each run
    opens its own connection for its start, heartbeats and end (the client's
    run context) from ``options.dsn``, the conninfo ``conn`` was made from:
    all of it, so that with a multi-host DSN a run follows a failover (the
    connection itself only knows the host it reached).
    """

    def __init__(self, conn: psycopg.Connection[Any] | None, options: Options, *, owner: str | None = None,
                 say: Callable[[str], None], stderr: IO[bytes] | None = None, ledger: Ledger | None = None,
                 max_runtime: timedelta | None = None) -> None:
        self._conn = conn
        if ledger is None:
            assert conn is not None
            ledger = Ledger(conn, owner=owner, heartbeat_conninfo=options.dsn)
        self._ledger = ledger
        self._options = options
        self._say = say
        self._stderr = stderr if stderr is not None else getattr(sys.stderr, "buffer", None)
        self._signals = Signals()
        self._max_runtime: timedelta | None = max_runtime  # the job's registered max_runtime, read by _loop
        self._group: int | None = None  # CMD's process group while it runs (the reaper's pid, or CMD's)
        self._fenced_file: str | None = None  # LEDGER_FENCED_FILE of the attempt that runs

    def run(self) -> int:
        with self._signals:
            try:
                return self._loop()
            except LeaseLost as error:
                self._say(str(error))
                return EXIT_LEASE_LOST
            except (psycopg.Error, LedgerError) as error:
                message = first_line(error)
                hint = ""
                if isinstance(error, InvalidArgument) and "ttl is required" in message:
                    hint = f" (pass --ttl, or register it: jobledger register {self._options.job} --ttl ...)"
                elif missing_ledger(error):
                    hint = " (this database has no ledger, or an older one: run `jobledger install`)"
                self._say(f"error: {message}{hint}")
                return EXIT_LEDGER_ERROR

    def run_adopted(self, run: RunContext) -> int:
        """CMD under ``run``, a run started already (the scheduler's ``start_due_runs``), with the retries;
        the exit code as :meth:`run` gives it. Called from a scheduler's worker thread: no signal handlers,
        :meth:`cancel` stops it."""
        try:
            ending = self._attempt(run, 1)
            assert ending is not None
            code = self._retry(run, ending, 1)
            return 0 if code is None else code
        except LeaseLost as error:
            self._say(str(error))
            return EXIT_LEASE_LOST
        except (psycopg.Error, LedgerError) as error:
            self._say(f"error: {first_line(error)}")
            return EXIT_LEDGER_ERROR

    def cancel(self, number: int = signal.SIGTERM) -> None:
        """As if the wrapper received signal ``number``: forwarded to CMD, the run recorded cancelled."""
        self._signals.received.append(number)

    # -- the runs --------------------------------------------------------------

    def _loop(self) -> int:
        job = self._options.job
        scheduled, self._max_runtime = self._job_options(job)
        ran = 0
        while True:
            if self._signals.received:  # told to stop between two runs
                return 128 + self._signals.received[0]
            run = RunContext(self._ledger, job, ttl=self._options.ttl, due=scheduled,
                             backfill=self._options.backfill)
            ending = self._attempt(run, 1)
            if ending is None:
                return self._not_started(run, ran)
            ran += 1
            code = self._retry(run, ending, ran)
            if code is not None:
                return code
            if not scheduled and self._options.backfill is None:
                return 0

    def _retry(self, run: RunContext, ending: _Ending, ran: int) -> int | None:
        """The retries of a failed attempt; the exit code when the loop stops here, None when it goes on."""
        job = self._options.job
        attempt = 1
        while ending.retryable and attempt <= self._options.retries:
            wait = backoff_delay(self._options.backoff, attempt)
            self._say(f"attempt {attempt} of {self._options.retries + 1} failed: retrying in "
                      f"{format_duration(wait)}")
            if not self._sleep(wait):
                number = self._signals.received[0]
                self._say(f"{signal_name(number)} received: no more retries")
                return 128 + number
            attempt += 1
            # The same slot (None for a job without schedule): a run of its own, a new start_run.
            retry = RunContext(self._ledger, job, ttl=self._options.ttl, slot=run.slot)
            next_ending = self._attempt(retry, attempt)
            if next_ending is None:  # another owner holds the job, or the slot is done meanwhile
                self._not_started(retry, ran)
                return 0 if retry.outcome == "already_done" else self._failure_code(ending)
            run, ending = retry, next_ending
        if ending.failed:
            # The loop stops at a run that did not succeed: its slot is retried next time.
            return self._failure_code(ending)
        return None

    def _attempt(self, run: RunContext, attempt: int) -> _Ending | None:
        """One run: CMD under ``run``, ended the way CMD ended; None when the ledger did not start it."""
        ending: _Ending | None = None
        try:
            with run:
                if not run.started:
                    return None
                self._report_start(run)
                for resource in self._options.fenced:
                    run.add_fenced(resource)
                descriptor, self._fenced_file = tempfile.mkstemp(prefix="jobledger-fenced-")
                os.close(descriptor)
                try:
                    ending = self._execute(run)
                    if not ending.failed:
                        self._add_reported_fences(run, ending)
                finally:
                    os.unlink(self._fenced_file)
                    self._fenced_file = None
                run.detail.update(ending.detail)
                if self._options.retries:
                    run.detail["attempt"] = attempt
                # Leave the block the way CMD ended: the context records it.
                if ending.cancelled_by is not None:
                    raise Cancelled(ending.error)
                if ending.failed:
                    raise CommandFailed(ending.error)
        except (Cancelled, CommandFailed):
            assert ending is not None
        except FenceNotCommitted as error:  # CMD succeeded, its fenced write did not commit: the run failed
            assert ending is not None
            ending.code, ending.error = EXIT_FENCE_NOT_COMMITTED, str(error)
        assert ending is not None
        self._report_end(run, ending)
        return ending

    def _add_reported_fences(self, run: RunContext, ending: _Ending) -> None:
        """The resources CMD wrote into LEDGER_FENCED_FILE, named to the completion; a bad line fails the run."""
        assert self._fenced_file is not None
        with open(self._fenced_file, "rb") as file:
            text = file.read(FENCED_FILE_BYTES + 1)
        if len(text) > FENCED_FILE_BYTES:
            ending.code = EXIT_FENCE_NOT_COMMITTED
            ending.error = f"LEDGER_FENCED_FILE holds more than {FENCED_FILE_BYTES} bytes"
            return
        for number, line in enumerate(text.decode("utf-8", errors="replace").splitlines(), 1):
            resource = line.strip()
            if not resource:
                continue
            if len(resource) > 200 or not resource.isprintable():
                ending.code = EXIT_FENCE_NOT_COMMITTED
                ending.error = (f"LEDGER_FENCED_FILE line {number} names no valid resource "
                                f"(1 to 200 printable characters): {resource[:200]!r}")
                return
            run.add_fenced(resource)
        if len(run.fenced) > MAX_FENCED:
            ending.code = EXIT_FENCE_NOT_COMMITTED
            ending.error = f"{len(run.fenced)} fenced resources named, more than the {MAX_FENCED} complete_run takes"

    @staticmethod
    def _failure_code(ending: _Ending) -> int:
        return EXIT_LEASE_LOST if ending.lost else ending.code

    def _sleep(self, duration: timedelta) -> bool:
        """Waits ``duration``; False as soon as a signal came (the retries stop)."""
        deadline = time.monotonic() + duration.total_seconds()
        while not self._signals.received:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, _POLL))
        return False

    def _not_started(self, run: RunContext, ran: int) -> int:
        job, outcome = self._options.job, run.outcome
        if outcome == "skipped_overlap":
            until = _local(run.holder_expires_at)
            self._say(f"skipped: held by {run.holder} until {until}")
            return self._options.skip_exit_code if ran == 0 else 0
        if outcome == "skipped_pool_full":  # a skip as the one above, of the job's pool: no token was issued
            self._say(f"skipped: {self._full_pool()}")
            return self._options.skip_exit_code if ran == 0 else 0
        if outcome == "paused":
            self._say(f"paused: job {job} is paused (jobledger resume {job})")
        elif outcome == "already_done":
            self._say(f"already done: job {job}'s slot {_local(run.slot)} succeeded or is running")
        elif outcome == "nothing_due" and self._options.backfill is not None:
            first, last = self._options.backfill
            self._say(f"backfill of job {job}: {ran} slot{'' if ran == 1 else 's'} run; none left from "
                      f"{_local(first)} to {_local(last)} that has not succeeded")
        elif outcome == "nothing_due" and (racing := self._racing_holder(run)) is not None:
            # Another host runs the due slot right now: a skip, said as one.
            self._say(f"nothing due: {racing}")
            return self._options.skip_exit_code if ran == 0 else 0
        elif self._options.verbose:  # nothing_due: the normal quiet end of a catch-up
            self._say(f"{'caught up' if ran else 'nothing due'}: job {job}")
        return 0

    def _full_pool(self) -> str:
        """``pool P of job J is full (U of S live leases)``, as far as this wrapper can ask."""
        job = self._options.job
        row = None if self._conn is None else self._conn.execute(queries.JOB_POOL, {"job": job}).fetchone()
        if row is None:  # a scheduler's wrapper (no connection of its own), or the job left its pool since
            return f"the pool of job {job} is full"
        pool, size, used = row
        return f"pool {pool} of job {job} is full ({used} of {size} live leases)"

    def _racing_holder(self, run: RunContext) -> str | None:
        """When another owner's live run holds the job: ``slot ... of job J is being run by O (lease until
        ...)``, from the start row when it names the holder, else from the log."""
        job = self._options.job
        if run.holder is not None and run.holder != run.owner:
            slot, holder, until = run.slot, run.holder, run.holder_expires_at
        elif self._conn is None:  # a scheduler's wrapper: no connection of its own to ask
            return None
        else:
            row = self._conn.execute(queries.RUNNING_HOLDER, {"job": job}).fetchone()
            if row is None or row[2] == run.owner:
                return None
            _, slot, holder, until = row
        what = f"slot {_local(slot)} of job {job}" if slot is not None else f"job {job}"
        return f"{what} is being run by {holder} (lease until {_local(until)})"

    # -- the command -------------------------------------------------------------

    def _environment(self, run: RunContext) -> dict[str, str]:
        """Ours, plus the run's facts: LEDGER_JOB and LEDGER_FENCING_TOKEN are the fence's arguments."""
        env = dict(os.environ)
        env.update(self._options.env)
        env.update({
            "LEDGER_JOB": run.job,
            "LEDGER_RUN_ID": str(run.run_id),
            "LEDGER_FENCING_TOKEN": str(run.token),
            "LEDGER_SLOT": "" if run.slot is None else run.slot.astimezone(timezone.utc).isoformat(),
            "LEDGER_OWNER": run.owner,
        })
        if self._options.dsn:
            env["LEDGER_DSN"] = self._options.dsn
        if self._options.pgoptions:
            env["PGOPTIONS"] = carried_options(env.get("PGOPTIONS", ""), run.job, run.token)
        if self._fenced_file is not None:
            env["LEDGER_FENCED_FILE"] = self._fenced_file
        return env

    def _execute(self, run: RunContext) -> _Ending:
        argv = list(self._options.argv)
        detail: dict[str, Any] = {"command": [arg[:200] for arg in argv[:20]]}
        if self._signals.received:  # the signal came while the run was starting
            number = self._signals.received[0]
            return _Ending(128 + number, f"{signal_name(number)} received before the command started",
                           cancelled_by=number, detail=detail)
        reaper = Reaper.start(self._options.grace)
        done = False
        try:
            started = time.monotonic()
            try:
                process = self._popen(argv, run, reaper)
            except FileNotFoundError as error:
                done = True
                return _Ending(EXIT_NOT_FOUND, f"command not found: {argv[0]} ({error.strerror})",
                               unstartable=True, detail=detail)
            except PermissionError as error:
                done = True
                return _Ending(EXIT_NOT_EXECUTABLE, f"command not executable: {argv[0]} ({error.strerror})",
                               unstartable=True, detail=detail)
            assert process.stderr is not None
            tail = StderrTail(process.stderr, self._stderr)
            ending = self._supervise(process, run, started)
            done = True  # CMD ended under our eyes: what it left running is left alone, as without a reaper
        finally:
            self._group = None
            if reaper is not None:
                reaper.close(done=done)  # not done (an error of ours): the reaper stops CMD's group
        ending.detail = {**detail, "exit_code": ending.code, "seconds": round(time.monotonic() - started, 3),
                         **ending.detail}
        stderr_tail = tail.text()
        if ending.lost or ending.cancelled_by is not None or ending.code != 0:
            ending.error += f"\n--- stderr (tail) ---\n{stderr_tail}" if stderr_tail else ""
        return ending

    def _popen(self, argv: list[str], run: RunContext, reaper: Reaper | None) -> subprocess.Popen[bytes]:
        """CMD started in the reaper's process group (in a group of its own without a reaper)."""
        env = self._environment(run)
        for target in ((reaper.group, 0) if reaper is not None else (0,)):
            group: dict[str, Any] = ({"process_group": target} if sys.version_info >= (3, 11)
                                     else {"preexec_fn": (lambda pgid=target: os.setpgid(0, pgid))})
            try:
                process = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, cwd=self._options.cwd, **group)
            except PermissionError:
                if target == 0 or (reaper is not None and reaper.alive()):
                    raise  # CMD's own (not executable)
                continue  # the reaper died before CMD could join its group (setpgid: EPERM): CMD alone
            self._group = target or process.pid
            return process
        raise AssertionError("unreachable")

    def _supervise(self, process: subprocess.Popen[bytes], run: RunContext, started: float) -> _Ending:
        grace = self._options.grace.total_seconds()
        # --timeout and the job's registered max_runtime: the smaller wins
        timeout = self._options.timeout
        what = ""  # said after the duration when it is the job's max_runtime
        if self._max_runtime is not None and (timeout is None or self._max_runtime < timeout):
            timeout, what = self._max_runtime, " (the job's max_runtime)"
        deadline = started + timeout.total_seconds() if timeout is not None else None
        forwarded = 0
        lost_at: float | None = None
        timed_out_at: float | None = None
        kill_at: float | None = None
        killed = False
        while True:
            try:
                returncode = process.wait(timeout=_POLL)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            while forwarded < len(self._signals.received):
                self._signal(process, self._signals.received[forwarded])
                forwarded += 1
                kill_at = kill_at if kill_at is not None else now + grace
            if lost_at is None and run.is_lost():  # marked lost, or past the local deadline
                lost_at = now
                what = "cancelled by an operator" if _cancelled(run) else "lease lost"
                self._say(f"{what}: stopping the command (SIGTERM, SIGKILL in {format_duration(self._options.grace)})")
                self._signal(process, signal.SIGTERM)
                kill_at = min(kill_at, now + grace) if kill_at is not None else now + grace
            if deadline is not None and timed_out_at is None and lost_at is None and now >= deadline:
                timed_out_at = now
                self._say(f"timeout: the command ran longer than {format_duration(timeout)}{what}: stopping it "
                          f"(SIGTERM, SIGKILL in {format_duration(self._options.grace)})")
                self._signal(process, signal.SIGTERM)
                kill_at = min(kill_at, now + grace) if kill_at is not None else now + grace
            if kill_at is not None and not killed and now >= kill_at:
                self._signal(process, signal.SIGKILL)
                killed = True
        code = exit_code(returncode)
        status = f"exit code {code}" if returncode >= 0 else f"killed by {signal_name(-returncode)}"
        if lost_at is not None:
            self._signal(process, signal.SIGKILL)  # nothing of the lost run may keep running
            lost = run.lost_error
            reason = lost.reason if lost is not None else "lease lost"
            how = "SIGTERM, then SIGKILL after the grace" if killed else "SIGTERM"
            if _cancelled(run):
                return _Ending(code, f"{reason}: command stopped with {how}; {status}", lost=True)
            return _Ending(code, f"lease lost ({reason}): command stopped with {how}; {status}", lost=True)
        if self._signals.received:
            number = self._signals.received[0]
            return _Ending(code, f"{signal_name(number)} received and forwarded to the command; {status}",
                           cancelled_by=number)
        if timed_out_at is not None:
            self._signal(process, signal.SIGKILL)  # what CMD left behind in its group goes with it
            how = "SIGTERM, then SIGKILL after the grace" if killed else "SIGTERM"
            return _Ending(EXIT_TIMEOUT, f"timeout: ran longer than {format_duration(timeout)}{what}; command "
                           f"stopped with {how}; {status}", timed_out=True,
                           detail={"timeout_seconds": timeout.total_seconds() if timeout else None,
                                   "timeout_from": "max_runtime" if what else "--timeout",
                                   "command_exit_code": code})
        return _Ending(code, "" if code == 0 else status)

    def _signal(self, process: subprocess.Popen[bytes], number: int) -> None:
        try:
            os.killpg(self._group if self._group is not None else process.pid, number)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already

    # -- what the ledger says about the job -------------------------------------------

    def _job_options(self, job: str) -> tuple[bool, timedelta | None]:
        """Whether the job has a schedule, and its registered max_runtime (one read, before the runs)."""
        assert self._conn is not None  # the scheduler's wrappers are given these facts instead
        row = self._conn.execute(queries.JOB_RUN_OPTIONS, {"job": job}).fetchone()
        return (bool(row[0]), row[1]) if row else (False, None)

    # -- messages -------------------------------------------------------------------

    def _report_start(self, run: RunContext) -> None:
        if self._options.verbose:
            slot = f", slot {_local(run.slot)}" if run.slot is not None else ""
            self._say(f"run {run.run_id} of job {run.job} started (token {run.token}{slot})")

    def _report_end(self, run: RunContext, ending: _Ending) -> None:
        result = run.result
        if result is None:  # the ledger refused the end (lease lost): the client said so already
            return
        if result.status == "success":
            if self._options.verbose:
                self._say(f"run {result.run_id} succeeded")
            return
        summary = first_line(ending.error) if ending.error else (result.error or "")
        verdict = "cancelled" if result.failure_reason == "cancelled" else f"failed ({result.failure_reason})"
        self._say(f"run {result.run_id} {verdict}: {summary}")


MAX_FENCED = 100  # ledger._max_fenced()
FENCED_FILE_BYTES = 64 * 1024  # read of LEDGER_FENCED_FILE: complete_run takes at most 100 resources


def _cancelled(run: RunContext) -> bool:
    """Whether the run was lost because an operator cancelled it (``jobledger cancel``)."""
    lost = run.lost_error
    return lost is not None and lost.reason == LOST_REASONS["cancelled"]


def _local(moment: datetime | None) -> str:
    return "?" if moment is None else moment.astimezone().isoformat(timespec="seconds")


class CommandRunner:
    """The scheduler's runner for a jobs file's commands: each run is a :class:`Wrapper`'s, with
    ``jobledger run``'s semantics (environment, heartbeat, timeout and the job's max_runtime, retries,
    exit code and stderr tail in the log, CMD's process group reaped with us).

    The scheduler's ``stop`` (its grace is over) is a SIGTERM forwarded to CMD, SIGKILL ``grace`` later:
    the run is recorded ``cancelled``.
    """

    def __init__(self, dsn: str, *, grace: timedelta = timedelta(seconds=10), say: Callable[[str], None],
                 verbose: bool = False) -> None:
        self._dsn = dsn
        self._grace = grace
        self._say = say
        self._verbose = verbose

    def __call__(self, ledger: Ledger, run: RunContext, job: JobDefinition, stop: threading.Event) -> int:
        """The run's exit code, as ``jobledger run`` would exit."""
        options = Options(job=job.name, argv=job.argv, ttl=job.ttl, grace=self._grace, verbose=self._verbose,
                          dsn=self._dsn, timeout=job.timeout, retries=job.retries, backoff=job.backoff,
                          env=job.env, cwd=job.cwd)
        max_runtime = job.register.get("max_runtime")
        wrapper = Wrapper(None, options, say=self._say, ledger=ledger,
                          max_runtime=max_runtime if isinstance(max_runtime, timedelta) else None)
        finished = threading.Event()

        def watch() -> None:
            while not finished.is_set():
                if stop.wait(0.1):
                    wrapper.cancel(signal.SIGTERM)
                    return

        watcher = threading.Thread(target=watch, name=f"jobledger-stop:{job.name}", daemon=True)
        watcher.start()
        try:
            return wrapper.run_adopted(run)
        finally:
            finished.set()
