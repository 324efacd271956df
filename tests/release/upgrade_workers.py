"""Worker processes for tests/release/test_upgrade_live.py: load on a ledger that is being migrated.

Run as a script, one process per worker: ``python upgrade_workers.py CONFIG_JSON``.
Each worker does a fixed number of iterations (never a duration) and prints
one JSON line per event to stdout (the test points stdout at a file):

- ``hello``: what the worker imported (``ledger_file``: the 0.1.0 client's
  ``ledger/__init__.py`` for the client kinds; ``null`` for the SQL kinds,
  which never import the package);
- ``iter``: one iteration of a client or SQL worker: ``runs`` (each started
  run: job, run_id, token, slot, writes, heartbeats, claimed end status),
  ``outcomes`` (every start's outcome), ``errors`` (the SQLSTATE of every
  error it met, ``LeaseLost`` for the 0.1.0 client's own loss without a
  database error), ``t0``/``t1`` (wall clock around the iteration);
- ``zombie``: one zombie attempt: took a run with a short ttl, stopped
  heartbeating, polled until another worker took the job over with a higher
  token (``taken_over_by``), then tried its fenced write (``fence_error``,
  ``fence_detail``, ``wrote``) and its end (``end_error``);
- ``round``: a zombie finished its attempts for one migration round.

Kinds (``kind`` in the config):

- ``client``: the 0.1.0 Python client (``Ledger(conn)`` or, with
  ``pool: true``, ``Ledger(dsn)``): ``with ledger.run(...)`` / ``catch_up``,
  fenced writes with ``run.fence``; every third run outlives ttl/3, so the
  client's heartbeat fires;
- ``sql``: plain psycopg, no ledger package: ``start_run`` /
  ``start_due_run``, ``heartbeat``, ``BEGIN; SELECT ledger.fence(...);
  INSERT ...; COMMIT``, ``complete_run`` (``fail_run`` after an error);
- ``zombie``: per migration round (table ``upgrade_rounds``) a few attempts
  as above, over plain SQL (``via: sql``) or the 0.1.0 client's own calls
  (``via: client``: ``Ledger.start_run``, ``ledger.client.fence``,
  ``Ledger.complete_run``).

``sabotage`` (only for proving that the test's checks can fail; never set
by default): ``unfenced`` makes the zombie write without its fence,
``stale_token`` makes the SQL worker write one token lower than its own.
"""

from __future__ import annotations

import faulthandler
import json
import random
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

POLL = 0.02  # seconds between two polls of the database
TAKEOVER_TIMEOUT = 30.0  # a zombie's longest wait for another worker to take its job over
ROUND_TIMEOUT = 300.0  # a zombie's longest wait for the test's next migration round
START_TIMEOUT = 30.0  # a zombie's longest wait to win a lease


def emit(event: dict[str, Any]) -> None:
    print(json.dumps(event, default=str), flush=True)


def resource_of(job: str) -> str:
    # A resource belongs to the job that first fenced it: one per job.
    return f"upgrade_writes/{job}"


INSERT = "INSERT INTO upgrade_writes (job, token, worker, run_id) VALUES (%s, %s, %s, %s)"


def sqlstate_of(error: BaseException) -> str:
    """The SQLSTATE behind an error: psycopg's, the 0.1.0 client's ledger errors', or their cause's."""
    state = getattr(error, "sqlstate", None)
    if state:
        return str(state)
    cause = error.__cause__
    if cause is not None and cause is not error:
        inner = sqlstate_of(cause)
        if inner != "none":
            return inner
    if type(error).__name__ == "LeaseLost":
        return "LeaseLost"  # the client's own verdict (its local deadline), no database error behind it
    return "none"


def detail_of(error: BaseException) -> Any:
    """The error's DETAIL parsed as JSON (the contract's facts), or the raw text when it is not JSON."""
    diag = getattr(error, "diag", None)
    if diag is None and error.__cause__ is not None:
        diag = getattr(error.__cause__, "diag", None)
    text = None if diag is None else diag.message_detail
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return {"unparsed": text}


# -- the 0.1.0 Python client ---------------------------------------------------

