"""Ad-hoc read-only reports over the ledger: a guard, then a read-only run.

Two fences, because a query that parses as SELECT is not read-only
(``SELECT ledger.acquire(...)`` writes, ``WITH x AS (DELETE ...) SELECT``
writes, ``SELECT ... INTO`` creates a table, ``FOR UPDATE`` locks):

1. :func:`check`, the parser fence. sqlglot (PostgreSQL dialect, errors
   raised) must read exactly one statement, a SELECT (or a set operation of
   SELECTs), and every node of the whole tree, CTEs and subqueries included,
   must pass: no write, DDL, ``INTO``, lock, command or ``OPERATOR()`` node;
   function calls from :data:`ALLOWED_FUNCTIONS` only, never schema-qualified;
   relations from schemas ``ledger`` and ``pg_catalog`` only, schema-qualified
   (an unqualified name must be a CTE in scope). What it returns is sqlglot's
   own rendering of the tree, without comments, and that is what runs: the
   text checked and the text executed cannot disagree.
2. :func:`run_read_only`, the database fence: a READ ONLY transaction under
   ``SET LOCAL ROLE ledger_reader`` (SELECT on the ledger, no EXECUTE on its
   functions), a ``statement_timeout``, ``search_path`` pinned to
   ``pg_catalog``, the extended protocol (one statement per call, enforced by
   the server), and a rollback at the end whatever happened. The connecting
   user must be a member of ``ledger_reader`` (``GRANT ledger_reader TO
   <login role>``; a superuser is one already).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import sqlglot
from psycopg import pq
from sqlglot import exp
from sqlglot.errors import ErrorLevel, ParseError, SqlglotError, TokenError

__all__ = [
    "ALLOWED_FUNCTIONS",
    "ALLOWED_SCHEMAS",
    "DEFAULT_TIMEOUT",
    "ReportRejected",
    "check",
    "read_only_transaction",
    "run_read_only",
    "run_report",
]

DIALECT = "postgres"
ALLOWED_SCHEMAS = frozenset({"ledger", "pg_catalog"})
DEFAULT_TIMEOUT = timedelta(seconds=5)


class ReportRejected(ValueError):
    """The guard refused the query; the message says what and why."""


# -- the function allow-list -------------------------------------------------
#
# sqlglot turns the functions it knows into typed nodes (``date_trunc`` is
# exp.TimestampTrunc, ``now()`` exp.CurrentTimestamp) and the others into
# exp.Anonymous. Both lists are matched exactly (the node's own class, not a
# subclass), and the SQL that runs is rendered from the node, so an allowed
# class always runs as the PostgreSQL function it stands for. Operators
# (sqlglot makes ->>, @>, ~, AND ... Func nodes too) are not listed: with
# OPERATOR() refused and search_path pinned to pg_catalog, only built-in
# operators can run, and none of them has a side effect.

_ALLOWED_NODES: dict[type[exp.Expr], str] = {
    # aggregates
    exp.Count: "count", exp.Sum: "sum", exp.Avg: "avg", exp.Min: "min", exp.Max: "max",
    exp.PercentileCont: "percentile_cont", exp.PercentileDisc: "percentile_disc",
    exp.Mode: "mode", exp.Stddev: "stddev", exp.StddevSamp: "stddev_samp",
    exp.StddevPop: "stddev_pop", exp.Variance: "variance", exp.LogicalAnd: "bool_and",
    exp.LogicalOr: "bool_or", exp.GroupConcat: "string_agg", exp.ArrayAgg: "array_agg",
    exp.JSONArrayAgg: "json_agg", exp.JSONBObjectAgg: "jsonb_object_agg",
    # window functions
    exp.RowNumber: "row_number", exp.Rank: "rank", exp.DenseRank: "dense_rank",
    exp.PercentRank: "percent_rank", exp.CumeDist: "cume_dist", exp.Ntile: "ntile",
    exp.Lag: "lag", exp.Lead: "lead", exp.FirstValue: "first_value",
    exp.LastValue: "last_value", exp.NthValue: "nth_value",
    # time
    exp.CurrentTimestamp: "now", exp.CurrentDate: "current_date",
    exp.Extract: "extract date_part", exp.TimestampTrunc: "date_trunc",
    exp.DateTrunc: "date_trunc", exp.TimeToStr: "to_char", exp.UnixToTime: "to_timestamp",
    exp.JustifyInterval: "justify_interval", exp.JustifyHours: "justify_hours",
    exp.JustifyDays: "justify_days", exp.MakeInterval: "make_interval",
    # conditionals and casts
    exp.Coalesce: "coalesce", exp.Nullif: "nullif", exp.Greatest: "greatest",
    exp.Least: "least", exp.Case: "CASE", exp.If: "CASE", exp.Cast: "CAST",
    exp.Exists: "EXISTS",
    # numbers
    exp.Round: "round", exp.Floor: "floor", exp.Ceil: "ceil", exp.Abs: "abs",
    exp.Sign: "sign", exp.Sqrt: "sqrt", exp.Ln: "ln", exp.Log: "log",
    # text
    exp.Lower: "lower", exp.Upper: "upper", exp.Length: "length", exp.Substring: "substring",
    exp.StrPosition: "position strpos", exp.Trim: "trim", exp.Replace: "replace",
    exp.SplitPart: "split_part", exp.Concat: "concat", exp.Left: "left", exp.Right: "right",
    exp.Initcap: "initcap", exp.Pad: "lpad rpad", exp.StartsWith: "starts_with",
    exp.RegexpReplace: "regexp_replace", exp.Format: "format",
    exp.StringToArray: "string_to_array", exp.ArrayToString: "array_to_string",
    # arrays and sets of rows
    exp.Array: "ARRAY[]", exp.ArraySize: "array_length", exp.Unnest: "unnest",
    exp.Explode: "unnest", exp.ExplodingGenerateSeries: "generate_series",
    exp.GenerateSeries: "generate_series",
}

# PostgreSQL functions that sqlglot leaves as exp.Anonymous: pure readers.
_ALLOWED_NAMES = frozenset({
    "age", "clock_timestamp", "statement_timestamp", "timezone", "isfinite",
    "make_timestamptz", "every", "cardinality",
    "jsonb_agg", "jsonb_build_object", "jsonb_build_array", "json_build_object",
    "jsonb_typeof", "jsonb_array_length", "jsonb_array_elements", "jsonb_array_elements_text",
    "jsonb_each", "jsonb_each_text", "jsonb_object_keys", "jsonb_extract_path",
    "jsonb_extract_path_text", "jsonb_strip_nulls", "jsonb_pretty", "to_jsonb", "to_json",
    "row_to_json", "jsonb_path_query", "jsonb_path_query_first", "jsonb_path_exists",
    "tstzrange", "lower_inf", "upper_inf", "isempty", "regexp_match",
})

#: What a report may call, for messages and the README.
ALLOWED_FUNCTIONS: tuple[str, ...] = tuple(sorted(
    {name for names in _ALLOWED_NODES.values() for name in names.split()
     if name.replace("_", "").isalpha()} | _ALLOWED_NAMES))


# -- nodes that are never allowed, anywhere in the tree ----------------------

def _forbidden(node: exp.Expr) -> tuple[str, str] | None:
    """(what, why) when ``node`` may not appear in a report."""
    kind = type(node).__name__.upper()
    if isinstance(node, exp.Command):
        return f"{str(node.this).upper()} command", "a report runs one read-only SELECT"
    if isinstance(node, exp.Into):
        return "SELECT ... INTO", "it creates a table"
    if isinstance(node, exp.Lock):
        return node.sql(DIALECT), "it locks rows"
    if isinstance(node, (exp.DML, exp.DDL, exp.Returning)):
        name = {"TRUNCATETABLE": "TRUNCATE"}.get(kind, kind)
        return name, "it writes (a report may only read)"
    if isinstance(node, (exp.Drop, exp.Alter, exp.TruncateTable, exp.Analyze)):
        return {"TRUNCATETABLE": "TRUNCATE"}.get(kind, kind), "it changes the database"
    if isinstance(node, (exp.Set, exp.Transaction, exp.Commit, exp.Rollback)):
        return kind, "it changes the session or transaction"
    if isinstance(node, exp.Operator):
        return "OPERATOR(...)", "explicit operator calls are not allowed"
    if isinstance(node, (exp.Placeholder, exp.Parameter)):
        return node.sql(DIALECT), "a report takes no parameters"
    return None


# -- the guard ---------------------------------------------------------------

def check(sql: str) -> str:
    """The normalised SQL of ``sql`` when it is one read-only SELECT; ReportRejected otherwise.

    The result is what :func:`run_report` executes (sqlglot's rendering,
    comments dropped).
    """
    if not isinstance(sql, str) or not sql.strip():
        raise ReportRejected("report rejected: the query is empty")
    try:
        return _check(sql)
    except RecursionError as error:  # sqlglot recurses per nesting level
        raise ReportRejected("report rejected: the query is nested too deeply for the guard") from error


def _check(sql: str) -> str:
    tree = _parse_one(sql)
    root = tree.unnest() if isinstance(tree, exp.Subquery) else tree
    if not isinstance(root, (exp.Select, exp.SetOperation)):
        raise ReportRejected(
            f"report rejected: {_label(root)} is not a SELECT; a report runs one read-only SELECT")
    for node in tree.walk():
        _check_node(node)
    normalised = tree.sql(dialect=DIALECT, comments=False)
    # A rendering that sqlglot itself reads differently is not trusted to run.
    if _parse_one(normalised).sql(dialect=DIALECT, comments=False) != normalised:
        raise ReportRejected(
            "report rejected: sqlglot cannot render this query faithfully; simplify it")
    return normalised


def _parse_one(sql: str) -> exp.Expr:
    try:
        statements = sqlglot.parse(sql, read=DIALECT, error_level=ErrorLevel.RAISE)
    except (ParseError, TokenError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ReportRejected(f"report rejected: not SQL that the guard can read ({first})") from error
    except SqlglotError as error:  # any other sqlglot failure is a refusal too
        raise ReportRejected(f"report rejected: not SQL that the guard can read ({error})") from error
    present = [s for s in statements if s is not None]
    if len(present) != 1:
        raise ReportRejected(
            f"report rejected: exactly one statement is allowed, got {len(present)}")
    return present[0]


def _check_node(node: exp.Expr) -> None:
    forbidden = _forbidden(node)
    if forbidden is not None:
        what, why = forbidden
        raise ReportRejected(f"report rejected: {what} is not allowed: {why}{_where(node)}")
    if isinstance(node, exp.Func) and not isinstance(node, (exp.Binary, exp.Unary)):
        _check_function(node)
    elif isinstance(node, exp.Table):
        _check_relation(node)
    elif isinstance(node, exp.DataType):
        _check_type(node)


def _check_function(node: exp.Func) -> None:
    parent = node.parent
    if isinstance(parent, exp.Dot) and parent.expression is node:
        _qualified_call(parent.this.sql(DIALECT), node)
    if type(node) is exp.Anonymous:
        allowed = node.name.lower() in _ALLOWED_NAMES
    else:
        allowed = type(node) in _ALLOWED_NODES
    if not allowed:
        raise ReportRejected(
            f"report rejected: function {_function_name(node)}() is not on the report allow-list "
            f"(read-only built-ins such as count, percentile_cont, date_trunc, coalesce, "
            f"row_number; the full list is in `jobledger report --help`){_where(node)}")


def _qualified_call(schema: str, node: exp.Func) -> None:
    raise ReportRejected(
        f"report rejected: schema-qualified function call {schema}.{_function_name(node)}() is not "
        "allowed: a report calls unqualified built-in functions only (the ledger's own functions "
        "are its write API)")


def _check_relation(table: exp.Table) -> None:
    if not isinstance(table.this, exp.Identifier):
        # A table function (FROM generate_series(...)): checked as a function,
        # but never schema-qualified.
        schema = table.args.get("db")
        if schema is not None and isinstance(table.this, exp.Func):
            _qualified_call(schema.sql(DIALECT), table.this)
        return
    name = _ident(table.this)
    shown = table.sql(DIALECT)
    if table.args.get("catalog") is not None:
        raise ReportRejected(
            f"report rejected: relation {shown} names a database; use schema.relation")
    schema_node = table.args.get("db")
    if schema_node is None:
        if name in _ctes_in_scope(table):
            return
        raise ReportRejected(
            f"report rejected: relation {shown} must be schema-qualified "
            f"(ledger.{name} or pg_catalog.{name}); only CTE names may stand alone")
    schema = _ident(schema_node)
    if schema not in ALLOWED_SCHEMAS:
        raise ReportRejected(
            f"report rejected: relation {shown} is outside schemas ledger and pg_catalog")


def _check_type(node: exp.DataType) -> None:
    kind = node.args.get("kind")
    if node.this == exp.DataType.Type.USERDEFINED and isinstance(kind, exp.Dot):
        schema = _ident(kind.this) if isinstance(kind.this, exp.Identifier) else ""
        if schema not in ALLOWED_SCHEMAS:
            raise ReportRejected(
                f"report rejected: type {node.sql(DIALECT)} is outside schemas ledger and pg_catalog")


def _ctes_in_scope(table: exp.Table) -> set[str]:
    """The CTE names visible where ``table`` stands, by PostgreSQL's scoping.

    A CTE sees the CTEs listed before it (all of them under RECURSIVE); the
    body of a query sees all of its own CTEs; names resolve outwards.
    """
    names: set[str] = set()
    child: exp.Expr = table
    node = table.parent
    while node is not None:
        if isinstance(node, exp.With):
            ctes = list(node.expressions)
            if node.args.get("recursive"):
                visible = ctes
            else:
                index = next((i for i, cte in enumerate(ctes) if cte is child), len(ctes))
                visible = ctes[:index]
            names.update(_cte_name(cte) for cte in visible)
        else:
            with_ = node.args.get("with_") or node.args.get("with")
            if isinstance(with_, exp.With) and child is not with_:
                names.update(_cte_name(cte) for cte in with_.expressions)
        child, node = node, node.parent
    names.discard("")
    return names


def _cte_name(cte: exp.Expr) -> str:
    alias = cte.args.get("alias")
    identifier = alias.this if isinstance(alias, exp.TableAlias) else None
    return _ident(identifier) if isinstance(identifier, exp.Identifier) else ""


def _ident(node: exp.Expr) -> str:
    """An identifier as PostgreSQL resolves it: folded to lower case unless quoted."""
    text = node.name
    return text if node.args.get("quoted") else text.lower()


def _function_name(node: exp.Func) -> str:
    if isinstance(node, exp.Anonymous):
        return node.name.lower()
    rendered = node.sql(DIALECT)
    head = rendered.split("(", 1)[0].strip()
    return head.lower() if head.replace("_", "").isalnum() else type(node).__name__.lower()


def _label(node: exp.Expr) -> str:
    """What a statement is, in SQL words: ``DELETE``, ``LOCK command``, ``NOTIFY``."""
    if isinstance(node, exp.Command):
        return f"{str(node.this).upper()} command"
    words = node.sql(DIALECT).split(None, 1)
    return words[0].upper() if words else type(node).__name__.upper()


def _where(node: exp.Expr) -> str:
    if node.parent is None:
        return ""
    context = node.parent
    while context.parent is not None and not isinstance(context, (exp.Query, exp.CTE)):
        context = context.parent
    snippet = " ".join(context.sql(DIALECT).split())
    return f" (in: {snippet[:100]}{'...' if len(snippet) > 100 else ''})"


# -- running it --------------------------------------------------------------

def run_report(
    conn: psycopg.Connection[Any], sql: str, timeout: timedelta = DEFAULT_TIMEOUT,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Check ``sql``, then run the checked rendering read-only: (column names, rows)."""
    return run_read_only(conn, check(sql), timeout)


