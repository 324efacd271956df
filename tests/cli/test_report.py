"""`jobledger report "SQL"`: the sqlglot guard, the read-only database fence, the output.

Hostile queries are refused with a message that names what and why, and
change nothing; the database alone (guard bypassed) still refuses writes and
enforces the timeout; useful queries give the numbers of a ledger built here
through the SQL API. Reports run as a reporting login (a member of
ledger_reader and nothing else, made for the module): a superuser session is
refused (tests/cli/test_report_limits.py covers that fence, the column checks,
the size limits and the row limit).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from datetime import timedelta
from typing import Any, Callable

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import errors, pq
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb
from pytest_postgresql.janitor import DatabaseJanitor

from clockseam import LedgerClock
from docpages import page_blocks
from ledger.cli import main
from ledger.report import (
    ALLOWED_FUNCTIONS, ReportRejected, check, load_catalog, read_only_transaction, run_read_only, run_report,
)
from clihelp import environment, jobledger_on_path, pg_variables
from repo import DOCS
from sqlhelp import one, rows, state, value

# -- a ledger with known contents, built once for the module through the SQL API --------


def _start(conn: psycopg.Connection, job: str, owner: str) -> dict[str, Any]:
    started = one(conn, "SELECT * FROM ledger.start_run(job => %s, owner => %s)", (job, owner))
    assert started is not None
    return started


def _complete(conn: psycopg.Connection, run: dict[str, Any], detail: dict[str, Any] | None = None) -> None:
    conn.execute("SELECT ledger.complete_run(run_id => %s, token => %s, detail => %s)",
                 (run["run_id"], run["token"], Jsonb(detail) if detail is not None else None))


def _fail(conn: psycopg.Connection, run: dict[str, Any], error: str) -> None:
    conn.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => %s)",
                 (run["run_id"], run["token"], error))


def _build(conn: psycopg.Connection) -> dict[str, Any]:
    conn.execute("SELECT ledger.register_job('etl', ttl => '10 minutes')")
    conn.execute("SELECT ledger.register_job('mail', ttl => '10 minutes')")
    conn.execute("SELECT ledger.register_job('tick', '250 milliseconds', ttl => '1 hour', max_backfill => 1)")

    _complete(conn, _start(conn, "etl", "host-a"))
    _complete(conn, _start(conn, "etl", "host-a"))
    _fail(conn, _start(conn, "etl", "host-b"), "disk full")
    held = _start(conn, "etl", "host-a")
    assert _start(conn, "etl", "host-b")["outcome"] == "skipped_overlap"
    _complete(conn, held)
    _fail(conn, _start(conn, "etl", "host-b"), "timeout talking to the API")

    for count in (10, 32):
        run = _start(conn, "mail", "host-c")
        time.sleep(0.02)
        _complete(conn, run, {"rows": count})

    first = one(conn, "SELECT * FROM ledger.start_due_run('tick', 'host-a')")
    assert first is not None and first["outcome"] == "started"
    _complete(conn, first)
    LedgerClock(conn).advance(timedelta(milliseconds=800))  # three 250 ms slots go by; the bound of 1 drops all but the newest
    second = one(conn, "SELECT * FROM ledger.start_due_run('tick', 'host-a')")
    assert second is not None and second["outcome"] == "started"
    _complete(conn, second)
    dropped = round((second["slot"] - first["slot"]) / timedelta(milliseconds=250)) - 1
    assert dropped >= 1

    log = rows(conn, "SELECT run_id, job, status, started_at, completed_at FROM ledger.job_execution_log")
    durations: dict[str, list[float]] = {}
    for run in log:
        if run["status"] == "success":
            durations.setdefault(run["job"], []).append(
                (run["completed_at"] - run["started_at"]).total_seconds())
    return {"dropped": dropped, "durations": durations,
            "week": value(conn, "SELECT date_trunc('week', now())")}


@pytest.fixture(scope="module")
def ledger_db(pg_server, ledger_template):
    """(dsn, facts): one database for the module, its contents known from `_build`."""
    name = f"ledger_report_{os.getpid()}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name, template_dbname=ledger_template)
    with janitor:
        dsn = pg_server.dsn(name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            facts = _build(conn)
        yield dsn, facts


@pytest.fixture(scope="module")
def conn(ledger_db):
    """The superuser's connection: builds, inspects, grants; reports do not run on it."""
    with psycopg.connect(ledger_db[0], autocommit=True) as connection:
        yield connection


@pytest.fixture(scope="module")
def reporting_login(conn):
    """A login whose only privileges come from ledger_reader (roles are cluster-wide: a unique name)."""
    name = f"test_reports_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE ROLE "{name}" LOGIN IN ROLE ledger_reader')
    yield name
    conn.execute(f'DROP ROLE "{name}"')


@pytest.fixture(scope="module")
def reader_dsn(ledger_db, reporting_login):
    return make_conninfo(ledger_db[0], user=reporting_login)


