-- 0006 undone: back to 0005

-- By hand: the view first (it calls the _risk_ functions dropped below), and the 4-argument
-- complete_run, so that the 3-argument one created below is the only one (no ambiguous call).
DROP VIEW ledger.db_risks;

DROP FUNCTION ledger.complete_run(bigint, bigint, jsonb, text[]);

CREATE OR REPLACE FUNCTION ledger.complete_run(run_id bigint, token bigint, detail jsonb DEFAULT NULL::jsonb)
 RETURNS ledger.job_execution_log
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
END
$function$;

ALTER FUNCTION ledger.complete_run(bigint,bigint,jsonb) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.complete_run(bigint,bigint,jsonb) FROM PUBLIC;

COMMENT ON FUNCTION ledger.complete_run(bigint,bigint,jsonb) IS 'End the run as success and release its lease';

GRANT EXECUTE ON FUNCTION ledger.complete_run(bigint,bigint,jsonb) TO ledger_client;

DROP FUNCTION ledger._risk_dead_per_live_critical();

DROP FUNCTION ledger._risk_dead_per_live_warn();

DROP FUNCTION ledger._risk_dead_rows_critical();

DROP FUNCTION ledger._risk_dead_rows_warn();

DROP FUNCTION ledger._risk_horizon_critical_age();

DROP FUNCTION ledger._risk_horizon_critical_xids();

DROP FUNCTION ledger._risk_horizon_warn_age();

DROP FUNCTION ledger._risk_horizon_warn_xids();

DROP FUNCTION ledger._risk_vacuum_critical_lag();

DROP FUNCTION ledger._risk_vacuum_warn_lag();

-- Left in place for the calls in flight across this change (old bodies call them):
--   ledger._max_fenced()

-- By hand: the hot tables' fillfactor back to the default.
ALTER TABLE ledger.leases RESET (fillfactor);
ALTER TABLE ledger.counters RESET (fillfactor);
ALTER TABLE ledger.skip_counts RESET (fillfactor);
