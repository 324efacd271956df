"""The job ledger from Python with asyncpg: the ledger's whole API is SQL
functions, so any client that can run a query can use it.

  LEDGER_DSN=postgres://user@host:5432/db python3 run.py run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
  python3 run.py zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
  python3 run.py tokens <job> <owner> [count]            # bigint tokens are Python ints

Without LEDGER_DSN, asyncpg reads PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE.
Behind PgBouncer in transaction mode set LEDGER_STATEMENT_CACHE_SIZE=0 (below).
Each mode prints one JSON line saying what happened. `run` and `zombie` write
into a table the caller created:
  CREATE TABLE fenced_writes (token bigint, written_by text)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import timedelta
from typing import Any

import asyncpg

DSN = os.environ.get("LEDGER_DSN") or None
# asyncpg prepares every query as a named statement (__asyncpg_stmt_1__, ...)
# and caches it on the connection. Behind a transaction pooler the next
# execution may run on another server connection, where that statement does
# not exist, or exists as another client's: `prepared statement
# "__asyncpg_stmt_1__" does not exist` (or `already exists`). With 0 asyncpg
# uses the unnamed statement, parsed again at every execution: nothing stays
# behind on the server connection. asyncpg has no DSN parameter for it.
STATEMENT_CACHE_SIZE = int(os.environ.get("LEDGER_STATEMENT_CACHE_SIZE", "100"))
TABLE_INSERT = "INSERT INTO fenced_writes (token, written_by) VALUES ($1, $2)"


def resource_of(job: str) -> str:
    # Tokens count per job, so a resource belongs to the first job that fenced it
    # (another job gets LD006): one per job.
    return f"fenced_writes:{job}"


async def connect() -> asyncpg.Connection:
    # asyncpg has no implicit transactions: every call outside `transaction()`
    # commits by itself, which is what the ledger's calls need.
    return await asyncpg.connect(DSN, statement_cache_size=STATEMENT_CACHE_SIZE,
                                 server_settings={"application_name": "ledger-asyncpg-example"})


class LeaseLost(Exception):
    pass


def describe(err: BaseException) -> dict[str, Any]:
    """An error as {code, message, detail}: the SQLSTATE (LD001..LD006 for the
    ledger's own) and the DETAIL, a JSON object of facts. json.loads reads its
    integers as Python ints, exact at any size (tokens past 2^53 included)."""
    if not isinstance(err, asyncpg.PostgresError):
        return {"code": None, "message": str(err), "detail": None}
    detail: Any = err.detail
    if detail and detail.startswith("{"):
        try:
            detail = json.loads(detail)
        except ValueError:
            pass  # not JSON after all: keep the text
    return {"code": err.sqlstate, "message": err.message, "detail": detail}


async def fenced_write(conn: asyncpg.Connection, job: str, resource: str, token: int, written_by: str) -> None:
    # One transaction holds the fence and the application's write: they commit
    # together or not at all. LD001 (the token is no longer live), LD002 (a newer
    # token wrote) or LD006 (another job's resource) roll both back.
    async with conn.transaction():
        await conn.execute("SELECT ledger.fence(job => $1, resource => $2, token => $3)", job, resource, token)
        await conn.execute(TABLE_INSERT, token, written_by)


async def heartbeats(ledger: asyncpg.Connection, run_id: int, token: int, every: float,
                     stop: asyncio.Event, result: dict[str, Any]) -> None:
    # Every ttl/3: two beats may be lost before the lease expires. NULL means
    # the lease is lost; LD001/LD003 raise. A beat in flight finishes before
    # the loop sees `stop`.
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            pass
        expires_at = await ledger.fetchval("SELECT ledger.heartbeat(run_id => $1, token => $2)", run_id, token)
        if expires_at is None:
            raise LeaseLost("lease lost: heartbeat returned NULL")
        result["heartbeats"] += 1


async def run_mode(job: str, owner: str, resource: str | None, ttl: float, work_ms: float,
                   key: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {"mode": "run", "job": job, "owner": owner, "outcome": None, "run_id": None,
                              "token": None, "wrote": False, "heartbeats": 0, "error": None}
    # Two connections: the ledger's calls on one, the application's transaction
    # on the other, so a heartbeat never lands inside the application's open
    # transaction (invisible until it commits, lost if it rolls back).
    ledger, app = await connect(), await connect()
    try:
        # Named notation; ttl is an interval, which asyncpg sends from a timedelta.
        start = await ledger.fetchrow(
            "SELECT * FROM ledger.start_run(job => $1, owner => $2, ttl => $3, idempotency_key => $4)",
            job, owner, timedelta(seconds=ttl), key)
        result["outcome"] = start["outcome"]
        if start["outcome"] == "skipped_overlap":  # another owner's lease is live: try at the next tick
            result["holder"] = start["holder"]
            result["holder_expires_at"] = start["holder_expires_at"].isoformat()
            return result
        if start["outcome"] in ("already_done", "paused"):  # the slot or key succeeded; the job is paused
            return result
        if start["outcome"] != "started":
            raise RuntimeError(f"unexpected outcome {start['outcome']}")
        run_id, token = start["run_id"], start["token"]  # Python ints: bigint is exact
        result["run_id"], result["token"] = str(run_id), str(token)

        stop = asyncio.Event()
        beat = asyncio.create_task(heartbeats(ledger, run_id, token, ttl / 3, stop, result))
        work = asyncio.create_task(asyncio.sleep(work_ms / 1000))  # the job's real work goes here
        try:
            await asyncio.wait({beat, work}, return_when=asyncio.FIRST_COMPLETED)
            if beat.done():  # the lease was lost before the work ended: stop working
                work.cancel()
                beat.result()
            await fenced_write(app, job, resource or resource_of(job), token, owner)
            result["wrote"] = True
        except Exception as err:  # any failure of the work fails the run
            result["error"] = describe(err)
        finally:
            stop.set()
            try:
                await beat  # a heartbeat in flight finishes first
            except Exception as err:
                result["error"] = result["error"] or describe(err)

        # Ending the run also releases the lease. A zombie learns here too that
        # it lost (LD001: a newer token took over; LD003: already closed).
        try:
            if result["error"] is None:
                await ledger.fetchval("SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)",
                                      run_id, token)
            else:
                error = result["error"]
                await ledger.fetchval("SELECT run_id FROM ledger.fail_run(run_id => $1, token => $2, error => $3)",
                                      run_id, token, f"{error['code'] or 'error'}: {error['message']}")
        except asyncpg.PostgresError as err:
            result["end_error"] = describe(err)
        return result
    finally:
        await asyncio.gather(ledger.close(), app.close())


async def zombie_mode(job: str, owner: str, run_id: str, token: str) -> dict[str, Any]:
    # A process that slept through its lease writes with the token it had: the
    # fence refuses it (LD001) and its row is rolled back; so is ending the run.
    result: dict[str, Any] = {"mode": "zombie", "job": job, "owner": owner, "run_id": run_id, "token": token,
                              "wrote": False, "error": None}
    conn = await connect()
    try:
        try:
            await fenced_write(conn, job, resource_of(job), int(token), owner)
            result["wrote"] = True
        except asyncpg.PostgresError as err:
            result["error"] = describe(err)
        try:
            await conn.fetchval("SELECT run_id FROM ledger.complete_run(run_id => $1, token => $2)",
                                int(run_id), int(token))
        except asyncpg.PostgresError as err:
            result["end_error"] = describe(err)
        return result
    finally:
        await conn.close()


async def tokens_mode(job: str, owner: str, count: int) -> dict[str, Any]:
    # Acquire `count` times (each acquire issues a new, greater token); find the
    # newest as an int and, wrongly, by comparing the decimal strings.
    conn = await connect()
    try:
        tokens: list[int] = []
        for _ in range(count):
            row = await conn.fetchrow("SELECT token FROM ledger.acquire(job => $1, owner => $2, ttl => $3)",
                                      job, owner, timedelta(minutes=1))
            if row is None:
                raise RuntimeError(f"job {job} is held by another owner")
            tokens.append(row["token"])
        newest = max(tokens)  # 10 > 9: right
        naive = max(str(t) for t in tokens)  # "9" > "10": wrong
        current = await conn.fetchval("SELECT ledger.is_current(job => $1, token => $2)", job, newest)
        await conn.fetchval("SELECT ledger.release(job => $1, owner => $2, token => $3)", job, owner, newest)
        big = await conn.fetchval("SELECT 9007199254740993::bigint")
        return {"mode": "tokens", "job": job, "owner": owner, "tokens": [str(t) for t in tokens],
                "newest": str(newest), "naive_string_newest": naive, "newest_was_current": current,
                # An int stays exact; a float (a double, as JSON numbers are in many languages) rounds.
                "beyond_2_53": {"bigint": str(big), "number": str(int(float(big)))}}
    finally:
        await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="the job ledger from asyncpg")
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
        coro = run_mode(args.job, args.owner, args.resource, args.ttl, args.work_ms, args.key)
    elif args.mode == "zombie":
        coro = zombie_mode(args.job, args.owner, args.run_id, args.token)
    else:
        coro = tokens_mode(args.job, args.owner, args.count)
    print(json.dumps(asyncio.run(coro)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