@pytest.fixture(scope="module")
def reader(reader_dsn):
    """The reporting login's connection: what reports run on."""
    with psycopg.connect(reader_dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture(scope="module")
def catalog(conn):
    return load_catalog(conn)


@pytest.fixture
def facts(ledger_db):
    return ledger_db[1]


def _percentile_cont(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _untouched(conn: psycopg.Connection) -> Any:
    """Everything a query could have changed: the ledger's rows, its run_id sequence, public's tables."""
    return (state(conn),
            value(conn, "SELECT last_value FROM ledger.job_execution_log_run_id_seq"),
            value(conn, "SELECT count(*) FROM pg_catalog.pg_class WHERE relnamespace = 'public'::regnamespace"))


# -- hostile queries: refused, with the reason, and nothing changes ------------------------

HOSTILE = [
    ("DELETE FROM ledger.job_execution_log", "DELETE is not a SELECT"),
    ("WITH x AS (DELETE FROM ledger.job_execution_log RETURNING run_id) SELECT count(*) FROM x",
     "DELETE is not allowed: it writes"),
    ("WITH x AS (UPDATE ledger.jobs SET paused = true RETURNING job) SELECT * FROM x",
     "UPDATE is not allowed: it writes"),
    ("SELECT * FROM (WITH x AS (INSERT INTO ledger.fences VALUES ('r', 99, now()) RETURNING 1) "
     "SELECT * FROM x) AS t", "INSERT is not allowed: it writes"),
    ("SELECT * INTO public.stolen FROM ledger.jobs", "SELECT ... INTO is not allowed: it creates a table"),
    ("SELECT * FROM ledger.leases FOR UPDATE", "FOR UPDATE is not allowed: it locks rows"),
    ("SELECT * FROM ledger.leases FOR SHARE", "FOR SHARE is not allowed: it locks rows"),
    ("SELECT (SELECT job FROM ledger.jobs LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED)",
     "FOR NO KEY UPDATE SKIP LOCKED is not allowed: it locks rows"),
    ("SELECT ledger.acquire('etl', 'intruder', '1 hour')", "schema-qualified function call ledger.acquire()"),
    ("SELECT * FROM ledger.start_run('etl', 'intruder')", "schema-qualified function call ledger.start_run()"),
    ("SELECT ledger.purge_log('1 second')", "schema-qualified function call ledger.purge_log()"),
    ("SELECT pg_catalog.pg_sleep(1)", "schema-qualified function call pg_catalog.pg_sleep()"),
    ("SELECT pg_sleep(100)", "function pg_sleep() is not on the report allow-list"),
    ("SELECT set_config('statement_timeout', '0', false)", "function set_config() is not on"),
    ("SELECT set_config('role', 'postgres', true), * FROM ledger.jobs", "function set_config() is not on"),
    ("COPY ledger.jobs TO '/tmp/ledger-jobs.csv'", "COPY is not a SELECT"),
    ("COPY (SELECT 1) TO PROGRAM 'touch /tmp/owned'", "COPY is not a SELECT"),
    ("SELECT 1; DELETE FROM ledger.job_execution_log", "exactly one statement is allowed, got 2"),
    ("SELECT 1 -- a comment ends at the newline\n; DELETE FROM ledger.jobs",
     "exactly one statement is allowed, got 2"),
    ("SELECT 1 /* nested /* comments */ ; DELETE FROM ledger.jobs; /* are PostgreSQL's */",
     "not SQL that the guard can read"),
    ("SELECT pg_read_file('/etc/passwd')", "function pg_read_file() is not on"),
    ("SELECT lo_import('/etc/passwd')", "function lo_import() is not on"),
    ("SELECT nextval('ledger.job_execution_log_run_id_seq')", "function nextval() is not on"),
    ("SELECT * FROM dblink('dbname=postgres', 'DELETE FROM ledger.jobs') AS t(ok text)",
     "function dblink() is not on"),
    ("SELECT query_to_xml('DELETE FROM ledger.jobs', true, true, '')", "function query_to_xml() is not on"),
    ("SELECT txid_current()", "function txid_current() is not on"),
    ("SELECT pg_advisory_lock(42)", "function pg_advisory_lock() is not on"),
    ("SELECT pg_notify('ledger', 'x')", "function pg_notify() is not on"),
    ("SELECT pg_terminate_backend(pg_backend_pid())", "function pg_terminate_backend() is not on"),
    ("SELECT * FROM public.t", "relation public.t is outside schemas ledger and pg_catalog"),
    ("SELECT * FROM information_schema.tables", "relation information_schema.tables is outside"),
    ('SELECT * FROM "Ledger".jobs', 'relation "Ledger".jobs is outside'),
    ("SELECT * FROM job_execution_log", "relation job_execution_log must be schema-qualified"),
    ("SELECT * FROM otherdb.ledger.jobs", "names a database"),
    # a CTE sees only the CTEs before it: this `b` would be looked up in search_path
    ("WITH a AS (SELECT * FROM b), b AS (SELECT 1 AS x) SELECT * FROM a",
     "relation b must be schema-qualified"),
    ("SELECT * FROM (WITH t AS (SELECT 1) SELECT * FROM t) AS s, t", "relation t must be schema-qualified"),
    ("SELECT job::public.evil FROM ledger.jobs", "type public.evil is outside"),
    ("SELECT 1 OPERATOR(pg_catalog.+) 1", "OPERATOR(...) is not allowed"),
    ("LOCK TABLE ledger.leases", "LOCK command is not a SELECT"),
    ("EXPLAIN ANALYZE DELETE FROM ledger.job_execution_log", "EXPLAIN command is not a SELECT"),
    ("CALL ledger.reap_expired()", "CALL command is not a SELECT"),
    ("DO $$ BEGIN DELETE FROM ledger.jobs; END $$", "DO command is not a SELECT"),
    ("NOTIFY ledger_events", "NOTIFY is not a SELECT"),
    ("SET ROLE postgres", "SET command is not a SELECT"),
    ("RESET ROLE", "RESET command is not a SELECT"),
    ("TRUNCATE ledger.job_execution_log", "TRUNCATE is not a SELECT"),
    ("CREATE TABLE ledger.x AS SELECT 1", "CREATE is not a SELECT"),
    ("BEGIN", "BEGIN is not a SELECT"),
    ("VALUES (1)", "VALUES is not a SELECT"),
    ("SELECT $1", "a report takes no parameters"),
    ("", "the query is empty"),
    ("SELECT FROM WHERE ;;", "not SQL that the guard can read"),
    ("SELECT " + "(" * 300 + "1" + ")" * 300, "nested too deeply"),
    # column notation is a function call: t.f runs f(t) when t has no column f
    ("SELECT l.pg_typeof FROM ledger.leases l", "unknown column l.pg_typeof: ledger.leases has no column"),
    ("SELECT leases.pg_typeof FROM ledger.leases", "unknown column leases.pg_typeof"),
    ("SELECT ledger.leases.pg_typeof FROM ledger.leases", "unknown column ledger.leases.pg_typeof"),
    ("SELECT g.pg_sleep FROM generate_series(1, 1) AS g", "unknown column g.pg_sleep"),
    ("SELECT (l).pg_typeof FROM ledger.leases AS l", "field selection (l).pg_typeof is not allowed"),
    ("SELECT pg_typeof FROM ledger.leases", "unknown column pg_typeof: no relation of the query has"),
    ("SELECT x.job FROM ledger.leases AS l", "column x.job: x is not a relation of the query"),
    ("SELECT * FROM ledger.no_such_view", "relation ledger.no_such_view does not exist"),
    # size, refused before PostgreSQL plans it
    ("WITH c0 AS (SELECT 1 AS x), " + ", ".join(f"c{i} AS (SELECT x FROM c{i - 1})" for i in range(1, 400))
     + " SELECT x FROM c399", "over the limit of 64 (MAX_SUBQUERIES)"),
    ("SELECT 1" + " " * 100_000, "over the limit of 100000 bytes"),
]


@pytest.mark.parametrize(("sql", "reason"), HOSTILE, ids=[f"hostile-{i}" for i in range(len(HOSTILE))])
def test_report_rejects_a_hostile_query_with_its_reason_and_changes_nothing(conn, reader, sql, reason):
    before = _untouched(conn)
    with pytest.raises(ReportRejected) as rejected:
        run_report(reader, sql, timedelta(seconds=2))
    message = str(rejected.value)
    assert message.startswith("report rejected: ")
    assert reason in message, message
    assert "\n" not in message
    assert reader.info.transaction_status == pq.TransactionStatus.IDLE
    assert _untouched(conn) == before


def test_there_are_at_least_25_hostile_queries():
    assert len(HOSTILE) >= 25


@pytest.mark.parametrize("sql", ["DELETE FROM ledger.jobs", "SELECT pg_sleep(100)",
                                 "WITH x AS (DELETE FROM ledger.leases RETURNING 1) SELECT * FROM x"])
def test_the_cli_refuses_a_hostile_query_in_one_line_with_exit_code_1(reader_dsn, conn, sql):
    before = _untouched(conn)
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, sql])
    assert result.exit_code == 1
    assert result.output.startswith("Error: report rejected: ")
    assert len(result.output.strip().splitlines()) == 1
    assert _untouched(conn) == before


