"""Property-based fuzz of the SQL API: hypothesis calls every public function
of schema `ledger` (as the catalog lists them) with hostile values, under
random session settings, and checks tests/fuzzhelp.py's property:

- the call succeeds or raises a documented SQLSTATE (22004, 22023,
  LD001-LD006; never 40001: one connection, no concurrency; for the
  procedure ledger.run_guarded also 25001 and 2D000, and its command's own
  error once the failed run records it);
- a call that raised changed no ledger table (run_guarded: nothing but the
  run that records its command's failure);
- a call outside the contract's Bounds does not succeed, and a 22004 or a
  label's 22023 blames an argument that is really NULL or invalid.

Every example starts from the same seeded ledger (a registered scheduled
job with history, purged slots and keys, a running run, fences, an expired
lease with a running run, a paused job, ...), restored before each example,
so a failure replays and shrinks. Fixed example counts and derandomize=True:
CI sees the same examples every time. Any finding fails with the call, its
values and the session settings printed.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from psycopg import sql
from pytest_postgresql.janitor import DatabaseJanitor

from fuzzhelp import (
    ALLOWED_SQLSTATES,
    TTLS,
    Arg,
    Call,
    Fuzz,
    Outcome,
    Session,
    Signature,
    apply_session,
    bound_violations,
    draw_values,
    live_values,
    precast,
    schedules,
    sessions,
    short,
    signatures,
    strategy_for,
    zones,
)
from repo import DOCS
from sqlhelp import value

CONTRACT = DOCS / "contract.md"

# The public functions, as docs/contract.md lists them; the first test checks
# that the catalog has exactly these (a new function must be fuzzed too).
FUZZED = sorted([
    "acquire", "renew", "release", "is_current", "assert_current",
    "advance_fence", "fence",
    "start_run", "heartbeat", "complete_run", "fail_run", "cancel_run", "reap_expired",
    "register_job", "pause_job", "resume_job", "due_slots", "start_due_run",
    "purge_log", "purge_log_batch", "purge_log_in_batches", "run_guarded", "next_slots", "preview_slots",
    "unregister_job", "force_release", "request_cancel", "backfill",
    "configure_events", "purge_events", "sync_alerts", "verify_state",
    "protect", "unprotect",
    "slot_jitter", "next_start", "start_due_runs", "trigger", "scheduler_heartbeat", "scheduler_stop", "sync_jobs",
    "register_pool", "resize_pool", "drop_pool",
])

# function_scoped_fixture: the fixture's database is shared on purpose, and
# every example restores the seed before its call. FUZZ_SCALE=10 runs ten
# times the examples (a deeper local run; CI keeps the fixed counts).
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
COMMON = dict(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PER_FUNCTION = settings(max_examples=int(60 * SCALE), **COMMON)  # type: ignore[arg-type]
SEQUENCES = settings(max_examples=int(40 * SCALE), **COMMON)  # type: ignore[arg-type]
# A canary only has to fail: no shrinking.
CANARY = settings(max_examples=60, report_multiple_bugs=False, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                  **COMMON)  # type: ignore[arg-type]


def _slot(conn: psycopg.Connection, job: str, back: str) -> str:
    return str(value(conn, "SELECT ledger._slot_at_or_before(j.schedule_spec, j.time_zone, now() - %s::interval)::text"
                           " FROM ledger.jobs j WHERE j.job = %s", [back, job]))


def _start(conn: psycopg.Connection, *args: str, **named: Any) -> tuple[int, int]:
    params = ", ".join(["%s"] * len(args) + [f"{k} => %s" for k in named])
    row = conn.execute(f"SELECT outcome, run_id, token FROM ledger.start_run({params})",
                       [*args, *named.values()]).fetchone()
    assert row is not None and row[0] == "started", row
    return row[1], row[2]


def seed(conn: psycopg.Connection) -> None:
    """Something for every call to change or trip over."""
    x = conn.execute
    x("SELECT ledger.register_job('nightly', '30 2 * * *', '1 hour', 5, 'Europe/Berlin')")
    x("SELECT ledger.register_job('every', '15 minutes', '10 minutes', 2, 'America/New_York')")
    x("SELECT ledger.register_job('minutely', '*/5 * * * *', '1 minute', 3, 'Australia/Lord_Howe')")
    x("SELECT ledger.register_pool('heavy', 2)")
    x("SELECT ledger.register_job('plain', ttl => '5 minutes', pool => 'heavy')")
    x("SELECT ledger.register_job('paused', '@hourly', '1 hour')")
    x("SELECT ledger.pause_job('paused')")
    # 'every': two successes (the older purged: purged_slots, purged_keys), a
    # failure, then a catch-up whose bound (2) drops slots (skipped_slots).
    run, token = _start(conn, "every", "host-1", slot=_slot(conn, "every", "6 hours"), idempotency_key="k-older")
    x("SELECT ledger.complete_run(%s, %s, '{\"n\": 0}')", [run, token])
    run, token = _start(conn, "every", "host-1", slot=_slot(conn, "every", "3 hours"), idempotency_key="k-old")
    x("SELECT ledger.complete_run(%s, %s)", [run, token])
    time.sleep(0.002)
    assert value(conn, "SELECT ledger.purge_log('1 microsecond')") == 1
    run, token = _start(conn, "every", "host-1", slot=_slot(conn, "every", "4 hours 30 minutes"))
    x("SELECT ledger.fail_run(%s, %s, 'boom')", [run, token])
    row = conn.execute("SELECT outcome, run_id, token FROM ledger.start_due_run('every', 'host-2')").fetchone()
    assert row is not None and row[0] == "started", row
    x("SELECT ledger.complete_run(%s, %s, '{\"caught_up\": true}')", [row[1], row[2]])
    x("SELECT ledger.register_job('every', '15 minutes', '10 minutes', 1000, 'America/New_York')")
    # 'nightly': a running run on its latest slot, holding two fences.
    run, token = _start(conn, "nightly", "host-1", "1 hour", slot=_slot(conn, "nightly", "0"),
                        idempotency_key="n-1", detail='{"seed": true}')
    x("SELECT ledger.fence('nightly', 'r', %s)", [token])
    x("SELECT ledger.advance_fence('nightly', 'r2', %s)", [token])
    # leases without runs: held, released; and a zombie (expired lease, running run)
    x("SELECT ledger.acquire('plain', 'host-3')")
    token = value(conn, "SELECT token FROM ledger.acquire('released', 'host-3', '1 hour')")
    assert value(conn, "SELECT ledger.release('released', 'host-3', %s)", [token]) is True
    _start(conn, "zombie", "host-4", "1 millisecond")
    # Tables for protect and unprotect (outside the ledger: the seed's restore leaves their triggers be).
    x("CREATE SCHEMA fuzz_protect; CREATE TABLE fuzz_protect.target (id integer)")
    x("CREATE VIEW fuzz_protect.target_view AS SELECT * FROM fuzz_protect.target")
    x("CREATE TABLE fuzz_protect.parted (at date) PARTITION BY RANGE (at)")
    time.sleep(0.005)
    counts = conn.execute(
        "SELECT (SELECT count(*) FROM ledger.purged_slots), (SELECT count(*) FROM ledger.purged_keys),"
        " (SELECT count(*) FROM ledger.skipped_slots), (SELECT count(*) FROM ledger.fences),"
        " (SELECT count(*) FROM ledger.job_execution_log WHERE status = 'running')").fetchone()
    assert counts == (1, 1, 1, 2, 2), counts


@pytest.fixture(scope="module")
def fuzz_dsn(pg_server: Any, ledger_template: str) -> Iterator[str]:
    """One clone of the template for the whole file, seeded once: every
    example restores the seed first (Fuzz.restore), so the examples need no
    database of their own, and the file saves a clone per test."""
    name = f"ledger_fuzz_{os.getpid()}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name, template_dbname=ledger_template)
    with janitor:
        dsn = pg_server.dsn(name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            seed(conn)
            Fuzz(conn, conn).save_seed()
        yield dsn


@pytest.fixture
def fuzz(fuzz_dsn: str) -> Iterator[Fuzz]:
    with psycopg.connect(fuzz_dsn, autocommit=True) as conn, \
            psycopg.connect(fuzz_dsn, autocommit=True) as observer:
        f = Fuzz(conn, observer)
        f.restore()
        observer.execute("DROP SCHEMA IF EXISTS fuzz_canary CASCADE")
        f.sigs = signatures(observer, "ledger")  # type: ignore[attr-defined]
        f.live = live_values(observer)  # type: ignore[attr-defined]
        yield f
        if os.environ.get("FUZZ_STATS"):  # FUZZ_STATS=1 pytest -s: what the calls answered
            print("\n" + ", ".join(f"{fn} {answer}: {n}" for (fn, answer), n in sorted(f.outcomes.items())))
            print("slowest calls:\n" + "\n".join(f"{t * 1000:8.1f} ms  {c}" for t, c in f.slowest))


# ------------------------------------------------------------------ the catalog and the contract

_DOC_ARG = re.compile(r"^([a-z_]+) (text\[\]|text|bigint|integer|interval|timestamptz|jsonb|boolean|regclass)"
                      r"(?: DEFAULT (.+))?$")


def contract_signatures() -> dict[str, list[tuple[str, str, str | None]]]:
    """`ledger.name(arg type [DEFAULT x], ...)` as docs/contract.md writes them."""
    found: dict[str, list[tuple[str, str, str | None]]] = {}
    for name, arglist in re.findall(r"ledger\.([a-z][a-z_]*)\(([^()]*)\)", CONTRACT.read_text()):
        parts = [p.strip() for p in arglist.split(",")] if arglist.strip() else []
        matches = [_DOC_ARG.match(p) for p in parts]
        if not parts or not all(matches):
            continue  # a call in an example, not a signature
        args = [(m.group(1), m.group(2), m.group(3)) for m in matches if m]
        assert found.setdefault(name, args) == args, f"docs/contract.md gives ledger.{name} two signatures"
    # a function of no arguments: its signature is the one followed by RETURNS
    for name in re.findall(r"ledger\.([a-z][a-z_]*)\(\) RETURNS", CONTRACT.read_text()):
        assert found.setdefault(name, []) == [], f"docs/contract.md gives ledger.{name} two signatures"
    return found


def test_the_catalog_has_the_contracts_functions_and_each_is_fuzzed(fuzz: Fuzz) -> None:
    db = fuzz.observer
    catalog = signatures(db, "ledger")
    assert sorted(catalog) == FUZZED, "a public function is missing from FUZZED, or FUZZED names one that is gone"
    documented = contract_signatures()
    assert sorted(documented) == sorted(catalog), (
        f"in the catalog, not in docs/contract.md: {sorted(set(catalog) - set(documented))}; "
        f"documented, not in the catalog: {sorted(set(documented) - set(catalog))}")
    live = live_values(db)
    for name, sig in catalog.items():
        assert [(a.name, a.type, a.default) for a in sig.args] == documented[name], name
        for arg in sig.args:
            strategy_for(arg, live)  # every argument has hostile values


def test_nul_cannot_reach_the_ledger(fuzz: Fuzz) -> None:
    """NUL is not a fuzz value because no text can hold it: the driver refuses
    it, and every way of spelling it in SQL fails before the ledger runs."""
    db = fuzz.conn
    before = fuzz.snapshot()
    with pytest.raises(psycopg.DataError, match="NUL"):
        db.execute("SELECT ledger.acquire(%s::text, 'o', '1 minute')", ["a\x00b"])
    for expression, sqlstate in [("chr(0)", "54000"), (r"E'a\x00b'", "22021"), (r"E'a\u0000b'", "42601"),
                                 (r"U&'a\0000b'", "42601"), (r"convert_from('\x610062', 'UTF8')", "22021")]:
        with pytest.raises(psycopg.Error) as caught:
            db.execute(f"SELECT ledger.acquire({expression}, 'o', '1 minute')")
        assert caught.value.sqlstate == sqlstate, expression
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT ledger.start_run('j', 'o', '1 minute', detail => %s::jsonb)", ['{"a": "\\u0000"}'])
    assert caught.value.sqlstate == "22P05"
    assert fuzz.snapshot() == before


EDGES = [  # (argument, value, the contract refuses it)
    ("ttl", "30 days", False), ("ttl", "720 hours", False), ("ttl", "1 month", True), ("ttl", "1 microsecond", False),
    ("ttl", "-1 month 31 days", True), ("ttl", "1 day", False), ("ttl", "29 days 24 hours", False),
    ("ttl", "30 days 1 microsecond", True), ("ttl", "0", True), ("ttl", "-1 year 361 days", True),
    ("ttl", "1 day -1 hour", True), ("ttl", "178000000 years", True),
    ("older_than", "100 years", True), ("older_than", "36500 days", False), ("older_than", "876000 hours", False),
    ("older_than", "36500 days 1 microsecond", True),
    ("slot", "1970-01-01 00:00:00+00", False), ("slot", "1969-12-31 23:59:59.999999+00", True),
    ("slot", "2199-12-31 23:59:59.999999+00", False), ("slot", "2200-01-01 00:00:00+00", True),
    ("slot", "infinity", True), ("at", "-infinity", True), ("at", "4713-01-01 BC", True),
    ("detail", '{"x": "' + "a" * 65_527 + '"}', False), ("detail", '{"x": "' + "a" * 65_528 + '"}', True),
    ("detail", "[]", True), ("detail", "null", True),
    ("token", 1, False), ("token", 0, True), ("run_id", -(2**63), True),
    ("job", "x" * 200, False), ("job", "x" * 201, True), ("job", "", True), ("job", " ", False),
    ("job", "a\u202eb", True), ("owner", "\u00a0", True), ("resource", "\U00013439", True), ("idempotency_key", "😀", False),
    ("max_backfill", 1000, False), ("max_backfill", 1001, True), ("max_backfill", 0, True),
    ("time_zone", "Mars/Olympus2", True), ("time_zone", "Etc/GMT-14", False), ("time_zone", "Etc/GMT-15", True),
    ("time_zone", "localtime", True), ("time_zone", "posixrules", True), ("time_zone", "CET", True),
]


def test_the_bounds_oracle_agrees_with_the_contract_at_the_edges(fuzz: Fuzz) -> None:
    """The fuzz's own reading of docs/contract.md's Bounds, checked at the
    edges, in a session whose TimeZone is far from UTC."""
    types = {"ttl": "interval", "older_than": "interval", "slot": "timestamptz", "at": "timestamptz",
             "detail": "jsonb", "token": "bigint", "run_id": "bigint", "max_backfill": "integer"}
    apply_session(fuzz.conn, Session("Pacific/Kiritimati", "sql_standard", "SQL, DMY", "read committed", "on", False))
    wrong = []
    for argument, raw, refused in EDGES:
        call = Call(Signature("x", "f", (Arg(argument, types.get(argument, "text"), False, None),)), {argument: raw})
        facts = precast(fuzz.conn, call)
        assert facts is not None, (argument, raw)
        if bool(bound_violations(call, facts)) != refused:
            wrong.append(f"{argument} = {str(raw)[:40]!r}: {bound_violations(call, facts) or 'accepted'}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ one call at a time

@pytest.mark.parametrize("function", FUZZED)
@PER_FUNCTION
@given(data=st.data())
def test_every_call_succeeds_or_raises_a_documented_sqlstate_and_changes_nothing_when_it_raises(
        fuzz: Fuzz, function: str, data: st.DataObject) -> None:
    sig = fuzz.sigs[function]  # type: ignore[attr-defined]
    fuzz.restore()
    values = draw_values(data, sig, fuzz.live)  # type: ignore[attr-defined]
    session = data.draw(sessions, label="session")
    fuzz.check_call(Call(sig, values), session, skip=lambda: assume(False))


# ------------------------------------------------------------------ sequences

# Calls that move a job along, more often than the rest.
STEPS = FUZZED + ["due_slots", "start_due_run", "start_due_run", "start_run", "complete_run", "complete_run",
                  "fail_run", "heartbeat", "purge_log", "reap_expired", "due_slots"]


class History:
    """The calls of one example, for the report of a finding that needs them."""

    def __init__(self, fuzz: Fuzz) -> None:
        self.fuzz = fuzz
        self.lines: list[str] = []

    def __str__(self) -> str:
        return "\n".join(self.lines) or "  (none)"

    def call(self, call: Call, session: Session) -> Outcome | None:
        try:
            outcome = self.fuzz.check_call(call, session)
        except AssertionError as finding:
            raise AssertionError(f"{finding}\n\nafter these calls:\n{self}") from None
        if outcome is not None:
            answer = f"ok {short(str(outcome.rows), 160)}" if outcome.ok else str(outcome.error.sqlstate)  # type: ignore[union-attr]
            self.lines.append(f"  [{session}]\n  {call}\n    -> {answer}")
        return outcome

    def check_views(self, session: Session) -> None:
        """Every view of schema ledger reads under the session's settings, and
        ledger.overlaps ("should always be empty") is empty."""
        views = [r[0] for r in self.fuzz.observer.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = 'ledger'::regnamespace AND c.relkind = 'v'"
            " ORDER BY 1").fetchall()]
        apply_session(self.fuzz.conn, session)
        for view in views:
            try:
                # jit off: JIT compiles the costlier views for a second or so
                # (see the report), which would only slow the fuzz down.
                with self.fuzz.conn.transaction():
                    self.fuzz.conn.execute("SET LOCAL jit = off")
                    self.fuzz.conn.execute(f"SELECT to_jsonb(v)::text FROM ledger.{view} v").fetchall()
            except psycopg.Error as error:
                raise AssertionError(
                    f"FUZZ FINDING: view ledger.{view} raised {error.sqlstate}: {error.diag.message_primary}\n"
                    f"CONTEXT: {error.diag.context}\nsession: {session}\nafter these calls:\n{self}") from None
        overlaps = self.fuzz.observer.execute("SELECT to_jsonb(o)::text FROM ledger.overlaps o").fetchall()
        assert not overlaps, ("FUZZ FINDING: ledger.overlaps is not empty:\n" + "\n".join(r[0] for r in overlaps)
                              + f"\nafter these calls:\n{self}")
        broken = [r[0] for r in self.fuzz.observer.execute(INVARIANTS).fetchall()]
        assert not broken, ("FUZZ FINDING: the ledger's tables break the contract:\n" + "\n".join(broken)
                            + f"\nafter these calls:\n{self}")


# What no sequence of calls may leave behind (docs/contract.md, Bounds): a
# recorded detail over its bound (the one a run ends with is merged with the
# one it started with), a duration stored with a month or day part (so that
# adding it to an instant would follow the session's TimeZone), a scheduled
# job whose newest slot done lies in the future (nothing would be due before
# it).
INVARIANTS = """
SELECT format('run %s records a detail of %s bytes', r.run_id, octet_length(r.detail::text))
  FROM ledger.job_execution_log r WHERE octet_length(r.detail::text) > 65536
