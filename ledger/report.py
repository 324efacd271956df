"""Ad-hoc read-only reports over the ledger: a guard, then a read-only run.

A query that parses as SELECT is not read-only (``SELECT ledger.acquire(...)``
writes, ``WITH x AS (DELETE ...) SELECT`` writes, ``SELECT ... INTO`` creates a
table, ``FOR UPDATE`` locks), and a read-only query is not yet harmless (it
can be huge, or call a function through column notation), hence these fences.
1 and 2 run before the database is touched; then, in the read-only transaction
of 5, the session check (4), the column check (3) and the query:

1. Size, before anything is parsed deeply (:data:`MAX_QUERY_BYTES`,
   :data:`MAX_DEPTH`, :data:`MAX_SUBQUERIES`, :data:`MAX_CTES`): at most
   100 000 bytes of text; at most 64 levels of nesting (parentheses and
   brackets in the tokens first, then the syntax tree, where a chain of one
   operator, ``a AND b AND c``, is one level); at most 64 query blocks (each
   SELECT: the main query, CTE bodies, subqueries, UNION arms; counted in the
   tokens first, then in the tree) and 32 CTEs. PostgreSQL's planner is not
   interrupted quickly by ``statement_timeout``: 400 chained CTEs planned for
   15 s under a 5 s timeout, so size is refused before the server sees it.
2. The parser fence (:func:`check`). sqlglot (PostgreSQL dialect, errors
   raised) must read exactly one statement, a SELECT (or a set operation of
   SELECTs), and every node of the whole tree, CTEs and subqueries included,
   must pass: no write, DDL, ``INTO``, lock, command or ``OPERATOR()`` node;
   no field selection ``(expr).name`` and no ``ROWS FROM``; function calls
   from :data:`ALLOWED_FUNCTIONS` only, never schema-qualified; relations from
   schemas ``ledger`` and ``pg_catalog`` only, schema-qualified (an
   unqualified name must be a CTE in scope), and existing.
3. The column fence (in :func:`check`, against a :data:`Catalog` read from
   ``pg_attribute``). PostgreSQL reads ``t.name`` as the function call
   ``name(t)`` when ``t`` has no column ``name`` (``SELECT l.pg_typeof FROM
   ledger.leases l`` runs ``pg_typeof(l)``), so every column reference must
   name a real column: ``t.name`` a column of every relation of the query
   called ``t`` (a table or view of the catalog, system columns included, a
   CTE, a derived table, a table function, VALUES; with their column alias
   lists; an ``unnest()`` needs a column list, as its columns depend on its
   argument's type), ``schema.relation.name`` a column of that relation, unaliased in
   FROM; and an unqualified ``name`` a column of some relation of the query,
   a relation's name (a whole-row reference) or an output alias of a SELECT
   (``ORDER BY`` an alias). Four-part names are refused.
4. The session fence (:func:`check_session`): ``SET LOCAL ROLE ledger_reader``
   is only a wall if the query cannot take another role back
   (``set_config('role', ...)``, or ``'none'`` to become the session user
   again), so the session user must hold no power beyond ledger_reader's;
   see :func:`session_risks` for exactly what is checked. A superuser session
   is refused unless the caller passes ``allow_superuser=True``
   (``--allow-superuser``). The setup: ``CREATE ROLE reports LOGIN IN ROLE
   ledger_reader;`` and connect as ``reports``.
5. The database fence (:func:`ledger.readonly.read_only_transaction`): a READ ONLY
   transaction under ``SET LOCAL ROLE ledger_reader`` (SELECT on the ledger,
   no EXECUTE on its functions), a ``statement_timeout``, ``search_path``
   pinned to ``pg_catalog``, and a rollback at the end whatever happened. The
   query runs as a server-side cursor, ``DECLARE ... CURSOR FOR <query>``
   sent with the extended protocol (one statement only, and a cursor takes
   nothing but a SELECT), never as a named prepared statement (so it works
   through PgBouncer, ``prepare_threshold=None``); rows come back in batches
   of :data:`BATCH_SIZE` (``FETCH``, each under the timeout) and stop at the
   caller's row limit (:data:`DEFAULT_LIMIT` for :func:`stream_report`).

What runs is sqlglot's own rendering of the checked tree, without comments:
the text checked and the text executed cannot disagree. The connecting user
must be a member of ``ledger_reader`` (``GRANT ledger_reader TO <login
role>``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import ErrorLevel, ParseError, SqlglotError, TokenError
from sqlglot import Token, TokenType

from ledger.readonly import READER_ROLE, read_only_transaction
from ledger.text import first_line

__all__ = [
    "ALLOWED_FUNCTIONS",
    "ALLOWED_SCHEMAS",
    "BATCH_SIZE",
    "Catalog",
    "DEFAULT_LIMIT",
    "DEFAULT_TIMEOUT",
    "MAX_CTES",
    "MAX_DEPTH",
    "MAX_QUERY_BYTES",
    "MAX_SUBQUERIES",
    "RelationColumns",
    "ReportRejected",
    "ReportRows",
    "UnsafeSession",
    "check",
    "check_session",
    "load_catalog",
    "read_only_transaction",
    "run_read_only",
    "run_report",
    "session_risks",
    "stream_report",
]

DIALECT = "postgres"
ALLOWED_SCHEMAS = frozenset({"ledger", "pg_catalog"})
DEFAULT_TIMEOUT = timedelta(seconds=5)

#: The longest query text, in bytes of UTF-8.
MAX_QUERY_BYTES = 100_000
#: The deepest nesting: of parentheses/brackets in the text, of the syntax tree.
MAX_DEPTH = 64
#: The most query blocks (SELECTs: main query, CTE bodies, subqueries, UNION arms).
MAX_SUBQUERIES = 64
#: The most CTEs (WITH entries, all levels together).
MAX_CTES = 32
#: Rows :func:`stream_report` (and ``jobledger report``) gives by default.
DEFAULT_LIMIT = 1000
#: Rows per FETCH from the server-side cursor.
BATCH_SIZE = 1000

_T = TypeVar("_T")
_CURSOR_NAME = "jobledger_report"
_SETUP_HINT = ("connect as a reporting login whose only privileges come from ledger_reader "
               "(CREATE ROLE reports LOGIN IN ROLE ledger_reader;)")


class ReportRejected(ValueError):
    """The guard refused the query; the message says what and why."""


class UnsafeSession(ReportRejected):
    """The session user could leave ledger_reader again; the message says why and what to do."""

    def __init__(self, message: str, risks: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.risks: tuple[str, ...] = tuple(risks)


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

@dataclass(frozen=True)
class RelationColumns:
    """The columns of one relation: ``columns`` in attnum order (what ``*`` gives), ``system`` (ctid, xmin ...)."""

    columns: tuple[str, ...]
    system: frozenset[str] = frozenset()


#: (schema, relation) -> its columns, for the relations a report may read.
Catalog = Mapping[tuple[str, str], RelationColumns]


def check(sql: str, catalog: Catalog) -> str:
    """The normalised SQL of ``sql`` when it is one read-only SELECT; ReportRejected otherwise.

    ``catalog`` holds the columns of the relations the query may read (from
    :func:`load_catalog`); every column reference is checked against it. The
    result is what :func:`run_report` executes (sqlglot's rendering,
    comments dropped).
    """
    return _guarded(lambda: _finish(_structure(sql), catalog))


def _guarded(step: Callable[[], _T]) -> _T:
    try:
        return step()
    except RecursionError as error:  # sqlglot recurses per nesting level
        raise ReportRejected("report rejected: the query is nested too deeply for the guard") from error


def _structure(sql: str) -> exp.Expr:
    """The parsed tree of ``sql`` once its size and every node passed; the columns are checked later."""
    if not isinstance(sql, str) or not sql.strip():
        raise ReportRejected("report rejected: the query is empty")
    size = len(sql.encode("utf-8", "surrogatepass"))
    if size > MAX_QUERY_BYTES:
        raise ReportRejected(
            f"report rejected: the query is {size} bytes, over the limit of {MAX_QUERY_BYTES} bytes "
            "(MAX_QUERY_BYTES)")
    tokens = _tokens(sql)
    _check_token_limits(tokens)
    tree = _parse_tokens(tokens, sql)
    _check_tree_limits(tree)
    root = tree.unnest() if isinstance(tree, exp.Subquery) else tree
    if not isinstance(root, (exp.Select, exp.SetOperation)):
        raise ReportRejected(
            f"report rejected: {_label(root)} is not a SELECT; a report runs one read-only SELECT")
    for node in tree.walk():
        _check_node(node)
    return tree


def _finish(tree: exp.Expr, catalog: Catalog) -> str:
    _check_columns(tree, catalog)
    normalised = tree.sql(dialect=DIALECT, comments=False)
    # A rendering that sqlglot itself reads differently is not trusted to run.
    if _parse_one(normalised).sql(dialect=DIALECT, comments=False) != normalised:
        raise ReportRejected(
            "report rejected: sqlglot cannot render this query faithfully; simplify it")
    return normalised


# -- size limits ---------------------------------------------------------------

def _nested_too_deeply(depth: int, where: str) -> ReportRejected:
    return ReportRejected(
        f"report rejected: the query is nested too deeply: {depth} levels of {where}, over the limit "
        f"of {MAX_DEPTH} (MAX_DEPTH)")


def _too_many_subqueries(count: int) -> ReportRejected:
    return ReportRejected(
        f"report rejected: the query has {count} SELECTs (the main query, CTEs, subqueries and UNION "
        f"arms count one each), over the limit of {MAX_SUBQUERIES} (MAX_SUBQUERIES)")


def _check_token_limits(tokens: Sequence[Token]) -> None:
    """Before the parser: parentheses nesting and SELECT keywords, counted in the tokens."""
    depth = deepest = selects = 0
    for token in tokens:
        kind = token.token_type
        if kind in (TokenType.L_PAREN, TokenType.L_BRACKET):
            depth += 1
            deepest = max(deepest, depth)
        elif kind in (TokenType.R_PAREN, TokenType.R_BRACKET):
            depth -= 1
        elif kind == TokenType.SELECT:
            selects += 1
    if deepest > MAX_DEPTH:
        raise _nested_too_deeply(deepest, "parentheses")
    if selects > MAX_SUBQUERIES:
        raise _too_many_subqueries(selects)


def _check_tree_limits(tree: exp.Expr) -> None:
    """After the parser, without recursion: tree depth, query blocks, CTEs."""
    deepest = selects = ctes = 0
    stack: list[tuple[exp.Expr, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _nested_too_deeply(depth, "the syntax tree")
        deepest = max(deepest, depth)
        if isinstance(node, exp.Select):
            selects += 1
        elif isinstance(node, exp.CTE):
            ctes += 1
        for child in node.iter_expressions():
            # a chain of one operator (a AND b AND c, x + y + z, UNION ALL ...) is one level
            chained = isinstance(node, (exp.Binary, exp.SetOperation)) and type(child) is type(node)
            stack.append((child, depth if chained else depth + 1))
    if selects > MAX_SUBQUERIES:
        raise _too_many_subqueries(selects)
    if ctes > MAX_CTES:
        raise ReportRejected(
            f"report rejected: the query has {ctes} CTEs, over the limit of {MAX_CTES} (MAX_CTES)")


# -- parsing -------------------------------------------------------------------

def _tokens(sql: str) -> list[Token]:
    try:
        return Dialect.get_or_raise(DIALECT).tokenize(sql)
    except SqlglotError as error:
        raise _unreadable(error) from error


def _parse_tokens(tokens: list[Token], sql: str) -> exp.Expr:
    try:
        parser = Dialect.get_or_raise(DIALECT).parser(error_level=ErrorLevel.RAISE)
        statements = parser.parse(tokens, sql)
    except SqlglotError as error:  # ParseError, TokenError, any other sqlglot failure
        raise _unreadable(error) from error
    present = [s for s in statements if s is not None]
    if len(present) != 1:
        raise ReportRejected(
            f"report rejected: exactly one statement is allowed, got {len(present)}")
    return present[0]


def _parse_one(sql: str) -> exp.Expr:
    return _parse_tokens(_tokens(sql), sql)


def _unreadable(error: SqlglotError) -> ReportRejected:
    text = str(error).strip()
    if isinstance(error, (ParseError, TokenError)):
        first = first_line(error)
    else:
        first = " ".join(text.split()) or type(error).__name__
    return ReportRejected(f"report rejected: not SQL that the guard can read ({first})")


# -- nodes ---------------------------------------------------------------------

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
    elif isinstance(node, exp.Dot):
        _check_dot(node)


def _check_dot(node: exp.Dot) -> None:
    """``(expr).name``: PostgreSQL reads it as the call ``name(expr)`` when expr has no field ``name``."""
    if isinstance(node.expression, exp.Func) or isinstance(node.parent, exp.DataType):
        return  # a schema-qualified call (refused as such) or a qualified type name (checked as a type)
    raise ReportRejected(
        f"report rejected: field selection {node.sql(DIALECT)} is not allowed: PostgreSQL reads "
        f"(x).name as the function call name(x) when x has no field of that name{_where(node)}")


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
    if table.args.get("rows_from"):
        raise ReportRejected(
            f"report rejected: ROWS FROM (...) is not allowed: the guard cannot tell its columns; "
            f"call the function directly in FROM{_where(table)}")
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
    return set(_cte_scope(table))


def _cte_scope(table: exp.Expr) -> dict[str, exp.CTE]:
    """The CTEs visible where ``table`` stands, by name, by PostgreSQL's scoping.

    A CTE sees the CTEs listed before it (all of them under RECURSIVE); the
    body of a query sees all of its own CTEs; names resolve outwards (the
    innermost definition of a name wins).
    """
    found: dict[str, exp.CTE] = {}
    child: exp.Expr = table
    node = table.parent
    while node is not None:
        visible: list[exp.CTE] = []
        if isinstance(node, exp.With):
            ctes = [cte for cte in node.expressions if isinstance(cte, exp.CTE)]
            if node.args.get("recursive"):
                visible = ctes
            else:
                index = next((i for i, cte in enumerate(ctes) if cte is child), len(ctes))
                visible = ctes[:index]
        else:
            with_ = node.args.get("with_") or node.args.get("with")
            if isinstance(with_, exp.With) and child is not with_:
                visible = [cte for cte in with_.expressions if isinstance(cte, exp.CTE)]
        for cte in visible:
            name = _cte_name(cte)
            if name:
                found.setdefault(name, cte)
        child, node = node, node.parent
    return found


def _cte_name(cte: exp.Expr) -> str:
    alias = cte.args.get("alias")
    identifier = alias.this if isinstance(alias, exp.TableAlias) else None
    return _ident(identifier) if isinstance(identifier, exp.Identifier) else ""


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_NAME_BYTES = 63  # NAMEDATALEN - 1: PostgreSQL truncates longer identifiers


def _ident(node: exp.Expr) -> str:
    """An identifier as PostgreSQL resolves it: ASCII folded to lower case unless quoted, cut to 63 bytes."""
    text = node.name if node.args.get("quoted") else node.name.translate(_ASCII_LOWER)
    encoded = text.encode("utf-8", "surrogatepass")
    if len(encoded) > _NAME_BYTES:
        text = encoded[:_NAME_BYTES].decode("utf-8", "ignore")  # on a character boundary, as pg_mbcliplen
    return text


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


# -- the column fence ------------------------------------------------------------
#
# PostgreSQL resolves ``t.name`` to a range variable ``t`` of the query (an
# alias, else the relation's, CTE's or function's name), takes its column
# ``name``, and when there is none calls the function ``name(t)``. So every
# qualified reference must name a real column of every range variable of the
# query that has that name (every one: the guard does not redo PostgreSQL's
# scoping, and when aliases repeat, whichever PostgreSQL picks has the
# column). Unqualified names never become calls; they are held to the simple
# rule that they name something real.

# Set-returning functions of the allow-list with OUT columns; the others return
# one column named after the FROM alias, else after the function.
_FUNCTION_COLUMNS: dict[str, tuple[str, ...]] = {
    "jsonb_each": ("key", "value"), "jsonb_each_text": ("key", "value"),
    "jsonb_array_elements": ("value",), "jsonb_array_elements_text": ("value",),
}


@dataclass(frozen=True)
class _RangeVar:
    """One FROM item: the name references use, its columns, what it is (for messages)."""

    name: str | None
    columns: tuple[str, ...]
    hidden: frozenset[str] = frozenset()
    relation: tuple[str, str] | None = None  # an unaliased catalog relation: schema.relation.column
    what: str = ""
    unsure: str = ""  # why its columns are not known for certain: qualified references refused

    def has(self, column: str) -> bool:
        return column in self.columns or column in self.hidden


class _Resolver:
    """Range variables of each SELECT and output columns of each query, computed once each."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._range_vars: dict[int, list[_RangeVar]] = {}
        self._outputs: dict[int, tuple[str, ...]] = {}
        self._busy: set[int] = set()

    def range_vars(self, select: exp.Select) -> list[_RangeVar]:
        key = id(select)
        if key not in self._range_vars:
            found: list[_RangeVar] = []
            from_ = select.args.get("from_") or select.args.get("from")
            items = [from_.this] if isinstance(from_, exp.From) else []
            items += [join.this for join in select.args.get("joins") or []]
            for item in items:
                found.extend(self._item(item))
            self._range_vars[key] = found
        return self._range_vars[key]

    def _item(self, item: exp.Expr) -> list[_RangeVar]:
        alias = item.args.get("alias")
        name = _ident(alias.this) if isinstance(alias, exp.TableAlias) and isinstance(
            alias.this, exp.Identifier) else None
        renames = [_ident(c) for c in alias.columns] if isinstance(alias, exp.TableAlias) else []
        shown = " ".join(item.sql(DIALECT).split())[:60]
        if isinstance(item, exp.Table):
            inner = [rv for join in item.args.get("joins") or [] for rv in self._item(join.this)]
            return [self._table(item, name, renames, shown)] + inner
        if isinstance(item, exp.Subquery):
            body = item.this
            if isinstance(body, exp.Table):  # a parenthesised join, perhaps with an alias
                members = self._item(body)
                columns = tuple(c for rv in members for c in rv.columns)
                joined = [_RangeVar(name, _renamed(columns, renames), what=shown)] if name else []
                return members + joined
            if isinstance(body, exp.Query):
                return [_RangeVar(name, _renamed(self.outputs(body), renames), what=shown)]
        if isinstance(item, exp.Lateral):
            body = item.this
            if isinstance(body, exp.Subquery) and isinstance(body.this, exp.Query):
                return [_RangeVar(name, _renamed(self.outputs(body.this), renames), what=shown)]
            if isinstance(body, exp.Func):
                return [_function_range_var(body, name, renames, bool(item.args.get("ordinality")), shown)]
        if isinstance(item, exp.Unnest):
            # sqlglot keeps the last name of "WITH ORDINALITY AS u(a, n)" as the offset's name
            offset = item.args.get("offset")
            if isinstance(offset, exp.Identifier):
                renames, ordinality = renames + [_ident(offset)], True
            else:
                ordinality = bool(offset)
            return [_function_range_var(item, name, renames, ordinality, shown)]
        if isinstance(item, exp.Values):
            return [_RangeVar(name, _renamed(_values_columns(item), renames), what=shown)]
        raise ReportRejected(
            f"report rejected: FROM item {shown} is not allowed: the guard cannot tell its columns")

    def _table(self, table: exp.Table, name: str | None, renames: list[str], shown: str) -> _RangeVar:
        if isinstance(table.this, exp.Func):
            return _function_range_var(table.this, name, renames, bool(table.args.get("ordinality")), shown)
        relation = _ident(table.this)
        schema_node = table.args.get("db")
        if schema_node is None:  # a CTE (the structural check made sure)
            cte = _cte_scope(table).get(relation)
            columns = self.cte_outputs(cte) if cte is not None else ()
            return _RangeVar(name or relation, _renamed(columns, renames), what=shown)
        key = (_ident(schema_node), relation)
        known = self.catalog.get(key)
        if known is None:
            raise ReportRejected(
                f"report rejected: relation {table.sql(DIALECT)} does not exist (or is not a table "
                "or view of schemas ledger and pg_catalog)")
        return _RangeVar(name or relation, _renamed(known.columns, renames), known.system,
                         relation=key if name is None else None, what=f"{key[0]}.{key[1]}")

    def cte_outputs(self, cte: exp.CTE) -> tuple[str, ...]:
        alias = cte.args.get("alias")
        renames = [_ident(c) for c in alias.columns] if isinstance(alias, exp.TableAlias) else []
        body = cte.this
        if renames and not isinstance(body, exp.Query):
            return tuple(renames)
        outputs = self.outputs(body) if isinstance(body, exp.Query) else ()
        return _renamed(outputs, renames)

    def outputs(self, query: exp.Expr) -> tuple[str, ...]:
        """The output column names of ``query``, as PostgreSQL names them (``?column?`` when it would)."""
        key = id(query)
        if key in self._outputs:
            return self._outputs[key]
        if key in self._busy:  # a query that reads itself (a recursive CTE's own name): nothing known
            return ()
        self._busy.add(key)
        try:
            result = self._compute_outputs(query)
        finally:
            self._busy.discard(key)
        self._outputs[key] = result
        return result

    def _compute_outputs(self, query: exp.Expr) -> tuple[str, ...]:
        if isinstance(query, exp.Subquery):
            return self.outputs(query.this)
        if isinstance(query, exp.SetOperation):
            return self.outputs(query.this)  # the left arm names the columns
        if isinstance(query, exp.Values):
            return _values_columns(query)
        if not isinstance(query, exp.Select):
            return ()
        names: list[str] = []
        for projection in query.expressions:
            if isinstance(projection, exp.Star):
                names.extend(c for rv in self.range_vars(query) for c in rv.columns)
            elif isinstance(projection, exp.Column) and isinstance(projection.this, exp.Star):
                qualifier = _ident(projection.args["table"]) if projection.args.get("table") else ""
                names.extend(c for rv in self._visible(query, qualifier) for c in rv.columns)
            else:
                names.append(_output_name(projection))
        return tuple(names)

    def _visible(self, select: exp.Select, name: str) -> list[_RangeVar]:
        """The range variables called ``name`` nearest to ``select`` (for ``t.*``)."""
        node: exp.Expr | None = select
        while node is not None:
            if isinstance(node, exp.Select):
                found = [rv for rv in self.range_vars(node) if rv.name == name]
                if found:
                    return found
            node = node.parent
        return []


