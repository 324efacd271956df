"""`jobledger report`, hardened: the session fence, the column fence, the size limits, the row limit.

Against a real database, no mocks. Roles are cluster-wide and test databases
share the cluster, so every role made here has a unique name and is dropped
(with what it owns or was granted) at the end of its test.
"""

from __future__ import annotations

import json
import os
import tracemalloc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import errors, pq
from psycopg.conninfo import make_conninfo
from pytest_postgresql.janitor import DatabaseJanitor

from ledger.cli import main
from ledger.report import (
    _FUNCTION_COLUMNS, ALLOWED_FUNCTIONS, DEFAULT_LIMIT, MAX_CTES, MAX_DEPTH, MAX_QUERY_BYTES, MAX_SUBQUERIES,
    ReportRejected, UnsafeSession, check, load_catalog, run_read_only, run_report, session_risks, stream_report,
)

COUNT_JOBS = "SELECT count(*) AS jobs FROM ledger.jobs"
MANY_ROWS = "SELECT generate_series(1, 3000000) AS n"  # a ProjectSet: produced row by row, never all at once


@pytest.fixture(scope="module")
def ledger_db(pg_server, ledger_template):
    name = f"ledger_report_limits_{os.getpid()}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name, template_dbname=ledger_template)
    with janitor:
        dsn = pg_server.dsn(name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT ledger.register_job('etl', ttl => '10 minutes')")
            conn.execute("SELECT ledger.register_job('mail', ttl => '10 minutes')")
        yield dsn


@pytest.fixture(scope="module")
def admin(ledger_db):
    """The superuser's connection (the test harness connects as one)."""
    with psycopg.connect(ledger_db, autocommit=True) as conn:
        assert conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone() == (True,)
        yield conn


@contextmanager
def _role(admin: psycopg.Connection, options: str = "LOGIN", member_of: tuple[str, ...] = ("ledger_reader",)
          ) -> Iterator[str]:
    name = f"test_rl_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE ROLE "{name}" {options}')
    try:
        for role in member_of:
            admin.execute(f'GRANT "{role}" TO "{name}"')
        yield name
    finally:
        admin.execute(f'DROP OWNED BY "{name}"')
        admin.execute(f'DROP ROLE "{name}"')


@contextmanager
def _login(admin: psycopg.Connection, ledger_db: str, **role: Any) -> Iterator[psycopg.Connection]:
    with _role(admin, **role) as name, psycopg.connect(make_conninfo(ledger_db, user=name),
                                                       autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def reporting_login(admin):
    """CREATE ROLE ... LOGIN IN ROLE ledger_reader: the setup the refusal message recommends."""
    name = f"test_reports_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE ROLE "{name}" LOGIN IN ROLE ledger_reader')
    yield name
    admin.execute(f'DROP ROLE "{name}"')


@pytest.fixture(scope="module")
def reader_dsn(ledger_db, reporting_login):
    return make_conninfo(ledger_db, user=reporting_login)


@pytest.fixture(scope="module")
def reader(reader_dsn):
    with psycopg.connect(reader_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def catalog(admin):
    return load_catalog(admin)


def _refused(conn: psycopg.Connection, *reasons: str) -> str:
    with pytest.raises(UnsafeSession) as refused:
        run_report(conn, COUNT_JOBS)
    message = str(refused.value)
    assert message.startswith("report refused: session user ")
    assert "\n" not in message
    for reason in reasons:
        assert reason in message, message
    assert "CREATE ROLE reports LOGIN IN ROLE ledger_reader;" in message
    assert "--allow-superuser" in message
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    return message


# -- the session fence -------------------------------------------------------------------------

def test_a_report_runs_as_a_login_that_is_only_a_member_of_ledger_reader(reader):
    assert session_risks(reader) == []
    assert run_report(reader, COUNT_JOBS) == (["jobs"], [(2,)])


def test_a_superuser_session_is_refused_without_the_flag(admin):
    message = _refused(admin, "is a superuser")
    assert isinstance(UnsafeSession(message), ReportRejected)  # callers catching refusals catch it


def test_a_superuser_session_runs_with_allow_superuser(admin):
    assert run_report(admin, COUNT_JOBS, allow_superuser=True) == (["jobs"], [(2,)])


@pytest.mark.parametrize("call", ["run_report", "run_read_only", "stream_report"])
def test_every_report_function_checks_the_session(admin, call):
    with pytest.raises(UnsafeSession, match="is a superuser"):
        if call == "run_report":
            run_report(admin, COUNT_JOBS)
        elif call == "run_read_only":
            run_read_only(admin, COUNT_JOBS)
        else:
            with stream_report(admin, COUNT_JOBS) as rows:
                list(rows)
    assert admin.info.transaction_status == pq.TransactionStatus.IDLE


def test_why_a_superuser_session_is_refused_its_query_can_take_its_role_back(admin, reader):
    superuser = admin.info.user
    # the guard bypassed: set_config('role') undoes SET LOCAL ROLE ledger_reader for a superuser ...
    _, result = run_read_only(admin, f"SELECT set_config('role', '{superuser}', true), current_user",
                              allow_superuser=True)
    assert result == [(superuser, superuser)]
    # ... and cannot for the reporting login
    with pytest.raises(errors.InsufficientPrivilege, match="permission denied to set role"):
        run_read_only(reader, f"SELECT set_config('role', '{superuser}', true), current_user")


def test_the_cli_refuses_a_superuser_session_in_one_line_and_runs_with_the_flag(ledger_db):
    refused = CliRunner().invoke(main, ["report", "--dsn", ledger_db, COUNT_JOBS])
    assert refused.exit_code == 1
    assert refused.output.startswith("Error: report refused: session user ")
    assert "is a superuser" in refused.output
    assert "CREATE ROLE reports LOGIN IN ROLE ledger_reader;" in refused.output
    assert len(refused.output.strip().splitlines()) == 1
    allowed = CliRunner().invoke(main, ["report", "--dsn", ledger_db, "--allow-superuser", "--format", "json",
                                        COUNT_JOBS])
    assert allowed.exit_code == 0, allowed.output
    assert json.loads(allowed.stdout) == [{"jobs": 2}]


def test_the_cli_runs_as_the_reporting_login(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "json", COUNT_JOBS])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"jobs": 2}]


