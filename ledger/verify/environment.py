"""The checks of what surrounds the ledger: the role, the clock, the path (a pooler), replication, the xmin horizon;
and the audit of the jobs' state rows.

Each takes a :class:`~ledger.verify._base.Probe` and returns a
:class:`~ledger.verify._base.Check`; none of them writes.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any

import psycopg
from psycopg import pq

from ledger import queries
from ledger.text import first_line
from ledger.verify._base import Check, Probe, dsn_params, fetch_all, fetch_one, fetch_value, ident, plain, verdict

# clock: a skew beyond this (and beyond half the round trip) is worth a warning.
CLOCK_WARN = 1.0
CLOCK_SAMPLES = 3

# path: rounds of the pooler probe, and how long a client may wait for a server connection in one.
PATH_ROUNDS = 3
PATH_WAIT = 3.0

# mvcc: what holds the horizon long enough to matter.
IDLE_HOLDER = 1.0  # seconds idle in a transaction with a snapshot: a session that holds the horizon doing nothing
LONG_HOLDER = 300.0  # seconds of any transaction with a snapshot
XID_AGE_WARN = 1_000_000  # transactions behind: for holders whose state this role cannot see
DEAD_WARN = 10_000  # dead versions on a hot table, and ten times its live rows


def check_role(probe: Probe) -> Check:
    """Whether the login can run jobs (ledger_client), and whether it is more than that (superuser, owner)."""
    with probe.connect() as conn:
        row = fetch_one(conn, queries.VERIFY_ROLE)
    role = row["role"]
    facts = {"role": role, "superuser": row["superuser"], "ledger_owner_member": row["owner_member"],
             "ledger_client": row["client"], "ledger_reader": row["reader"], "installed": row["installed"]}
    can_run = bool(row["installed"] and (row["client"] or row["can_start"] or row["superuser"]))
    facts["can_run"] = can_run
    grant = f"GRANT ledger_client TO {ident(role)};"
    if not row["installed"]:
        return verdict("role", "failed", "this database has no ledger, or an older one", facts,
                       how_to_reproduce='psql "$LEDGER_DSN" -c "\\df ledger.start_due_run"',
                       advice="run `jobledger install` against it (as its owner)")
    if row["superuser"]:
        return verdict("role", "warn", f"{role} is a superuser: it bypasses the ledger's grants (it could write the "
                       "tables directly and rewind a token)", facts,
                       advice="run jobs as a login that is a member of ledger_client only "
                              "(`CREATE ROLE jobs LOGIN IN ROLE ledger_client;`)")
    if row["owner_member"]:
        return verdict("role", "warn", f"{role} is a member of ledger_owner: it can redefine the ledger's functions "
                       "and its clock", facts,
                       advice="keep ledger_owner for installs and upgrades; run jobs as a login that is a "
                              "member of ledger_client only")
    if can_run:
        return verdict("role", "held", f"{role} uses ledger_client and is neither superuser nor ledger owner", facts)
    what = "uses ledger_reader only: it may read the ledger but not run jobs" if row["reader"] else \
        "is not a member of ledger_client: it cannot run jobs"
    return verdict("role", "failed", f"{role} {what}", facts, advice=f"as the ledger's owner: {grant}")


def check_clock(probe: Probe) -> Check:
    """The database's clock against this host's, at the midpoint of the quickest of a few round trips."""
    with probe.connect() as conn:
        samples = []
        for _ in range(CLOCK_SAMPLES):
            sent, sent_wall = time.monotonic(), time.time()
            database = fetch_value(conn, queries.DATABASE_NOW)
            trip = time.monotonic() - sent
            samples.append((trip, database.timestamp() - (sent_wall + trip / 2)))
        trip, offset = min(samples)
        seam = None
        try:
            seam = float(fetch_value(conn, queries.VERIFY_CLOCK_SEAM))
        except psycopg.Error:
            pass  # no ledger yet: the role check says so
    facts = {"offset_seconds": round(offset, 6), "round_trip_seconds": round(trip, 6),
             "ledger_clock_offset_seconds": seam}
    ahead = f"{abs(offset):.3f} s {'ahead of' if offset >= 0 else 'behind'} this host's clock (± {trip / 2:.3f} s)"
    why = ("informational: the ledger decides by the database's clock alone, the client's deadlines by this "
           "host's monotonic clock")
    facts["why"] = ("skew changes no decision of the ledger's; it shifts the times you pass in (a slot, an `at`) "
                    "and the times you read against this host's")
    if seam:
        return verdict("clock", "warn", f"the ledger's clock is moved {seam:g} s by its test seam "
                       "(ledger._clock_offset): a test database?", facts,
                       advice="only a test database's owner redefines ledger._clock_offset()")
    if abs(offset) - trip / 2 > CLOCK_WARN:
        return verdict("clock", "warn", f"{ahead}: {why}", facts,
                       advice="run NTP (chrony, systemd-timesyncd) on both hosts")
    return verdict("clock", "held", f"{ahead}; {why}", facts)


def check_path(probe: Probe) -> Check:
    """A transaction pooler between us, whether server-side prepared statements survive it, the DSN's settings.

    Two client connections: one prepares a statement (a protocol-level one,
    under a name of this verify's own, as a driver that prepares does), the
    other holds a transaction open meanwhile. Behind a transaction pooler the
    holder may land on the preparer's server connection, and the preparer's
    next statement on another one, where its prepared statement does not
    exist (26000), or another client's of the same name does.
    """
    params = dsn_params(probe.dsn)
    facts: dict[str, Any] = {"dsn_hosts": params["hosts"], "target_session_attrs": params["target_session_attrs"]}
    evidence: list[str] = []
    broke: str | None = None
    moved = waited = statement_pooling = False
    with probe.connect() as holder, probe.connect() as preparer:
        for round_ in range(PATH_ROUNDS):
            name = f"jobledger_verify_{os.getpid()}_{secrets.token_hex(4)}_{round_}".encode()
            first = _prepared(preparer, name, prepare=True)
            second: dict[str, Any] = {}
            thread = threading.Thread(target=lambda: second.update(_prepared(preparer, name)), daemon=True)
            try:
                with holder.transaction():
                    held = fetch_value(holder, queries.VERIFY_BACKEND_PID)
                    thread.start()
                    thread.join(PATH_WAIT)
                    waited = waited or thread.is_alive()
            except psycopg.Error as error:
                if "statement pool" in str(error):
                    statement_pooling = True
                    facts["error"] = first_line(error)
                    break
                raise
            thread.join(PATH_WAIT)
            broke = broke or first.get("error") or second.get("error")
            if first.get("pid") is not None and held == first["pid"]:
                evidence.append(f"another client's transaction ran on this client's server connection "
                                f"(backend {held})")
            if first.get("pid") is not None and second.get("pid") is not None and first["pid"] != second["pid"]:
                moved = True
                evidence.append(f"one client's transactions ran on backends {first['pid']} and {second['pid']}")
    pooled = bool(evidence) or broke is not None
    survived = ("break: " + broke if broke else "survive (the pooler tracks them)" if moved else
                "work" if not pooled else "not seen to break (this client kept its server connection)")
    facts.update(transaction_pooling=pooled or statement_pooling, statement_pooling=statement_pooling,
                 evidence=sorted(set(evidence)), waited_for_a_server_connection=waited,
                 server_prepared_statements=survived, ledger_connections="never prepare (prepare_threshold=None)")
    if statement_pooling:
        return verdict("path", "failed", "a statement pooler: a fence and the write it guards cannot share a "
                       "transaction", facts, advice="use session or transaction pooling (docs/poolers.md)")
    advice = None
    if pooled:
        prepared = (f"server-side prepared statements break there ({broke})" if broke else
                    "server-side prepared statements survived a move between server connections (the pooler "
                    "tracks them)" if moved else "server-side prepared statements were not seen to break")
        summary = (f"a transaction pooler: {(evidence or ['a prepared statement went missing'])[0]}; {prepared}; "
                   "the ledger's connections never prepare, so they are safe on it")
        facts["safe_settings"] = "psycopg: prepare_threshold=None for your own connections and pools (docs/poolers.md)"
        if not moved or broke:
            advice = "give your own psycopg connections and pools on this path prepare_threshold=None"
    else:
        summary = (f"no transaction pooling seen in {PATH_ROUNDS} rounds (a direct connection or a session "
                   "pooler): server-side prepared statements work, any driver settings are safe")
        facts["safe_settings"] = "any"
    if waited:
        summary += "; a client waited for a free server connection (a small pool: size it for the heartbeats too)"
    if len(params["hosts"]) > 1 and params["target_session_attrs"] not in ("read-write", "primary"):
        return verdict("path", "warn", f"{summary}; the DSN names {len(params['hosts'])} hosts without "
                       "target_session_attrs=read-write: a connection may land on a standby", facts,
                       advice="add target_session_attrs=read-write to the DSN (docs/high-availability.md)")
    return verdict("path", "held", summary, facts, advice=advice)


def _prepared(conn: psycopg.Connection[Any], name: bytes, *, prepare: bool = False) -> dict[str, Any]:
    """Prepare (when asked) and run the backend-pid statement under ``name``: its pid, or the error."""
    pgconn = conn.pgconn
    if prepare:
        result = pgconn.prepare(name, queries.VERIFY_BACKEND_PID.encode())
        if result.status != pq.ExecStatus.COMMAND_OK:
            return {"error": _error_of(result)}
    result = pgconn.exec_prepared(name, [])
    if result.status != pq.ExecStatus.TUPLES_OK:
        return {"error": _error_of(result)}
    value = result.get_value(0, 0)
    return {"pid": int(value) if value is not None else None}


def plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _error_of(result: pq.abc.PGresult) -> str:
    sqlstate = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
    message = first_line(result.error_message.decode(errors="replace")).removeprefix("ERROR:  ")
    return f"{sqlstate}: {message}"


def check_replication(probe: Probe) -> Check:
    """Whether a commit waits for a synchronous standby: what a failover to a standby may lose."""
    with probe.connect() as conn:
        settings = fetch_one(conn, queries.VERIFY_REPLICATION)
        standbys = fetch_all(conn, queries.VERIFY_STANDBYS)
    names = str(settings["synchronous_standby_names"] or "").strip()
    commit = str(settings["synchronous_commit"])
    sees = bool(settings["sees_all"])
    synchronous = [row for row in standbys if row["sync_state"] in ("sync", "quorum")]
    facts: dict[str, Any] = {
        "synchronous_standby_names": names, "synchronous_commit": commit, "in_recovery": settings["in_recovery"],
        "standbys": [{key: row[key] for key in ("application_name", "state", "sync_state", "replay_lag_seconds")}
                     for row in standbys],
        "standbys_visible": sees}
    tokens = ("tokens stay safe: a promoted standby's tokens jump past the old primary's "
              "(docs/high-availability.md)")
    advice = "for no loss: synchronous replication (synchronous_standby_names, synchronous_commit = on)"
    if settings["in_recovery"]:
        facts["a_failover_may_lose"] = "n/a"
        return verdict("replication", "failed", "this server is a standby (in recovery): the ledger cannot write here",
                       facts, advice="point the DSN at the primary: target_session_attrs=read-write")
    waits = commit in ("on", "remote_apply", "remote_write")
    if names and waits and (synchronous or not sees):
        named = ", ".join(str(row["application_name"]) for row in synchronous)
        which = (f"{plural(len(synchronous), 'synchronous standby', 'synchronous standbys')} ({named}, "
                 f"{synchronous[0]['sync_state']})" if synchronous else
                 "a synchronous standby (its state is hidden from this role: pg_read_all_stats)")
        facts["a_failover_may_lose"] = "nothing acknowledged" if commit != "remote_write" else \
            "acknowledged commits if the standby's host crashes too (remote_write: written, not flushed)"
        return verdict("replication", "held", f"each commit waits for {which}: synchronous_standby_names = {names!r}, "
                       f"synchronous_commit = {commit}; a failover to it loses no acknowledged commit", facts)
    if names and waits:
        facts["a_failover_may_lose"] = "nothing, but commits wait"
        return verdict("replication", "warn", f"synchronous_standby_names = {names!r} but no synchronous standby is "
                       "connected: every commit waits until one is", facts, advice="bring a standby back, or clear it")
    lose = ("the commits acknowledged in the last moments before it: runs recorded as started or done, fenced "
            "writes; " + tokens)
    if names:
        facts["a_failover_may_lose"] = lose
        return verdict("replication", "warn", f"synchronous_commit = {commit} in this session: its commits do not wait "
                       f"for the synchronous standby ({names!r}); a failover may lose {lose}", facts, advice=advice)
    if standbys or not sees:
        facts["a_failover_may_lose"] = lose
        where = plural(len(standbys), "asynchronous standby", "asynchronous standbys") if standbys else \
            "no synchronous standby configured (standbys are hidden from this role)"
        return verdict("replication", "warn", f"{where}: a failover may lose {lose}", facts, advice=advice)
    if commit == "off":
        facts["a_failover_may_lose"] = "n/a: no standby"
        return verdict("replication", "warn", "no standby, and synchronous_commit = off: a crash may lose the last "
                       "acknowledged runs and fenced writes (the ledger makes each new token durable itself)", facts,
                       advice="synchronous_commit = on for the jobs' role")
    facts["a_failover_may_lose"] = "n/a: no standby"
    return verdict("replication", "held", f"no standby: nothing to fail over to, and a crash loses no acknowledged "
                   f"commit (synchronous_commit = {commit})", facts)


def check_mvcc(probe: Probe) -> Check:
    """Who holds back the xmin horizon (sessions, replication slots, prepared transactions), and dead versions
    on the ledger's hot rows, which vacuum removes only past that horizon."""
    with probe.connect() as conn:
        sessions = fetch_all(conn, queries.VERIFY_HORIZON_SESSIONS)
        slots = fetch_all(conn, queries.VERIFY_HORIZON_SLOTS)
        prepared = fetch_all(conn, queries.VERIFY_HORIZON_PREPARED)
        hot = fetch_all(conn, queries.VERIFY_HOT_ROWS)
        sees = bool(fetch_one(conn, queries.VERIFY_REPLICATION)["sees_all"])
    risks: list[str] = []
    for row in sessions:
        who = f"pid {row['pid']} ({', '.join(str(part) for part in (row['role'], row['application_name']) if part)})"
        if row["state"] is None:  # another role's session: its pid and ages only
            if (row["xid_age"] or 0) >= XID_AGE_WARN:
                risks.append(f"{who} holds the horizon {row['xid_age']} transactions back")
        elif row["state"].startswith("idle in transaction") and (row["state_seconds"] or 0) >= IDLE_HOLDER:
            risks.append(f"{who} has been idle in a transaction for {row['state_seconds']:.0f} s holding a snapshot "
                         f"({row['xid_age']} transactions back)")
        elif (row["transaction_seconds"] or 0) >= LONG_HOLDER:
            risks.append(f"{who} has held a snapshot for {row['transaction_seconds']:.0f} s ({row['state']})")
        elif (row["xid_age"] or 0) >= XID_AGE_WARN:  # a walsender: a standby's hot_standby_feedback
            risks.append(f"{who} holds the horizon {row['xid_age']} transactions back ({row['backend_type']})")
    for row in slots:
        if not row["active"] or (row["xid_age"] or 0) >= XID_AGE_WARN:
            risks.append(f"replication slot {row['slot_name']} ({'active' if row['active'] else 'inactive'}) "
                         f"holds the horizon {row['xid_age']} transactions back")
    for row in prepared:
        if (row["seconds"] or 0) >= 60:
            risks.append(f"prepared transaction {row['gid']!r} ({row['role']}) has been open {row['seconds']:.0f} s")
    for row in hot:
        if row["dead"] >= DEAD_WARN and row["dead"] > 10 * max(row["live"], 1):
            risks.append(f"ledger.{row['table_name']} has {row['dead']} dead versions for {row['live']} live rows")
    facts: dict[str, Any] = {
        "holders": [{key: plain(row[key]) for key in row} for row in sessions],
        "slots": [{key: plain(row[key]) for key in row} for row in slots],
        "prepared_transactions": [{key: plain(row[key]) for key in row} for row in prepared],
        "hot_rows": [{key: plain(row[key]) for key in row} for row in hot],
        "all_sessions_visible": sees, "risks": risks}
    oldest = max((int(row["xid_age"] or 0) for row in [*sessions, *slots, *prepared]), default=0)
    facts["oldest_snapshot_transactions"] = oldest
    if risks:
        return verdict("mvcc", "warn", "; ".join(risks) + ": while it lasts, vacuum cannot remove the dead versions "
                       "every start, heartbeat and end leaves on the ledger's lease and counters rows", facts,
                       advice="end it (pg_terminate_backend(pid), COMMIT PREPARED / ROLLBACK PREPARED, "
                              "pg_drop_replication_slot); set idle_in_transaction_session_timeout")
    seen = "nothing holds it long" if sees else \
        "nothing visible holds it long (this role sees other roles' sessions by their ages only: pg_read_all_stats)"
    dead = ", ".join(f"ledger.{row['table_name']} {row['dead']} dead / {row['live']} live" for row in hot)
    return verdict("mvcc", "held", f"the oldest snapshot is {oldest} transactions old, {seen}; hot rows: {dead}",
                   facts)


def check_state(probe: Probe) -> Check:
    """The state audit: every job's stored state recomputed from its log, what purge kept of it, its schedule
    and its lease (``ledger.verify_state()``), which is empty while the ledger holds. It reads the whole log."""
    with probe.connect() as conn:
        differing = fetch_all(conn, queries.VERIFY_STATE)
    jobs = int(differing[0]["jobs"]) if differing else 0
    facts: dict[str, Any] = {"jobs_differing": jobs,
                             "first": [{"job": row["job"], "state": row["state"], "differences": row["differences"]}
                                       for row in differing]}
    if jobs:
        named = ", ".join(f"{row['job']} ({', '.join(sorted(row['differences']))})" for row in differing)
        return verdict("state", "failed", f"{jobs} job{'' if jobs == 1 else 's'}' stored state differs from the log: "
                       f"{named}{', ...' if jobs > len(differing) else ''}", facts,
                       advice="report it (an issue, with the rows of ledger.verify_state()): the state rows have "
                              "one writer, and a difference is a bug or a write past the ledger's functions")
    return verdict("state", "held", "every job's stored state is what its log, schedule and lease give", facts)