# -- the guard's reading of SQL ---------------------------------------------------------------

@pytest.mark.parametrize(("sql", "normalised"), [
    ("select 1 -- ; DELETE FROM ledger.jobs", "SELECT 1"),
    ("SELECT /* DELETE */ job FROM LEDGER.JOBS", "SELECT job FROM LEDGER.JOBS"),
    ("SELECT E'\\'; DELETE FROM ledger.jobs; --'", "SELECT e'''; DELETE FROM ledger.jobs; --'"),
    ("SELECT $q$ '; DELETE FROM ledger.jobs $q$", "SELECT ' ''; DELETE FROM ledger.jobs '"),
    ("SELECT 1;", "SELECT 1"),
])
def test_what_runs_is_the_guards_rendering_without_comments(catalog, sql, normalised):
    assert check(sql, catalog) == normalised


@pytest.mark.parametrize("sql", [
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) SELECT * FROM r",
    "WITH a AS (SELECT 1 AS x), b AS (SELECT * FROM a) SELECT * FROM b",
    "(SELECT job FROM ledger.jobs) UNION (SELECT job FROM ledger.leases)",
    "SELECT j.job, l.run_id FROM ledger.jobs AS j LEFT JOIN LATERAL "
    "(SELECT r.run_id FROM ledger.job_execution_log AS r WHERE r.job = j.job LIMIT 1) AS l ON true",
    "SELECT detail ->> 'rows', detail -> 'x', detail #>> '{a,b}', detail ? 'rows', detail @> '{}' "
    "FROM ledger.job_execution_log WHERE error ~ 'disk' OR error ILIKE '%api%'",
    "SELECT relname FROM pg_catalog.pg_class WHERE relnamespace = 'ledger'::regnamespace",
    "SELECT EXISTS (SELECT 1 FROM ledger.overlaps)",
])
def test_the_guard_accepts_ordinary_query_shapes(catalog, reader, sql):
    check(sql, catalog)
    run_report(reader, sql)  # and PostgreSQL agrees they are fine