def test_a_login_with_createrole_is_refused(admin, ledger_db):
    with _login(admin, ledger_db, options="LOGIN CREATEROLE") as conn:
        _refused(conn, "has CREATEROLE")
        assert run_report(conn, COUNT_JOBS, allow_superuser=True) == (["jobs"], [(2,)])


def test_a_login_that_is_also_a_ledger_client_is_refused(admin, ledger_db):
    with _login(admin, ledger_db, member_of=("ledger_reader", "ledger_client")) as conn:
        _refused(conn, "is a member of ledger_client, which holds EXECUTE on ledger.")


def test_a_login_that_belongs_to_a_superuser_role_is_refused(admin, ledger_db):
    with _role(admin, options="NOLOGIN SUPERUSER", member_of=()) as power, \
            _login(admin, ledger_db, member_of=("ledger_reader", power)) as conn:
        _refused(conn, f"is a member of {power}, which is a superuser")
        # and it could indeed become it from inside the query
        _, result = run_read_only(conn, f"SELECT set_config('role', '{power}', true)", allow_superuser=True)
        assert result == [(power,)]


def test_a_login_that_belongs_to_a_predefined_role_is_refused(admin, ledger_db):
    with _login(admin, ledger_db, member_of=("ledger_reader", "pg_signal_backend")) as conn:
        _refused(conn, "is a member of pg_signal_backend, which is a predefined role")


def test_a_login_reaching_a_powerful_role_through_a_group_is_refused(admin, ledger_db):
    with _role(admin, options="NOLOGIN", member_of=("ledger_client",)) as group, \
            _login(admin, ledger_db, member_of=("ledger_reader", group)) as conn:
        _refused(conn, "is a member of ledger_client")


def test_a_login_reaching_ledger_reader_through_an_empty_group_runs(admin, ledger_db):
    with _role(admin, options="NOLOGIN", member_of=("ledger_reader",)) as group, \
            _login(admin, ledger_db, member_of=(group,)) as conn:
        assert session_risks(conn) == []
        assert run_report(conn, COUNT_JOBS) == (["jobs"], [(2,)])


def test_a_login_with_a_direct_grant_on_a_catalog_function_is_refused(admin, ledger_db):
    with _login(admin, ledger_db) as conn:
        user = conn.info.user
        admin.execute(f'GRANT EXECUTE ON FUNCTION pg_catalog.pg_read_file(text) TO "{user}"')
        _refused(conn, "holds EXECUTE on pg_catalog.pg_read_file() directly")