def _renamed(columns: Sequence[str], renames: Sequence[str]) -> tuple[str, ...]:
    """A column alias list renames the first columns, in order."""
    return tuple(renames) + tuple(columns[len(renames):])


def _values_columns(values: exp.Values) -> tuple[str, ...]:
    first = values.expressions[0] if values.expressions else None
    width = len(first.expressions) if isinstance(first, exp.Tuple) else 1
    return tuple(f"column{i}" for i in range(1, width + 1))


def _function_range_var(func: exp.Expr, name: str | None, renames: list[str], ordinality: bool,
                        shown: str) -> _RangeVar:
    fname = "unnest" if isinstance(func, exp.Unnest) else (
        _function_name(func) if isinstance(func, exp.Func) else "")
    base = _FUNCTION_COLUMNS.get(fname) or (name or fname,)
    columns = base + (("ordinality",) if ordinality else ())
    # unnest(anyarray) gives one column, unnest(tsvector) three (lexeme, positions, weights):
    # which one runs depends on a type the guard does not know, unless a column list names them
    unsure = ("unnest() names its columns after its argument's type; name them: unnest(...) AS u(x)"
              if fname == "unnest" and not renames else "")
    return _RangeVar(name or fname, _renamed(columns, renames), what=shown, unsure=unsure)