# -- the database fence alone (guard bypassed) -----------------------------------------------

WRITES = [
    "DELETE FROM ledger.job_execution_log",
    "UPDATE ledger.jobs SET paused = true",
    "WITH x AS (DELETE FROM ledger.counters RETURNING 1) SELECT count(*) FROM x",
    "SELECT * INTO public.stolen FROM ledger.jobs",
    "CREATE TEMP TABLE scratch (a int)",  # ledger_reader may create temp tables: READ ONLY stops it
]


@pytest.mark.parametrize("sql", WRITES)
def test_the_database_refuses_a_write_without_the_guard(conn, reader, sql):
    # run as a cursor (DECLARE ... FOR <query>): the server refuses anything but a query
    before = _untouched(conn)
    with pytest.raises((errors.SyntaxError, errors.FeatureNotSupported, errors.ReadOnlySqlTransaction)):
        run_read_only(reader, sql, timedelta(seconds=2))
    assert _untouched(conn) == before
    assert reader.info.transaction_status == pq.TransactionStatus.IDLE


@pytest.mark.parametrize("sql", WRITES)
def test_the_read_only_transaction_alone_refuses_a_write(conn, reader, sql):
    before = _untouched(conn)
    with pytest.raises(errors.ReadOnlySqlTransaction):
        with read_only_transaction(reader, timedelta(seconds=2)) as cur:
            cur.execute(sql)
    assert _untouched(conn) == before


@pytest.mark.parametrize("sql", ["SELECT ledger.acquire('etl', 'intruder', '1 hour')",
                                 "SELECT ledger.purge_log('1 second')",
                                 "SELECT nextval('ledger.job_execution_log_run_id_seq')"])
def test_the_reader_role_cannot_call_ledger_functions_or_sequences(conn, reader, sql):
    before = _untouched(conn)
    with pytest.raises(errors.InsufficientPrivilege):
        run_read_only(reader, sql, timedelta(seconds=2))
    assert _untouched(conn) == before


def test_the_query_runs_as_ledger_reader_in_a_read_only_transaction(reader):
    columns, result = run_read_only(
        reader, "SELECT current_user, current_setting('transaction_read_only'), "
              "current_setting('statement_timeout'), current_setting('search_path')",
        timedelta(milliseconds=1500))
    assert result == [("ledger_reader", "on", "1500ms", "pg_catalog, pg_temp")]


def test_the_server_refuses_a_second_statement_without_the_guard(conn, reader):
    before = _untouched(conn)
    with pytest.raises(errors.SyntaxError, match="multiple commands"):
        run_read_only(reader, "SELECT 1; DELETE FROM ledger.job_execution_log", timedelta(seconds=2))
    assert _untouched(conn) == before


def test_the_statement_timeout_fires_in_the_database(reader):
    # Only the statement timeout cancels it (a 30 s sleep ends without an error): the database fired it.
    with pytest.raises(errors.QueryCanceled, match="statement timeout"):
        run_read_only(reader, "SELECT pg_sleep(30)", timedelta(milliseconds=200))


def test_an_expensive_allowed_query_is_cancelled_by_the_timeout(reader, catalog):
    expensive = "SELECT count(*) FROM generate_series(1, 100000) AS a, generate_series(1, 100000) AS b"
    check(expensive, catalog)  # the guard lets it through: generate_series is allowed
    # The count would take hours and ends without an error: only the statement timeout cancels it.
    with pytest.raises(errors.QueryCanceled, match="statement timeout"):
        run_report(reader, expensive, timedelta(milliseconds=300))


def test_the_cli_says_when_a_report_timed_out(reader_dsn):
    result = CliRunner().invoke(main, [
        "report", "--dsn", reader_dsn, "--timeout", "300ms",
        "SELECT count(*) FROM generate_series(1, 100000) AS a, generate_series(1, 100000) AS b"])
    assert result.exit_code == 1
    assert "report timed out after 300ms" in result.output