def test_a_login_that_owns_ledger_objects_is_refused(admin, ledger_db):
    with _login(admin, ledger_db) as conn:
        user = conn.info.user
        table = f"ledger.scratch_{uuid.uuid4().hex[:10]}"
        admin.execute(f"CREATE TABLE {table} (a int)")
        admin.execute(f'ALTER TABLE {table} OWNER TO "{user}"')  # dropped with DROP OWNED BY
        _refused(conn, f"owns {table}")


def test_a_direct_select_grant_on_a_ledger_table_is_no_risk(admin, ledger_db):
    with _login(admin, ledger_db) as conn:
        admin.execute(f'GRANT SELECT ON ledger.jobs TO "{conn.info.user}"')
        assert session_risks(conn) == []


# -- the column fence ---------------------------------------------------------------------------

ACCEPTED = [
    "WITH x AS (SELECT job AS j FROM ledger.leases) SELECT j FROM x",
    "WITH x AS (SELECT job AS j FROM ledger.leases) SELECT x.j FROM x ORDER BY x.j",
    "SELECT job AS name, count(*) AS n FROM ledger.jobs GROUP BY name ORDER BY n DESC, name",
    "SELECT d.job, d.paused FROM (SELECT * FROM ledger.jobs) AS d",
    "SELECT d.a FROM (SELECT j.job FROM ledger.jobs AS j) AS d(a)",
    "SELECT j.xmin, j.ctid, ledger.jobs.job FROM ledger.jobs, ledger.jobs AS j WHERE j.job = ledger.jobs.job",
    "SELECT \"job\" FROM ledger.jobs",
    "SELECT row_to_json(j) FROM ledger.jobs AS j",
    "SELECT j FROM ledger.jobs AS j",
    "SELECT e.key, e.value FROM ledger.jobs AS j, jsonb_each(to_jsonb(j)) AS e",
    "SELECT e.value FROM jsonb_array_elements('[1, 2]'::jsonb) AS e",
    "SELECT g.g, g.ordinality FROM generate_series(1, 3) WITH ORDINALITY AS g",
    "SELECT t.x, t.n FROM generate_series(1, 3) WITH ORDINALITY AS t(x, n)",
    "SELECT u.x, u FROM unnest(ARRAY[1, 2]) AS u(x)",
    "SELECT v.a, v.b FROM (VALUES (1, 'x')) AS v(a, b)",
    "WITH RECURSIVE r AS (SELECT 1 AS n UNION ALL SELECT r.n + 1 FROM r WHERE r.n < 3) SELECT r.n FROM r",
    "SELECT j.job FROM ledger.jobs AS j WHERE EXISTS "
    "(SELECT 1 FROM ledger.job_execution_log AS r WHERE r.job = j.job)",
    "SELECT s.a FROM (SELECT 1 AS a UNION ALL SELECT 2) AS s",
    "SELECT c.relname, a.attname FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_attribute AS a ON a.attrelid = c.oid WHERE c.relname = 'jobs' AND a.attnum > 0",
    "SELECT a.job, b.token FROM (ledger.jobs AS a JOIN ledger.leases AS b USING (job))",
]


@pytest.mark.parametrize("sql", ACCEPTED, ids=[f"accepted-{i}" for i in range(len(ACCEPTED))])
def test_real_columns_pass_the_column_fence_and_run(catalog, reader, sql):
    check(sql, catalog)
    run_report(reader, sql)