def _output_name(projection: exp.Expr) -> str:
    """PostgreSQL's name for an output column (FigureColname, the cases a report meets)."""
    node = projection
    while True:
        if isinstance(node, exp.Alias):
            return _ident(node.args["alias"]) if isinstance(node.args.get("alias"), exp.Identifier) \
                else node.alias
        if isinstance(node, exp.Column):
            return _ident(node.this) if isinstance(node.this, exp.Identifier) else node.name
        if isinstance(node, (exp.Cast, exp.Paren, exp.Window, exp.Filter, exp.WithinGroup)):
            node = node.this
            continue
        if isinstance(node, exp.Case):
            return "case"
        if isinstance(node, exp.Func) and not isinstance(node, (exp.Binary, exp.Unary)):
            return _function_name(node)
        return "?column?"


def _check_columns(tree: exp.Expr, catalog: Catalog) -> None:
    resolver = _Resolver(catalog)
    every: list[_RangeVar] = []
    for select in tree.find_all(exp.Select):
        every.extend(resolver.range_vars(select))
    by_name: dict[str, list[_RangeVar]] = {}
    for rv in every:
        if rv.name:
            by_name.setdefault(rv.name, []).append(rv)
    known = {c for rv in every for c in rv.columns} | {c for rv in every for c in rv.hidden}
    aliases = {_ident(node.args["alias"]) for node in tree.find_all(exp.Alias)
               if isinstance(node.args.get("alias"), exp.Identifier)}
    for column in tree.find_all(exp.Column):
        _check_column(column, every, by_name, known | aliases | set(by_name))


