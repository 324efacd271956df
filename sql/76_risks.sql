-- The ledger watches its own failure mode (issue 21): every renewal writes a
-- new version of one row of ledger.leases (and a heartbeat one of its run),
-- and vacuum may remove the old versions only once no snapshot can still see
-- them. A snapshot held open anywhere in the database (an idle transaction, a
-- replication slot's xmin, a forgotten prepared transaction) keeps every one,
-- so each renewal walks a longer chain of dead versions and gets slower
-- (PgQue #61: a 5-row table at 14,312 dead rows in an hour, a fifth of its
-- throughput). ledger.db_risks says so before the workers lose their leases.

-- The hot tables keep half of each page free. A renewal, a heartbeat, a
-- run's counters and a skip change no indexed column, so with room on the
-- page the new version is a HOT update (no index entry) and the next visit
-- prunes the old ones without vacuum: with fillfactor 50, 100% of 10,000
-- leases' renewals were HOT, with full pages 94%, and under a held snapshot
-- 56% against 9% (half the index growth; BENCHMARKS.md). Only the storage
-- parameter: no rewrite, and a lock (SHARE UPDATE EXCLUSIVE) that no
-- renewal waits for.
ALTER TABLE ledger.leases SET (fillfactor = 50);
ALTER TABLE ledger.counters SET (fillfactor = 50);
ALTER TABLE ledger.skip_counts SET (fillfactor = 50);

-- The thresholds (docs/contract.md, "Database risks"). LANGUAGE sql
-- constants, inlined like the bounds of 11_bounds.sql.

-- The xmin horizon: the oldest transaction, snapshot, slot or prepared
-- transaction that holds vacuum back, by how long (when the reader may see
-- it: xact_start) or by how many transactions were started since (always).
CREATE FUNCTION ledger._risk_horizon_warn_age() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '5 minutes' $$;

CREATE FUNCTION ledger._risk_horizon_critical_age() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '1 hour' $$;

CREATE FUNCTION ledger._risk_horizon_warn_xids() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000000::bigint $$;

-- Half of autovacuum_freeze_max_age's default: wraparound vacuums loom.
CREATE FUNCTION ledger._risk_horizon_critical_xids() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 100000000::bigint $$;

-- Dead row versions on a hot table: at least this many, and at least this
-- many per live row (pruning keeps a hot table under about one per row when
-- nothing holds the horizon; PgQue #61 had 2,862 per row).
CREATE FUNCTION ledger._risk_dead_rows_warn() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000::bigint $$;

CREATE FUNCTION ledger._risk_dead_rows_critical() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 10000::bigint $$;

CREATE FUNCTION ledger._risk_dead_per_live_warn() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 10::bigint $$;

CREATE FUNCTION ledger._risk_dead_per_live_critical() RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 100::bigint $$;

-- Autovacuum lag: a hot table past autovacuum's own trigger whose last
-- vacuum is older than this (autovacuum_naptime is a minute by default).
CREATE FUNCTION ledger._risk_vacuum_warn_lag() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '10 minutes' $$;

CREATE FUNCTION ledger._risk_vacuum_critical_lag() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '1 hour' $$;

-- One row per risk, always: xmin_horizon (the worst holder), and dead_rows
-- and autovacuum_lag for each hot table (the rows every lease, run and skip
-- rewrites). Read as whoever reads it: pg_stat_activity shows a role without
-- pg_read_all_stats every backend's pid, user, application_name and xmin,
-- but not its state nor xact_start, so such a reader judges backends by
-- transactions only (docs/contract.md). Ages use the ledger's read clock.
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
COMMENT ON VIEW ledger.db_risks IS
    'What slows the ledger down from the database: the xmin horizon''s age and holder, dead rows and autovacuum lag on its hot tables';
