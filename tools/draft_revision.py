"""Draft the next alembic revision from the difference between the newest
revision and sql/ (make revision REV=0003 MESSAGE="what changes").

sql/ is the truth; a revision is its frozen history. Functions and views are
most of what changes, and their new definitions can be read back from a
database: this installs the newest revision into one scratch database and
sql/ into another, then writes
  migrations/versions/<REV>_<slug>.sql           the upgrade: new and changed
      functions (pg_get_functiondef, in sql/'s creation order), changed views
      (CREATE OR REPLACE VIEW), comments, grants, dropped functions;
  migrations/versions/<REV>_<slug>.downgrade.sql the same the other way round;
  migrations/versions/<REV>_<slug>.py            the alembic revision.
It then applies the draft to the old database and compares its catalog with
sql/'s (tests/catalog.py): whatever still differs (tables, columns, indexes,
triggers, a view whose columns changed) is listed for you to write by hand,
and the command exits 1 until the two agree. Nothing here takes a table lock:
a draft that needs one is yours to write with a bounded lock_timeout.

The scratch databases live on the server that the PG* variables name and are
dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from catalog import snapshot_of, without_functions  # noqa: E402  (tests/catalog.py)

from ledger import migrate  # noqa: E402

VERSIONS = ROOT / "migrations" / "versions"

_FUNCTIONS = """
    SELECT p.oid::regprocedure::text, pg_catalog.pg_get_functiondef(p.oid),
           pg_catalog.obj_description(p.oid, 'pg_proc'),
           coalesce((SELECT array_agg(pg_catalog.pg_get_userbyid(a.grantee) ORDER BY 1)
                       FROM aclexplode(p.proacl) a
                      WHERE a.grantee <> p.proowner AND a.grantee <> 0), '{}'),
           p.prokind
      FROM pg_catalog.pg_proc p
     WHERE p.pronamespace = 'ledger'::regnamespace
     ORDER BY p.oid"""

_VIEWS = """
    SELECT c.oid::regclass::text, pg_catalog.pg_get_viewdef(c.oid),
           pg_catalog.obj_description(c.oid, 'pg_class')
      FROM pg_catalog.pg_class c
     WHERE c.relnamespace = 'ledger'::regnamespace AND c.relkind = 'v'
     ORDER BY c.oid"""


def _server(dbname: str) -> str:
    return make_conninfo("", host=os.environ.get("PGHOST", "127.0.0.1"),
                         port=os.environ.get("PGPORT", "5432"),
                         user=os.environ.get("PGUSER", "postgres"), dbname=dbname)


@contextmanager
def _scratch_databases(count: int) -> Iterator[list[str]]:
    names = [f"ledger_draft_{uuid.uuid4().hex[:10]}" for _ in range(count)]
    with psycopg.connect(_server("postgres"), autocommit=True) as admin:
        for name in names:
            admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
        try:
            yield [_server(name) for name in names]
        finally:
            for name in names:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _catalog(dsn: str) -> tuple[dict[str, tuple[str, str | None, list[str], str]], dict[str, tuple[str, str | None]]]:
    with psycopg.connect(dsn) as conn:
        functions = {row[0]: row[1:] for row in conn.execute(_FUNCTIONS)}
        views = {row[0]: row[1:] for row in conn.execute(_VIEWS)}
    return functions, views  # type: ignore[return-value]


def _literal(text: str | None) -> str:
    return "NULL" if text is None else "'" + text.replace("'", "''") + "'"


def _kind(prokind: str) -> str:
    return "PROCEDURE" if prokind == "p" else "FUNCTION"


def draft(old_dsn: str, new_dsn: str) -> str:
    """The SQL that takes a database with old_dsn's catalog to new_dsn's, for functions and views."""
    old_functions, old_views = _catalog(old_dsn)
    new_functions, new_views = _catalog(new_dsn)
    out: list[str] = []
    # New and changed functions in sql/'s creation order (the new database's
    # OIDs): a LANGUAGE sql body is checked when created, so what it calls
    # comes first.
    for signature, (definition, comment, grantees, prokind) in new_functions.items():
        before = old_functions.get(signature)
        if before is None or before[0] != definition:
            out.append(definition.rstrip() + ";")
        if before is None:
            out.append(f"ALTER {_kind(prokind)} {signature} OWNER TO ledger_owner;")
            out.append(f"REVOKE ALL ON {_kind(prokind)} {signature} FROM PUBLIC;")
        if before is None or before[1] != comment:
            out.append(f"COMMENT ON {_kind(prokind)} {signature} IS {_literal(comment)};")
        granted_before = set(before[2]) if before else set()
        for grantee in sorted(set(grantees) - granted_before):
            out.append(f"GRANT EXECUTE ON {_kind(prokind)} {signature} TO {grantee};")
        for grantee in sorted(granted_before - set(grantees)):
            out.append(f"REVOKE EXECUTE ON {_kind(prokind)} {signature} FROM {grantee};")
    for name, (definition, comment) in new_views.items():
        before = old_views.get(name)
        if before is not None and before[0] != definition:
            out.append(f"CREATE OR REPLACE VIEW {name} AS\n{definition.rstrip().rstrip(';')};")
        if before is not None and before[1] != comment:
            out.append(f"COMMENT ON VIEW {name} IS {_literal(comment)};")
    # A function that no body here calls any more is dropped last. One that
    # another body of the old catalog calls stays: a call in flight across the
    # commit still runs the old body, which may call it (42883, an
    # undocumented answer); it leaves in a later revision (expand, then contract).
    gone = sorted(old_functions.keys() - new_functions.keys())
    called = [signature for signature in gone if _called(signature, old_functions)]
    for signature in gone:
        if signature not in called:
            out.append(f"DROP {_kind(old_functions[signature][3])} {signature};")
    if called:
        out.append("-- Left in place for the calls in flight across this change (old bodies call them):\n"
                   + "\n".join(f"--   {signature}" for signature in called))
    return "\n\n".join(out) + "\n"


def _called(signature: str, functions: dict[str, tuple[str, str | None, list[str], str]]) -> bool:
    """Whether another function's body calls this one (by its qualified name, outside string literals:
    an error message that names a function does not call it)."""
    name = f"ledger.{_name(signature)}("
    return any(name in _LITERAL.sub("''", definition)
               for other, (definition, *_) in functions.items() if other != signature)


_LITERAL = re.compile(r"'(?:[^']|'')*'")


def _only_in(old_dsn: str, new_dsn: str) -> list[str]:
    """The functions old_dsn has and new_dsn lacks (a draft from old to new leaves them in place)."""
    return sorted(_catalog(old_dsn)[0].keys() - _catalog(new_dsn)[0].keys())


def _differences(expected_dsn: str, actual_dsn: str, left_in_place: set[str] = frozenset()) -> list[str]:
    expected = snapshot_of(expected_dsn)
    actual = without_functions(snapshot_of(actual_dsn), set(left_in_place))
    lines = []
    for section in sorted(expected.keys() | actual.keys()):
        want, got = expected.get(section, []), actual.get(section, [])
        lines += [f"  {section}: missing after the draft: {row}" for row in want if row not in got]
        lines += [f"  {section}: left over after the draft: {row}" for row in got if row not in want]
    return lines


def _name(signature: str) -> str:
    return signature.split("(", 1)[0].removeprefix("ledger.")


def _revision_py(rev: str, previous: str, message: str, stem: str) -> str:
    return f'''"""{message}