def _check_column(column: exp.Column, every: list[_RangeVar], by_name: dict[str, list[_RangeVar]],
                  unqualified_ok: set[str]) -> None:
    star = isinstance(column.this, exp.Star)
    name = "*" if star else _ident(column.this)
    shown = column.sql(DIALECT)
    parts = [column.args.get(k) for k in ("catalog", "db", "table")]
    if parts[0] is not None:
        raise ReportRejected(
            f"report rejected: column {shown} names a database; use relation.column{_where(column)}")
    schema_node, table_node = parts[1], parts[2]
    if table_node is None:
        if not star and name not in unqualified_ok:
            raise ReportRejected(
                f"report rejected: unknown column {shown}: no relation of the query has a column "
                f"of that name{_where(column)}")
        return
    qualifier = _ident(table_node)
    if schema_node is not None:
        relation = (_ident(schema_node), qualifier)
        candidates = [rv for rv in every if rv.relation == relation]
        if not candidates:
            raise ReportRejected(
                f"report rejected: column {shown}: {relation[0]}.{relation[1]} is not an unaliased "
                f"relation of the query{_where(column)}")
    else:
        candidates = by_name.get(qualifier, [])
        if not candidates:
            raise ReportRejected(
                f"report rejected: column {shown}: {qualifier} is not a relation of the query"
                f"{_where(column)}")
    if star:
        return
    unsure = next((rv for rv in candidates if rv.unsure), None)
    if unsure is not None:
        raise ReportRejected(
            f"report rejected: column {shown} is not allowed: {unsure.unsure}{_where(column)}")
    lacking = [rv for rv in candidates if not rv.has(name)]
    if lacking:
        which = lacking[0].what or qualifier
        raise ReportRejected(
            f"report rejected: unknown column {shown}: {which} has no column {name}, and PostgreSQL "
            f"would read {shown} as the function call {name}({qualifier}){_where(column)}")


