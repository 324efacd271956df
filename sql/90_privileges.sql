-- Privileges: clients write only through the SECURITY DEFINER functions, so
-- no client can forge or rewind a token. Runs last, over everything above.

REVOKE ALL ON SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger FROM PUBLIC;

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
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO ledger_client', f);
    END LOOP;
END
$grants$;

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
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO ledger_client, ledger_reader', f);
    END LOOP;
END
$pure$;
