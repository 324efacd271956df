-- Reporting views: read-only, granted to ledger_reader. They read the log and
-- the counters; none of them writes.

-- Per job: the counts and percentiles over each job's newest 1,000 runs (an
-- index scan per job, so a metrics scrape does not grow with the log's
-- length); the longest successful run over the whole log, from the job's
-- state (ledger.counters.longest_success).
CREATE VIEW ledger.run_stats AS
SELECT c.job,
       count(*)                                             AS runs,
       count(*) FILTER (WHERE r.status = 'success')         AS successes,
       count(*) FILTER (WHERE r.status = 'failure')         AS failures,
       round(count(*) FILTER (WHERE r.status = 'failure')::numeric
             / nullif(count(*) FILTER (WHERE r.status <> 'running'), 0), 4) AS failure_rate,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p50_duration,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p95_duration,
       c.longest_success                                    AS max_duration
  FROM ledger.counters c
 CROSS JOIN LATERAL (
       SELECT r.status, r.started_at, r.completed_at FROM ledger.job_execution_log r
        WHERE r.job = c.job ORDER BY r.started_at DESC LIMIT 1000) r
 WHERE c.last_run_id IS NOT NULL
 GROUP BY c.job, c.longest_success;
COMMENT ON VIEW ledger.run_stats IS
    'Per job, over its newest 1,000 runs: runs, failure rate, p50/p95 duration of successful runs; the longest over the log';

-- The ttl should be 1.5 to 2 times the longest normal run, renewed every
-- ttl/3; never under 1 second (ledger._advice_min_ttl: a 19 ms run is no
-- reason for a 28 ms lease), and no advice before 5 successes
-- (ledger._advice_min_runs): one run is no sample. The verdict is the job's
-- state view's (ledger._job_state), which the ttl_too_short alert reads.
CREATE VIEW ledger.ttl_advice AS
SELECT s.job,
       s.ttl,
       s.advice_longest                                                  AS longest_run,
       -- greatest() ignores NULLs: no sample, no recommendation
       CASE WHEN s.advice_longest IS NOT NULL
            THEN greatest(s.advice_longest * 1.5, ledger._advice_min_ttl()) END AS recommended_min,
       CASE WHEN s.advice_longest IS NOT NULL
            THEN greatest(s.advice_longest * 2, ledger._advice_min_ttl()) END   AS recommended_max,
       s.ttl / 3                                                         AS renew_every,
       s.ttl_verdict                                                     AS verdict,
       s.successes                                                       AS successes
  FROM ledger._job_state s;
COMMENT ON VIEW ledger.ttl_advice IS
    'Per job: ttl, longest successful run, recommended ttl range (1.5-2x, at least 1 s, after 5 successes), renew interval, verdict';

-- One row per known job (ledger._job_state): lease, last run, last
-- success, current run, next slot, its state, the counters. The cost is per
-- job, whatever the length of the log, and no schedule is evaluated: the
-- next slot is the first after the newest done one (next_due), ahead of now
-- while the job keeps up, behind it while slots are due.
CREATE VIEW ledger.job_status AS
SELECT s.job,
       s.schedule,
       s.time_zone,
       s.ttl,
       s.max_backfill,
       s.paused,
       s.holder,
       s.token,
       s.lease_expires_at,
       s.last_run_id,
       s.last_status,
       s.last_started_at,
       s.last_completed_at,
       s.last_success_at,
       s.running_run_id,
       s.running_for,
       CASE WHEN s.schedule IS NOT NULL AND NOT s.paused THEN s.next_due END AS next_slot,
       -- kept for older clients: the state says it (late or down)
       s.state IN ('late', 'down')                                        AS overdue,
       s.consecutive_failures,
       s.runs_started,
       s.successes,
       s.failures,
       s.skipped_overlap,
       s.skipped_backfill,
       s.leases_lost,
       s.state,
       s.skipped_deadline,
       s.skipped_pool_full,
       s.pool
  FROM ledger._job_state s;
COMMENT ON VIEW ledger.job_status IS
    'One row per known job: lease, last run, last success, current run, next slot, state, failures, counters';

-- One state per known job (ledger._job_state has the states, in their
-- order), since when and why, and the bounds it is judged by. `since` is
-- when the state began (for failing: the end of the last success, or the
-- registration; for ok: the last success).
CREATE VIEW ledger.job_health AS
SELECT s.job,
       s.state,
       s.since,
       s.reason,
       s.pause_reason,
       s.last_success_at,
       s.at - s.last_success_at                                           AS last_success_age,
       s.last_success_at - s.last_success_started_at                      AS last_success_duration,
       s.missed_slots,
       s.missed_slots_capped,
       s.grace                                                            AS late_after,
       s.down_after,
       s.min_runtime,
       s.max_runtime,
       s.pause_after_failures,
       s.consecutive_failures,
       CASE WHEN s.live THEN s.running_run_id END                         AS running_run_id,
       CASE WHEN s.live THEN s.running_for END                            AS running_for
  FROM ledger._job_state s;
COMMENT ON VIEW ledger.job_health IS
    'One state per known job (crashed, overrun, paused, running, down, late, failing, never_run, ok), since when, why';

-- One row per live problem, at most one per job and cause: the kinds the
-- job's state row says it raises (ledger._job_state.alerts, the one
-- definition of which alerts a job has: the job's state when it is trouble,
-- crashed, overrun, down, late, failing, or paused by pause_after_failures,
-- with its reason and since; long_running, too_fast, overlap and
-- ttl_too_short), each with its run, message and since. One pass over the
-- jobs' state, never the log (but for an overlap's start); the message of a
-- kind is written only for the jobs that raise it.
CREATE VIEW ledger.alerts AS
SELECT a.alert, s.job,
       CASE a.alert WHEN 'crashed' THEN s.running_run_id WHEN 'overrun' THEN s.running_run_id
                    WHEN 'long_running' THEN s.running_run_id WHEN 'overlap' THEN s.overlap_run_id END AS run_id,
       CASE a.alert
           WHEN 'long_running' THEN format('running for %s, over twice its longest successful run (%s)',
                                           date_trunc('second', s.running_for), date_trunc('second', s.longest_success))
           WHEN 'too_fast' THEN format('the last success took %s, under its min_runtime %s',
                                       s.last_success_at - s.last_success_started_at, s.min_runtime)
           WHEN 'overlap' THEN format('run %s started before an earlier run of the job ended '
                                      '(ledger.overlaps lists the pairs)', s.overlap_run_id)
           WHEN 'ttl_too_short' THEN format('ttl %s is under 1.5 times the longest successful run (%s)',
                                            s.ttl, s.advice_longest)
           ELSE s.reason
       END AS message,
       CASE a.alert
           WHEN 'long_running' THEN s.running_started_at
           WHEN 'too_fast' THEN s.last_success_at
           WHEN 'overlap' THEN (SELECT r.started_at FROM ledger.job_execution_log r WHERE r.run_id = s.overlap_run_id)
           WHEN 'ttl_too_short' THEN NULL::timestamptz
           ELSE s.since
       END AS since
  FROM ledger._job_state s
 CROSS JOIN LATERAL unnest(s.alerts) AS a(alert);
COMMENT ON VIEW ledger.alerts IS
    'One row per live problem, one per job and cause: crashed, overrun, down, late, failing, paused (by failures), '
    'long_running, too_fast, overlap, ttl_too_short';