# -- the session fence ---------------------------------------------------------

_SESSION_QUERY = """
WITH RECURSIVE
  me AS (SELECT r.oid FROM pg_catalog.pg_roles AS r WHERE r.rolname = pg_catalog.session_user()),
  reader(roleid) AS (
    SELECT r.oid FROM pg_catalog.pg_roles AS r WHERE r.rolname = %(reader)s
    UNION
    SELECT m.roleid FROM pg_catalog.pg_auth_members AS m JOIN reader AS u ON m.member = u.roleid),
  held(roleid) AS (
    SELECT oid FROM me
    UNION
    SELECT m.roleid FROM pg_catalog.pg_auth_members AS m JOIN held AS u ON m.member = u.roleid),
  spaces AS (SELECT n.oid, n.nspname::text AS nspname, n.nspowner, n.nspacl
               FROM pg_catalog.pg_namespace AS n WHERE n.nspname IN ('ledger', 'pg_catalog')),
  objects AS (
    SELECT 'schema ' || s.nspname AS label, s.nspname, 'schema' AS kind, s.nspowner AS owner, s.nspacl AS acl
      FROM spaces AS s
    UNION ALL
    SELECT s.nspname || '.' || c.relname::text, s.nspname, 'relation', c.relowner, c.relacl
      FROM pg_catalog.pg_class AS c JOIN spaces AS s ON c.relnamespace = s.oid
    UNION ALL
    SELECT s.nspname || '.' || p.proname::text || '()', s.nspname, 'function', p.proowner, p.proacl
      FROM pg_catalog.pg_proc AS p JOIN spaces AS s ON p.pronamespace = s.oid)
SELECT r.rolname::text, r.oid = (SELECT oid FROM me), r.rolsuper, r.rolcreaterole,
       r.rolname::text LIKE 'pg\\_%%',
       ARRAY(SELECT o.label FROM objects AS o
              WHERE o.owner = r.oid AND o.nspname = 'ledger' ORDER BY 1),
       ARRAY(SELECT DISTINCT a.privilege_type || ' on ' || o.label
               FROM objects AS o, pg_catalog.aclexplode(o.acl) AS a
              WHERE a.grantee = r.oid AND a.grantor <> r.oid
                AND NOT (o.nspname = 'ledger' AND o.kind = 'schema' AND a.privilege_type = 'USAGE')
                AND NOT (o.nspname = 'ledger' AND o.kind = 'relation' AND a.privilege_type = 'SELECT')
              ORDER BY 1)
  FROM held JOIN pg_catalog.pg_roles AS r ON r.oid = held.roleid
 WHERE held.roleid NOT IN (SELECT roleid FROM reader)
 ORDER BY 2 DESC, 1
"""


