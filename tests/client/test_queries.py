"""The statements of ``ledger/queries.py`` against the real database: typed rows match, every one plans.

queries.py is the one place the package's SQL is written, and a typed row's
columns are written once, as its dataclass's fields. These tests tie both to
the installed schema: a dataclass field the view or type does not have (or a
view column a dataclass forgot) fails here, and so does a statement that no
longer plans (a renamed argument, a dropped column), before any client sends it.
"""

from __future__ import annotations

import os
import re
import tokenize
from dataclasses import fields
from pathlib import Path

import psycopg
import pytest
from psycopg.sql import SQL, Identifier

import ledger
from ledger import queries
from ledger.models import DbRisk, Event, EventSettings, Job, JobStatus, Lease, Run, RunStart

# dataclass -> the relation or composite type it is a row of (docs/contract.md)
ROWS = {
    Run: "ledger.job_execution_log",
    Job: "ledger.jobs",
    JobStatus: "ledger.job_status",
    Lease: "ledger.lease",
    RunStart: "ledger.run_start",
    Event: "ledger.events",
    EventSettings: "ledger.event_settings",
    DbRisk: "ledger.db_risks",
}

# Columns of a relation that no typed row carries: the evaluator's compiled schedule, the
# settings' one-row key.
INTERNAL = {"ledger.jobs": {"schedule_spec"}, "ledger.event_settings": {"singleton"}}

STATEMENTS = {name: value for name, value in vars(queries).items()
              if name.isupper() and isinstance(value, str) and not name.endswith("_COLUMNS")}


def columns_of(db: psycopg.Connection, relation: str) -> list[str]:
    rows = db.execute("SELECT a.attname FROM pg_attribute a WHERE a.attrelid = %s::regclass "
                      "AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum", (relation,)).fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("row", list(ROWS), ids=lambda row: row.__name__)
def test_a_typed_row_has_exactly_the_columns_of_its_relation(db, row) -> None:
    names = [field.name for field in fields(row)]
    internal = INTERNAL.get(ROWS[row], set())
    assert names == [name for name in columns_of(db, ROWS[row]) if name not in internal], row.__name__


def sql_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in ``path`` that starts like a statement."""
    found = []
    with path.open() as source:
        for token in tokenize.generate_tokens(source.readline):
            if token.type == tokenize.STRING:
                body = token.string.lstrip("rbfuRBFU").strip("\"'").lstrip()
                if STATEMENT.match(body):
                    found.append((token.start[0], body.split("\n")[0][:60]))
    return found


STATEMENT = re.compile(r"(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|DROP|ALTER)\s")  # house style: upper case
# Not the client's statements: the report guard's own session checks (ledger/report.py), the
# read-only transaction's settings (ledger/readonly.py), the migration runner's bookkeeping
# (ledger/migrate.py), the per-call statement_timeout prefix (ledger/connect.py), and the CLI's
# help examples of `jobledger report` (ledger/cli/report.py).
ELSEWHERE = {"report.py", "readonly.py", "migrate.py", "connect.py", "cli/report.py"}


def test_every_statement_is_found_and_none_is_written_outside_queries() -> None:
    assert len(STATEMENTS) >= 30
    package = Path(ledger.__file__).parent
    offenders = [f"{path.relative_to(package)}:{line}: {text}"
                 for path in sorted(package.rglob("*.py"))
                 if path.name != "queries.py" and str(path.relative_to(package)) not in ELSEWHERE
                 for line, text in sql_literals(path)]
    assert offenders == []


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_every_statement_plans_against_the_installed_schema(db, name) -> None:
    """EXPLAIN (no execution) with every parameter NULL: the names, arguments and columns all exist."""
    text = STATEMENTS[name]
    if text.startswith(("LISTEN ", "UNLISTEN ")):
        db.execute(text)  # a command, which EXPLAIN does not take; running it is harmless
        return
    if "{}" in text:
        # A DDL template for psycopg.sql (the embedded server's database), which EXPLAIN does not take:
        # it runs, on a database of this test's own (database names are cluster-wide).
        scratch = f"ledger_ddl_{os.getpid()}_{name.lower()}"
        statement = SQL(text).format(Identifier(scratch))
        exists = "SELECT count(*) FROM pg_database WHERE datname = %s"
        if text.startswith("DROP DATABASE"):
            db.execute(SQL("CREATE DATABASE {}").format(Identifier(scratch)))
            db.execute(statement)
            assert db.execute(exists, (scratch,)).fetchone() == (0,)
        else:
            try:
                db.execute(statement)
                assert db.execute(exists, (scratch,)).fetchone() == (1,)
            finally:
                db.execute(SQL("DROP DATABASE IF EXISTS {}").format(Identifier(scratch)))
        return
    params = {key: None for key in re.findall(r"%\((\w+)\)s", text)}
    with psycopg.ClientCursor(db) as cur:
        sql = cur.mogrify(text, params)
        cur.execute("EXPLAIN " + sql)
        assert cur.fetchall()
