"""The job ledger from Python with psycopg2: the ledger's whole API is SQL
functions, so any client that can run a query can use it.

  LEDGER_DSN=postgres://user@host:5432/db python3 run.py run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
  python3 run.py zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
  python3 run.py tokens <job> <owner> [count]            # bigint tokens are Python ints

Without LEDGER_DSN, libpq reads PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE.
Each mode prints one JSON line saying what happened. `run` and `zombie` write
into a table the caller created:
  CREATE TABLE fenced_writes (token bigint, written_by text)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import psycopg2

DSN = os.environ.get("LEDGER_DSN", "")
TABLE_INSERT = "INSERT INTO fenced_writes (token, written_by) VALUES (%s, %s)"


def resource_of(job: str) -> str:
    # Tokens count per job, so a resource belongs to the first job that fenced it
    # (another job gets LD006): one per job.
    return f"fenced_writes:{job}"


def connect() -> Any:
    conn = psycopg2.connect(DSN, application_name="ledger-psycopg2-example")
    # psycopg2 opens a transaction by itself before the first statement and
    # keeps it open until commit(). A start_run left in it is invisible: a
    # racing worker waits on the lease row, then skips against nobody, and
    # behind a transaction pooler the idle transaction pins a server
    # connection. Autocommit: every ledger call commits by itself, and
    # `with conn:` is the one explicit transaction (psycopg2 2.9+).
    conn.autocommit = True
    return conn


def call(conn: Any, query: str, *args: Any) -> Any:
    """The first row of a query (None when there is none)."""
    with conn.cursor() as cur:
        cur.execute(query, args)
        return cur.fetchone()


class LeaseLost(Exception):
    pass


def describe(err: BaseException) -> dict[str, Any]:
    """An error as {code, message, detail}: pgcode is the SQLSTATE (LD001..LD006
    for the ledger's own), diag the message and the DETAIL, a JSON object of
    facts. json.loads reads its integers as Python ints, exact at any size."""
    if not isinstance(err, psycopg2.Error) or err.pgcode is None:
        return {"code": None, "message": str(err).strip(), "detail": None}
    detail: Any = err.diag.message_detail
    if detail and detail.startswith("{"):
        try:
            detail = json.loads(detail)
        except ValueError:
            pass  # not JSON after all: keep the text
    return {"code": err.pgcode, "message": err.diag.message_primary, "detail": detail}


def fenced_write(conn: Any, job: str, resource: str, token: int, written_by: str) -> None:
    # One transaction holds the fence and the application's write: `with conn`
    # is BEGIN ... COMMIT, or ROLLBACK when LD001, LD002 or LD006 is raised.
    with conn:
        call(conn, "SELECT ledger.fence(job => %s, resource => %s, token => %s)", job, resource, token)
        with conn.cursor() as cur:
            cur.execute(TABLE_INSERT, (token, written_by))


def heartbeats(ledger: Any, run_id: int, token: int, every: float, stop: threading.Event,
               lease_lost: threading.Event, lost: list[BaseException], result: dict[str, Any]) -> None:
    # Every ttl/3, on the ledger's connection (the main thread does not use it
    # meanwhile): two beats may be lost before the lease expires. NULL means the
    # lease is lost; LD001/LD003 raise. Either sets lease_lost, with the reason.
    while not stop.wait(every):
        try:
            (expires_at,) = call(ledger, "SELECT ledger.heartbeat(run_id => %s, token => %s)", run_id, token)
        except psycopg2.Error as err:
            lost.append(err)
        else:
            if expires_at is not None:
                result["heartbeats"] += 1
                continue
            lost.append(LeaseLost("lease lost: heartbeat returned NULL"))
        lease_lost.set()
        return


def run_mode(job: str, owner: str, resource: str | None, ttl: float, work_ms: float,
             key: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {"mode": "run", "job": job, "owner": owner, "outcome": None, "run_id": None,
                              "token": None, "wrote": False, "heartbeats": 0, "error": None}
    # Two connections: the ledger's calls on one, the application's transaction
    # on the other, so a heartbeat never lands inside the application's open
    # transaction (invisible until it commits, lost if it rolls back).
    ledger, app = connect(), connect()
    try:
        # Named notation; psycopg2 sends a timedelta as an interval literal.
        outcome, run_id, token, holder, holder_expires_at = call(
            ledger, "SELECT outcome, run_id, token, holder, holder_expires_at FROM ledger.start_run("
                    "job => %s, owner => %s, ttl => %s, idempotency_key => %s)",
            job, owner, timedelta(seconds=ttl), key)
        result["outcome"] = outcome
        if outcome == "skipped_overlap":  # another owner's lease is live: try at the next tick
            result["holder"] = holder
            result["holder_expires_at"] = holder_expires_at.isoformat()
            return result
        if outcome in ("already_done", "paused"):  # the slot or key succeeded; the job is paused
            return result
        if outcome != "started":
            raise RuntimeError(f"unexpected outcome {outcome}")
        result["run_id"], result["token"] = str(run_id), str(token)  # Python ints: bigint is exact

        stop, lease_lost = threading.Event(), threading.Event()
        lost: list[BaseException] = []
        beat = threading.Thread(target=heartbeats,
                                args=(ledger, run_id, token, ttl / 3, stop, lease_lost, lost, result))
        beat.start()
        try:
            # The job's real work goes here (a sleep that ends early when the lease is lost).
            if lease_lost.wait(work_ms / 1000):
                raise lost[0]
            fenced_write(app, job, resource or resource_of(job), token, owner)
            result["wrote"] = True
        except Exception as err:  # any failure of the work fails the run
            result["error"] = describe(err)
        finally:
            stop.set()
            beat.join()  # a heartbeat in flight finishes first

        # Ending the run also releases the lease. A zombie learns here too that
        # it lost (LD001: a newer token took over; LD003: already closed).
        try:
            if result["error"] is None:
                call(ledger, "SELECT run_id FROM ledger.complete_run(run_id => %s, token => %s)", run_id, token)
            else:
                error = result["error"]
                call(ledger, "SELECT run_id FROM ledger.fail_run(run_id => %s, token => %s, error => %s)",
                     run_id, token, f"{error['code'] or 'error'}: {error['message']}")
        except psycopg2.Error as err:
            result["end_error"] = describe(err)
        return result
    finally:
        ledger.close()
        app.close()


def zombie_mode(job: str, owner: str, run_id: str, token: str) -> dict[str, Any]:
    # A process that slept through its lease writes with the token it had: the
    # fence refuses it (LD001) and its row is rolled back; so is ending the run.
    result: dict[str, Any] = {"mode": "zombie", "job": job, "owner": owner, "run_id": run_id, "token": token,
                              "wrote": False, "error": None}
    conn = connect()
    try:
        try:
            fenced_write(conn, job, resource_of(job), int(token), owner)
            result["wrote"] = True
        except psycopg2.Error as err:
            result["error"] = describe(err)
        try:
            call(conn, "SELECT run_id FROM ledger.complete_run(run_id => %s, token => %s)", int(run_id), int(token))
        except psycopg2.Error as err:
            result["end_error"] = describe(err)
        return result
    finally:
        conn.close()


def tokens_mode(job: str, owner: str, count: int) -> dict[str, Any]:
    # Acquire `count` times (each acquire issues a new, greater token); find the
    # newest as an int and, wrongly, by comparing the decimal strings.
    conn = connect()
    try:
        tokens: list[int] = []
        for _ in range(count):
            row = call(conn, "SELECT token FROM ledger.acquire(job => %s, owner => %s, ttl => %s)",
                       job, owner, timedelta(minutes=1))
            if row is None:
                raise RuntimeError(f"job {job} is held by another owner")
            tokens.append(row[0])
        newest = max(tokens)  # 10 > 9: right
        naive = max(str(t) for t in tokens)  # "9" > "10": wrong
        (current,) = call(conn, "SELECT ledger.is_current(job => %s, token => %s)", job, newest)
        call(conn, "SELECT ledger.release(job => %s, owner => %s, token => %s)", job, owner, newest)
        (big,) = call(conn, "SELECT 9007199254740993::bigint")
        return {"mode": "tokens", "job": job, "owner": owner, "tokens": [str(t) for t in tokens],
                "newest": str(newest), "naive_string_newest": naive, "newest_was_current": current,
                # An int stays exact; a float (a double, as JSON numbers are in many languages) rounds.
                "beyond_2_53": {"bigint": str(big), "number": str(int(float(big)))}}
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="the job ledger from psycopg2")
    modes = parser.add_subparsers(dest="mode", required=True)
    run = modes.add_parser("run")
    run.add_argument("job")
    run.add_argument("owner")
    run.add_argument("--resource")
    run.add_argument("--ttl", type=float, default=30)
    run.add_argument("--work-ms", type=float, default=0)
    run.add_argument("--key")
    zombie = modes.add_parser("zombie")
    for name in ("job", "owner", "run_id", "token"):
        zombie.add_argument(name)
    tokens = modes.add_parser("tokens")
    tokens.add_argument("job")
    tokens.add_argument("owner")
    tokens.add_argument("count", nargs="?", type=int, default=10)
    try:
        args = parser.parse_args()
    except SystemExit as exit_:
        return 64 if exit_.code else 0
    if args.mode == "run":
        result = run_mode(args.job, args.owner, args.resource, args.ttl, args.work_ms, args.key)
    elif args.mode == "zombie":
        result = zombie_mode(args.job, args.owner, args.run_id, args.token)
    else:
        result = tokens_mode(args.job, args.owner, args.count)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
