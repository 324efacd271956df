-- Reporting views: read-only, granted to ledger_reader. They read the log and
-- the counters; none of them writes.

CREATE VIEW ledger.run_stats AS
SELECT r.job,
       count(*)                                             AS runs,
       count(*) FILTER (WHERE r.status = 'success')         AS successes,
       count(*) FILTER (WHERE r.status = 'failure')         AS failures,
       round(count(*) FILTER (WHERE r.status = 'failure')::numeric
             / nullif(count(*) FILTER (WHERE r.status <> 'running'), 0), 4) AS failure_rate,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p50_duration,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p95_duration,
       max(r.completed_at - r.started_at) FILTER (WHERE r.status = 'success') AS max_duration
  FROM ledger.job_execution_log r
 GROUP BY r.job;
COMMENT ON VIEW ledger.run_stats IS
    'Per job, over the log: runs, failure rate, p50/p95/max duration of successful runs';

-- The ttl should be 1.5 to 2 times the longest normal run, renewed every ttl/3.
CREATE VIEW ledger.ttl_advice AS
WITH known AS (
    SELECT job, coalesce(j.ttl, l.ttl) AS ttl
      FROM ledger.jobs j FULL JOIN ledger.leases l USING (job)
)
SELECT k.job,
       k.ttl,
       s.max_duration                                      AS longest_run,
       s.max_duration * 1.5                                AS recommended_min,
       s.max_duration * 2                                  AS recommended_max,
       k.ttl / 3                                           AS renew_every,
       CASE
           WHEN k.ttl IS NULL OR s.max_duration IS NULL THEN 'no_data'
           WHEN k.ttl < s.max_duration * 1.5 THEN 'too_short'
           WHEN k.ttl > s.max_duration * 2 THEN 'too_long'
           ELSE 'ok'
       END                                                 AS verdict
  FROM known k
  LEFT JOIN ledger.run_stats s ON s.job = k.job;
COMMENT ON VIEW ledger.ttl_advice IS
    'Per job: ttl, longest successful run, recommended ttl range (1.5-2x), renew interval, verdict';

CREATE VIEW ledger.job_status AS
WITH known AS (
    SELECT job FROM ledger.jobs
    UNION
    SELECT job FROM ledger.leases
)
SELECT k.job,
       j.schedule,
       j.time_zone,
       coalesce(j.ttl, l.ttl)                               AS ttl,
       j.max_backfill,
       coalesce(j.paused, false)                            AS paused,
       CASE WHEN l.released_at IS NULL AND l.expires_at > now() THEN l.owner END AS holder,
       l.token,
       l.expires_at                                         AS lease_expires_at,
       last_run.run_id                                      AS last_run_id,
       last_run.status                                      AS last_status,
       last_run.started_at                                  AS last_started_at,
       last_run.completed_at                                AS last_completed_at,
       last_success.completed_at                            AS last_success_at,
       running.run_id                                       AS running_run_id,
       now() - running.started_at                           AS running_for,
       CASE WHEN j.schedule IS NOT NULL AND NOT j.paused
            THEN ledger._slot_after(j.schedule_spec, j.time_zone, now()) END AS next_slot,
       -- Overdue: a slot at least one ttl old (5 minutes without a ttl) has
       -- not succeeded and no live run is on it (a run whose lease expired
       -- is a crash, not progress). A job that never ran counts from its
       -- registration.
       coalesce(j.schedule IS NOT NULL AND NOT j.paused
                AND NOT (running.run_id IS NOT NULL AND l.token = running.token
                         AND l.released_at IS NULL AND l.expires_at > now())
                AND ledger._slot_at_or_before(j.schedule_spec, j.time_zone,
                                              now() - coalesce(j.ttl, l.ttl, interval '5 minutes'))
                    > coalesce(done.slot, j.created_at), false) AS overdue,
       (SELECT count(*) FROM ledger.job_execution_log f
         WHERE f.job = k.job AND f.status = 'failure'
           AND f.started_at > coalesce(last_success.started_at, '-infinity')) AS consecutive_failures,
       -- A job known only by its lease has no counters row: zeros, not NULLs.
       coalesce(c.runs_started, 0) AS runs_started, coalesce(c.successes, 0) AS successes,
       coalesce(c.failures, 0) AS failures, coalesce(c.skipped_overlap, 0) AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill, coalesce(c.leases_lost, 0) AS leases_lost
  FROM known k
  LEFT JOIN ledger.jobs j ON j.job = k.job
  LEFT JOIN ledger.leases l ON l.job = k.job
  LEFT JOIN ledger.job_counters c ON c.job = k.job
  LEFT JOIN LATERAL (
      SELECT r.run_id, r.status, r.started_at, r.completed_at FROM ledger.job_execution_log r
       WHERE r.job = k.job ORDER BY r.started_at DESC, r.run_id DESC LIMIT 1) last_run ON true
  LEFT JOIN LATERAL (
      SELECT r.started_at, r.completed_at FROM ledger.job_execution_log r
       WHERE r.job = k.job AND r.status = 'success' ORDER BY r.started_at DESC LIMIT 1) last_success ON true
  LEFT JOIN LATERAL (
      SELECT r.run_id, r.token, r.started_at FROM ledger.job_execution_log r
       WHERE r.job = k.job AND r.status = 'running') running ON true
  LEFT JOIN LATERAL (
      SELECT r.slot FROM ledger.job_execution_log r
       WHERE r.job = k.job AND r.status = 'success' AND r.slot IS NOT NULL
       ORDER BY r.slot DESC LIMIT 1) done ON true;
COMMENT ON VIEW ledger.job_status IS
    'One row per known job: lease, last run, last success, current run, next slot, overdue, failures, counters';

-- One row per live problem.
CREATE VIEW ledger.alerts AS
SELECT 'long_running'::text AS alert, s.job, s.running_run_id AS run_id,
       format('running for %s, over twice its longest successful run (%s)',
              date_trunc('second', s.running_for), date_trunc('second', t.longest_run)) AS message,
       now() - s.running_for AS since
  FROM ledger.job_status s JOIN ledger.ttl_advice t USING (job)
 WHERE s.running_run_id IS NOT NULL AND s.running_for > t.longest_run * 2
UNION ALL
SELECT 'overdue', s.job, NULL,
       format('a slot is more than one ttl old and has not succeeded, with no live run on it; next slot %s', s.next_slot),
       NULL
  FROM ledger.job_status s
 WHERE s.overdue
UNION ALL
SELECT 'consecutive_failures', s.job, s.last_run_id,
       format('%s failures in a row', s.consecutive_failures), NULL
  FROM ledger.job_status s
 WHERE s.consecutive_failures >= 3
UNION ALL
SELECT 'overlap', o.job, o.other_run_id,
       format('runs %s and %s overlap', o.run_id, o.other_run_id), o.other_started_at
  FROM ledger.overlaps o
UNION ALL
SELECT 'ttl_too_short', t.job, NULL,
       format('ttl %s is under 1.5 times the longest successful run (%s)', t.ttl, t.longest_run), NULL
  FROM ledger.ttl_advice t
 WHERE t.verdict = 'too_short';
COMMENT ON VIEW ledger.alerts IS
    'One row per live problem: long_running, overdue, consecutive_failures, overlap, ttl_too_short';