def session_risks(conn: psycopg.Connection[Any]) -> list[str]:
    """Why the session user could leave ledger_reader again, or hold more than it: empty when it cannot.

    ``SET LOCAL ROLE ledger_reader`` can be undone from inside a query:
    ``set_config('role', 'x', true)`` becomes any role the *session user*
    belongs to (PostgreSQL 15 lets every member SET ROLE, whatever the
    INHERIT option), ``set_config('role', 'none', true)`` becomes the session
    user itself. So the check covers the session user (``session_user``, not
    ``current_user``) and every role it belongs to, directly or through
    other roles, except ledger_reader and the roles ledger_reader itself
    belongs to. Each of them is a risk when it:

    - is a superuser (``rolsuper``): it may become any role, read server
      files, signal backends, reach other databases;
    - has CREATEROLE (``rolcreaterole``): up to PostgreSQL 15 it may grant
      itself any role but the superuser ones;
    - is a predefined ``pg_*`` role (``pg_read_server_files``,
      ``pg_signal_backend``, ``pg_execute_server_program`` ...);
    - owns schema ``ledger`` or a relation or function in it;
    - holds a privilege granted to it directly (in its own ACL entry, not
      through ledger_reader) on schema ``ledger`` beyond USAGE, on a ledger
      relation beyond SELECT, on a ledger function (``ledger_client``'s
      EXECUTE on the write API), or on anything in ``pg_catalog`` (relations,
      functions: e.g. EXECUTE on ``pg_read_file``, SELECT on ``pg_authid``).

    So a login made with ``CREATE ROLE reports LOGIN IN ROLE ledger_reader``
    passes, and so does one that reaches ledger_reader through group roles
    that hold nothing of their own. Not checked: CREATEDB, REPLICATION and
    BYPASSRLS (nothing a read-only transaction over the ledger could use),
    privileges on objects outside schemas ``ledger`` and ``pg_catalog`` (the
    guard reads nothing else, READ ONLY stops writes), database and parameter
    privileges, and what PUBLIC holds (everyone does).
    """
    return _session(conn)[1]


