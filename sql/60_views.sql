-- Read-only views over the ledger: counters and the overlap audit.

CREATE VIEW ledger.job_counters AS
SELECT k.job,
       coalesce(c.runs_started, 0)     AS runs_started,
       coalesce(c.successes, 0)        AS successes,
       coalesce(c.failures, 0)         AS failures,
       -- skips not yet folded into ledger.counters are in ledger.skip_counts
       coalesce(c.skipped_overlap, 0)
           + coalesce((SELECT sum(s.skipped_overlap) FROM ledger.skip_counts s WHERE s.job = k.job), 0)::bigint
                                       AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill,
       coalesce(c.leases_lost, 0)      AS leases_lost,
       coalesce(c.skipped_deadline, 0) AS skipped_deadline,
       coalesce(c.skipped_pool_full, 0) AS skipped_pool_full
  FROM (SELECT t.job FROM ledger.counters t
        UNION SELECT t.job FROM ledger.jobs t
        UNION SELECT t.job FROM ledger.skip_counts t) k
  LEFT JOIN ledger.counters c ON c.job = k.job;
COMMENT ON VIEW ledger.job_counters IS
    'Per job: runs started, successes, failures, skips by overlap and by backfill limit, leases lost, skips by start deadline, '
    'starts skipped by a full pool';

-- Pairs of runs of one job and seat whose time spans overlap (a job of
-- max_concurrent N has seats 1 .. N: N + 1 runs at once put two in one
-- seat; a single-holder job has seat 1 only). Should always be empty:
-- it is the audit that proves it. A window over start order finds the runs
-- that start before an earlier one ended, so the cost stays O(n log n) and
-- the pair join only touches offenders.
CREATE VIEW ledger.overlaps AS
WITH ordered AS (
    SELECT r.run_id, r.job, r.started_at,
           max(coalesce(r.completed_at, 'infinity')) OVER (
               PARTITION BY r.job, r.seat ORDER BY r.started_at, r.run_id
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
      FROM ledger.job_execution_log r
)
SELECT a.job,
       a.run_id          AS run_id,
       a.owner           AS owner,
       a.token           AS token,
       a.started_at      AS started_at,
       a.completed_at    AS completed_at,
       b.run_id          AS other_run_id,
       b.owner           AS other_owner,
       b.token           AS other_token,
       b.started_at      AS other_started_at,
       b.completed_at    AS other_completed_at
  FROM ordered o
  JOIN ledger.job_execution_log b ON b.run_id = o.run_id
  JOIN ledger.job_execution_log a
    ON a.job = o.job
   AND a.seat = b.seat
   AND (a.started_at, a.run_id) < (o.started_at, o.run_id)
   AND coalesce(a.completed_at, 'infinity') > o.started_at
 WHERE o.earlier_end > o.started_at;
COMMENT ON VIEW ledger.overlaps IS
    'Pairs of runs of the same job whose time spans overlap; always empty when the ledger holds';

-- Two successes of one job for one slot or one idempotency key. Should
-- always be empty (the unique partial indexes forbid it): the audit that
-- proves no slot or key succeeded twice.
CREATE VIEW ledger.duplicates AS
SELECT r.job, 'slot'::text AS kind, r.slot::text AS value,
       array_agg(r.run_id ORDER BY r.run_id) AS run_ids
  FROM ledger.job_execution_log r
 WHERE r.status = 'success' AND r.slot IS NOT NULL
 GROUP BY r.job, r.slot
HAVING count(*) > 1
UNION ALL
SELECT r.job, 'idempotency_key', r.idempotency_key::text,
       array_agg(r.run_id ORDER BY r.run_id)
  FROM ledger.job_execution_log r
 WHERE r.status = 'success' AND r.idempotency_key IS NOT NULL
 GROUP BY r.job, r.idempotency_key
HAVING count(*) > 1;
COMMENT ON VIEW ledger.duplicates IS
    'Slots and idempotency keys of a job that succeeded more than once; always empty when the ledger holds';