UNION ALL
SELECT format('job %s stores ttl %s', j.job, j.ttl) FROM ledger.jobs j
 WHERE date_trunc('day', j.ttl) <> interval '0'
UNION ALL
SELECT format('the lease of job %s stores ttl %s', l.job, l.ttl) FROM ledger.leases l
 WHERE date_trunc('day', l.ttl) <> interval '0'
UNION ALL
SELECT format('scheduled job %s has slot %s %s, in the future', j.job, r.slot, r.status)
  FROM ledger.jobs j JOIN ledger.job_execution_log r ON r.job = j.job
 WHERE j.schedule IS NOT NULL AND r.status IN ('running', 'success') AND r.slot > clock_timestamp()
"""


def _registration(data: st.DataObject, jobs: list[str], zone: st.SearchStrategy[Any],
                  schedule: st.SearchStrategy[Any]) -> dict[str, Any]:
    return {
        "job": data.draw(st.sampled_from(jobs), label="job"),
        "schedule": data.draw(schedule, label="schedule"),
        "ttl": data.draw(st.sampled_from([None, *TTLS]), label="ttl"),
        "max_backfill": data.draw(st.sampled_from([1, 2, 5, 1000]), label="max_backfill"),
        "time_zone": data.draw(zone, label="time_zone"),
    }


@SEQUENCES
@given(data=st.data())
def test_call_sequences_keep_the_property_and_leave_every_view_readable(fuzz: Fuzz, data: st.DataObject) -> None:
    """A valid but odd registration (any schedule, any zone), then calls that
    use it and the seeded jobs, each checked; then every view of schema
    ledger reads without error, and ledger.overlaps is empty."""
    fuzz.restore()
    sigs = fuzz.sigs  # type: ignore[attr-defined]
    history = History(fuzz)
    registration = _registration(data, ["fz", "every", "nightly", "minutely", "plain", "paused"],
                                 zones(valid_only=True), schedules(valid_only=True))
    history.call(Call(sigs["register_job"], registration), data.draw(sessions, label="session"))
    for _ in range(data.draw(st.integers(2, 6), label="steps")):
        sig = sigs[data.draw(st.sampled_from(STEPS), label="function")]
        values = draw_values(data, sig, live_values(fuzz.observer))
        history.call(Call(sig, values), data.draw(sessions, label="session"))
    history.check_views(data.draw(sessions, label="session"))


# Zones at some of their odd offset changes (UTC instants near them): a
# skipped day, 30-minute and 2-hour DST, DST at midnight, negative DST, a
# permanent change of offset. Examples land within 40 hours either side.
TRANSITIONS = [
    ("Pacific/Apia", "2011-12-30 10:00"), ("Pacific/Kiritimati", "1994-12-31 10:00"),
    ("Australia/Lord_Howe", "2020-10-03 15:30"), ("Australia/Lord_Howe", "2021-04-03 14:30"),
    ("Antarctica/Troll", "2020-03-29 01:00"), ("Africa/Casablanca", "2020-04-19 02:00"),
    ("America/Santiago", "2020-09-06 04:00"), ("America/Havana", "2020-03-08 05:00"),
    ("America/Sao_Paulo", "2018-11-04 03:00"), ("Europe/Dublin", "2020-10-25 01:00"),
    ("Europe/Berlin", "2020-03-29 01:00"), ("Europe/Berlin", "2020-10-25 01:00"),
    ("America/New_York", "2020-03-08 07:00"), ("America/New_York", "2020-11-01 06:00"),
    ("Europe/Moscow", "2011-03-26 23:00"), ("Europe/Moscow", "2014-10-25 22:00"),
    ("Pacific/Chatham", "2020-09-26 14:00"), ("America/St_Johns", "2020-11-01 03:30"),
    ("Asia/Gaza", "2023-04-28 23:00"), ("Asia/Tehran", "2022-09-21 19:30"),
]
DST_SCHEDULES = ["30 2 * * *", "0,30 2 * * *", "*/15 2 * * *", "0 0 * * *", "30 0 * * *", "*/30 * * * *",
                 "0 1 * * *", "59 23 * * *", "0 3 * * *", "15 1,2,3 * * *", "* 2 * * *", "0 * * * *",
                 "1 day", "24 hours", "90 minutes", "1 week", "1 month", "45 minutes", "1 day 30 minutes"]


@SEQUENCES
@given(data=st.data())
def test_the_slots_due_slots_gives_in_an_odd_zone_are_slots_start_run_accepts(fuzz: Fuzz,
                                                                              data: st.DataObject) -> None:
    """Schedule arithmetic at odd offset changes: register a job there, ask
    due_slots at an instant near the change, start (and end) a run for each
    slot it gives, then catch up with start_due_run (which counts the slots
    dropped since). Every call keeps the property; moreover a slot that
    due_slots gave is one start_run accepts (started or already_done)."""
    fuzz.restore()
    sigs = fuzz.sigs  # type: ignore[attr-defined]
    history = History(fuzz)
    zone, near = data.draw(st.sampled_from(TRANSITIONS), label="zone and change")
    session = data.draw(sessions, label="session")
    registration = _registration(data, ["dst", "every"], st.just(zone),
                                 st.one_of(st.sampled_from(DST_SCHEDULES), schedules(valid_only=True)))
    registration["ttl"] = "1 hour"
    if not history.call(Call(sigs["register_job"], registration), session).ok:  # type: ignore[union-attr]
        return
    job = registration["job"]
    minutes = data.draw(st.integers(-40 * 60, 40 * 60), label="minutes from the change")
    at = (datetime.fromisoformat(near) + timedelta(minutes=minutes, seconds=data.draw(
        st.sampled_from([0, 0, 1, 59]), label="seconds"))).isoformat(sep=" ") + "+00"
    due = history.call(Call(sigs["due_slots"], {"job": job, "at": at}), session)
    assert due is not None and due.ok, f"due_slots refused {at}\n{history}"
    # The same slots in ISO and UTC: a DateStyle such as 'German, MDY' does
    # not read back what it writes, which is PostgreSQL's affair.
    slots = [row[0] for row in fuzz.observer.execute(
        "SELECT to_char(s AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00'"
        " FROM ledger.due_slots(%s, %s::timestamptz) s", [job, at]).fetchall()]
    assert len(slots) == len(due.rows or []), f"due_slots depends on the session's settings\n{history}"
    for slot in slots[: data.draw(st.integers(1, 3), label="slots to run")]:
        session = data.draw(sessions, label="session")
        started = history.call(Call(sigs["start_run"], {"job": job, "owner": "host-1", "slot": slot}), session)
        assert started is not None and started.ok and started.rows, (
            f"FUZZ FINDING: due_slots({job!r}, at => {at!r}) gave slot {slot!r}, which start_run refuses\n"
            f"registration: {registration}\n{history}")
        outcome, run_id, token = started.rows[0][0].strip("()").split(",")[:3]
        assert outcome in {"started", "already_done"}, f"{outcome} for a due slot\n{history}"
        if outcome == "started":
            end = data.draw(st.sampled_from(["complete_run", "fail_run"]), label="end")
            history.call(Call(sigs[end], {"run_id": int(run_id), "token": int(token), "error": "boom"}
                              if end == "fail_run" else {"run_id": int(run_id), "token": int(token)}), session)
    history.call(Call(sigs["start_due_run"], {"job": job, "owner": "host-2"}), data.draw(sessions, label="session"))
    history.check_views(session)


# ------------------------------------------------------------------ canaries: the fuzz can fail

CANARY_SQL = """
CREATE SCHEMA fuzz_canary;
-- Checks its label like the ledger, and then divides by zero for every odd
-- max_backfill: SQLSTATE 22012, which no contract documents.
CREATE FUNCTION fuzz_canary.broken(job text, max_backfill integer DEFAULT 1) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF max_backfill IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument max_backfill must not be null';
    ELSIF max_backfill < 1 OR max_backfill > 1000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'argument max_backfill out of range';
    END IF;
    RETURN 1 / (max_backfill % 2 - 1);
