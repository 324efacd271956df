-- 0006: fence check and db risks (drafted by tools/draft_revision.py from sql/)

-- By hand: fillfactor 50 on the hot tables (a storage parameter: no rewrite; SHARE UPDATE
-- EXCLUSIVE, which no renewal waits for). Existing pages keep their fill until rows move.
ALTER TABLE ledger.leases SET (fillfactor = 50);
ALTER TABLE ledger.counters SET (fillfactor = 50);
ALTER TABLE ledger.skip_counts SET (fillfactor = 50);

-- By hand: complete_run gains a trailing argument, so it is a new function. The old one goes in
-- the same transaction: with both, every call of before (complete_run(1, 2), or by name) would be
-- ambiguous (42725). A call in flight across the commit is planned again and resolves to the new one.
DROP FUNCTION ledger.complete_run(bigint, bigint, jsonb);

CREATE OR REPLACE FUNCTION ledger._max_fenced()
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 100 $function$;

ALTER FUNCTION ledger._max_fenced() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._max_fenced() FROM PUBLIC;

COMMENT ON FUNCTION ledger._max_fenced() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._max_fenced() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._max_fenced() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger.complete_run(run_id bigint, token bigint, detail jsonb DEFAULT NULL::jsonb, fenced text[] DEFAULT NULL::text[])
 RETURNS ledger.job_execution_log
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_run      ledger.job_execution_log;
    v_resource text;
    v_missing  jsonb := '[]'::jsonb;
    v_held     jsonb := '{}'::jsonb;
    v_fence    ledger.fences;
BEGIN
    IF fenced IS NULL OR cardinality(fenced) = 0 THEN
        RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
    END IF;
    IF array_ndims(fenced) > 1 OR cardinality(fenced) > ledger._max_fenced() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument fenced must be a list of at most %s resources', ledger._max_fenced()),
            DETAIL = jsonb_build_object('argument', 'fenced', 'count', cardinality(fenced),
                                        'dimensions', array_ndims(fenced), 'max', ledger._max_fenced())::text;
    END IF;
    -- A NULL element is an invalid value of a list that is not NULL: 22023.
    IF array_position(fenced, NULL) IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument fenced must not contain null (element %s)', array_position(fenced, NULL)),
            DETAIL = jsonb_build_object('argument', 'fenced', 'element', array_position(fenced, NULL))::text;
    END IF;
    FOREACH v_resource IN ARRAY fenced LOOP
        PERFORM ledger._check_label(v_resource, 'fenced');
    END LOOP;
    IF detail IS NOT NULL THEN
        PERFORM ledger._check_detail(detail);
    END IF;
    -- The run's own token is checked by _end_run (LD004, LD001, LD003, in
    -- that order, before anything is written): a run that is not this
    -- caller's to end is answered as without fenced.
    SELECT * INTO v_run FROM ledger.job_execution_log r
     WHERE r.run_id = complete_run.run_id AND r.token = complete_run.token AND r.status = 'running';
    IF FOUND THEN
        FOR v_resource IN SELECT DISTINCT u.resource FROM unnest(fenced) AS u(resource) ORDER BY 1 LOOP
            -- What has committed (or this transaction wrote): a fenced write
            -- still in flight on another connection is not committed yet.
            SELECT * INTO v_fence FROM ledger.fences f WHERE f.resource = v_resource;
            IF FOUND AND v_fence.job <> v_run.job THEN
                PERFORM ledger._raise('LD006',
                    format('fence of another job: resource %s belongs to job %s, not %s',
                           v_resource, v_fence.job, v_run.job),
                    jsonb_build_object('resource', v_resource, 'job', v_run.job, 'bound_job', v_fence.job,
                                       'token', v_run.token, 'argument', 'fenced'));
            END IF;
            IF NOT FOUND OR v_fence.token <> v_run.token THEN
                v_missing := v_missing || to_jsonb(v_resource);
                v_held := v_held || jsonb_build_object(v_resource, v_fence.token);
            END IF;
        END LOOP;
    END IF;
    IF jsonb_array_length(v_missing) = 0 THEN
        RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
    END IF;
    v_run := ledger._end_run(run_id, token, 'failure', 'error',
        format('fence not committed: %s', (
            SELECT string_agg(format('%s holds %s', m.resource,
                                     coalesce('token ' || (v_held ->> m.resource), 'no token')), ', ')
              FROM jsonb_array_elements_text(v_missing) AS m(resource)))
        || format(', not the run''s token %s: the fenced write did not commit (a rolled back or lost COMMIT)',
                  token),
        coalesce(detail, '{}'::jsonb) || jsonb_build_object('fence_not_committed', v_missing,
                                                            'fence_tokens', v_held));
    RAISE WARNING USING ERRCODE = 'LD007',
        MESSAGE = format('fence not committed: run %s of job %s is recorded as failure, not success: '
                         'the fence of %s does not hold its token %s',
                         v_run.run_id, v_run.job,
                         (SELECT string_agg(m.resource, ', ') FROM jsonb_array_elements_text(v_missing) AS m(resource)),
                         token),
        DETAIL = jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                    'resources', v_missing, 'fence_tokens', v_held)::text;
    RETURN v_run;