def client_worker(cfg: dict[str, Any]) -> None:
    import ledger
    from ledger import Ledger

    emit({"event": "hello", "w": cfg["name"], "kind": "client", "ledger_file": ledger.__file__,
          "version": getattr(ledger, "__version__", None)})
    rng = random.Random(cfg["seed"])
    ttl = timedelta(seconds=cfg["ttl"])
    conn = psycopg.connect(cfg["dsn"], autocommit=True)
    lg = Ledger(cfg["dsn"], owner=cfg["name"]) if cfg.get("pool") else Ledger(conn, owner=cfg["name"])
    jobs = cfg["jobs"] + [cfg["scheduled"]]
    try:
        started_runs = 0
        for i in range(cfg["iterations"]):
            job = rng.choice(jobs)
            hold = cfg["long_hold"] if started_runs % 3 == 0 else rng.uniform(0.01, 0.08)
            event: dict[str, Any] = {"event": "iter", "w": cfg["name"], "kind": "client", "i": i, "job": job,
                                     "runs": [], "outcomes": [], "errors": [], "t0": time.time()}

            def body(run: Any) -> dict[str, Any]:
                entry = {"job": job, "run_id": run.run_id, "token": run.token, "slot": run.slot,
                         "writes": 0, "status": None}
                event["runs"].append(entry)
                for _ in range(2):  # a write, a pause longer than ttl/3 (the heartbeat beats), a write
                    with conn.transaction():
                        run.fence(conn, resource_of(job))
                        conn.execute(INSERT, (job, run.token, cfg["name"], run.run_id))
                    entry["writes"] += 1
                    time.sleep(hold / 2)
                return entry

            def ended(run: Any) -> None:  # the end the client reports for its run (None: it could not tell)
                for entry in event["runs"]:
                    if entry["run_id"] == run.run_id:
                        entry["status"] = None if run.result is None else run.result.status

            try:
                if job == cfg["scheduled"]:
                    started = False
                    for run in lg.catch_up(job, ttl=ttl):
                        started = True
                        event["outcomes"].append(run.outcome)
                        try:
                            with run:
                                body(run)
                        finally:
                            ended(run)
                        if len(event["runs"]) >= 3:
                            break  # slots come faster than a run ends: catch_up alone would never stop
                    if not started:
                        event["outcomes"].append("not_started")  # catch_up yields only started runs
                else:
                    context = lg.run(job, ttl=ttl)
                    try:
                        with context as run:
                            event["outcomes"].append(run.outcome)
                            if run.started:
                                body(run)
                    finally:
                        ended(context)
            except Exception as error:  # a ledger error, or one we must report: recorded, never swallowed silently
                event["errors"].append(sqlstate_of(error))
                event["error_text"] = f"{type(error).__name__}: {error}"
            event["t1"] = time.time()
            emit(event)
            started_runs += len(event["runs"])
            # A skip waits a little longer: the holder is busy for a while.
            time.sleep(rng.uniform(0.01, 0.05) if event["runs"] else rng.uniform(0.1, 0.25))
    finally:
        if cfg.get("pool"):
            lg.close()
        conn.close()


# -- plain SQL, no ledger package -----------------------------------------------