END
$$;
-- Accepts anything: invalid labels, NULLs, a ttl of a century.
CREATE FUNCTION fuzz_canary.lax(job text, owner text, ttl interval DEFAULT NULL) RETURNS boolean
LANGUAGE sql AS $$ SELECT true $$;
"""


def _canary_run(fuzz: Fuzz, function: str) -> str:
    sig = signatures(fuzz.observer, "fuzz_canary")[function]

    @CANARY
    @given(data=st.data())
    def canary(data: st.DataObject) -> None:
        fuzz.restore()
        values = draw_values(data, sig, fuzz.live)  # type: ignore[attr-defined]
        fuzz.check_call(Call(sig, values), data.draw(sessions, label="session"), skip=lambda: assume(False))

    with pytest.raises(AssertionError) as caught:
        canary()
    return str(caught.value)


def test_canary_an_undocumented_sqlstate_fails_the_fuzz(fuzz: Fuzz) -> None:
    fuzz.observer.execute(CANARY_SQL)
    report = _canary_run(fuzz, "broken")
    assert "FUZZ FINDING in fuzz_canary.broken" in report
    assert "undocumented SQLSTATE 22012" in report
    assert "job = " in report and "session: TimeZone=" in report


def test_canary_a_value_out_of_bounds_that_succeeds_fails_the_fuzz(fuzz: Fuzz) -> None:
    fuzz.observer.execute(CANARY_SQL)
    report = _canary_run(fuzz, "lax")
    assert "FUZZ FINDING in fuzz_canary.lax" in report
    assert "succeeded, yet the contract's bounds refuse it" in report


def test_canary_a_failed_call_that_changed_a_table_fails_the_fuzz(fuzz: Fuzz, fuzz_dsn: str) -> None:
    # A change that outlives the failed call's rollback: an autonomous write
    # through dblink, then the ledger's own 22023 for an invalid label.
    if value(fuzz.observer, "SELECT count(*) FROM pg_available_extensions WHERE name = 'dblink'") == 0:
        pytest.skip("needs dblink (apt-get install postgresql-contrib): on the server")
    fuzz.observer.execute("CREATE SCHEMA fuzz_canary; CREATE SCHEMA IF NOT EXISTS fuzz_dblink;"
                          " CREATE EXTENSION IF NOT EXISTS dblink SCHEMA fuzz_dblink")
    fuzz.observer.execute(sql.SQL("""
        CREATE FUNCTION fuzz_canary.leaky(job text) RETURNS boolean LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM fuzz_dblink.dblink_exec({}, 'UPDATE ledger.counters SET failures = failures + 1');
            PERFORM ledger._check_label(job, 'job');
            RETURN true;
        END
        $$""").format(sql.Literal(fuzz_dsn)))
    report = _canary_run(fuzz, "leaky")
    assert "FUZZ FINDING in fuzz_canary.leaky" in report
    assert "the call raised, yet it changed the ledger's tables" in report
    assert "counters: -" in report and "counters: +" in report


def test_the_allowed_sqlstates_are_the_documented_ones() -> None:
    # 40001 stays out: the fuzz has one connection, and without a concurrent
    # transaction REPEATABLE READ and SERIALIZABLE cannot fail to serialize.
    # A code whose row says it is a WARNING (LD007) is never raised: no call may fail with it.
    table = [code for code, when in re.findall(r"^\| (LD\d{3}) \|[^|]*\| (.*)$", CONTRACT.read_text(), re.MULTILINE)
             if not when.startswith("a **WARNING**")]
    assert ALLOWED_SQLSTATES == {"22004", "22023", *table}