END
$function$;

ALTER FUNCTION ledger.complete_run(bigint,bigint,jsonb,text[]) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.complete_run(bigint,bigint,jsonb,text[]) FROM PUBLIC;

COMMENT ON FUNCTION ledger.complete_run(bigint,bigint,jsonb,text[]) IS 'End the run as success and release its lease; as failure (warning LD007) when a fence named in fenced does not hold its token';

GRANT EXECUTE ON FUNCTION ledger.complete_run(bigint,bigint,jsonb,text[]) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._risk_horizon_warn_age()
 RETURNS interval
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT interval '5 minutes' $function$;

ALTER FUNCTION ledger._risk_horizon_warn_age() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_horizon_warn_age() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_horizon_warn_age() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_warn_age() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_warn_age() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_horizon_critical_age()
 RETURNS interval
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT interval '1 hour' $function$;

ALTER FUNCTION ledger._risk_horizon_critical_age() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_horizon_critical_age() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_horizon_critical_age() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_critical_age() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_critical_age() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_horizon_warn_xids()
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 1000000::bigint $function$;

ALTER FUNCTION ledger._risk_horizon_warn_xids() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_horizon_warn_xids() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_horizon_warn_xids() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_warn_xids() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_warn_xids() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_horizon_critical_xids()
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 100000000::bigint $function$;

ALTER FUNCTION ledger._risk_horizon_critical_xids() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_horizon_critical_xids() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_horizon_critical_xids() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_critical_xids() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_horizon_critical_xids() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_dead_rows_warn()
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 1000::bigint $function$;

ALTER FUNCTION ledger._risk_dead_rows_warn() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_dead_rows_warn() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_dead_rows_warn() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_rows_warn() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_rows_warn() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_dead_rows_critical()
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 10000::bigint $function$;

ALTER FUNCTION ledger._risk_dead_rows_critical() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_dead_rows_critical() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_dead_rows_critical() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_rows_critical() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_rows_critical() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_dead_per_live_warn()
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 10::bigint $function$;

ALTER FUNCTION ledger._risk_dead_per_live_warn() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_dead_per_live_warn() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_dead_per_live_warn() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_per_live_warn() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_per_live_warn() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_dead_per_live_critical()
 RETURNS bigint
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 100::bigint $function$;

ALTER FUNCTION ledger._risk_dead_per_live_critical() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_dead_per_live_critical() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_dead_per_live_critical() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_per_live_critical() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_dead_per_live_critical() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_vacuum_warn_lag()
 RETURNS interval
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT interval '10 minutes' $function$;