Revision ID: {rev}
Revises: {previous}

Drafted by tools/draft_revision.py from sql/; frozen once released.
"""

from __future__ import annotations

from pathlib import Path

from alembic import op

from ledger.migrate import execute_sql

revision = "{rev}"
down_revision = "{previous}"
branch_labels = None
depends_on = None

# Frozen beside this file; never the live sql/, or history would move with it.
UPGRADE_SQL = Path(__file__).with_name("{stem}.sql")
DOWNGRADE_SQL = Path(__file__).with_name("{stem}.downgrade.sql")


def upgrade() -> None:
    execute_sql(op.get_context(), UPGRADE_SQL.read_text())


def downgrade() -> None:
    execute_sql(op.get_context(), DOWNGRADE_SQL.read_text())
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the new revision's id, e.g. 0003")
    parser.add_argument("--message", required=True, help="what changes, in a few words")
    args = parser.parse_args()
    if not re.fullmatch(r"\d{4}", args.rev):
        parser.error("--rev must be four digits, e.g. 0003")
    previous = migrate.head()
    if args.rev <= previous:
        parser.error(f"--rev {args.rev} must come after the newest revision, {previous}")
    slug = re.sub(r"[^a-z0-9]+", "_", args.message.lower()).strip("_")[:40]
    stem = f"{args.rev}_{slug}"

    def install_new(dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(migrate.install_script().replace(  # type: ignore[arg-type]
                f"VALUES ('{previous}')", f"VALUES ('{args.rev}')"))

    def apply(dsn: str, script: str, version: str, what: str) -> list[str]:
        """Nothing when the script applies; else what to finish by hand (a table, a view first...)."""
        try:
            with psycopg.connect(dsn) as conn:  # one transaction, as alembic runs it
                conn.execute(script)  # type: ignore[arg-type]
                conn.execute("UPDATE ledger.alembic_version SET version_num = %s", (version,))
        except psycopg.Error as error:
            return [f"  the {what} does not apply as drafted ({error.sqlstate}): {str(error).splitlines()[0]}"]
        return []

    with _scratch_databases(4) as (old, new, up, down):
        migrate.upgrade(old, previous)
        install_new(new)
        upgrade_sql, downgrade_sql = draft(old, new), draft(new, old)
        # Prove the draft both ways: the old revision plus the upgrade must be
        # sql/, and sql/ minus the downgrade the old revision.
        migrate.upgrade(up, previous)
        failed = apply(up, upgrade_sql, args.rev, "upgrade")
        install_new(down)
        failed += apply(down, downgrade_sql, previous, "downgrade")
        # An upgrade may not leave behind a function that sql/ dropped: keep
        # it in sql/ until a later revision. A downgrade leaves the newer
        # revision's functions in place, by design: compare without them.
        old_functions, new_functions = _catalog(old)[0], _catalog(new)[0]
        left = [f"  sql/ no longer has {signature}, which another old body calls: keep it in sql/ until a "
                "later revision drops it (a call in flight across the upgrade may still call it)"
                for signature in _only_in(old, new) if _called(signature, old_functions)]
        left += _differences(new, up)
        kept = {_name(signature) for signature in _only_in(new, old) if _called(signature, new_functions)}
        left += [f"  (downgrade){line[1:]}" for line in _differences(old, down, kept)]
        left = failed + left

    header = f"-- {args.rev}: {args.message} (drafted by tools/draft_revision.py from sql/)\n\n"
    (VERSIONS / f"{stem}.sql").write_text(header + upgrade_sql)
    (VERSIONS / f"{stem}.downgrade.sql").write_text(f"-- {args.rev} undone: back to {previous}\n\n" + downgrade_sql)
    (VERSIONS / f"{stem}.py").write_text(_revision_py(args.rev, previous, args.message, stem))
    print(f"wrote migrations/versions/{stem}.py, {stem}.sql and {stem}.downgrade.sql")
    if left:
        print("still to write by hand (the draft covers functions, views, comments and grants):")
        print("\n".join(left))
        return 1
    print(f"{previous} + the upgrade gives the same catalog as sql/, and the downgrade gives {previous}'s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