def _session(conn: psycopg.Connection[Any]) -> tuple[str, list[str]]:
    with conn.cursor() as cur:
        cur.execute(_SESSION_QUERY, {"reader": READER_ROLE}, prepare=False)
        found = cur.fetchall()
        cur.execute("SELECT pg_catalog.session_user()::text", prepare=False)
        row = cur.fetchone()
    name = str(row[0]) if row else "?"
    risks: list[str] = []
    for role, is_me, superuser, createrole, predefined, owned, granted in found:
        powers: list[str] = []
        if superuser:  # nothing else matters then
            risks.append("is a superuser" if is_me else f"is a member of {role}, which is a superuser")
            continue
        if createrole:
            powers.append("has CREATEROLE")
        if predefined:
            powers.append("is a predefined role")
        if owned:
            powers.append(f"owns {_listed(owned)}")
        if granted:
            powers.append(f"holds {_listed(granted)} directly")
        if not powers:
            continue
        if is_me:
            risks.extend(powers)
        else:
            risks.append(f"is a member of {role}, which {' and '.join(powers)}")
    return name, risks


def check_session(conn: psycopg.Connection[Any], *, allow_superuser: bool = False) -> None:
    """UnsafeSession unless the session user holds no power beyond ledger_reader's (:func:`session_risks`).

    ``allow_superuser=True`` skips the check: the operator accepts that the
    guard is then the only wall.
    """
    if allow_superuser:
        return
    name, risks = _session(conn)
    if risks:
        raise UnsafeSession(
            f"report refused: session user {name} {'; '.join(risks)}, so a query could leave "
            f"ledger_reader again (set_config('role', ...)) and the guard would be the only wall; "
            f"{_SETUP_HINT}, or pass --allow-superuser (allow_superuser=True) to run anyway", risks)


