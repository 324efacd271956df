-- Privileges: clients write only through the SECURITY DEFINER functions, so
-- no client can forge or rewind a token. Runs last, over everything above.

REVOKE ALL ON SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL ROUTINES IN SCHEMA ledger FROM PUBLIC;  -- functions and procedures

GRANT USAGE ON SCHEMA ledger TO ledger_client, ledger_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA ledger TO ledger_client, ledger_reader;

-- The public API: every function whose name does not start with '_'.
DO $grants$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
           AND p.proname NOT LIKE E'\\_%'
         ORDER BY p.oid::regprocedure::text
    LOOP
        EXECUTE format('GRANT EXECUTE ON ROUTINE %s TO ledger_client', f);  -- ROUTINE: procedures too
    END LOOP;
END
$grants$;

-- The schedule previews read nothing a reader may not SELECT (a job's
-- schedule) and write nothing: dashboards may call them too.
GRANT EXECUTE ON FUNCTION ledger.next_slots(text, integer, timestamptz),
                          ledger.preview_slots(text, text, integer, timestamptz) TO ledger_reader;

-- The state audit reads the tables a reader may SELECT, and writes nothing:
-- a monitor may run it, as it reads ledger.overlaps.
GRANT EXECUTE ON FUNCTION ledger.verify_state() TO ledger_reader;

-- The views compute next and overdue slots, and a view's functions are
-- checked against whoever reads it. IMMUTABLE helpers are pure arithmetic
-- (slots, tokens, argument checks) that read and write nothing: both roles
-- may run them. Helpers that touch tables stay with the owner.
DO $pure$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
           AND p.proname LIKE E'\\_%'
           AND p.provolatile = 'i'
         ORDER BY p.oid::regprocedure::text
    LOOP
        EXECUTE format('GRANT EXECUTE ON ROUTINE %s TO ledger_client, ledger_reader', f);
    END LOOP;
END
$pure$;

-- The clock (12_clock.sql) is read by the views and the previews as whoever
-- reads them; reading it is harmless. Moving it is redefining it: the owner's.
GRANT EXECUTE ON FUNCTION ledger._clock_offset(), ledger._now(), ledger._view_now()
    TO ledger_client, ledger_reader;

-- Protected tables (45_protect.sql): protect and unprotect run as their
-- caller, a table's owner in ledger_client, and so do their two helpers
-- (they read the catalog and lock the caller's own table). CREATE TRIGGER
-- checks EXECUTE on the trigger function against the table's owner; a
-- trigger function cannot be called but as a trigger, and it fires as
-- ledger_owner whoever writes.
GRANT EXECUTE ON FUNCTION ledger._owned_table(regclass, text), ledger._lock_for_protect(regclass, boolean, text),
                          ledger._protect()
    TO ledger_client;

-- Least privilege for the ledger itself: everything in the schema belongs to
-- ledger_owner (NOLOGIN, no other privileges), so a SECURITY DEFINER
-- function runs as that role, never as the superuser who may have installed
-- it. The installer keeps the schema (DROP SCHEMA ledger CASCADE still
-- uninstalls) and alembic's version table. To hand objects to ledger_owner
-- the installer must be a member: a superuser is; a CREATEROLE user that
-- created the role grants it to itself; otherwise an administrator has.
DO $owner$
DECLARE
    v_object record;
BEGIN
    IF NOT pg_catalog.pg_has_role(current_user, 'ledger_owner', 'USAGE') THEN
        BEGIN
            EXECUTE format('GRANT ledger_owner TO %I', current_user);
        EXCEPTION WHEN insufficient_privilege OR invalid_grant_operation THEN
            RAISE EXCEPTION USING ERRCODE = '42501',
                MESSAGE = format('%s must be a member of ledger_owner to install the ledger', current_user),
                HINT = format('An administrator runs once: GRANT ledger_owner TO %I;', current_user);
        END;
    END IF;
    GRANT USAGE, CREATE ON SCHEMA ledger TO ledger_owner;
    FOR v_object IN
        SELECT format('ALTER %s %s OWNER TO ledger_owner',
                      CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
                      c.oid::regclass) AS statement
          FROM pg_catalog.pg_class c
         WHERE c.relnamespace = 'ledger'::regnamespace
           AND c.relkind IN ('r', 'v', 'p')
           AND c.relname <> 'alembic_version'
        UNION ALL
        SELECT format('ALTER ROUTINE %s OWNER TO ledger_owner', p.oid::regprocedure)
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
        UNION ALL
        SELECT format('ALTER %s %s OWNER TO ledger_owner',
                      CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END, t.oid::regtype)
          FROM pg_catalog.pg_type t
         WHERE t.typnamespace = 'ledger'::regnamespace
           AND t.typtype IN ('c', 'd')
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_class c
                            WHERE c.oid = t.typrelid AND c.relkind <> 'c')
    LOOP
        EXECUTE v_object.statement;
    END LOOP;
END
$owner$;
