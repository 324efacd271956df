"""``jobledger run JOB -- CMD ...``: a shell command as a run of the ledger.

What ``flock -n`` does on one host, across hosts and with a log: the wrapper
starts a run (``start_run``; for a job with a schedule it loops on
``start_due_run``, one run per due slot), runs CMD with the run's facts in its
environment, keeps the lease alive meanwhile (the client's heartbeat, every
ttl/3), and ends the run with CMD's verdict.

- CMD's environment: ``LEDGER_JOB``, ``LEDGER_RUN_ID``, ``LEDGER_FENCING_TOKEN``,
  ``LEDGER_SLOT``, ``LEDGER_OWNER`` and ``LEDGER_DSN``: what the job-aware
  fence needs, ``ledger.fence(job => <LEDGER_JOB>, resource => '...', token =>
  <LEDGER_FENCING_TOKEN>)`` in the transaction of each write.

- CMD runs in its own process group, so a signal reaches the whole tree it
  starts (a shell script and its children), and a terminal's Ctrl-C reaches
  it once, through the wrapper.
- Lease lost (the heartbeat found the job taken over, or the run closed), or
  its local deadline passed (no heartbeat renewed it in time, even one stuck
  in a call of a silent partition; see ``ledger.heartbeat``): SIGTERM to
  CMD's group, SIGKILL after the grace, exit 124. Its late writes are the
  fence's business; stopping it early is ours.
- SIGTERM/SIGINT/SIGHUP to the wrapper: forwarded to CMD (SIGKILL after the
  grace), the run is recorded ``cancelled``, the wrapper exits with CMD's code.
- CMD's stderr passes through; its tail (bounded) goes into the run's error.

Exit codes are in :data:`EXIT_CODES` (and the README).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import FrameType, TracebackType
from typing import IO, Any

import psycopg

from ledger.client import Ledger, RunContext
from ledger.durations import format_duration
from ledger.errors import InvalidArgument, LeaseLost, LedgerError

EXIT_LEASE_LOST = 124
EXIT_LEDGER_ERROR = 125
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

EXIT_CODES: dict[str, str] = {
    "0": "CMD succeeded (every due slot, for a scheduled job); or nothing ran: nothing due, job paused, "
         "or held by another owner (`skipped: held by ...`, see --skip-exit-code)",
    "1-123": "CMD's own exit code: it failed, the run is recorded as failure with its stderr tail",
    "124": "the lease was lost while CMD ran: CMD was stopped (SIGTERM, SIGKILL after --grace), "
           "the run is not a success",
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

_HAS_SCHEDULE = "SELECT j.schedule IS NOT NULL FROM ledger.jobs AS j WHERE j.job = %(job)s"


@dataclass(frozen=True)
class Options:
    job: str
    argv: Sequence[str]
    ttl: timedelta | None = None
    grace: timedelta = timedelta(seconds=10)
    skip_exit_code: int = 0
    verbose: bool = False
    dsn: str = ""  # handed to CMD as LEDGER_DSN (when not empty), so it can fence its writes


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
    detail: dict[str, Any] = field(default_factory=dict)


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


class Wrapper:
    """Runs ``options.argv`` as runs of ``options.job``; :meth:`run` returns the exit code.

    ``conn`` (autocommit) answers whether the job has a schedule; each run
    opens its own connection from the same conninfo for its start, heartbeats
    and end (the client's run context).
    """

    def __init__(self, conn: psycopg.Connection[Any], options: Options, *, owner: str | None = None,
                 say: Callable[[str], None], stderr: IO[bytes] | None = None) -> None:
        self._conn = conn
        self._ledger = Ledger(conn, owner=owner)
        self._options = options
        self._say = say
        self._stderr = stderr if stderr is not None else getattr(sys.stderr, "buffer", None)
        self._signals = Signals()

    def run(self) -> int:
        with self._signals:
            try:
                return self._loop()
            except LeaseLost as error:
                self._say(str(error))
                return EXIT_LEASE_LOST
            except (psycopg.Error, LedgerError) as error:
                lines = str(error).strip().splitlines() or [type(error).__name__]
                hint = ""
                if isinstance(error, InvalidArgument) and "ttl is required" in lines[0]:
                    hint = f" (pass --ttl, or register it: jobledger register {self._options.job} --ttl ...)"
                self._say(f"error: {lines[0]}{hint}")
                return EXIT_LEDGER_ERROR

    # -- the runs --------------------------------------------------------------

    def _loop(self) -> int:
        job = self._options.job
        scheduled = self._has_schedule(job)
        ran = 0
        while True:
            if self._signals.received:  # told to stop between two runs
                return 128 + self._signals.received[0]
            run = RunContext(self._ledger, job, ttl=self._options.ttl, due=scheduled)
            ending: _Ending | None = None
            try:
                with run:
                    if not run.started:
                        return self._not_started(run, ran)
                    ran += 1
                    self._report_start(run)
                    ending = self._execute(run)
                    run.detail.update(ending.detail)
                    # Leave the block the way CMD ended: the context records it.
                    if ending.cancelled_by is not None:
                        raise Cancelled(ending.error)
                    if ending.lost or ending.code != 0:
                        raise CommandFailed(ending.error)
            except (Cancelled, CommandFailed):
                assert ending is not None
                self._report_end(run, ending)
                # The loop stops at a run that did not succeed: its slot is retried next time.
                return EXIT_LEASE_LOST if ending.lost else ending.code
            assert ending is not None
            self._report_end(run, ending)
            if not scheduled:
                return 0

    def _not_started(self, run: RunContext, ran: int) -> int:
        job, outcome = self._options.job, run.outcome
        if outcome == "skipped_overlap":
            until = _local(run.holder_expires_at)
            self._say(f"skipped: held by {run.holder} until {until}")
            return self._options.skip_exit_code if ran == 0 else 0
        if outcome == "paused":
            self._say(f"paused: job {job} is paused (jobledger resume {job})")
        elif outcome == "already_done":
            self._say(f"already done: job {job}'s slot {_local(run.slot)} succeeded or is running")
        elif self._options.verbose:  # nothing_due: the normal quiet end of a catch-up
            self._say(f"{'caught up' if ran else 'nothing due'}: job {job}")
        return 0

    # -- the command -------------------------------------------------------------

    def _environment(self, run: RunContext) -> dict[str, str]:
        """Ours, plus the run's facts: LEDGER_JOB and LEDGER_FENCING_TOKEN are the fence's arguments."""
        env = dict(os.environ)
        env.update({
            "LEDGER_JOB": run.job,
            "LEDGER_RUN_ID": str(run.run_id),
            "LEDGER_FENCING_TOKEN": str(run.token),
            "LEDGER_SLOT": "" if run.slot is None else run.slot.astimezone(timezone.utc).isoformat(),
            "LEDGER_OWNER": run.owner,
        })
        if self._options.dsn:
            env["LEDGER_DSN"] = self._options.dsn
        return env

    def _execute(self, run: RunContext) -> _Ending:
        argv = list(self._options.argv)
        detail: dict[str, Any] = {"command": [arg[:200] for arg in argv[:20]]}
        if self._signals.received:  # the signal came while the run was starting
            number = self._signals.received[0]
            return _Ending(128 + number, f"{signal_name(number)} received before the command started",
                           cancelled_by=number, detail=detail)
        group: dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                                 else {"preexec_fn": os.setpgrp})
        started = time.monotonic()
        try:
            process = subprocess.Popen(argv, env=self._environment(run), stderr=subprocess.PIPE, **group)
        except FileNotFoundError as error:
            return _Ending(EXIT_NOT_FOUND, f"command not found: {argv[0]} ({error.strerror})", detail=detail)
        except PermissionError as error:
            return _Ending(EXIT_NOT_EXECUTABLE, f"command not executable: {argv[0]} ({error.strerror})",
                           detail=detail)
        assert process.stderr is not None
        tail = StderrTail(process.stderr, self._stderr)
        ending = self._supervise(process, run)
        ending.detail = {**detail, "exit_code": ending.code, "seconds": round(time.monotonic() - started, 3)}
        stderr_tail = tail.text()
        if ending.lost or ending.cancelled_by is not None or ending.code != 0:
            ending.error += f"\n--- stderr (tail) ---\n{stderr_tail}" if stderr_tail else ""
        return ending

    def _supervise(self, process: subprocess.Popen[bytes], run: RunContext) -> _Ending:
        grace = self._options.grace.total_seconds()
        forwarded = 0
        lost_at: float | None = None
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
                self._say(f"lease lost: stopping the command (SIGTERM, SIGKILL in {format_duration(self._options.grace)})")
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
            return _Ending(code, f"lease lost ({reason}): command stopped with {how}; {status}", lost=True)
        if self._signals.received:
            number = self._signals.received[0]
            return _Ending(code, f"{signal_name(number)} received and forwarded to the command; {status}",
                           cancelled_by=number)
        return _Ending(code, "" if code == 0 else status)

    @staticmethod
    def _signal(process: subprocess.Popen[bytes], number: int) -> None:
        try:
            os.killpg(process.pid, number)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already

    # -- what the ledger says about the job -------------------------------------------

    def _has_schedule(self, job: str) -> bool:
        row = self._conn.execute(_HAS_SCHEDULE, {"job": job}).fetchone()
        return bool(row and row[0])

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
        summary = ending.error.splitlines()[0] if ending.error else (result.error or "")
        verdict = "cancelled" if result.failure_reason == "cancelled" else f"failed ({result.failure_reason})"
        self._say(f"run {result.run_id} {verdict}: {summary}")


def _local(moment: datetime | None) -> str:
    return "?" if moment is None else moment.astimezone().isoformat(timespec="seconds")