def test_the_session_comes_out_as_it_went_in(reader, reporting_login):
    reader.execute("SET statement_timeout = '42s'")
    try:
        run_report(reader, "SELECT count(*) FROM ledger.jobs")
        with pytest.raises(errors.QueryCanceled):
            run_read_only(reader, "SELECT pg_sleep(30)", timedelta(milliseconds=100))
        assert reader.info.transaction_status == pq.TransactionStatus.IDLE
        assert reader.execute("SELECT current_user, current_setting('statement_timeout'), "
                              "current_setting('transaction_read_only')").fetchone() == (
            reporting_login, "42s", "off")
    finally:
        reader.execute("RESET statement_timeout")


def test_a_connection_inside_a_transaction_is_refused(reader_dsn):
    with psycopg.connect(reader_dsn) as busy:
        busy.execute("SELECT 1")
        with pytest.raises(ValueError, match="no transaction open"):
            run_report(busy, "SELECT 1")


def test_the_connecting_user_must_be_a_member_of_ledger_reader(ledger_db, conn):
    role = f"test_report_outsider_{os.getpid()}"
    conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        with psycopg.connect(ledger_db[0], user=role, autocommit=True) as outsider:
            with pytest.raises(errors.InsufficientPrivilege, match="ledger_reader"):
                run_report(outsider, "SELECT count(*) FROM ledger.jobs")
            conn.execute(f'GRANT ledger_reader TO "{role}"')
            assert run_report(outsider, "SELECT count(*) FROM ledger.jobs") == (["count"], [(3,)])
    finally:
        conn.execute(f'DROP ROLE "{role}"')


# -- useful queries: right answers for the ledger built above -----------------------------------

Check = Callable[[list[str], list[tuple[Any, ...]], dict[str, Any]], None]


def _daily_failure_rate(columns, result, facts):
    assert columns == ["day", "job", "runs", "failures", "failure_rate"]
    totals: dict[str, tuple[int, int]] = {}
    for _day, job, runs, failures, rate in result:  # one day, unless the module ran over midnight
        assert float(rate) == round(failures / runs, 2)
        done, failed = totals.get(job, (0, 0))
        totals[job] = (done + runs, failed + failures)
    assert totals == {"etl": (5, 2), "mail": (2, 0), "tick": (2, 0)}


def _p95_by_job(columns, result, facts):
    assert columns == ["job", "p95_seconds", "max_seconds"]
    assert [row[0] for row in result] == sorted(facts["durations"])
    for job, p95, longest in result:
        assert p95 == pytest.approx(_percentile_cont(facts["durations"][job], 0.95), abs=1e-6)
        assert longest == pytest.approx(max(facts["durations"][job]), abs=1e-6)
    assert dict((r[0], r[2]) for r in result)["mail"] >= 0.02  # mail slept 20 ms in each run


def _skipped_per_week(columns, result, facts):
    assert columns == ["week", "job", "reason", "slots"]
    assert result == [(facts["week"], "tick", "backfill_limit", facts["dropped"])]


def _runs_per_owner(columns, result, facts):
    assert columns == ["owner", "runs", "successes", "failures"]
    assert result == [("host-a", 5, 5, 0), ("host-b", 2, 0, 2), ("host-c", 2, 2, 0)]


def _last_failures(columns, result, facts):
    assert columns == ["run_id", "job", "owner", "error", "completed_at"]
    assert [(r[1], r[2], r[3]) for r in result] == [
        ("etl", "host-b", "timeout talking to the API"), ("etl", "host-b", "disk full")]


def _overlap_audit(columns, result, facts):
    assert columns == ["job", "run_id", "other_run_id"]
    assert result == []


def _overlaps_view(columns, result, facts):
    assert result == [(0,)]


def _counters_and_status(columns, result, facts):
    assert result == [("etl", "failure", 1, 5, 3, 2, 1, 0), ("mail", "success", 0, 2, 2, 0, 0, 0),
                      ("tick", "success", 0, 2, 2, 0, 0, facts["dropped"])]


def _rows_from_detail(columns, result, facts):
    assert result == [("mail", 42, 2)]


def _latest_run_per_job(columns, result, facts):
    assert [(r[0], r[2]) for r in result] == [("etl", "failure"), ("mail", "success"), ("tick", "success")]


def _ledger_views(columns, result, facts):
    assert [r[0] for r in result] == ["_job_state", "_pool_holders", "alerts", "db_risks", "duplicates", "job_counters", "job_health",
                                       "job_status", "overlaps", "pool_status", "protected_tables", "run_stats", "trigger_status",
                                       "ttl_advice"]


def _busy_jobs(columns, result, facts):
    assert result == [("etl", 5), ("mail", 2), ("tick", 2)]