REFUSED = [
    ("SELECT l.pg_typeof FROM ledger.leases AS l", "unknown column l.pg_typeof"),
    ("SELECT leases.pg_typeof FROM ledger.leases", "would read leases.pg_typeof as the function call "
                                                    "pg_typeof(leases)"),
    ("SELECT pg_typeof FROM ledger.leases", "unknown column pg_typeof"),
    ("WITH x AS (SELECT job AS j FROM ledger.leases) SELECT x.job FROM x", "x has no column job"),
    ("SELECT d.pg_typeof FROM (SELECT * FROM ledger.jobs) AS d", "unknown column d.pg_typeof"),
    ("SELECT d.job FROM (SELECT j.job FROM ledger.jobs AS j) AS d(a)", "unknown column d.job"),
    ("SELECT e.pg_typeof FROM jsonb_each('{}'::jsonb) AS e", "unknown column e.pg_typeof"),
    ("SELECT g.pg_sleep FROM generate_series(1, 1) AS g", "unknown column g.pg_sleep"),
    # aliases repeated for different relations: the column must exist in every one of them
    ("SELECT a.job FROM ledger.jobs AS a WHERE EXISTS "
     "(SELECT 1 FROM ledger.job_execution_log AS a WHERE a.run_id = 1)", "unknown column a.run_id"),
    ('SELECT "Job" FROM ledger.jobs', 'unknown column "Job"'),
    ("SELECT ledger.jobs.pg_typeof FROM ledger.jobs", "unknown column ledger.jobs.pg_typeof"),
    ("SELECT ledger.leases.job FROM ledger.jobs", "ledger.leases is not an unaliased relation"),
    ("SELECT x.ledger.jobs.job FROM ledger.jobs", "names a database"),
    ("SELECT (j).pg_typeof FROM ledger.jobs AS j", "field selection (j).pg_typeof"),
    ("SELECT (jsonb_each('{}'::jsonb)).key", "field selection"),
    ("SELECT * FROM ROWS FROM (generate_series(1, 2)) AS t", "ROWS FROM (...) is not allowed"),
]


@pytest.mark.parametrize(("sql", "reason"), REFUSED, ids=[f"refused-{i}" for i in range(len(REFUSED))])
def test_a_column_that_is_not_real_is_refused_with_its_name(catalog, reader, sql, reason):
    with pytest.raises(ReportRejected) as rejected:
        check(sql, catalog)
    assert reason in str(rejected.value), str(rejected.value)
    with pytest.raises(ReportRejected):
        run_report(reader, sql)


def test_column_notation_does_call_a_function_in_postgresql(reader):
    # what the column fence is for: without the guard, l.pg_typeof is pg_typeof(l)
    _, result = run_read_only(reader, "SELECT l.pg_typeof FROM ledger.jobs AS l LIMIT 1")
    assert result == [("ledger.jobs",)]


def test_the_guard_knows_the_out_columns_of_every_allowed_set_returning_function(admin):
    found = admin.execute(
        "SELECT proname::text, array_agg(DISTINCT names ORDER BY names) FROM ("
        "  SELECT p.proname, array_to_string(ARRAY(SELECT n FROM unnest(p.proargnames, p.proargmodes) AS a(n, m)"
        "                                          WHERE m IN ('o', 't')), ',') AS names"
        "    FROM pg_proc AS p WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proretset"
        "     AND p.proname = ANY(%s) AND p.proargmodes && ARRAY['o', 't']::\"char\"[]) AS f GROUP BY 1",
        (list(ALLOWED_FUNCTIONS),)).fetchall()
    # unnest(tsvector) has OUT columns too: the guard cannot tell which unnest runs, so it refuses
    # qualified references to an unnest without a column list (test below)
    assert {name: names for name, names in found} == {
        **{name: [",".join(columns)] for name, columns in _FUNCTION_COLUMNS.items()},
        "unnest": ["lexeme,positions,weights"]}


FROM_FUNCTIONS = [
    "generate_series(1, 2)", "unnest(ARRAY[1, 2])", "jsonb_each('{\"a\": 1}'::jsonb)",
    "jsonb_each_text('{\"a\": 1}'::jsonb)", "jsonb_array_elements('[1]'::jsonb)",
    "jsonb_array_elements_text('[1]'::jsonb)", "jsonb_object_keys('{\"a\": 1}'::jsonb)",
    "jsonb_path_query('{\"a\": 1}'::jsonb, '$.a')", "regexp_match('abc', 'b')",
]


@pytest.mark.parametrize("function", FROM_FUNCTIONS)
@pytest.mark.parametrize("alias", ["", " AS f", " WITH ORDINALITY AS f", " AS f(a)",
                                   " WITH ORDINALITY AS f(a, b)"])
def test_the_columns_postgresql_gives_a_function_in_from_are_the_ones_the_guard_allows(reader, function, alias):
    columns, _ = run_read_only(reader, f"SELECT * FROM {function}{alias}")
    qualifier = "f" if alias else function.split("(", 1)[0]
    selected = ", ".join(f"{qualifier}.{column}" for column in columns)
    if function.startswith("unnest") and "(a" not in alias:
        with pytest.raises(ReportRejected, match="name them: unnest"):
            run_report(reader, f"SELECT {selected} FROM {function}{alias}")
    else:
        assert run_report(reader, f"SELECT {selected} FROM {function}{alias}")[0] == columns