ALTER FUNCTION ledger._risk_vacuum_warn_lag() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_vacuum_warn_lag() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_vacuum_warn_lag() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_vacuum_warn_lag() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_vacuum_warn_lag() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._risk_vacuum_critical_lag()
 RETURNS interval
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT interval '1 hour' $function$;

ALTER FUNCTION ledger._risk_vacuum_critical_lag() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._risk_vacuum_critical_lag() FROM PUBLIC;

COMMENT ON FUNCTION ledger._risk_vacuum_critical_lag() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._risk_vacuum_critical_lag() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._risk_vacuum_critical_lag() TO ledger_reader;

-- By hand: the new view, after the functions it calls.
CREATE VIEW ledger.db_risks AS
WITH holders AS (
    -- What keeps vacuum from removing this database's dead row versions:
    -- backends of this database (and walsenders, whose xmin is a standby's
    -- hot_standby_feedback) by their snapshot or their own xid, replication
    -- slots by their xmin (catalog_xmin holds back only the system catalogs),
    -- prepared transactions of this database. Not this session, not
    -- autovacuum (its xmin holds nothing back; a reader cannot tell it apart).
    SELECT 'backend'::text AS holder_type, a.pid::text AS holder, a.pid, a.application_name, a.state,
           a.xact_start, greatest(age(a.backend_xmin), age(a.backend_xid))::bigint AS xids,
           CASE WHEN a.xact_start IS NOT NULL
                THEN greatest(interval '0', ledger._view_now() - a.xact_start) END AS age
      FROM pg_catalog.pg_stat_activity a
     WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
       AND a.pid <> pg_backend_pid()
       AND (a.datname = current_database() OR a.datid IS NULL)
       AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
    UNION ALL
    SELECT 'replication_slot', s.slot_name::text, s.active_pid, NULL,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END, NULL, age(s.xmin)::bigint, NULL
      FROM pg_catalog.pg_replication_slots s
     WHERE s.xmin IS NOT NULL
    UNION ALL
    SELECT 'prepared_xact', p.gid, NULL, NULL, 'prepared', p.prepared, age(p.transaction)::bigint,
           CASE WHEN p.prepared IS NOT NULL THEN greatest(interval '0', ledger._view_now() - p.prepared) END
      FROM pg_catalog.pg_prepared_xacts p
     WHERE p.database = current_database()
), judged AS (
    SELECT h.*,
           CASE WHEN h.xids >= ledger._risk_horizon_critical_xids()
                  OR h.age >= ledger._risk_horizon_critical_age() THEN 2
                WHEN h.xids >= ledger._risk_horizon_warn_xids()
                  OR h.age >= ledger._risk_horizon_warn_age() THEN 1
                ELSE 0 END AS level,
           CASE h.holder_type
               WHEN 'backend' THEN format('backend %s (application_name %L, %s)', h.pid, h.application_name,
                                          coalesce(h.state, 'state hidden from this role'))
               WHEN 'replication_slot' THEN format('replication slot %s (%s)', h.holder, h.state)
               ELSE format('prepared transaction %L', h.holder) END AS described,
           CASE h.holder_type
               WHEN 'backend' THEN format('end it (SELECT pg_terminate_backend(%s)) or bound it '
                                          '(idle_in_transaction_session_timeout, short transactions)', h.pid)
               WHEN 'replication_slot' THEN format('let its consumer catch up, or drop it '
                                                   '(SELECT pg_drop_replication_slot(%L))', h.holder)
               ELSE format('finish it (COMMIT PREPARED %L or ROLLBACK PREPARED %L)', h.holder, h.holder) END
               AS remedy
      FROM holders h
), horizon AS (
    SELECT w.holder_type, w.holder, w.pid, w.application_name, w.state, w.xact_start,
           coalesce(w.xids, 0) AS xids, w.age, coalesce(w.level, 0) AS level, w.described, w.remedy,
           (SELECT count(*) FROM judged j) AS holders,
           (SELECT count(*) FROM judged j WHERE j.level > 0) AS holders_at_risk
      FROM (SELECT 1) AS one
      LEFT JOIN LATERAL (SELECT j.* FROM judged j
                          ORDER BY j.level DESC, j.xids DESC NULLS LAST, j.age DESC NULLS LAST
                          LIMIT 1) AS w ON true
), hot (relid) AS (
    VALUES ('ledger.leases'::regclass), ('ledger.counters'::regclass), ('ledger.skip_counts'::regclass)
), tables AS (
    SELECT format('%I.%I', s.schemaname, s.relname) AS relation, s.n_live_tup, s.n_dead_tup,
           s.n_tup_upd, s.n_tup_hot_upd, greatest(s.last_vacuum, s.last_autovacuum) AS last_vacuum,
           s.last_autovacuum, s.last_autoanalyze,
           coalesce(o.fillfactor, 100) AS fillfactor,
           current_setting('autovacuum')::boolean AND current_setting('track_counts')::boolean
               AND coalesce(o.autovacuum_enabled, true) AS autovacuum,
           (coalesce(o.vacuum_threshold, current_setting('autovacuum_vacuum_threshold')::bigint)
            + coalesce(o.vacuum_scale_factor, current_setting('autovacuum_vacuum_scale_factor')::float8)
              * greatest(c.reltuples, 0))::bigint AS trigger
      FROM hot
      JOIN pg_catalog.pg_class c ON c.oid = hot.relid
      JOIN pg_catalog.pg_stat_all_tables s ON s.relid = hot.relid
     CROSS JOIN LATERAL (
           SELECT max(r.option_value) FILTER (WHERE r.option_name = 'fillfactor')::integer AS fillfactor,
                  max(r.option_value) FILTER (WHERE r.option_name = 'autovacuum_enabled')::boolean
                      AS autovacuum_enabled,
                  max(r.option_value) FILTER (WHERE r.option_name = 'autovacuum_vacuum_threshold')::bigint
                      AS vacuum_threshold,
                  max(r.option_value) FILTER (WHERE r.option_name = 'autovacuum_vacuum_scale_factor')::float8
                      AS vacuum_scale_factor
             FROM pg_options_to_table(c.reloptions) r) AS o
), measured AS (
    SELECT t.*,
           CASE WHEN t.n_dead_tup >= greatest(ledger._risk_dead_rows_critical(),
                                              ledger._risk_dead_per_live_critical() * t.n_live_tup) THEN 2
                WHEN t.n_dead_tup >= greatest(ledger._risk_dead_rows_warn(),
                                              ledger._risk_dead_per_live_warn() * t.n_live_tup) THEN 1
                ELSE 0 END AS dead_level,
           t.n_dead_tup > t.trigger AS due,
           CASE WHEN t.last_vacuum IS NOT NULL THEN greatest(interval '0', ledger._view_now() - t.last_vacuum) END
               AS since_vacuum,
           jsonb_build_object(
               'n_live_tup', t.n_live_tup, 'n_dead_tup', t.n_dead_tup, 'fillfactor', t.fillfactor,
               'hot_update_share', CASE WHEN t.n_tup_upd > 0 THEN round(t.n_tup_hot_upd::numeric / t.n_tup_upd, 4) END,
               'autovacuum', t.autovacuum, 'autovacuum_trigger', t.trigger, 'last_vacuum', t.last_vacuum,
               'last_autovacuum', t.last_autovacuum, 'last_autoanalyze', t.last_autoanalyze) AS detail
      FROM tables t
), risks AS (
    SELECT 'xmin_horizon'::text AS kind, NULL::text AS relation, h.level, h.xids AS value,
           'transactions'::text AS unit, h.age, h.holder_type, h.holder, h.pid, h.application_name, h.state,
           h.xact_start,
           CASE WHEN h.holder IS NULL THEN
                    'no transaction, replication slot or prepared transaction holds vacuum back'
                WHEN h.level = 0 THEN
                    format('the oldest is %s: %s transactions old%s', h.described, h.xids,
                           CASE WHEN h.age IS NOT NULL THEN format(', for %s', date_trunc('second', h.age)) END)
                ELSE format('%s holds vacuum back: %s transactions old, %s; vacuum keeps every row version '
                            'written since, so each lease renewal gets slower; %s',
                            h.described, h.xids,
                            CASE WHEN h.age IS NOT NULL THEN format('for %s', date_trunc('second', h.age))
                                 ELSE 'for how long is hidden from this role (pg_read_all_stats)' END,
                            h.remedy)
                     || CASE WHEN h.holders_at_risk > 1
                             THEN format(' (%s holders at risk in all)', h.holders_at_risk) ELSE '' END
           END AS message,
           jsonb_build_object('holders', h.holders, 'holders_at_risk', h.holders_at_risk) AS detail
      FROM horizon h
    UNION ALL
    SELECT 'dead_rows', m.relation, m.dead_level, m.n_dead_tup, 'rows', NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           format('%s dead row versions on %s (%s live, fillfactor %s)', m.n_dead_tup, m.relation, m.n_live_tup,
                  m.fillfactor)
           || CASE WHEN m.dead_level = 0 THEN ''
                   WHEN h.holder IS NOT NULL THEN format(': each renewal walks past them, and vacuum cannot '
                                                         'remove the newer ones while %s holds it back', h.described)
                   ELSE format(': each renewal walks past them; VACUUM %s removes them once no older '
                               'transaction is open', m.relation) END,
           m.detail
      FROM measured m CROSS JOIN horizon h
    UNION ALL
    SELECT 'autovacuum_lag', m.relation,
           CASE WHEN NOT m.due THEN 0
                WHEN m.since_vacuum >= ledger._risk_vacuum_critical_lag() THEN 2
                WHEN m.since_vacuum IS NULL OR m.since_vacuum >= ledger._risk_vacuum_warn_lag()
                     OR NOT m.autovacuum THEN 1
                ELSE 0 END,
           extract(epoch FROM m.since_vacuum)::bigint, 'seconds', m.since_vacuum,
           NULL, NULL, NULL, NULL, NULL, NULL,
           format('%s: %s dead rows, autovacuum''s trigger %s, ', m.relation, m.n_dead_tup, m.trigger)
           || CASE WHEN m.since_vacuum IS NOT NULL
                   THEN format('last vacuumed %s ago', date_trunc('second', m.since_vacuum))
                   ELSE 'never vacuumed' END
           || CASE WHEN NOT m.due THEN ''
                   WHEN NOT m.autovacuum THEN ': autovacuum is off for it (autovacuum, track_counts or the '
                                               'table''s autovacuum_enabled); VACUUM it, or turn autovacuum on'
                   ELSE ': autovacuum is due (behind: autovacuum_max_workers, autovacuum_naptime, '
                        'autovacuum_vacuum_cost_limit)' END,
           m.detail
      FROM measured m
)
SELECT r.kind, r.relation,
       CASE r.level WHEN 2 THEN 'critical' WHEN 1 THEN 'warn' ELSE 'ok' END AS severity,
       r.value, r.unit, r.age, r.holder_type, r.holder, r.pid, r.application_name, r.state, r.xact_start,
       r.message, r.detail
  FROM risks r;
ALTER VIEW ledger.db_risks OWNER TO ledger_owner;

REVOKE ALL ON ledger.db_risks FROM PUBLIC;

GRANT SELECT ON ledger.db_risks TO ledger_client, ledger_reader;

COMMENT ON VIEW ledger.db_risks IS
    'What slows the ledger down from the database: the xmin horizon''s age and holder, dead rows and autovacuum lag on its hot tables';
