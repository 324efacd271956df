"""Alembic environment for the ledger: raw SQL revisions, no ORM models.

Every migration transaction first takes the ledger's advisory lock (so
concurrent migrators run one after the other, and the later one finds the
work done), then creates schema ledger if needed: alembic keeps its version
table there, and creates it before revision 0001 runs. A downgrade that ends
at base then uninstalls: schema ledger (the version table with it) and the
roles that nothing else uses.

The database: `config.attributes["url"]` (set by ledger.migrate), else the
conninfo in $LEDGER_DSN, else libpq's PG* defaults.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import create_engine, pool

from ledger.migrate import LOCK_KEY, SCHEMA, VERSION_TABLE, execute_sql, sqlalchemy_url

# The lock wait is bounded once the migrators' own lock is held: a revision
# that must lock a table (a view it replaces, a column it adds; an uninstall
# drops them all) fails with 55P03 after MIGRATION_LOCK_WAIT rather than
# queue every client of that table behind an idle transaction; run it again.
MIGRATION_LOCK_WAIT = "2s"
PREPARE = f"""\
SELECT pg_catalog.pg_advisory_xact_lock({LOCK_KEY});
SET LOCAL lock_timeout = '{MIGRATION_LOCK_WAIT}';
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
"""

# The contract: uninstall is DROP SCHEMA ledger CASCADE. The roles are
# cluster-wide: they stay while another database's ledger uses them (2BP01),
# or while they are granted to, or hold, other roles (for ledger_owner, its
# grant to the uninstalling user does not count: the install made it).
UNINSTALL = f"""\
DROP SCHEMA {SCHEMA} CASCADE;
DO $uninstall$
DECLARE
    role_name name;
BEGIN
    FOR role_name IN
        SELECT r.rolname
          FROM pg_catalog.pg_roles r
         WHERE r.rolname IN ('ledger_client', 'ledger_reader', 'ledger_owner')
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_auth_members m
                            WHERE r.oid IN (m.roleid, m.member)
                              AND NOT (r.rolname = 'ledger_owner' AND m.roleid = r.oid
                                       AND m.member = (SELECT u.oid FROM pg_catalog.pg_roles u
                                                   WHERE u.rolname = current_user)))
         ORDER BY r.rolname = 'ledger_owner'  -- the owner last: the others' grants name it
    LOOP
        BEGIN
            EXECUTE format('DROP ROLE %I', role_name);
        -- Still in use elsewhere, or not ours to drop: the role stays. So it
        -- does when another database is dropped at that instant: DROP ROLE
        -- reads every database's shared dependencies and fails with XX000
        -- "cache lookup failed for database" for the one that just went.
        EXCEPTION WHEN dependent_objects_still_exist OR insufficient_privilege OR internal_error THEN
            NULL;
        END;
    END LOOP;
END
$uninstall$;
"""


# An offline script from a revision (`jobledger sql --upgrade-from`) applies
# only to a database at that revision: refuse any other before changing anything.
FROM_REVISION = f"""\
DO $from$
DECLARE
    v_at text;
BEGIN
    IF pg_catalog.to_regclass('{SCHEMA}.{VERSION_TABLE}') IS NOT NULL THEN
        SELECT version_num INTO v_at FROM {SCHEMA}.{VERSION_TABLE};
    END IF;
    IF v_at IS DISTINCT FROM '%(revision)s' THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = format('this script upgrades a ledger at revision %(revision)s; this database is at %%s',
                             coalesce('revision ' || v_at, 'no ledger')),
            HINT = 'Print the script for this database''s release, or run `jobledger install --dsn ...`, '
                   'which upgrades from any revision.';
    END IF;
END
$from$;
"""


def run_migrations(**connection_or_dialect: Any) -> None:
    at_base_after_downgrade = False
    applied = context.config.attributes.setdefault("applied", [])  # read by ledger.migrate.upgrade

    def after_step(*, step: Any, heads: set[str], **_: Any) -> None:
        nonlocal at_base_after_downgrade
        at_base_after_downgrade = not heads and not step.is_upgrade and not step.is_stamp
        if step.is_upgrade and not step.is_stamp:
            applied.append(step.up_revision_id)

    context.configure(
        **connection_or_dialect,
        version_table=VERSION_TABLE,
        version_table_schema=SCHEMA,
        transactional_ddl=True,  # one transaction: all revisions or none
        on_version_apply=[after_step],
        dialect_opts={"paramstyle": "named"},  # offline: no %-doubling in alembic's own SQL
    )
    migration = context.get_context()
    with context.begin_transaction():
        if not migration.opts.get("dont_mutate"):  # `alembic current` only reads
            execute_sql(migration, PREPARE)
        if migration.as_sql and context.get_starting_revision_argument() not in (None, "base"):
            execute_sql(migration, FROM_REVISION % {"revision": context.get_starting_revision_argument()})
        context.run_migrations()
        if at_base_after_downgrade:
            execute_sql(migration, UNINSTALL)


def run_online() -> None:
    url = context.config.attributes.get("url") or sqlalchemy_url(os.environ.get("LEDGER_DSN", ""))
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            run_migrations(connection=connection)
    finally:
        engine.dispose()


if context.config.config_file_name:  # the alembic CLI, with alembic.ini
    fileConfig(context.config.config_file_name, disable_existing_loggers=False)
if context.is_offline_mode():
    run_migrations(dialect_name="postgresql")
else:
    run_online()