def test_unnest_of_a_tsvector_needs_a_column_list_for_qualified_references(reader):
    with pytest.raises(ReportRejected, match="name them"):
        run_report(reader, "SELECT u.lexeme FROM unnest('a b'::tsvector) AS u")
    assert run_report(reader, "SELECT u.l FROM unnest('a b'::tsvector) AS u(l, p, w)") == (["l"], [("a",), ("b",)])


# -- size limits --------------------------------------------------------------------------------

def _chained_ctes(count: int) -> str:
    chain = ", ".join(f"c{i} AS (SELECT x FROM c{i - 1})" for i in range(1, count))
    return f"WITH c0 AS (SELECT 1 AS x){', ' + chain if chain else ''} SELECT x FROM c{count - 1}"


def test_400_chained_ctes_are_refused_by_the_guard(catalog, reader, reader_dsn):
    sql = _chained_ctes(400)
    with pytest.raises(ReportRejected, match=f"over the limit of {MAX_SUBQUERIES} \\(MAX_SUBQUERIES\\)"):
        check(sql, catalog)
    with pytest.raises(ReportRejected, match="MAX_SUBQUERIES"):
        run_report(reader, sql)
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, sql])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "report rejected: the query has 401 SELECTs" in result.output


def test_more_than_32_ctes_are_refused_and_32_run(catalog, reader):
    with pytest.raises(ReportRejected, match=f"33 CTEs, over the limit of {MAX_CTES} \\(MAX_CTES\\)"):
        check(_chained_ctes(MAX_CTES + 1), catalog)
    assert run_report(reader, _chained_ctes(MAX_CTES)) == (["x"], [(1,)])


def test_more_than_64_query_blocks_are_refused_and_64_run(catalog, reader):
    union = " UNION ALL ".join(["SELECT 1 AS x"] * (MAX_SUBQUERIES + 1))
    with pytest.raises(ReportRejected, match="65 SELECTs"):
        check(union, catalog)
    columns, result = run_report(reader, " UNION ALL ".join(["SELECT 1 AS x"] * MAX_SUBQUERIES))
    assert len(result) == MAX_SUBQUERIES