def run_read_only(
    conn: psycopg.Connection[Any], sql: str, timeout: timedelta = DEFAULT_TIMEOUT,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The database fence alone, no guard: run ``sql`` in :func:`read_only_transaction`.

    Sent with the extended protocol (``prepare=True``), so the server refuses
    a second statement. Raises psycopg.errors.QueryCanceled on timeout.
    """
    with read_only_transaction(conn, timeout) as cur:
        cur.execute(sql, prepare=True)
        columns = [column.name for column in cur.description or []]
        rows = cur.fetchall()
    return columns, rows


@contextmanager
def read_only_transaction(
    conn: psycopg.Connection[Any], timeout: timedelta = DEFAULT_TIMEOUT,
) -> Iterator[psycopg.Cursor[Any]]:
    """A cursor in a transaction of its own that can only read, always rolled back.

    READ ONLY, ``SET LOCAL ROLE ledger_reader`` (SELECT on the ledger, no
    EXECUTE on its functions), ``statement_timeout`` = ``timeout`` per
    statement, ``search_path`` = pg_catalog. InsufficientPrivilege when the
    connecting user is not a member of ledger_reader. The session comes out
    as it went in (role, settings).
    """
    if timeout <= timedelta(0):
        raise ValueError("timeout must be positive")
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise ValueError("a report needs a connection with no transaction open: "
                         "it runs in a read-only transaction of its own")
    milliseconds = max(1, round(timeout.total_seconds() * 1000))
    with conn.transaction(force_rollback=True), conn.cursor() as cur:
        cur.execute("SET TRANSACTION READ ONLY")
        cur.execute("SET LOCAL ROLE ledger_reader")
        cur.execute(
            "SELECT pg_catalog.set_config('statement_timeout', %s, true),"
            " pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true),"
            " pg_catalog.set_config('standard_conforming_strings', 'on', true)",
            (str(milliseconds),))
        yield cur
