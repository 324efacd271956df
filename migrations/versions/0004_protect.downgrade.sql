-- 0004 undone: back to 0003

-- By hand: a protected table's trigger calls ledger._protect(), which needs
-- ledger.protected_writes: refused while any table is protected.
DO $protected$
DECLARE
    v_tables text[];
BEGIN
    SELECT array_agg(t.tgrelid::regclass::text ORDER BY 1) INTO v_tables
      FROM pg_catalog.pg_trigger t
     WHERE t.tgfoid = pg_catalog.to_regprocedure('ledger._protect()');
    IF v_tables IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = format('cannot downgrade below revision 0004 while tables are protected: %s; '
                             'run ledger.unprotect on each first', array_to_string(v_tables, ', ')),
            DETAIL = jsonb_build_object('tables', to_jsonb(v_tables))::text;
    END IF;
END
$protected$;

DROP VIEW ledger.protected_tables;
DROP TABLE ledger.protected_writes;

DROP FUNCTION ledger._protect();

DROP FUNCTION ledger._trigger_args(bytea);

DROP FUNCTION ledger.protect(regclass,text,text);

DROP FUNCTION ledger.unprotect(regclass);

-- Left in place for the calls in flight across this change (old bodies call them):
--   ledger._lock_for_protect(regclass,boolean,text)
--   ledger._owned_table(regclass,text)
