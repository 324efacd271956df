"""ledger.run_guarded: guarding a SQL job from pg_cron (docs/pg_cron.md).

The first half runs the procedure on the normal test database: a CALL from
an autocommit connection, a concurrent CALL while the first is inside its
command, a failing or cancelled command, catch-up slots, fencing, bad input,
a CALL inside a transaction block. The second half (marked `cluster`) starts
a private cluster with pg_cron preloaded and lets pg_cron itself make the
calls: two schedules of one job at the same minute, a failing command, the
reaper closing a crashed run, fenced writes; and the docs' cron lines are
scheduled and their commands run. Waits poll for a condition with a generous
deadline; nothing asserts on a duration.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cluster import Cluster, _bindir
from repo import ROOT
from sqlhelp import one, rows, state, value
from waiting import wait_for

TIMEOUT = 60.0          # seconds: a condition not reached by then is a hang
CRON_TIMEOUT = 150.0    # pg_cron fires on minute boundaries: up to a minute, plus margin
GATE = 4711             # advisory lock key that holds a command inside its run


def call(conn: psycopg.Connection, job: Any, command: Any, **extra: Any) -> None:
    """CALL ledger.run_guarded in named notation, parameters bound (extended protocol)."""
    names = ", ".join(f"{name} => %({name})s" for name in ["job", "command", *extra])
    conn.execute(f"CALL ledger.run_guarded({names})", {"job": job, "command": command, **extra})


class Notice:
    """A notice's fields, copied: psycopg's Diagnostic is only valid inside the handler."""

    def __init__(self, diag: psycopg.errors.Diagnostic) -> None:
        self.message_primary = diag.message_primary or ""
        self.message_detail = diag.message_detail
        self.message_hint = diag.message_hint


def notices(conn: psycopg.Connection) -> list[Notice]:
    seen: list[Notice] = []
    conn.add_notice_handler(lambda diag: seen.append(Notice(diag)))
    return seen


class Caller(threading.Thread):
    """A CALL on its own connection, in a thread: the error it raised, if any."""

    def __init__(self, conn: psycopg.Connection, job: str, command: str, **extra: Any) -> None:
        super().__init__(daemon=True)
        self.conn, self.job, self.command, self.extra = conn, job, command, extra
        self.pid = conn.info.backend_pid
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            call(self.conn, self.job, self.command, **self.extra)
        except BaseException as error:  # reported to the test
            self.error = error

    def finish(self) -> None:
        self.join(TIMEOUT)
        assert not self.is_alive(), "the CALL hangs"


def waiting_on_the_gate(conn: psycopg.Connection, pid: int) -> bool:
    return value(conn, "SELECT wait_event_type = 'Lock' AND wait_event = 'advisory' FROM pg_stat_activity "
                       "WHERE pid = %s", (pid,)) is True


# ------------------------------------------------------------ without pg_cron


def test_a_call_from_an_autocommit_connection_runs_the_command_and_records_success(db):
    db.execute("CREATE TABLE seen (job text, owner text, run_id bigint, token bigint, slot text)")
    said = notices(db)
    call(db, "nightly", """
        INSERT INTO seen SELECT current_setting('ledger.job'), current_setting('ledger.owner'),
                                current_setting('ledger.run_id')::bigint, current_setting('ledger.token')::bigint,
                                current_setting('ledger.slot')""", ttl="10 minutes")
    run = one(db, "SELECT * FROM ledger.job_execution_log")
    assert run["status"] == "success" and run["job"] == "nightly" and run["error"] is None
    # The command saw its own run, through the transaction-local settings...
    assert rows(db, "SELECT * FROM seen") == [
        {"job": "nightly", "owner": run["owner"], "run_id": run["run_id"], "token": run["token"], "slot": ""}]
    # ...which are gone once the CALL committed.
    assert value(db, "SELECT coalesce(current_setting('ledger.token', true), '')") == ""
    # The default owner names the backend: '<application>:<database>:<pid>'.
    dbname = value(db, "SELECT current_database()")
    assert run["owner"] == f"sql:{dbname}:{db.info.backend_pid}"
    assert one(db, "SELECT released_at IS NOT NULL AS released FROM ledger.leases WHERE job = 'nightly'") == {
        "released": True}
    assert value(db, "SELECT successes FROM ledger.job_counters WHERE job = 'nightly'") == 1
    assert [n.message_primary for n in said] == [
        f"ledger.run_guarded: job nightly run {run['run_id']} (token {run['token']}) succeeded"]


def test_an_explicit_owner_and_the_registered_ttl_are_used(db):
    db.execute("SELECT ledger.register_job('nightly', ttl => '7 minutes')")
    call(db, "nightly", "SELECT 1", owner="db-host-1")
    run = one(db, "SELECT owner, token FROM ledger.job_execution_log")
    assert run["owner"] == "db-host-1"
    assert value(db, "SELECT ttl FROM ledger.leases WHERE job = 'nightly'") == timedelta(minutes=7)


def test_the_run_is_visible_while_the_command_runs_and_a_concurrent_call_is_skipped(connect):
    observer, gate = connect(), connect()
    gate.execute("SELECT pg_advisory_lock(%s)", (GATE,))
    first = Caller(connect(), "nightly", f"SELECT pg_advisory_xact_lock({GATE})", ttl="10 minutes")
    first.start()
    wait_for(lambda: waiting_on_the_gate(observer, first.pid), what="the first CALL to be inside its command")

    # The start committed before the command: the run is there for everyone.
    running = one(observer, "SELECT run_id, owner, status FROM ledger.job_execution_log")
    assert running["status"] == "running" and running["owner"].endswith(f":{first.pid}")

    second = connect()
    said = notices(second)
    call(second, "nightly", "SELECT 1", ttl="10 minutes")  # a skip is not an error
    assert value(observer, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'nightly'") == 1
    assert value(observer, "SELECT count(*) FROM ledger.job_execution_log") == 1
    assert len(said) == 1 and said[0].message_primary.startswith(
        f"ledger.run_guarded: job nightly skipped (skipped_overlap): held by {running['owner']} until ")

    gate.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
    first.finish()
    assert first.error is None
    assert rows(observer, "SELECT run_id, status FROM ledger.job_execution_log") == [
        {"run_id": running["run_id"], "status": "success"}]
    assert value(observer, "SELECT count(*) FROM ledger.overlaps") == 0
    assert value(observer, "SELECT failures FROM ledger.job_counters WHERE job = 'nightly'") == 0


def test_a_failing_command_is_recorded_with_its_error_and_the_call_raises_it(db):
    db.execute("CREATE TABLE written (n int)")
    with pytest.raises(psycopg.errors.DivisionByZero) as raised:
        call(db, "nightly", "INSERT INTO written VALUES (1); SELECT 1/0", ttl="10 minutes")
    run = one(db, "SELECT * FROM ledger.job_execution_log")
    assert run["status"] == "failure" and run["failure_reason"] == "error"
    assert run["error"] == "22012: division by zero"
    assert run["detail"]["sqlstate"] == "22012" and "EXECUTE" in run["detail"]["error_context"]
    # The command's writes rolled back with it; the lease is free again.
    assert value(db, "SELECT count(*) FROM written") == 0
    assert value(db, "SELECT failures FROM ledger.job_counters WHERE job = 'nightly'") == 1
    assert raised.value.diag.message_primary == "division by zero"
    assert f"run {run['run_id']}" in raised.value.diag.message_hint
    call(db, "nightly", "SELECT 1", ttl="10 minutes")
    assert value(db, "SELECT array_agg(status ORDER BY run_id) FROM ledger.job_execution_log") == [
        "failure", "success"]


def test_the_callers_own_error_keeps_its_sqlstate_detail_and_hint(db):
    with pytest.raises(psycopg.Error) as raised:
        call(db, "nightly", "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'XX123', MESSAGE = 'feed is down', "
                            "DETAIL = 'upstream 503', HINT = 'retry later'; END $$", ttl="10 minutes")
    assert raised.value.sqlstate == "XX123"
    assert (raised.value.diag.message_primary, raised.value.diag.message_detail, raised.value.diag.message_hint) == (
        "feed is down", "upstream 503", "retry later")
    run = one(db, "SELECT error, detail FROM ledger.job_execution_log")
    assert run["error"] == "XX123: feed is down"
    assert run["detail"]["error_detail"] == "upstream 503" and run["detail"]["error_hint"] == "retry later"


def test_a_cancelled_command_is_recorded_as_cancelled(db):
    db.execute("SET statement_timeout = '1s'")
    with pytest.raises(psycopg.errors.QueryCanceled):
        call(db, "nightly", "SELECT pg_sleep(60)", ttl="10 minutes")
    db.execute("RESET statement_timeout")
    run = one(db, "SELECT status, failure_reason, error FROM ledger.job_execution_log")
    assert run == {"status": "failure", "failure_reason": "cancelled",
                   "error": "57014: canceling statement due to statement timeout"}
    assert value(db, "SELECT released_at IS NOT NULL FROM ledger.leases WHERE job = 'nightly'") is True


def test_a_scheduled_job_runs_each_due_slot_as_its_own_run_oldest_first(db):
    db.execute("CREATE TABLE served (slot timestamptz, token bigint)")
    db.execute("SELECT ledger.register_job('hourly', '1 hour', ttl => '10 minutes', max_backfill => 5)")
    now = value(db, "SELECT date_trunc('hour', clock_timestamp())")
    seeded = one(db, "SELECT run_id, token FROM ledger.start_run('hourly', 'seed', slot => %s)",
                 (now - timedelta(hours=3),))
    db.execute("SELECT ledger.complete_run(%s, %s)", (seeded["run_id"], seeded["token"]))
    command = ("INSERT INTO served SELECT current_setting('ledger.slot')::timestamptz, "
               "current_setting('ledger.token')::bigint")
    call(db, "hourly", command)
    served = rows(db, "SELECT slot, token FROM served ORDER BY slot")
    assert [r["slot"] for r in served] == [now - timedelta(hours=2), now - timedelta(hours=1), now]
    assert rows(db, "SELECT slot, token FROM ledger.job_execution_log WHERE owner <> 'seed' AND status = 'success' "
                    "ORDER BY slot") == served
    assert len({r["token"] for r in served}) == 3
    said = notices(db)
    call(db, "hourly", command)  # nothing is due any more
    assert [n.message_primary for n in said] == ["ledger.run_guarded: job hourly not run (nothing_due)"]
    assert value(db, "SELECT count(*) FROM served") == 3


def test_a_scheduled_job_stops_at_its_first_failing_slot(db):
    db.execute("SELECT ledger.register_job('hourly', '1 hour', ttl => '10 minutes', max_backfill => 5)")
    now = value(db, "SELECT date_trunc('hour', clock_timestamp())")
    seeded = one(db, "SELECT run_id, token FROM ledger.start_run('hourly', 'seed', slot => %s)",
                 (now - timedelta(hours=3),))
    db.execute("SELECT ledger.complete_run(%s, %s)", (seeded["run_id"], seeded["token"]))
    with pytest.raises(psycopg.errors.DivisionByZero):
        call(db, "hourly", "SELECT 1/0")
    # One failed run for the oldest due slot, not a tight loop over it.
    assert rows(db, "SELECT slot, status FROM ledger.job_execution_log WHERE owner <> 'seed'") == [
        {"slot": now - timedelta(hours=2), "status": "failure"}]


def test_a_paused_job_is_not_run(db):
    db.execute("CREATE TABLE written (n int)")
    db.execute("SELECT ledger.register_job('nightly', ttl => '10 minutes')")
    db.execute("SELECT ledger.pause_job('nightly')")
    said = notices(db)
    call(db, "nightly", "INSERT INTO written VALUES (1)")
    assert [n.message_primary for n in said] == ["ledger.run_guarded: job nightly not run (paused)"]
    assert value(db, "SELECT count(*) FROM written") == 0
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == 0


def test_the_command_fences_its_write_with_the_token_of_the_setting_and_a_stale_token_is_refused(db):
    db.execute("CREATE TABLE articles (token bigint)")
    fenced = ("INSERT INTO articles SELECT ledger.fence(job => current_setting('ledger.job'), resource => 'articles', "
              "token => current_setting('ledger.token')::bigint {stale})")
    call(db, "publish", fenced.format(stale=""), ttl="10 minutes")
    call(db, "publish", fenced.format(stale=""), ttl="10 minutes")
    assert value(db, "SELECT array_agg(token ORDER BY token) FROM articles") == [1, 2]
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'articles'") == 2
    # A command that writes with an older token (a zombie's) is refused, and
    # its write goes with it.
    with pytest.raises(psycopg.Error) as raised:
        call(db, "publish", fenced.format(stale="- 1"), ttl="10 minutes")
    assert raised.value.sqlstate == "LD001"
    run = one(db, "SELECT token, status, error FROM ledger.job_execution_log ORDER BY run_id DESC LIMIT 1")
    assert run["token"] == 3 and run["status"] == "failure" and run["error"].startswith("LD001: lease superseded")
    assert value(db, "SELECT count(*) FROM articles") == 2
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'articles'") == 2


def test_a_run_that_lost_its_lease_while_the_command_ran_rolls_its_writes_back(connect):
    observer, gate = connect(), connect()
    observer.execute("CREATE TABLE written (n int)")
    gate.execute("SELECT pg_advisory_lock(%s)", (GATE,))
    zombie = Caller(connect(), "nightly",
                    f"INSERT INTO written VALUES (1); SELECT pg_advisory_xact_lock({GATE})", ttl="1 second")
    zombie.start()
    wait_for(lambda: waiting_on_the_gate(observer, zombie.pid), what="the CALL to be inside its command")
    token = value(observer, "SELECT token FROM ledger.job_execution_log")
    wait_for(lambda: value(observer, "SELECT NOT ledger.is_current('nightly', %s)", (token,)),
             what="the 1-second lease to expire")
    taken = one(observer, "SELECT * FROM ledger.start_run('nightly', 'host-2', '10 minutes')")
    assert taken["outcome"] == "started"
    said = notices(zombie.conn)
    gate.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
    zombie.finish()
    # The zombie learns it lost (LD001) and its write is rolled back.
    assert isinstance(zombie.error, psycopg.Error) and zombie.error.sqlstate == "LD001"
    assert value(observer, "SELECT count(*) FROM written") == 0
    assert rows(observer, "SELECT token, status, failure_reason FROM ledger.job_execution_log ORDER BY run_id") == [
        {"token": token, "status": "failure", "failure_reason": "lease_expired"},
        {"token": taken["token"], "status": "running", "failure_reason": None}]
    assert any("lost its lease while the command ran" in n.message_primary for n in said)


LONG = "x" * 201

BAD_INPUT = [
    ({"job": None, "command": "SELECT 1", "ttl": "1 minute"}, "22004", "job"),
    ({"job": "", "command": "SELECT 1", "ttl": "1 minute"}, "22023", "job"),
    ({"job": LONG, "command": "SELECT 1", "ttl": "1 minute"}, "22023", "job"),
    ({"job": "nightly\n", "command": "SELECT 1", "ttl": "1 minute"}, "22023", "job"),
    ({"job": "nightly", "command": None, "ttl": "1 minute"}, "22004", "command"),
    ({"job": "nightly", "command": "", "ttl": "1 minute"}, "22023", "command"),
    ({"job": "nightly", "command": " \n\t ", "ttl": "1 minute"}, "22023", "command"),
    ({"job": "nightly", "command": "SELECT 1", "owner": "", "ttl": "1 minute"}, "22023", "owner"),
    ({"job": "nightly", "command": "SELECT 1", "owner": "host\u202e1", "ttl": "1 minute"}, "22023", "owner"),
    ({"job": "nightly", "command": "SELECT 1", "ttl": "0 seconds"}, "22023", "ttl"),
    ({"job": "nightly", "command": "SELECT 1", "ttl": "-1 minute"}, "22023", "ttl"),
    ({"job": "nightly", "command": "SELECT 1", "ttl": "31 days"}, "22023", "ttl"),
    ({"job": "unregistered", "command": "SELECT 1"}, "22023", "ttl"),
]


@pytest.mark.parametrize("arguments, sqlstate, argument", BAD_INPUT)
def test_bad_input_raises_22004_or_22023_naming_the_argument_and_changes_nothing(db, arguments, sqlstate, argument):
    db.execute("CREATE TABLE written (n int)")
    arguments = dict(arguments)
    if arguments["command"] == "SELECT 1":
        arguments["command"] = "INSERT INTO written VALUES (1)"
    before = state(db)
    with pytest.raises(psycopg.Error) as raised:
        call(db, **arguments)
    assert raised.value.sqlstate == sqlstate
    assert f"argument {argument}" in raised.value.diag.message_primary
    if sqlstate == "22023":
        assert f'"argument": "{argument}"' in raised.value.diag.message_detail
    assert state(db) == before
    assert value(db, "SELECT count(*) FROM written") == 0


def test_a_call_inside_a_transaction_block_raises_a_clear_error_and_changes_nothing(connect):
    db = connect()
    db.execute("CREATE TABLE written (n int)")
    before = state(db)
    block = connect(autocommit=False)
    with pytest.raises(psycopg.errors.ActiveSqlTransaction) as raised:
        # Unparameterised: the simple protocol, as psql sends it after BEGIN.
        block.execute("CALL ledger.run_guarded(job => 'nightly', command => 'INSERT INTO written VALUES (1)', "
                      "ttl => '1 minute')")
    assert raised.value.diag.message_primary.startswith(
        "ledger.run_guarded must be called outside a transaction block")
    assert "autocommit" in raised.value.diag.message_hint
    block.rollback()
    # Where it cannot tell beforehand (a parameterised CALL in a block, a call
    # from a function), PostgreSQL refuses its first COMMIT, before any work.
    with pytest.raises(psycopg.errors.InvalidTransactionTermination):
        call(block, "nightly", "INSERT INTO written VALUES (1)", ttl="1 minute")
    block.rollback()
    db.execute("CREATE FUNCTION guarded_from_a_function() RETURNS void LANGUAGE plpgsql AS "
               "$$ BEGIN CALL ledger.run_guarded(job => 'nightly', command => 'INSERT INTO written VALUES (1)', "
               "ttl => '1 minute'); END $$")
    with pytest.raises(psycopg.errors.InvalidTransactionTermination):
        db.execute("SELECT guarded_from_a_function()")
    assert state(db) == before
    assert value(db, "SELECT count(*) FROM written") == 0


def test_a_client_role_calls_it_and_the_command_runs_with_the_callers_privileges(db):
    name = f"test_cron_app_{os.getpid()}"
    db.execute(f"DROP ROLE IF EXISTS {name}")
    db.execute(f"CREATE ROLE {name} NOLOGIN IN ROLE ledger_client")
    try:
        db.execute("CREATE TABLE mine (who text)")
        db.execute(f"GRANT INSERT ON mine TO {name}")
        db.execute(f"SET ROLE {name}")
        call(db, "nightly", "INSERT INTO mine SELECT current_user", ttl="1 minute")
        assert value(db, "SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'") == 1
        # The command is the caller's: no privilege it did not have.
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            call(db, "nightly", "DELETE FROM ledger.job_execution_log", ttl="1 minute")
        db.execute("RESET ROLE")
        assert value(db, "SELECT who FROM mine") == name
        assert value(db, "SELECT array_agg(status ORDER BY run_id) FROM ledger.job_execution_log") == [
            "success", "failure"]
    finally:
        db.execute("RESET ROLE")
        db.execute(f"DROP OWNED BY {name}")
        db.execute(f"DROP ROLE {name}")


def test_the_procedure_is_not_security_definer_and_only_ledger_client_may_call_it(db):
    proc = one(db, "SELECT prokind, prosecdef, proconfig FROM pg_proc "
                   "WHERE oid = 'ledger.run_guarded(text, text, text, interval)'::regprocedure")
    assert proc == {"prokind": "p", "prosecdef": False, "proconfig": None}
    routine = "ledger.run_guarded(text, text, text, interval)"
    assert value(db, "SELECT has_function_privilege('ledger_client', %s, 'EXECUTE')", (routine,)) is True
    assert value(db, "SELECT has_function_privilege('ledger_reader', %s, 'EXECUTE')", (routine,)) is False
    assert value(db, "SELECT has_function_privilege('public', %s, 'EXECUTE')", (routine,)) is False


# --------------------------------------------------------------- with pg_cron

SCHEDULE = "* * * * *"  # pg_cron 1.4 (Debian 12) has no seconds schedules
GATED = ("DO $gate$ BEGIN WHILE NOT EXISTS (SELECT FROM public.gate) LOOP PERFORM pg_sleep(0.05); END LOOP; "
         "END $gate$")
FENCED = ("INSERT INTO public.articles (run_id, token) SELECT current_setting('ledger.run_id')::bigint, "
          "ledger.fence(job => current_setting('ledger.job'), resource => '{resource}', "
          "token => current_setting('ledger.token')::bigint {stale})")
CRON_JOBS = {
    # two schedules of one job, firing at the same minute
    "overlap-a": f"CALL ledger.run_guarded(job => 'overlap', command => $$ {GATED} $$)",
    "overlap-b": f"CALL ledger.run_guarded(job => 'overlap', command => $$ {GATED} $$)",
    "failing": "CALL ledger.run_guarded(job => 'failing', command => $$SELECT 1/0$$)",
    "fenced": f"CALL ledger.run_guarded(job => 'fenced', command => $${FENCED.format(resource='articles', stale='')}$$)",
    "fenced-stale": "CALL ledger.run_guarded(job => 'fenced-stale', command => "
                    f"$${FENCED.format(resource='stale-articles', stale='- 1')}$$)",
    "ledger-reaper": "SELECT ledger.reap_expired()",
}


def _pg_cron_missing(bindir: Path) -> str | None:
    libdirs = [bindir.parent / "lib"]
    if (bindir / "pg_config").exists():
        found = subprocess.run([str(bindir / "pg_config"), "--pkglibdir"], capture_output=True, text=True)
        libdirs.insert(0, Path(found.stdout.strip()))
    if any((libdir / "pg_cron.so").exists() for libdir in libdirs):
        return None
    version = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True).stdout
    major = m.group(1) if (m := re.search(r"(\d+)(?:\.\d+)+", version)) else "NN"
    return f"needs pg_cron (apt-get install postgresql-{major}-cron): for the PostgreSQL server in {bindir}"


class CronRun:
    """What one minute of pg_cron did on a private cluster."""

    def __init__(self, cluster: Cluster, jobids: dict[str, int], crashed_run: int,
                 overlap: dict[str, Any]) -> None:
        self.cluster, self.jobids, self.crashed_run = cluster, jobids, crashed_run
        self.overlap = overlap  # job overlap as it was seen while held, and once its run ended

    def details(self, *names: str) -> list[dict[str, Any]]:
        with self.cluster.connect() as conn:
            return rows(conn, "SELECT jobid, status, return_message FROM cron.job_run_details "
                              "WHERE jobid = ANY(%s) ORDER BY runid", ([self.jobids[n] for n in names],))

    def runs(self, job: str) -> list[dict[str, Any]]:
        with self.cluster.connect() as conn:
            return rows(conn, "SELECT * FROM ledger.job_execution_log WHERE job = %s ORDER BY run_id", (job,))

    def value(self, query: str, params: Any = None) -> Any:
        with self.cluster.connect() as conn:
            return value(conn, query, params)


@pytest.fixture(scope="module")
def cron_run() -> Iterator[CronRun]:
    bindir = _bindir()
    if bindir is None:
        pytest.skip("needs initdb and pg_ctl (apt-get install postgresql): a private cluster")
    missing = _pg_cron_missing(bindir)
    if missing:
        pytest.skip(missing)
    root = Path(tempfile.mkdtemp(prefix="ledger-cron-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    cluster = Cluster(root, "cron")
    try:
        cluster.initdb()
        cluster.configure(shared_preload_libraries="pg_cron", **{"cron.database_name": "postgres",
                                                                  "cron.host": "127.0.0.1"})
        cluster.start()
        cluster.install_ledger()
        yield _one_minute_of_cron(cluster)
    finally:
        cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def _one_minute_of_cron(cluster: Cluster) -> CronRun:
    app = "ledger_cron_app"
    with cluster.connect() as conn:
        conn.execute("CREATE EXTENSION pg_cron")
        conn.execute(f"CREATE ROLE {app} LOGIN IN ROLE ledger_client")
        conn.execute("CREATE TABLE public.gate (opened boolean)")
        conn.execute("CREATE TABLE public.articles (run_id bigint, token bigint)")
        conn.execute(f"GRANT SELECT ON public.gate TO {app}")
        conn.execute(f"GRANT SELECT, INSERT ON public.articles TO {app}")
        for job in ("overlap", "failing", "fenced", "fenced-stale"):
            conn.execute("SELECT ledger.register_job(%s, ttl => '10 minutes')", (job,))
        # fenced-stale had a run before: its cron run's token minus one is a real, stale token.
        call(conn, "fenced-stale", "SELECT 1")

        # A crashed run: its backend dies inside the command, its 1-second lease runs out.
        victim = Caller(cluster.connect(), "crashed", "SELECT pg_sleep(600)", ttl="1 second")
        victim.start()
        wait_for(lambda: value(conn, "SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = %s",
                               (victim.pid,)), what="the crashing CALL to be inside its command")
        conn.execute("SELECT pg_terminate_backend(%s)", (victim.pid,))
        victim.finish()
        victim.conn.close()
        assert isinstance(victim.error, psycopg.OperationalError)
        crashed = one(conn, "SELECT run_id, status FROM ledger.job_execution_log WHERE job = 'crashed'")
        assert crashed["status"] == "running"
        # Expired before the schedules exist: the reaper's first call closes it.
        wait_for(lambda: value(conn, "SELECT expires_at < clock_timestamp() FROM ledger.leases WHERE job = 'crashed'"),
                 what="the crashed run's lease to expire")

        # Every schedule in one transaction: they fire at the same minute.
        with conn.transaction():
            jobids = {name: value(conn, "SELECT cron.schedule_in_database(%s, %s, %s, 'postgres', %s)",
                                  (name, SCHEDULE, command, app))
                      for name, command in CRON_JOBS.items()}

        def explain() -> str:
            with cluster.connect() as diag:
                details = rows(diag, "SELECT jobid, status, return_message FROM cron.job_run_details ORDER BY runid")
                runs = rows(diag, "SELECT run_id, job, owner, status, error FROM ledger.job_execution_log")
                counters = rows(diag, "SELECT * FROM ledger.job_counters")
            log = cluster.logfile.read_text(errors="replace")[-6000:]
            return f"cron jobs {jobids}\nruns of cron {details}\nledger {runs}\ncounters {counters}\nlog:\n{log}"

        def fired(*names: str) -> bool:
            return value(conn, "SELECT count(DISTINCT jobid) FROM cron.job_run_details "
                               "WHERE jobid = ANY(%s) AND status IN ('succeeded', 'failed')",
                         ([jobids[n] for n in names],)) == len(names)

        # The overlap: one run held inside its command, the other schedule skipped.
        wait_for(lambda: value(conn, "SELECT skipped_overlap >= 1 FROM ledger.job_counters WHERE job = 'overlap'"),
                 CRON_TIMEOUT, "pg_cron to fire both schedules of job overlap", explain=explain)
        while_held = rows(conn, "SELECT status, owner FROM ledger.job_execution_log WHERE job = 'overlap'")
        wait_for(lambda: fired("failing", "fenced", "fenced-stale"), CRON_TIMEOUT, "the other cron jobs",
                 explain=explain)
        wait_for(lambda: value(conn, "SELECT status <> 'running' FROM ledger.job_execution_log WHERE run_id = %s",
                               (crashed["run_id"],)), CRON_TIMEOUT, "the reaper to close the crashed run",
                 explain=explain)
        # pg_cron 1.4 cancels a job that is unscheduled while it runs ('job
        # canceled'): unschedule each one once it is idle.
        idle = [jobids[name] for name in ("failing", "fenced", "fenced-stale", "ledger-reaper")]
        wait_for(lambda: value(conn, "SELECT count(*) = 0 FROM cron.job_run_details WHERE jobid = ANY(%s) "
                                     "AND status NOT IN ('succeeded', 'failed')", (idle,)),
                 what="the other cron jobs to be idle", explain=explain)
        for jobid in idle:
            conn.execute("SELECT cron.unschedule(%s::bigint)", (jobid,))
        holder_pid = int(while_held[0]["owner"].rsplit(":", 1)[1])
        # Before the gate opens, no other call of pg_cron is still on its way.
        wait_for(lambda: value(conn, "SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name = 'pg_cron' "
                                     "AND backend_type = 'client backend' AND pid <> %s", (holder_pid,)),
                 what="pg_cron's other connections to end", explain=explain)
        conn.execute("INSERT INTO public.gate VALUES (true)")
        overlap = [jobids["overlap-a"], jobids["overlap-b"]]
        wait_for(lambda: value(conn, "SELECT count(*) = 0 FROM cron.job_run_details WHERE jobid = ANY(%s) "
                                     "AND status NOT IN ('succeeded', 'failed')", (list(jobids.values()),)),
                 what="every cron run to end", explain=explain)
        seen = {"while_held": while_held,
                "runs": rows(conn, "SELECT * FROM ledger.job_execution_log WHERE job = 'overlap' ORDER BY run_id"),
                "skipped": value(conn, "SELECT skipped_overlap FROM ledger.job_counters WHERE job = 'overlap'"),
                "details": rows(conn, "SELECT jobid, status, return_message FROM cron.job_run_details "
                                      "WHERE jobid = ANY(%s) ORDER BY runid", (overlap,))}
        for jobid in overlap:
            conn.execute("SELECT cron.unschedule(%s::bigint)", (jobid,))
    return CronRun(cluster, jobids, crashed["run_id"], seen)


@pytest.mark.cluster
def test_two_cron_schedules_of_one_job_give_one_run_and_counted_skips(cron_run):
    seen = cron_run.overlap
    # While the first call was inside its command, the other was skipped...
    assert [(r["status"], r["owner"].split(":")[0]) for r in seen["while_held"]] == [("running", "pg_cron")]
    # ...and that one run is all there was.
    runs = seen["runs"]
    assert [(r["status"], r["owner"]) for r in runs] == [("success", seen["while_held"][0]["owner"])]
    # Every call of both schedules either ran the job or was skipped, and
    # pg_cron logs a skip as succeeded: it is not an error.
    details = seen["details"]
    assert seen["skipped"] >= 1 and len(details) == len(runs) + seen["skipped"]
    assert {d["jobid"] for d in details} == {cron_run.jobids["overlap-a"], cron_run.jobids["overlap-b"]}
    assert {(d["status"], d["return_message"]) for d in details} == {("succeeded", "CALL")}
    assert cron_run.value("SELECT count(*) FROM ledger.overlaps") == 0
    assert cron_run.value("SELECT failures FROM ledger.job_counters WHERE job = 'overlap'") == 0
    # The skip's NOTICE reaches the server log (pg_cron prints its notices there).
    log = cron_run.cluster.logfile.read_text(errors="replace")
    assert f"ledger.run_guarded: job overlap skipped (skipped_overlap): held by {runs[0]['owner']}" in log


@pytest.mark.cluster
def test_a_failing_cron_command_is_recorded_with_its_error_and_pg_cron_logs_it_failed(cron_run):
    runs = cron_run.runs("failing")
    assert runs and all(r["status"] == "failure" and r["error"] == "22012: division by zero" for r in runs)
    details = cron_run.details("failing")
    assert len(details) == len(runs)
    assert all(d["status"] == "failed" and "division by zero" in d["return_message"] for d in details)


@pytest.mark.cluster
def test_reap_expired_from_pg_cron_closes_a_crashed_run(cron_run):
    assert [(r["run_id"], r["status"], r["failure_reason"]) for r in cron_run.runs("crashed")] == [
        (cron_run.crashed_run, "failure", "lease_expired")]
    details = cron_run.details("ledger-reaper")
    assert details and all(d["status"] == "succeeded" for d in details)
    assert cron_run.value("SELECT leases_lost FROM ledger.job_counters WHERE job = 'crashed'") == 1


@pytest.mark.cluster
def test_a_cron_command_fences_its_write_with_the_token_and_a_stale_token_is_refused(cron_run):
    runs = cron_run.runs("fenced")
    assert runs and all(r["status"] == "success" for r in runs)
    articles = cron_run.value("SELECT jsonb_agg(jsonb_build_array(run_id, token) ORDER BY run_id) "
                              "FROM public.articles")
    assert articles == [[r["run_id"], r["token"]] for r in runs]
    assert cron_run.value("SELECT token FROM ledger.fences WHERE resource = 'articles'") == runs[-1]["token"]
    stale = [r for r in cron_run.runs("fenced-stale") if r["owner"].startswith("pg_cron:")]
    assert stale and all(r["status"] == "failure" and r["error"].startswith("LD001: lease superseded")
                         for r in stale)
    assert cron_run.value("SELECT count(*) FROM ledger.fences WHERE resource = 'stale-articles'") == 0
    assert all(d["status"] == "failed" and "lease superseded" in d["return_message"]
               for d in cron_run.details("fenced-stale"))


DOCS = ROOT / "docs" / "pg_cron.md"


@pytest.mark.cluster
def test_the_cron_lines_of_the_docs_schedule_and_their_commands_run(cron_run):
    blocks = [b for b in re.findall(r"```sql\n(.*?)```", DOCS.read_text(), re.S) if "cron.schedule(" in b]
    assert len(blocks) >= 4  # a guarded job, the reaper, the purge, a fenced write
    with cron_run.cluster.connect() as conn:
        conn.execute("CREATE TABLE daily_totals (day date, total numeric)")
        conn.execute("CREATE TABLE orders (amount numeric, created_at timestamptz)")
        conn.execute("INSERT INTO orders VALUES (5, now() - interval '1 day'), (7, now() - interval '1 day')")
        conn.execute("CREATE TABLE feed (published_at timestamptz, token bigint)")
        for job in sorted({job for block in blocks for job in re.findall(r"job => '([^']+)'", block)}):
            conn.execute("SELECT ledger.register_job(%s, ttl => '10 minutes')", (job,))
        commands = []
        for block in blocks:
            # Scheduled and rolled back: pg_cron never sees them, their commands run here.
            with conn.transaction():
                jobid = value(conn, block)
                commands.append(value(conn, "SELECT command FROM cron.job WHERE jobid = %s", (jobid,)))
                raise psycopg.Rollback()
        for command in commands:
            conn.execute(command)
        assert "CALL ledger.purge_log_in_batches('90 days')" in commands  # it ran (nothing old to delete)
        for job in ("nightly-rollup", "publish"):
            assert value(conn, "SELECT status FROM ledger.job_execution_log WHERE job = %s", (job,)) == "success"
        assert value(conn, "SELECT total FROM daily_totals") == 12
        assert value(conn, "SELECT token FROM feed") == value(
            conn, "SELECT token FROM ledger.fences WHERE resource = 'feed'")
