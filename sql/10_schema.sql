-- The ledger's tables, types and invariants. Everything lives in schema
-- `ledger`; uninstall is `DROP SCHEMA ledger CASCADE`.
-- Invariants are enforced here (constraints, unique partial indexes), not
-- only by the functions that write these tables.

-- IF NOT EXISTS: an upgrade (env.py) or install_script() creates it first,
-- to hold alembic's version table.
CREATE SCHEMA IF NOT EXISTS ledger;
COMMENT ON SCHEMA ledger IS 'Postgres-native job ledger: leases, fencing tokens, execution log';

-- Roles are cluster-wide: create them once, leave them if they exist (also
-- when another database of the cluster is installing at the same moment).
--   ledger_owner   NOLOGIN; owns the ledger's tables and functions, so the
--                  SECURITY DEFINER functions run with the ledger's own
--                  privileges and never as the (super)user who installed.
--   ledger_client  EXECUTE on the API and SELECT; ledger_reader SELECT only.
-- Without CREATEROLE the roles must exist already (an administrator creates
-- them: see docs); checking first avoids PostgreSQL's "permission denied to
-- create role", which it raises before it looks whether the role exists.
DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['ledger_owner', 'ledger_client', 'ledger_reader'] LOOP
        CONTINUE WHEN EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.rolname = role_name);
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        WHEN insufficient_privilege THEN
            RAISE EXCEPTION USING ERRCODE = '42501',
                MESSAGE = format('role %s does not exist and %s may not create it', role_name, current_user),
                HINT = 'An administrator runs once: CREATE ROLE ledger_owner NOLOGIN; CREATE ROLE ledger_client NOLOGIN; '
                       'CREATE ROLE ledger_reader NOLOGIN; GRANT ledger_owner TO <installing user>;';
        END;
    END LOOP;
END
$roles$;

-- Declared result types (as pgmq does): PL/pgSQL refuses an OUT column
-- named like an argument, and a declared type is readable from \dT.
CREATE TYPE ledger.lease AS (
    job         text,
    owner       text,
    token       bigint,
    acquired_at timestamptz,
    expires_at  timestamptz
);

CREATE TYPE ledger.run_start AS (
    outcome           text,
    run_id            bigint,
    token             bigint,
    expires_at        timestamptz,
    slot              timestamptz,
    holder            text,
    holder_expires_at timestamptz
);
