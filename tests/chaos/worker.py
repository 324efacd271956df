"""A chaos worker: one process of tests/chaos/driver.py, run as a script.

    python worker.py client  --dsn DSN --log FILE --name W --seed N --stop FILE
    python worker.py wrapper --dsn DSN --log FILE --name W --seed N --stop FILE
    python worker.py cmd     --log FILE --seed N          (CMD of `jobledger run`)

``client`` loops on runs of the Python client (``ledger.run`` for the
unscheduled job, ``ledger.catch_up`` for the scheduled one); ``wrapper``
loops on invocations of ``jobledger run JOB --ttl ... -- python worker.py cmd``;
``cmd`` is what the wrapper runs: it reads LEDGER_JOB, LEDGER_FENCING_TOKEN,
LEDGER_RUN_ID, LEDGER_SLOT and LEDGER_DSN from its environment.

Every write goes through a job-aware fence, in the transaction of the write
and BEFORE the INSERT (the driver's commit-order argument depends on that
order): ``run.fence(conn, resource)`` or the module function
``ledger.client.fence(conn, job, resource, token)`` for the client, plain
``SELECT ledger.fence(job, resource, token)`` SQL for the wrapper's CMD.

What the worker saw acknowledged is appended to its log file (JSON lines, one
``write()`` each, O_APPEND, written only after the call returned): ``start``
(a committed start_run: token, run id), ``write`` (a committed fenced write),
``end`` (a committed complete/fail), ``rejected`` (a fence refused a zombie).
The driver checks them against the database after the crashes. Surviving a
database restart is the worker's business, not the ledger's: a connection
error is logged, the connection dropped, and the loop goes on after a short
sleep.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

SCHEDULED = "chaos-scheduled"
UNSCHEDULED = "chaos-unscheduled"
JOBS = (SCHEDULED, UNSCHEDULED)
RESOURCES = 3  # per job: "<job>/r0" .. "<job>/r2"
TTLS = (1.0, 1.5, 2.0, 3.0)  # seconds; the driver's freezes last longer than the largest

INSERT = ("INSERT INTO public.writes (job, resource, token, slot, run_id, worker, tag) "
          "VALUES (%s, %s, %s, %s, %s, %s, %s)")


class Log:
    """Append-only JSON lines; one write() per line, so a SIGKILL never leaves half a record behind."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, event: str, **facts: Any) -> None:
        facts = {"e": event, "t": time.time(), "pid": os.getpid(), **facts}
        os.write(self._fd, (json.dumps(facts, default=str) + "\n").encode())


def connection_trouble(error: BaseException) -> bool:
    """An error of the connection (the server restarted), not of the ledger."""
    return isinstance(error, (psycopg.OperationalError, psycopg.InterfaceError, OSError))


def pause(log: Log, hold: Path, step: int, rng: random.Random) -> bool:
    """Between two writes of a run. When the driver asked (the hold file), a long pause,
    announced first, so that its SIGSTOP lands inside the run: the write after it is a zombie's."""
    try:
        hold.unlink()
    except FileNotFoundError:
        if step > 0:
            time.sleep(rng.uniform(0, 0.03))
        return False
    log("pause")
    time.sleep(2.5)
    return True


def resource_for(job: str, step: int, paused: bool, rng: random.Random) -> str:
    """A run's first write, and a zombie's, go to the job's main resource r0, which every
    run writes: a zombie write a broken fence let through is then out of order there."""
    return f"{job}/r{0 if step == 0 or paused else rng.randrange(RESOURCES)}"


# -- the Python client ----------------------------------------------------------

