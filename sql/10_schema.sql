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
DO $roles$
BEGIN
    BEGIN
        CREATE ROLE ledger_client NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
    BEGIN
        CREATE ROLE ledger_reader NOLOGIN;
    EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
    END;
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

-- A label (job, owner, resource, idempotency key): 1 to 200 characters, no
-- control characters. The functions raise 22023 first; this is the backstop.
CREATE DOMAIN ledger.label AS text
    CONSTRAINT label_valid CHECK (char_length(VALUE) BETWEEN 1 AND 200 AND VALUE !~ '[[:cntrl:]]');
