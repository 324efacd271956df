"""A normalised snapshot of everything schema `ledger` holds, for comparing
databases that were installed different ways (procrastinate's migration test).

Each section is a sorted list of rows. Only what a user can observe goes in:
definitions, types, defaults, privileges, comments; never OIDs, and column
order but not attnum, so two equal schemas compare equal however they got
there.
"""

from __future__ import annotations

from typing import Any

import psycopg

Snapshot = dict[str, list[tuple[Any, ...]]]


def _acl(column: str, kind: str, owner: str) -> str:
    # Normalised privileges: NULL means the default ACL, so spell it out (kind
    # is acldefault's object type, an SQL expression); then one text per
    # grant, 'grantee=privilege[*]/grantor', sorted.
    return f"""(
        SELECT coalesce(array_agg(g.grant ORDER BY g.grant), '{{}}')
          FROM (SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END
                       || '=' || a.privilege_type || CASE WHEN a.is_grantable THEN '*' ELSE '' END
                       || '/' || pg_get_userbyid(a.grantor) AS grant
                  FROM aclexplode(coalesce({column}, acldefault(({kind})::"char", {owner}))) a) g)"""


_NS = "(SELECT oid FROM pg_namespace WHERE nspname = %(schema)s)"

QUERIES: dict[str, str] = {
    "schema": f"""
        SELECT n.nspname, pg_get_userbyid(n.nspowner), {_acl('n.nspacl', "'n'", 'n.nspowner')},
               obj_description(n.oid, 'pg_namespace')
          FROM pg_namespace n WHERE n.oid = {_NS}""",
    # tables, views, composite types, sequences
    "relations": f"""
        SELECT c.relname, c.relkind, pg_get_userbyid(c.relowner), c.relpersistence,
               c.relrowsecurity, c.relforcerowsecurity, c.reloptions,
               {_acl('c.relacl', "CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END", 'c.relowner')},
               obj_description(c.oid, 'pg_class')
          FROM pg_class c
         WHERE c.relnamespace = {_NS} AND c.relkind IN ('r', 'p', 'v', 'm', 'c', 'S', 'f')
         ORDER BY 1""",
    "columns": f"""
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated,
               co.collname, col_description(c.oid, a.attnum), a.attacl::text[]
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
          LEFT JOIN pg_collation co ON co.oid = a.attcollation AND co.collname <> 'default'
         WHERE c.relnamespace = {_NS} AND c.relkind IN ('r', 'p', 'v', 'm', 'c', 'f')
           AND a.attnum > 0 AND NOT a.attisdropped
         ORDER BY c.relname, a.attnum""",
    "constraints": f"""
        SELECT coalesce(c.relname, t.typname), k.conname, k.contype, pg_get_constraintdef(k.oid),
               obj_description(k.oid, 'pg_constraint')
          FROM pg_constraint k
          LEFT JOIN pg_class c ON c.oid = k.conrelid
          LEFT JOIN pg_type t ON t.oid = k.contypid
         WHERE k.connamespace = {_NS}
         ORDER BY 1, 2""",
    "indexes": f"""
        SELECT i.relname, pg_get_indexdef(i.oid), obj_description(i.oid, 'pg_class')
          FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
         WHERE i.relnamespace = {_NS}
         ORDER BY 1""",
    "views": f"""
        SELECT c.relname, pg_get_viewdef(c.oid, true)
          FROM pg_class c WHERE c.relnamespace = {_NS} AND c.relkind IN ('v', 'm')
         ORDER BY 1""",
    "sequences": f"""
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement,
               s.seqmin, s.seqmax, s.seqcache, s.seqcycle
          FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
         WHERE c.relnamespace = {_NS}
         ORDER BY 1""",
    # composite types, domains, enums, ranges (and the row and array types)
    "types": f"""
        SELECT t.typname, t.typtype, format_type(t.typbasetype, t.typtypmod), t.typnotnull,
               t.typdefault, pg_get_userbyid(t.typowner), {_acl('t.typacl', "'T'", 't.typowner')},
               obj_description(t.oid, 'pg_type'),
               (SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder) FROM pg_enum e
                 WHERE e.enumtypid = t.oid)
          FROM pg_type t WHERE t.typnamespace = {_NS}
         ORDER BY 1""",
    "functions": f"""
        SELECT p.proname, pg_get_function_identity_arguments(p.oid),
               pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
               l.lanname, p.prokind, p.provolatile, p.proparallel, p.prosecdef, p.proleakproof,
               p.proisstrict, p.procost, p.prorows, p.proconfig, p.prosrc,
               pg_get_userbyid(p.proowner), {_acl('p.proacl', "'f'", 'p.proowner')},
               obj_description(p.oid, 'pg_proc')
          FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
         WHERE p.pronamespace = {_NS}
         ORDER BY 1, 2""",
    "triggers": f"""
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
         WHERE c.relnamespace = {_NS} AND NOT t.tgisinternal
         ORDER BY 1, 2""",
    "policies": """
        SELECT tablename, policyname, permissive, roles, cmd, qual, with_check
          FROM pg_policies WHERE schemaname = %(schema)s
         ORDER BY 1, 2""",
    "default_privileges": f"""
        SELECT pg_get_userbyid(d.defaclrole), d.defaclobjtype, d.defaclacl::text[]
          FROM pg_default_acl d WHERE d.defaclnamespace = {_NS}
         ORDER BY 1, 2""",
}


def snapshot(conn: psycopg.Connection[Any], schema: str = "ledger") -> Snapshot:
    """Every section of QUERIES for `schema`, plus the alembic revision it is stamped with."""
    shot = {name: conn.execute(query, {"schema": schema}).fetchall()  # type: ignore[arg-type]
            for name, query in QUERIES.items()}
    shot["version"] = conn.execute(
        f"SELECT version_num FROM {schema}.alembic_version ORDER BY 1").fetchall()  # type: ignore[arg-type]
    return shot


def snapshot_of(dsn: str, schema: str = "ledger") -> Snapshot:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return snapshot(conn, schema)


def without_functions(snapshot: Snapshot, names: set[str]) -> Snapshot:
    """The snapshot less the functions named: what a downgrade leaves in place on purpose
    (a revision's functions stay for the calls in flight across it; tools/draft_revision.py)."""
    return {section: [row for row in rows if not (section == "functions" and row[0] in names)]
            for section, rows in snapshot.items()}