def client(args: argparse.Namespace) -> None:
    from ledger.client import Ledger, fence
    from ledger.errors import LeaseLost, LeaseSuperseded, LedgerError, StaleToken

    rng = random.Random(args.seed)
    log = Log(args.log)
    stop = Path(args.stop)
    hold = Path(args.log + ".hold")
    conn: psycopg.Connection[Any] | None = None
    counter = 0

    def body(run: Any, data: psycopg.Connection[Any]) -> None:
        nonlocal counter
        for step in range(rng.choice((1, 1, 2, 3))):
            resource = resource_for(run.job, step, pause(log, hold, step, rng), rng)
            counter += 1
            tag = f"{args.name}-{counter}"
            try:
                with data.transaction():
                    # The fence first, then the INSERT: see driver.py, Chaos.audit.
                    if rng.random() < 0.5:
                        run.fence(data, resource)
                    else:
                        fence(data, run.job, resource, run.token)
                    if rng.random() < 0.05:
                        time.sleep(rng.uniform(0, 0.2))  # a freeze may land between fence and commit
                    data.execute(INSERT, (run.job, resource, run.token, run.slot, run.run_id, args.name, tag))
            except (LeaseLost, LeaseSuperseded, StaleToken) as error:
                code = "lost" if isinstance(error, LeaseLost) else error.sqlstate
                log("rejected", tag=tag, job=run.job, token=run.token, run=run.run_id, resource=resource, code=code)
                raise
            log("write", tag=tag, job=run.job, token=run.token, run=run.run_id, resource=resource)
        if rng.random() < 0.03:
            raise RuntimeError("chaos: a simulated failure of the job")

    def ended(run: Any) -> None:
        if run.result is not None:  # complete_run / fail_run returned: committed
            log("end", run=run.run_id, status=run.result.status, reason=run.result.failure_reason)

    def one(ledger: Ledger, data: psycopg.Connection[Any]) -> None:
        """One iteration: the scheduled job's due slots, or one run of the unscheduled job."""
        ttl = timedelta(seconds=rng.choice(TTLS))
        if rng.random() < 0.3:
            started = False
            for run in ledger.catch_up(SCHEDULED, ttl=ttl):
                started = True
                try:
                    with run:
                        log("start", kind="py", job=run.job, token=run.token, run=run.run_id,
                            slot=run.slot.isoformat() if run.slot else None)
                        body(run, data)
                finally:
                    ended(run)
            if not started:
                time.sleep(rng.uniform(0.01, 0.08))
            return
        # Some runs carry an idempotency key shared by whoever runs in the same half second.
        key = f"k{int(time.time() * 2)}" if rng.random() < 0.3 else None
        run = ledger.run(UNSCHEDULED, ttl=ttl, idempotency_key=key)
        try:
            with run:
                if not run.started:
                    time.sleep(rng.uniform(0.01, 0.08))
                    return
                log("start", kind="py", job=run.job, token=run.token, run=run.run_id, slot=None, key=key)
                body(run, data)
        finally:
            ended(run)

    # Ledger(conn): each run opens its own connection; Ledger(pool): runs borrow pool
    # connections, and the writes a pool connection too (broken ones are discarded on return).
    pool: Any = None
    if args.pool:
        from psycopg_pool import ConnectionPool
        pool = ConnectionPool(args.dsn, min_size=2, max_size=4, kwargs={"autocommit": True}, name=args.name)

    while not stop.exists():
        try:
            if pool is not None:
                with pool.connection() as data:
                    one(Ledger(pool, owner=args.name), data)
            else:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(args.dsn, autocommit=True)
                one(Ledger(conn, owner=args.name), conn)
        except (LeaseLost, LeaseSuperseded, StaleToken):
            pass  # logged as rejected; the run was failed (or the ledger refused: a takeover's verdict)
        except RuntimeError as error:
            if "simulated" not in str(error):
                raise
        except (psycopg.Error, LedgerError, OSError) as error:
            log("dberror", error=f"{type(error).__name__}: {str(error).strip()[:200]}")
            if conn is not None and connection_trouble(error):
                try:
                    conn.close()
                except Exception:
                    pass
                conn = None
            time.sleep(rng.uniform(0.05, 0.3))


# -- the wrapper ----------------------------------------------------------------

def wrapper(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    log = Log(args.log)
    stop = Path(args.stop)
    here = os.path.abspath(__file__)
    n = 0
    while not stop.exists():
        n += 1
        job = rng.choice(JOBS)
        ttl = rng.choice(TTLS)
        owner = f"{args.name}-x{n}"
        argv = [sys.executable, "-m", "ledger", "run", job, "--ttl", f"{ttl}s", "--grace", "1s",
                "--owner", owner, "--dsn", args.dsn, "--",
                sys.executable, here, "cmd", "--log", args.log, "--seed", str(rng.randrange(2**31))]
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        log("wrapper", n=n, wrapper_pid=process.pid, owner=owner, job=job)
        rc = process.wait()
        log("wrapper-exit", n=n, wrapper_pid=process.pid, rc=rc)
        time.sleep(rng.uniform(0.05, 0.3) if rc == 125 else rng.uniform(0.0, args.pace))


def cmd(args: argparse.Namespace) -> int:
    """CMD of `jobledger run`: fenced writes with the run's token, as any script would do them."""
    rng = random.Random(args.seed)
    log = Log(args.log)
    job = os.environ["LEDGER_JOB"]
    token = int(os.environ["LEDGER_FENCING_TOKEN"])
    run_id = int(os.environ["LEDGER_RUN_ID"])
    slot = os.environ.get("LEDGER_SLOT") or None
    owner = os.environ["LEDGER_OWNER"]
    log("start", kind="cmd", job=job, token=token, run=run_id, slot=slot, owner=owner, wrapper_pid=os.getppid())
    hold = Path(args.log + ".hold")
    try:
        with psycopg.connect(os.environ["LEDGER_DSN"], autocommit=True) as conn:
            for step in range(rng.choice((1, 1, 2, 3))):
                resource = resource_for(job, step, pause(log, hold, step, rng), rng)
                tag = f"{owner}-r{run_id}-{step}"
                try:
                    with conn.transaction():
                        # The fence first, then the INSERT: see driver.py, Chaos.audit.
                        conn.execute("SELECT ledger.fence(job => %s, resource => %s, token => %s)",
                                     (job, resource, token))
                        conn.execute(INSERT, (job, resource, token, slot, run_id, owner, tag))
                except psycopg.Error as error:
                    if error.sqlstate in ("LD001", "LD002"):
                        log("rejected", tag=tag, job=job, token=token, run=run_id, resource=resource,
                            code=error.sqlstate)
                        return 3
                    raise
                log("write", tag=tag, job=job, token=token, run=run_id, resource=resource)
    except psycopg.Error as error:
        log("dberror", error=f"{type(error).__name__}: {str(error).strip()[:200]}")
        return 4
    return 1 if rng.random() < 0.03 else 0  # sometimes the job fails


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("client", "wrapper", "cmd"))
    parser.add_argument("--dsn", default="")
    parser.add_argument("--log", required=True)
    parser.add_argument("--name", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", default="")
    parser.add_argument("--pool", action="store_true", help="client: Ledger(ConnectionPool) instead of Ledger(conn)")
    parser.add_argument("--pace", type=float, default=0.05, help="wrapper: at most this long between invocations")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the client's warnings (lost leases) are expected here
    if args.mode == "client":
        client(args)
    elif args.mode == "wrapper":
        wrapper(args)
    else:
        return cmd(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