USEFUL: list[tuple[str, str, Check]] = [
    ("daily-failure-rate", """
        SELECT date_trunc('day', started_at) AS day, job, count(*) AS runs,
               count(*) FILTER (WHERE status = 'failure') AS failures,
               round(count(*) FILTER (WHERE status = 'failure')::numeric / count(*), 2) AS failure_rate
          FROM ledger.job_execution_log
         WHERE status <> 'running'
         GROUP BY 1, 2
         ORDER BY 1, 2""", _daily_failure_rate),
    ("p95-by-job", """
        SELECT job,
               percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM completed_at - started_at))
                   AS p95_seconds,
               max(extract(epoch FROM completed_at - started_at))::float8 AS max_seconds
          FROM ledger.job_execution_log
         WHERE status = 'success'
         GROUP BY job
         ORDER BY job""", _p95_by_job),
    ("skipped-per-week", """
        SELECT date_trunc('week', recorded_at) AS week, job, reason, sum(slot_count)::int AS slots
          FROM ledger.skipped_slots
         GROUP BY 1, 2, 3
         ORDER BY 1, 2""", _skipped_per_week),
    ("runs-per-owner", """
        SELECT owner, count(*) AS runs,
               count(*) FILTER (WHERE status = 'success') AS successes,
               count(*) FILTER (WHERE status = 'failure') AS failures
          FROM ledger.job_execution_log
         GROUP BY owner
         ORDER BY owner""", _runs_per_owner),
    ("last-10-failures", """
        SELECT run_id, job, owner, error, completed_at
          FROM ledger.job_execution_log
         WHERE status = 'failure'
         ORDER BY completed_at DESC, run_id DESC
         LIMIT 10""", _last_failures),
    ("overlap-audit", """
        SELECT a.job, a.run_id, b.run_id AS other_run_id
          FROM ledger.job_execution_log AS a
          JOIN ledger.job_execution_log AS b
            ON b.job = a.job AND b.run_id > a.run_id
           AND tstzrange(a.started_at, a.completed_at) && tstzrange(b.started_at, b.completed_at)
         ORDER BY 1, 2, 3""", _overlap_audit),
    ("overlaps-view", "SELECT count(*) FROM ledger.overlaps", _overlaps_view),
    ("status-and-counters", """
        SELECT s.job, s.last_status, s.consecutive_failures, c.runs_started, c.successes, c.failures,
               c.skipped_overlap, c.skipped_backfill
          FROM ledger.job_status AS s JOIN ledger.job_counters AS c USING (job)
         ORDER BY s.job""", _counters_and_status),
    ("rows-from-detail", """
        SELECT job, sum((detail ->> 'rows')::int) AS total_rows, count(*) AS runs
          FROM ledger.job_execution_log
         WHERE detail ? 'rows'
         GROUP BY job""", _rows_from_detail),
    ("latest-run-per-job", """
        SELECT job, run_id, status
          FROM (SELECT job, run_id, status,
                       row_number() OVER (PARTITION BY job ORDER BY started_at DESC, run_id DESC) AS n
                  FROM ledger.job_execution_log) AS ranked
         WHERE n = 1
         ORDER BY job""", _latest_run_per_job),
    ("ledger-views", """
        SELECT c.relname
          FROM pg_catalog.pg_class AS c
          JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
         WHERE n.nspname = 'ledger' AND c.relkind = 'v'
         ORDER BY 1""", _ledger_views),
    ("busy-jobs-cte", """
        WITH per_job AS (SELECT job, count(*) AS runs FROM ledger.job_execution_log GROUP BY job)
        SELECT job, runs FROM per_job WHERE runs >= 2 ORDER BY runs DESC, job""", _busy_jobs),
]


@pytest.mark.parametrize(("sql", "verify"), [(sql, verify) for _, sql, verify in USEFUL],
                         ids=[name for name, _, _ in USEFUL])
def test_report_answers_a_useful_query(reader, facts, sql, verify):
    columns, result = run_report(reader, sql, timedelta(seconds=5))
    verify(columns, result, facts)


def test_the_cli_prints_a_report_as_json(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "json",
                                       "SELECT owner, count(*) AS runs FROM ledger.job_execution_log "
                                       "GROUP BY owner ORDER BY owner"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [{"owner": "host-a", "runs": 5}, {"owner": "host-b", "runs": 2},
                                         {"owner": "host-c", "runs": 2}]


def test_the_cli_prints_a_report_as_csv_with_intervals_in_seconds(reader_dsn, facts):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "csv",
                                       "SELECT job, max(completed_at - started_at) AS longest, "
                                       "bool_and(status = 'success') AS all_ok, NULL AS nothing "
                                       "FROM ledger.job_execution_log GROUP BY job ORDER BY job"])
    assert result.exit_code == 0, result.output
    table = list(csv.reader(io.StringIO(result.output)))
    assert table[0] == ["job", "longest", "all_ok", "nothing"]
    assert [row[0] for row in table[1:]] == ["etl", "mail", "tick"]
    assert float(table[2][1]) == pytest.approx(max(facts["durations"]["mail"]), abs=1e-6)
    assert [row[2] for row in table[1:]] == ["false", "true", "true"]
    assert all(row[3] == "" for row in table[1:])


def test_the_cli_prints_a_report_as_a_table(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn,
                                       "SELECT job, error FROM ledger.job_execution_log "
                                       "WHERE status = 'failure' ORDER BY run_id"])
    assert result.exit_code == 0, result.output
    assert "disk full" in result.output and "timeout talking to the API" in result.output
    assert "2 rows" in result.output


