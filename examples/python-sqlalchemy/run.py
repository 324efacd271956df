"""The job ledger from Python with SQLAlchemy 2 on psycopg 3: the ledger's whole
API is SQL functions, so any client that can run a query can use it.

  LEDGER_DSN=postgres://user@host:5432/db python3 run.py run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
  python3 run.py zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
  python3 run.py tokens <job> <owner> [count]            # bigint tokens are Python ints

Behind PgBouncer in transaction mode set LEDGER_PREPARE_THRESHOLD=none (below).
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

import psycopg
from sqlalchemy import Connection, Engine, create_engine, exc, make_url, text

# psycopg 3 prepares a query on the server once a connection ran it 5 times
# (prepare_threshold=5), under a name such as _pg3_0. Behind a transaction
# pooler the next execution may run on another server connection, where
# _pg3_0 does not exist, or is another client's: `prepared statement
# "_pg3_0" does not exist` (or `already exists`). None: never prepare. It is
# a psycopg argument, not a libpq one, so it goes in connect_args, not in the URL.
PREPARE_THRESHOLD = os.environ.get("LEDGER_PREPARE_THRESHOLD", "5")
TABLE_INSERT = text("INSERT INTO fenced_writes (token, written_by) VALUES (:token, :written_by)")


def resource_of(job: str) -> str:
    # Tokens count per job, so a resource belongs to the first job that fenced it
    # (another job gets LD006): one per job.
    return f"fenced_writes:{job}"


def engine() -> Engine:
    # postgres://... (or postgresql://...) on the psycopg 3 dialect.
    url = make_url(os.environ["LEDGER_DSN"]).set(drivername="postgresql+psycopg")
    threshold = None if PREPARE_THRESHOLD.lower() == "none" else int(PREPARE_THRESHOLD)
    return create_engine(url, connect_args={"prepare_threshold": threshold,
                                            "application_name": "ledger-sqlalchemy-example"})


def autocommit(conn: Connection) -> Connection:
    # SQLAlchemy begins a transaction by itself at the first statement and
    # keeps it until commit(). A start_run left in it is invisible: a racing
    # worker waits on the lease row, then skips against nobody, and behind a
    # transaction pooler the idle transaction pins a server connection. The
    # ledger's calls run in AUTOCOMMIT; the fenced write in conn.begin().
    return conn.execution_options(isolation_level="AUTOCOMMIT")


class LeaseLost(Exception):
    pass


def describe(err: BaseException) -> dict[str, Any]:
    """An error as {code, message, detail}: SQLAlchemy wraps the psycopg error
    (.orig); its sqlstate is the SQLSTATE (LD001..LD006 for the ledger's own)
    and its diag the message and the DETAIL, a JSON object of facts. json.loads
    reads its integers as Python ints, exact at any size."""
    orig = err.orig if isinstance(err, exc.DBAPIError) else err
    if not isinstance(orig, psycopg.Error) or orig.sqlstate is None:
        return {"code": None, "message": str(orig), "detail": None}
    detail: Any = orig.diag.message_detail
    if detail and detail.startswith("{"):
        try:
            detail = json.loads(detail)
        except ValueError:
            pass  # not JSON after all: keep the text
    return {"code": orig.sqlstate, "message": orig.diag.message_primary, "detail": detail}


def fenced_write(conn: Connection, job: str, resource: str, token: int, written_by: str) -> None:
    # One transaction holds the fence and the application's write: conn.begin()
    # commits both, or rolls both back when LD001, LD002 or LD006 is raised.
    with conn.begin():
        conn.execute(text("SELECT ledger.fence(job => :job, resource => :resource, token => :token)"),
                     {"job": job, "resource": resource, "token": token})
        conn.execute(TABLE_INSERT, {"token": token, "written_by": written_by})


def heartbeats(ledger: Connection, run_id: int, token: int, every: float, stop: threading.Event,
               lease_lost: threading.Event, lost: list[BaseException], result: dict[str, Any]) -> None:
    # Every ttl/3, on the ledger's connection (the main thread does not use it
    # meanwhile): two beats may be lost before the lease expires. NULL means the
    # lease is lost; LD001/LD003 raise. Either sets lease_lost, with the reason.
    beat = text("SELECT ledger.heartbeat(run_id => :run_id, token => :token)")
    while not stop.wait(every):
        try:
            expires_at = ledger.execute(beat, {"run_id": run_id, "token": token}).scalar()
        except exc.DBAPIError as err:
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
    db = engine()
    # Two connections: the ledger's calls on one, the application's transaction
    # on the other, so a heartbeat never lands inside the application's open
    # transaction (invisible until it commits, lost if it rolls back).
    try:
        with autocommit(db.connect()) as ledger, db.connect() as app:
            # Named notation; psycopg sends a timedelta as an interval.
            start = ledger.execute(text(
                "SELECT * FROM ledger.start_run(job => :job, owner => :owner, ttl => :ttl, "
                "idempotency_key => :key)"),
                {"job": job, "owner": owner, "ttl": timedelta(seconds=ttl), "key": key}).one()
            result["outcome"] = start.outcome
            if start.outcome == "skipped_overlap":  # another owner's lease is live: try at the next tick
                result["holder"] = start.holder
                result["holder_expires_at"] = start.holder_expires_at.isoformat()
                return result
            if start.outcome in ("already_done", "paused"):  # the slot or key succeeded; the job is paused
                return result
            if start.outcome != "started":
                raise RuntimeError(f"unexpected outcome {start.outcome}")
            run_id, token = start.run_id, start.token  # Python ints: bigint is exact
            result["run_id"], result["token"] = str(run_id), str(token)

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
            ids = {"run_id": run_id, "token": token}
            try:
                if result["error"] is None:
                    ledger.execute(text("SELECT run_id FROM ledger.complete_run(run_id => :run_id, token => :token)"),
                                   ids)
                else:
                    error = result["error"]
                    ledger.execute(text("SELECT run_id FROM ledger.fail_run(run_id => :run_id, token => :token, "
                                        "error => :error)"),
                                   {**ids, "error": f"{error['code'] or 'error'}: {error['message']}"})
            except exc.DBAPIError as err:
                result["end_error"] = describe(err)
            return result
    finally:
        db.dispose()


def zombie_mode(job: str, owner: str, run_id: str, token: str) -> dict[str, Any]:
    # A process that slept through its lease writes with the token it had: the
    # fence refuses it (LD001) and its row is rolled back; so is ending the run.
    result: dict[str, Any] = {"mode": "zombie", "job": job, "owner": owner, "run_id": run_id, "token": token,
                              "wrote": False, "error": None}
    db = engine()
    try:
        with db.connect() as conn:
            try:
                fenced_write(conn, job, resource_of(job), int(token), owner)
                result["wrote"] = True
            except exc.DBAPIError as err:
                result["error"] = describe(err)
        with autocommit(db.connect()) as conn:
            try:
                conn.execute(text("SELECT run_id FROM ledger.complete_run(run_id => :run_id, token => :token)"),
                             {"run_id": int(run_id), "token": int(token)})
            except exc.DBAPIError as err:
                result["end_error"] = describe(err)
        return result
    finally:
        db.dispose()


def tokens_mode(job: str, owner: str, count: int) -> dict[str, Any]:
    # Acquire `count` times (each acquire issues a new, greater token); find the
    # newest as an int and, wrongly, by comparing the decimal strings.
    db = engine()
    try:
        with autocommit(db.connect()) as conn:
            tokens: list[int] = []
            acquire = text("SELECT token FROM ledger.acquire(job => :job, owner => :owner, ttl => :ttl)")
            for _ in range(count):
                token = conn.execute(acquire, {"job": job, "owner": owner, "ttl": timedelta(minutes=1)}).scalar()
                if token is None:
                    raise RuntimeError(f"job {job} is held by another owner")
                tokens.append(token)
            newest = max(tokens)  # 10 > 9: right
            naive = max(str(t) for t in tokens)  # "9" > "10": wrong
            current = conn.execute(text("SELECT ledger.is_current(job => :job, token => :token)"),
                                   {"job": job, "token": newest}).scalar()
            conn.execute(text("SELECT ledger.release(job => :job, owner => :owner, token => :token)"),
                         {"job": job, "owner": owner, "token": newest})
            big = conn.execute(text("SELECT CAST(9007199254740993 AS bigint)")).scalar()
        return {"mode": "tokens", "job": job, "owner": owner, "tokens": [str(t) for t in tokens],
                "newest": str(newest), "naive_string_newest": naive, "newest_was_current": current,
                # An int stays exact; a float (a double, as JSON numbers are in many languages) rounds.
                "beyond_2_53": {"bigint": str(big), "number": str(int(float(big)))}}
    finally:
        db.dispose()


def main() -> int:
    parser = argparse.ArgumentParser(description="the job ledger from SQLAlchemy on psycopg 3")
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
