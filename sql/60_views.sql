-- Read-only views over the ledger: counters and the overlap audit.

CREATE VIEW ledger.job_counters AS
SELECT job,
       coalesce(c.runs_started, 0)     AS runs_started,
       coalesce(c.successes, 0)        AS successes,
       coalesce(c.failures, 0)         AS failures,
       coalesce(c.skipped_overlap, 0)  AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill,
       coalesce(c.leases_lost, 0)      AS leases_lost
  FROM ledger.counters c
  FULL JOIN ledger.jobs j USING (job);
COMMENT ON VIEW ledger.job_counters IS
    'Per job: runs started, successes, failures, skips by overlap and by backfill limit, leases lost';

-- Pairs of runs of one job whose time spans overlap. Should always be empty:
-- it is the audit that proves it. A window over start order finds the runs
-- that start before an earlier one ended, so the cost stays O(n log n) and
-- the pair join only touches offenders.
CREATE VIEW ledger.overlaps AS
WITH ordered AS (
    SELECT r.run_id, r.job, r.started_at,
           max(coalesce(r.completed_at, 'infinity')) OVER (
               PARTITION BY r.job ORDER BY r.started_at, r.run_id
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
   AND (a.started_at, a.run_id) < (o.started_at, o.run_id)
   AND coalesce(a.completed_at, 'infinity') > o.started_at
 WHERE o.earlier_end > o.started_at;
COMMENT ON VIEW ledger.overlaps IS
    'Pairs of runs of the same job whose time spans overlap; always empty when the ledger holds';