def test_the_cli_reads_the_query_from_stdin(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "json", "-"],
                                input="SELECT count(*) AS jobs FROM ledger.jobs\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == [{"jobs": 3}]


def test_the_report_examples_of_the_docs_pass_the_guard_and_run(reader):
    text = (DOCS / "operations.md").read_text()
    section = text.split("\n## Reports\n", 1)[1].split("\n## ", 1)[0]
    examples = re.findall(r'^jobledger report (?:--format \w+ )?"(.*?)"$', section, re.M | re.S)
    assert len(examples) >= 6
    for sql in examples:
        run_report(reader, sql, timedelta(seconds=5))


# Every allow-listed function, as sqlglot renders it, runs in PostgreSQL.
FUNCTION_SAMPLES = {
    "count": "count(*)", "sum": "sum(x)", "avg": "avg(x)", "min": "min(x)", "max": "max(x)",
    "percentile_cont": "percentile_cont(0.5) WITHIN GROUP (ORDER BY x)",
    "percentile_disc": "percentile_disc(0.5) WITHIN GROUP (ORDER BY x)",
    "mode": "mode() WITHIN GROUP (ORDER BY x)", "stddev": "stddev(x)", "stddev_samp": "stddev_samp(x)",
    "stddev_pop": "stddev_pop(x)", "variance": "variance(x)", "bool_and": "bool_and(x > 0)",
    "bool_or": "bool_or(x > 0)", "every": "every(x > 0)", "string_agg": "string_agg(x::text, ',' ORDER BY x)",
    "array_agg": "array_agg(x ORDER BY x)", "json_agg": "json_agg(x)", "jsonb_agg": "jsonb_agg(x)",
    "jsonb_object_agg": "jsonb_object_agg(x::text, x)", "row_number": "row_number() OVER (ORDER BY x)",
    "rank": "rank() OVER (ORDER BY x)", "dense_rank": "dense_rank() OVER (ORDER BY x)",
    "percent_rank": "percent_rank() OVER (ORDER BY x)", "cume_dist": "cume_dist() OVER (ORDER BY x)",
    "ntile": "ntile(2) OVER (ORDER BY x)", "lag": "lag(x) OVER (ORDER BY x)",
    "lead": "lead(x, 1) OVER (ORDER BY x)", "first_value": "first_value(x) OVER (ORDER BY x)",
    "last_value": "last_value(x) OVER (ORDER BY x)", "nth_value": "nth_value(x, 2) OVER (ORDER BY x)",
    "now": "now()", "current_date": "current_date", "extract": "extract(epoch FROM now())",
    "date_part": "date_part('hour', now())", "date_trunc": "date_trunc('week', now())",
    "to_char": "to_char(now(), 'IYYY-IW')", "to_timestamp": "to_timestamp(0)",
    "justify_interval": "justify_interval(interval '30 hours')",
    "justify_hours": "justify_hours(interval '30 hours')", "justify_days": "justify_days(interval '40 days')",
    "make_interval": "make_interval(secs => 5)", "coalesce": "coalesce(NULL, x)", "nullif": "nullif(x, 1)",
    "greatest": "greatest(x, 2)", "least": "least(x, 2)", "round": "round(x::numeric / 3, 2)",
    "floor": "floor(x / 3.0)", "ceil": "ceil(x / 3.0)", "abs": "abs(-x)", "sign": "sign(x)",
    "sqrt": "sqrt(x)", "ln": "ln(x)", "log": "log(x)", "lower": "lower('A')", "upper": "upper('a')",
    "length": "length('abc')", "substring": "substring('abc' FROM 2 FOR 1)",
    "position": "position('b' IN 'abc')", "strpos": "strpos('abc', 'b')", "trim": "trim(' a ')",
    "replace": "replace('abc', 'b', 'x')", "split_part": "split_part('a,b', ',', 2)",
    "concat": "concat('a', x)", "left": "left('abc', 2)", "right": "right('abc', 2)",
    "initcap": "initcap('ab cd')", "lpad": "lpad('a', 3, '0')", "rpad": "rpad('a', 3)",
    "starts_with": "starts_with('abc', 'a')", "regexp_replace": "regexp_replace('abc', 'b', 'x')",
    "format": "format('%s-%s', 'a', x)", "string_to_array": "string_to_array('a,b', ',')",
    "array_to_string": "array_to_string(ARRAY['a','b'], ',')", "array_length": "array_length(ARRAY[1,2], 1)",
    "unnest": "unnest(ARRAY[1,2])", "generate_series": "generate_series(1, 2)",
    "age": "age(now(), now() - interval '1 day')", "clock_timestamp": "clock_timestamp()",
    "statement_timestamp": "statement_timestamp()", "timezone": "timezone('UTC', now())",
    "isfinite": "isfinite(now())", "make_timestamptz": "make_timestamptz(2020, 1, 2, 3, 4, 5)",
    "cardinality": "cardinality(ARRAY[1,2])", "jsonb_build_object": "jsonb_build_object('a', x)",
    "jsonb_build_array": "jsonb_build_array(1, x)", "json_build_object": "json_build_object('a', x)",
    "jsonb_typeof": "jsonb_typeof('{}'::jsonb)", "jsonb_array_length": "jsonb_array_length('[1]'::jsonb)",
    "jsonb_array_elements": "jsonb_array_elements('[1,2]'::jsonb)",
    "jsonb_array_elements_text": "jsonb_array_elements_text('[1,2]'::jsonb)",
    "jsonb_each": "jsonb_each('{\"a\":1}'::jsonb)", "jsonb_each_text": "jsonb_each_text('{\"a\":1}'::jsonb)",
    "jsonb_object_keys": "jsonb_object_keys('{\"a\":1}'::jsonb)",
    "jsonb_extract_path": "jsonb_extract_path('{\"a\":1}'::jsonb, 'a')",
    "jsonb_extract_path_text": "jsonb_extract_path_text('{\"a\":1}'::jsonb, 'a')",
    "jsonb_strip_nulls": "jsonb_strip_nulls('{\"a\":null}'::jsonb)",
    "jsonb_pretty": "jsonb_pretty('{}'::jsonb)", "to_jsonb": "to_jsonb(x)", "to_json": "to_json(x)",
    "row_to_json": "row_to_json(row_of)", "jsonb_path_query": "jsonb_path_query('{\"a\":1}'::jsonb, '$.a')",
    "jsonb_path_query_first": "jsonb_path_query_first('{\"a\":1}'::jsonb, '$.a')",
    "jsonb_path_exists": "jsonb_path_exists('{\"a\":1}'::jsonb, '$.a')",
    "tstzrange": "tstzrange(now(), now() + interval '1 hour')",
    "lower_inf": "lower_inf(tstzrange(NULL, now()))", "upper_inf": "upper_inf(tstzrange(now(), NULL))",
    "isempty": "isempty(tstzrange(now(), now()))", "regexp_match": "regexp_match('abc', 'b')",
    "CASE": "CASE WHEN x > 1 THEN 'big' ELSE 'small' END", "CAST": "CAST(x AS text)",
    "EXISTS": "EXISTS (SELECT 1 FROM ledger.jobs)",
}