def test_nesting_deeper_than_the_limit_is_refused(catalog, reader):
    with pytest.raises(ReportRejected, match=f"65 levels of parentheses, over the limit of {MAX_DEPTH}"):
        check("SELECT " + "(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), catalog)
    with pytest.raises(ReportRejected, match="levels of the syntax tree, over the limit of 64 \\(MAX_DEPTH\\)"):
        check("SELECT " + "- " * 80 + "1", catalog)  # no parentheses: the tree's depth counts
    nested = "SELECT 1 AS x"
    for _ in range(10):
        nested = f"SELECT s.x FROM ({nested}) AS s"
    assert run_report(reader, nested) == (["x"], [(1,)])


def test_a_long_chain_of_conditions_is_one_level(catalog, reader):
    conditions = " AND ".join(f"job <> 'no-{i}'" for i in range(200))
    check(f"SELECT job FROM ledger.jobs WHERE {conditions}", catalog)
    assert len(run_report(reader, f"SELECT job FROM ledger.jobs WHERE {conditions}")[1]) == 2


def test_a_query_over_the_size_limit_is_refused_before_parsing(catalog):
    with pytest.raises(ReportRejected, match=f"over the limit of {MAX_QUERY_BYTES} bytes"):
        check("SELECT 1 AS x WHERE 1 IN (" + ", ".join(["1"] * 40_000) + ")", catalog)
    # multi-byte text counts in bytes
    with pytest.raises(ReportRejected, match="bytes, over the limit"):
        check("SELECT '" + "é" * (MAX_QUERY_BYTES // 2 + 1) + "' AS x", catalog)
    check("SELECT 1 AS x WHERE 1 IN (" + ", ".join(["1"] * 20_000) + ")", catalog)  # 60 kB is fine


# -- the row limit and streaming ------------------------------------------------------------------

def test_stream_report_stops_at_the_default_limit_and_says_it_was_cut(reader):
    with stream_report(reader, MANY_ROWS) as rows:
        got = [row[0] for row in rows]
        assert rows.truncated and rows.count == DEFAULT_LIMIT
    assert got == list(range(1, DEFAULT_LIMIT + 1))
    assert reader.info.transaction_status == pq.TransactionStatus.IDLE


@pytest.mark.parametrize(("limit", "expected", "truncated"), [
    (None, 2500, False), (0, 2500, False), (2500, 2500, False), (2499, 2499, True), (1, 1, True)])
def test_the_limit_cuts_exactly_and_only_when_rows_are_left(reader, limit, expected, truncated):
    with stream_report(reader, "SELECT generate_series(1, 2500) AS n", limit=limit, batch_size=700) as rows:
        got = [row[0] for row in rows]
        assert (rows.count, rows.truncated) == (expected, truncated)
    assert got == list(range(1, expected + 1))


def test_a_negative_limit_is_refused(reader):
    with pytest.raises(ValueError, match="limit"):
        run_report(reader, COUNT_JOBS, limit=-1)


def test_rows_come_from_a_server_side_cursor_in_batches(reader):
    with stream_report(reader, MANY_ROWS, limit=None) as rows:
        iterator = iter(rows)
        assert next(iterator) == (1,)
        cursors = reader.execute("SELECT name, statement FROM pg_cursors").fetchall()
        assert [name for name, _ in cursors] == ["jobledger_report"]
        assert cursors[0][1].startswith("DECLARE")


def test_streaming_many_rows_keeps_memory_flat(reader):
    tracemalloc.start()
    try:
        with stream_report(reader, "SELECT generate_series(1, 300000) AS n", limit=None) as rows:
            total = sum(row[0] for row in rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == 300000 * 300001 // 2
    assert peak < 5_000_000, peak  # all 300000 rows at once would be over 20 MB


def test_the_cli_stops_at_1000_rows_by_default_and_says_so_on_stderr(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "csv", MANY_ROWS])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "n" and lines[1:] == [str(n) for n in range(1, 1001)]
    assert "report stopped at 1000 rows; --limit N to change (--limit 0: no limit)" in result.stderr


def test_the_cli_limit_option_changes_the_cut(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "json", "--limit", "3",
                                       MANY_ROWS])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert "report stopped at 3 rows" in result.stderr


def test_the_cli_limit_0_gives_every_row_and_no_note(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "csv", "--limit", "0",
                                       "SELECT generate_series(1, 2500) AS n"])
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2501
    assert "stopped" not in result.stderr


def test_the_cli_says_nothing_when_the_rows_fit_the_limit(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "json", "--limit", "2",
                                       "SELECT job FROM ledger.jobs ORDER BY job"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"job": "etl"}, {"job": "mail"}]
    assert result.stderr == ""


def test_the_cli_prints_a_long_table_in_pages(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--limit", "2500", MANY_ROWS])
    assert result.exit_code == 0, result.output
    for caption in ("rows 1-1000", "rows 1001-2000", "rows 2001-2500"):
        assert caption in result.stdout
    assert "report stopped at 2500 rows" in result.stderr


def test_the_cli_json_of_no_rows_is_an_empty_list(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--format", "json",
                                       "SELECT job FROM ledger.jobs WHERE false"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == []


def test_the_cli_refuses_a_negative_limit_as_a_usage_error(reader_dsn):
    result = CliRunner().invoke(main, ["report", "--dsn", reader_dsn, "--limit", "-1", COUNT_JOBS])
    assert result.exit_code == 2


# -- no prepared statements (PgBouncer) -------------------------------------------------------------

def test_no_statement_of_a_report_is_prepared_even_while_it_runs(reader):
    # psycopg deallocates its statements at a rollback, so look inside the report's transaction;
    # seven reports: past psycopg's prepare_threshold (5), nothing gets prepared either
    for _ in range(7):
        with stream_report(reader, MANY_ROWS) as rows:
            assert next(iter(rows)) == (1,)
            prepared = reader.execute("SELECT name, statement FROM pg_prepared_statements", prepare=False)
            assert prepared.fetchall() == []


def test_reports_run_on_a_connection_that_never_prepares(reader_dsn):
    with psycopg.connect(reader_dsn, autocommit=True, prepare_threshold=None) as conn:
        for _ in range(3):
            assert run_report(conn, COUNT_JOBS) == (["jobs"], [(2,)])
        with stream_report(conn, MANY_ROWS, limit=10) as rows:
            assert len(list(rows)) == 10
        assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)