def sql_worker(cfg: dict[str, Any]) -> None:
    assert "ledger" not in sys.modules, "the SQL worker must not import the ledger package"
    emit({"event": "hello", "w": cfg["name"], "kind": "sql", "ledger_file": None})
    rng = random.Random(cfg["seed"])
    ttl = timedelta(seconds=cfg["ttl"])
    conn = psycopg.connect(cfg["dsn"], autocommit=True)
    jobs = cfg["jobs"] + [cfg["scheduled"]] * 2  # the scheduled job is contended by the client's catch_up loops
    name = cfg["name"]

    def one(query: str, params: Any) -> dict[str, Any]:
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, params)
            row = cur.fetchone()
            assert row is not None
            return row

    def run_once(event: dict[str, Any], job: str, hold: float, stale: bool) -> bool:
        """One start; when it started: two fenced writes with a heartbeat between, and the end. True when started."""
        try:
            if job == cfg["scheduled"]:
                start = one("SELECT * FROM ledger.start_due_run(job => %s, owner => %s, ttl => %s)", (job, name, ttl))
            else:
                start = one("SELECT * FROM ledger.start_run(job => %s, owner => %s, ttl => %s)", (job, name, ttl))
        except psycopg.Error as error:
            event["errors"].append(error.sqlstate or "none")
            event["error_text"] = str(error)
            return False
        event["outcomes"].append(start["outcome"])
        if start["outcome"] != "started":
            return False
        run_id, token = start["run_id"], start["token"]
        entry = {"job": job, "run_id": run_id, "token": token, "slot": start["slot"], "writes": 0,
                 "heartbeats": 0, "status": None}
        event["runs"].append(entry)
        failed: str | None = None
        try:
            for step in range(2):  # a write, a heartbeat in a pause, a write
                with conn.transaction():
                    conn.execute("SELECT ledger.fence(job => %s, resource => %s, token => %s)",
                                 (job, resource_of(job), token))
                    # Sabotage only: the second write carries an older token than the run's.
                    conn.execute(INSERT, (job, token - 1 if stale and step else token, name, run_id))
                entry["writes"] += 1
                if step == 0:
                    time.sleep(hold / 2)
                    if hold >= cfg["ttl"] / 3:
                        renewed = one("SELECT ledger.heartbeat(run_id => %s, token => %s, ttl => %s) AS e",
                                      (run_id, token, ttl))["e"]
                        if renewed is None:
                            failed = "heartbeat answered NULL: lease lost"
                            entry["heartbeat_lost"] = True
                            break
                        entry["heartbeats"] += 1
                    time.sleep(hold / 2)
        except psycopg.Error as error:
            event["errors"].append(error.sqlstate or "none")
            event["error_text"] = str(error)
            failed = f"{error.sqlstate}: {error}"
        try:
            if failed is None:
                ended = one("SELECT status FROM ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
            else:
                ended = one("SELECT status FROM ledger.fail_run(run_id => %s, token => %s, error => %s)",
                            (run_id, token, failed))
            entry["status"] = ended["status"]
        except psycopg.Error as error:
            event["errors"].append(error.sqlstate or "none")
            event["end_error_text"] = str(error)
        return entry["status"] == "success"

    try:
        started_runs = 0
        for i in range(cfg["iterations"]):
            job = rng.choice(jobs)
            event: dict[str, Any] = {"event": "iter", "w": name, "kind": "sql", "i": i, "job": job,
                                     "runs": [], "outcomes": [], "errors": [], "t0": time.time()}
            # A scheduled job: loop on start_due_run (as a runner does), at most 3 runs an iteration.
            for _ in range(3 if job == cfg["scheduled"] else 1):
                hold = cfg["long_hold"] if started_runs % 3 == 0 else rng.uniform(0.01, 0.08)
                stale = cfg.get("sabotage") == "stale_token" and i % 10 == 5
                before = len(event["runs"])
                succeeded = run_once(event, job, hold, stale)
                started_runs += len(event["runs"]) - before
                if not succeeded:
                    break
            event["t1"] = time.time()
            emit(event)
            # A skip waits a little longer: the holder is busy for a while.
            time.sleep(rng.uniform(0.01, 0.05) if event["runs"] else rng.uniform(0.1, 0.25))
    finally:
        conn.close()


# -- zombies ----------------------------------------------------------------------

def zombie_worker(cfg: dict[str, Any]) -> None:
    name, via = cfg["name"], cfg["via"]
    lg: Any = None
    if via == "client":
        import ledger
        import ledger.client
        from ledger import Ledger

        emit({"event": "hello", "w": name, "kind": "zombie", "via": via, "ledger_file": ledger.__file__,
              "version": getattr(ledger, "__version__", None)})
    else:
        assert "ledger" not in sys.modules, "the SQL zombie must not import the ledger package"
        emit({"event": "hello", "w": name, "kind": "zombie", "via": via, "ledger_file": None})
    conn = psycopg.connect(cfg["dsn"], autocommit=True)
    if via == "client":
        lg = Ledger(conn, owner=name)
    zttl = timedelta(seconds=cfg["zombie_ttl"])
    rng = random.Random(cfg["seed"])

    def value(query: str, params: Any = None) -> Any:
        row = conn.execute(query, params).fetchone()
        return None if row is None else row[0]

    try:
        for round_no in range(cfg["rounds"]):
            waited = time.monotonic()
            while value("SELECT round FROM upgrade_rounds") < round_no:
                if time.monotonic() - waited > ROUND_TIMEOUT:
                    raise SystemExit(f"{name}: round {round_no} never came")
                time.sleep(POLL)
            for k in range(cfg["per_round"]):
                job = cfg["jobs"][rng.randrange(len(cfg["jobs"]))]
                event: dict[str, Any] = {"event": "zombie", "w": name, "kind": "zombie", "via": via,
                                         "round": round_no, "k": k, "job": job, "t0": time.time(),
                                         "start_errors": []}
                # 1. Take a run with a short ttl (the job is contended: retry until this zombie wins it).
                token = run_id = None
                began = time.monotonic()
                while token is None and time.monotonic() - began < START_TIMEOUT:
                    try:
                        if via == "client":
                            start = lg.start_run(job, ttl=zttl)
                            outcome, token, run_id = start.outcome, start.token, start.run_id
                        else:
                            start_row = conn.execute(
                                "SELECT outcome, token, run_id"
                                "  FROM ledger.start_run(job => %s, owner => %s, ttl => %s)",
                                (job, name, zttl)).fetchone()
                            assert start_row is not None
                            outcome, token, run_id = start_row
                    except Exception as error:
                        event["start_errors"].append(sqlstate_of(error))
                        outcome = token = run_id = None
                    if outcome != "started":
                        token = run_id = None
                        time.sleep(POLL)
                event.update(run_id=run_id, token=token)
                if token is None:
                    event["outcome"] = "never_started"
                    event["t1"] = time.time()
                    emit(event)
                    continue
                # 2. Stop heartbeating; wait until another worker has taken the job over.
                began = time.monotonic()
                current = value("SELECT token FROM ledger.leases WHERE job = %s", (job,))
                while current <= token and time.monotonic() - began < TAKEOVER_TIMEOUT:
                    time.sleep(POLL)
                    current = value("SELECT token FROM ledger.leases WHERE job = %s", (job,))
                event["taken_over_by"] = current if current > token else None
                if current <= token:
                    event["outcome"] = "no_takeover"
                # 3. The fenced write, which must be refused: LD001, and no row.
                event["wrote"] = False
                event["fence_at"] = time.time()
                try:
                    with conn.transaction():
                        if cfg.get("sabotage") != "unfenced":
                            if via == "client":
                                ledger.client.fence(conn, job, resource_of(job), token)
                            else:
                                conn.execute("SELECT ledger.fence(job => %s, resource => %s, token => %s)",
                                             (job, resource_of(job), token))
                        conn.execute(INSERT, (job, token, name, run_id))
                    event["wrote"] = True
                except Exception as error:
                    event["fence_error"] = sqlstate_of(error)
                    event["fence_detail"] = getattr(error, "facts", None) or detail_of(error)
                    event["fence_error_type"] = type(error).__name__
                # 4. Its end: the takeover closed the run already.
                try:
                    if via == "client":
                        event["end_status"] = lg.complete_run(run_id, token).status
                    else:
                        event["end_status"] = value(
                            "SELECT status FROM ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
                except Exception as error:
                    event["end_error"] = sqlstate_of(error)
                event.setdefault("outcome", "refused" if not event["wrote"] else "wrote")
                event["t1"] = time.time()
                emit(event)
                time.sleep(rng.uniform(0.05, 0.2))
            conn.execute("INSERT INTO upgrade_zombie_rounds (worker, round) VALUES (%s, %s)", (name, round_no))
            emit({"event": "round", "w": name, "round": round_no, "t": time.time()})
    finally:
        conn.close()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a worker that hangs
    cfg = json.loads(sys.argv[1])
    {"client": client_worker, "sql": sql_worker, "zombie": zombie_worker}[cfg["kind"]](cfg)
    emit({"event": "done", "w": cfg["name"]})


if __name__ == "__main__":
    main()