def test_every_allowed_function_has_a_sample():
    assert set(FUNCTION_SAMPLES) == set(ALLOWED_FUNCTIONS)


@pytest.mark.parametrize("name", sorted(FUNCTION_SAMPLES))
def test_an_allowed_function_runs_as_rendered(reader, name):
    sql = (f"SELECT {FUNCTION_SAMPLES[name]} AS v "
           "FROM generate_series(1, 3) AS t(x), LATERAL (SELECT 1 AS a) AS row_of")
    columns, result = run_report(reader, sql, timedelta(seconds=5))
    assert columns == ["v"] and result


# -- the Reports section of docs/operations.md, as a reader runs it --------------------------

@pytest.fixture
def docs_login(dsn):
    """A name of this test's own for the page's `reports` login (roles are cluster-wide), dropped at the end."""
    name = f"test_docs_reports_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as owner:
        owner.execute(f'DROP ROLE IF EXISTS "{name}"')


def test_the_reports_section_creates_its_login_then_reports_through_it_as_written(dsn, docs_login, tmp_path):
    """Its blocks in order, in a shell whose PG* variables name the ledger as its superuser (the
    login a new user has, which reports refuse): the SQL through psql, the commands through sh."""
    if shutil.which("psql") is None:
        pytest.skip("needs psql (apt-get install postgresql-client)")
    with psycopg.connect(dsn, autocommit=True) as owner:  # a failure for the reports to find
        owner.execute("SELECT ledger.register_job('nightly', ttl => '10 minutes')")
        _fail(owner, _start(owner, "nightly", "host-1"), "disk full")
    env = jobledger_on_path(tmp_path / "bin", {**environment(), **pg_variables(dsn)})
    blocks = [block for block in page_blocks("docs/operations.md")
              if block.section == "Reports" and block.executed_by == "tests/cli/test_report.py"]
    assert any(block.lang == "sh" for block in blocks), "the section shows no jobledger report"
    outputs = []
    for block in blocks:
        body = re.sub(r"\breports\b", docs_login, block.body)  # the page's login, under the test's name
        if block.lang == "sql":
            result = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-f", "-"], input=body,
                                    env=env, capture_output=True, text=True, timeout=60)
        else:
            script = tmp_path / f"block-{block.line}.sh"
            script.write_text(body)
            result = subprocess.run(["sh", "-e", str(script)], env=env, cwd=tmp_path, capture_output=True,
                                    text=True, timeout=120)
        assert result.returncode == 0, f"{block.where}: {result.stderr}"
        outputs.append(result.stdout)
    assert "disk full" in outputs[-1]  # the last failures, read through the login
    with psycopg.connect(dsn, autocommit=True) as owner:
        granted = owner.execute("SELECT r.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.roleid "
                                "JOIN pg_roles u ON u.oid = m.member WHERE u.rolname = %s", (docs_login,))
        assert [row[0] for row in granted] == ["ledger_reader"]