def _listed(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


# -- the catalog -----------------------------------------------------------------

_CATALOG_QUERY = """
SELECT n.nspname::text, c.relname::text, a.attname::text, a.attnum
  FROM pg_catalog.pg_class AS c
  JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
  JOIN pg_catalog.pg_attribute AS a ON a.attrelid = c.oid
 WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'v', 'm', 'p', 'f', 'S') AND NOT a.attisdropped
 ORDER BY 1, 2, a.attnum
"""


def load_catalog(conn: psycopg.Connection[Any]) -> Catalog:
    """The columns of every table, view and sequence of the allowed schemas, from pg_attribute."""
    columns: dict[tuple[str, str], list[str]] = {}
    system: dict[tuple[str, str], set[str]] = {}
    with conn.cursor() as cur:
        cur.execute(_CATALOG_QUERY, (sorted(ALLOWED_SCHEMAS),), prepare=False)
        for schema, relation, column, number in cur:
            key = (schema, relation)
            columns.setdefault(key, [])
            system.setdefault(key, set())
            (columns[key].append(column) if number > 0 else system[key].add(column))
    return {key: RelationColumns(tuple(names), frozenset(system[key])) for key, names in columns.items()}


# -- running it --------------------------------------------------------------

class ReportRows:
    """The rows of a running report, fetched from its server-side cursor in batches.

    ``columns`` are known at once; iterate (once) for the rows. When the
    iteration stopped at the limit with more rows left, ``truncated`` is
    True; ``count`` is how many rows were given.
    """

    def __init__(self, cursor: psycopg.ServerCursor[Any], limit: int | None, batch_size: int) -> None:
        self.columns: list[str] = [column.name for column in cursor.description or []]
        self.truncated = False
        self.count = 0
        self._cursor = cursor
        self._limit = limit
        self._batch_size = batch_size
        self._started = False

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        if self._started:
            raise RuntimeError("the rows of a report can be read once")
        self._started = True
        return self._rows()

    def _rows(self) -> Iterator[tuple[Any, ...]]:
        limit = self._limit
        while True:
            # one row past the limit tells whether the limit cut the result
            want = self._batch_size if limit is None else min(self._batch_size, limit - self.count + 1)
            batch = self._cursor.fetchmany(want)
            for row in batch:
                if limit is not None and self.count >= limit:
                    self.truncated = True
                    return
                self.count += 1
                yield row
            if len(batch) < want:
                return


def _limit(limit: int | None) -> int | None:
    if limit is None or limit == 0:
        return None
    if limit < 0:
        raise ValueError("limit must be a positive number of rows, or 0 or None for no limit")
    return limit


@contextmanager
def stream_report(
    conn: psycopg.Connection[Any], sql: str, timeout: timedelta = DEFAULT_TIMEOUT, *,
    limit: int | None = DEFAULT_LIMIT, allow_superuser: bool = False, batch_size: int = BATCH_SIZE,
) -> Iterator[ReportRows]:
    """Check ``sql`` and run it read-only; the rows, streamed, at most ``limit`` of them (0/None: all).

    The guard's structural checks run first, without the database; then, in
    the read-only transaction: the session check (:func:`check_session`,
    skipped with ``allow_superuser=True``), the column check against the
    catalog, and the query as a server-side cursor. The transaction stays
    open while the block runs: read the rows inside it.
    """
    tree = _guarded(lambda: _structure(sql))
    with _cursor(conn, lambda: _guarded(lambda: _finish(tree, load_catalog(conn))), timeout,
                 limit, allow_superuser, batch_size) as rows:
        yield rows


def run_report(
    conn: psycopg.Connection[Any], sql: str, timeout: timedelta = DEFAULT_TIMEOUT, *,
    limit: int | None = None, allow_superuser: bool = False,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Check ``sql``, then run the checked rendering read-only: (column names, rows).

    All rows unless ``limit`` (use :func:`stream_report` to know whether the
    limit cut them, or to keep them out of memory). UnsafeSession when the
    session user could leave ledger_reader, unless ``allow_superuser=True``.
    """
    with stream_report(conn, sql, timeout, limit=limit, allow_superuser=allow_superuser) as rows:
        return rows.columns, list(rows)


def run_read_only(
    conn: psycopg.Connection[Any], sql: str, timeout: timedelta = DEFAULT_TIMEOUT, *,
    limit: int | None = None, allow_superuser: bool = False,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The session and database fences alone, no guard: run ``sql`` in :func:`read_only_transaction`.

    Run as a server-side cursor (``DECLARE``, extended protocol, not
    prepared), so the server refuses a second statement and anything but a
    query. Raises psycopg.errors.QueryCanceled on timeout, UnsafeSession as
    :func:`check_session` does.
    """
    with _cursor(conn, lambda: sql, timeout, limit, allow_superuser, BATCH_SIZE) as rows:
        return rows.columns, list(rows)


@contextmanager
def _cursor(
    conn: psycopg.Connection[Any], query: Any, timeout: timedelta, limit: int | None,
    allow_superuser: bool, batch_size: int,
) -> Iterator[ReportRows]:
    limit = _limit(limit)
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    with read_only_transaction(conn, timeout):
        check_session(conn, allow_superuser=allow_superuser)
        text: str = query()
        with conn.cursor(name=_CURSOR_NAME) as cursor:
            cursor.execute(text)
            yield ReportRows(cursor, limit, batch_size)
