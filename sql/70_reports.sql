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
-- (ledger._advice_min_runs): one run is no sample.
CREATE VIEW ledger.ttl_advice AS
WITH known AS (
    SELECT job, coalesce(j.ttl, l.ttl) AS ttl
      FROM ledger.jobs j FULL JOIN ledger.leases l USING (job)
), sampled AS (
    SELECT k.job, k.ttl,
           CASE WHEN c.successes >= ledger._advice_min_runs() THEN c.longest_success END AS longest,
           coalesce(c.successes, 0) AS successes
      FROM known k
      LEFT JOIN ledger.counters c ON c.job = k.job
)
SELECT s.job,
       s.ttl,
       s.longest                                                    AS longest_run,
       -- greatest() ignores NULLs: no sample, no recommendation
       CASE WHEN s.longest IS NOT NULL
            THEN greatest(s.longest * 1.5, ledger._advice_min_ttl()) END AS recommended_min,
       CASE WHEN s.longest IS NOT NULL
            THEN greatest(s.longest * 2, ledger._advice_min_ttl()) END   AS recommended_max,
       s.ttl / 3                                                    AS renew_every,
       CASE
           WHEN s.ttl IS NULL OR s.longest IS NULL THEN 'no_data'
           WHEN s.ttl < greatest(s.longest * 1.5, ledger._advice_min_ttl()) THEN 'too_short'
           WHEN s.ttl > greatest(s.longest * 2, ledger._advice_min_ttl()) THEN 'too_long'
           ELSE 'ok'
       END                                                          AS verdict,
       s.successes                                                  AS successes
  FROM sampled s;
COMMENT ON VIEW ledger.ttl_advice IS
    'Per job: ttl, longest successful run, recommended ttl range (1.5-2x, at least 1 s, after 5 successes), renew interval, verdict';

-- Per job, from the job's row in each of jobs, leases and counters (its
-- state, kept by the writing functions): the cost is per job, whatever the
-- length of the log.
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
       CASE WHEN l.released_at IS NULL AND l.expires_at > ledger._view_now() THEN l.owner END AS holder,
       l.token,
       l.expires_at                                         AS lease_expires_at,
       c.last_run_id                                        AS last_run_id,
       c.last_status                                        AS last_status,
       c.last_started_at                                    AS last_started_at,
       c.last_completed_at                                  AS last_completed_at,
       c.last_success_at                                    AS last_success_at,
       c.running_run_id                                     AS running_run_id,
       ledger._view_now() - c.running_started_at                         AS running_for,
       -- next_due still ahead: no slot since done_slot, so it is the next
       -- (no schedule evaluation for a job that keeps up)
       CASE WHEN j.schedule IS NOT NULL AND NOT j.paused
            THEN CASE WHEN c.next_due > ledger._view_now() THEN c.next_due
                      ELSE ledger._slot_after(j.schedule_spec, j.time_zone, ledger._view_now()) END END AS next_slot,
       -- Overdue: a slot at least one ttl old (5 minutes without a ttl) has
       -- not succeeded and no live run is on it (a run whose lease expired
       -- is a crash, not progress). A job that never ran counts from its
       -- registration.
       coalesce(j.schedule IS NOT NULL AND NOT j.paused
                AND NOT (c.running_run_id IS NOT NULL AND l.token = c.running_token
                         AND l.released_at IS NULL AND l.expires_at > ledger._view_now())
                AND NOT coalesce(c.next_due > ledger._view_now() - coalesce(j.ttl, l.ttl, interval '5 minutes'), false)
                AND ledger._slot_at_or_before(j.schedule_spec, j.time_zone,
                                              ledger._view_now() - coalesce(j.ttl, l.ttl, interval '5 minutes'))
                    > coalesce(c.done_slot, j.created_at), false) AS overdue,
       coalesce(c.consecutive_failures, 0)                  AS consecutive_failures,
       -- A job known only by its lease has no counters row: zeros, not NULLs.
       coalesce(c.runs_started, 0) AS runs_started, coalesce(c.successes, 0) AS successes,
       coalesce(c.failures, 0) AS failures,
       coalesce(c.skipped_overlap, 0)
           + coalesce((SELECT sum(s.skipped_overlap) FROM ledger.skip_counts s WHERE s.job = k.job), 0)::bigint
                                   AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill, coalesce(c.leases_lost, 0) AS leases_lost
  FROM known k
  LEFT JOIN ledger.jobs j ON j.job = k.job
  LEFT JOIN ledger.leases l ON l.job = k.job
  LEFT JOIN ledger.counters c ON c.job = k.job;
COMMENT ON VIEW ledger.job_status IS
    'One row per known job: lease, last run, last success, current run, next slot, overdue, failures, counters';

-- One health state per known job, from its rows in jobs, leases and
-- counters (never the log): O(jobs). The first state that holds wins:
--   paused    the job is paused (pause_reason: 'operator' or 'failures');
--   overrun   a live run has been running longer than max_runtime;
--   running   a live run (its lease held and not expired);
--   down      at least 3 slots missed (ledger._down_after_slots), or no
--             success for longer than down_after (since registration when
--             none ever succeeded);
--   late      a slot missed: due, not started within the grace;
--   failing   the last ended run failed (consecutive_failures >= 1);
--   never_run no run yet;
--   ok        otherwise.
-- A slot is missed when it lies after the newest slot that succeeded (or
-- the registration) and is older than the grace: late_after, or by
-- default the ttl but at least 1 minute. missed_slots counts them from the
-- schedule, without listing them: arithmetic for an interval, per day for
-- cron, over at most 366 days back (beyond that the count is a lower bound:
-- missed_slots_capped). `since` is when the state began (for failing: the
-- end of the last success, or the registration; for ok: the last success).
CREATE VIEW ledger.job_health AS
WITH known AS (
    SELECT job FROM ledger.jobs
    UNION
    SELECT job FROM ledger.leases
), base AS (
    SELECT k.job, j.schedule, j.schedule_spec, j.time_zone, j.created_at, coalesce(j.paused, false) AS paused,
           j.paused_at, j.pause_reason, j.down_after, j.min_runtime, j.max_runtime, j.pause_after_failures,
           coalesce(j.late_after, greatest(coalesce(j.ttl, l.ttl, interval '1 minute'), interval '1 minute')) AS grace,
           c.last_success_at, c.last_success_started_at, c.consecutive_failures, c.running_run_id,
           c.running_started_at, coalesce(c.runs_started, 0) AS runs_started, c.last_completed_at,
           c.next_due,
           (c.running_run_id IS NOT NULL AND l.token = c.running_token
            AND l.released_at IS NULL AND l.expires_at > ledger._view_now()) AS live,
           -- missed slots lie in (done, upto]
           coalesce(c.done_slot, j.created_at) AS done
      FROM known k
      LEFT JOIN ledger.jobs j ON j.job = k.job
      LEFT JOIN ledger.leases l ON l.job = k.job
      LEFT JOIN ledger.counters c ON c.job = k.job
), counted AS (
    SELECT b.*,
           CASE WHEN b.schedule IS NULL THEN NULL
                WHEN ledger._view_now() - b.grace <= b.done OR b.next_due > ledger._view_now() - b.grace THEN 0::bigint
                WHEN (b.schedule_spec).kind = 'interval'
                THEN ledger._slot_count(b.schedule_spec, b.time_zone, b.done, ledger._view_now() - b.grace)
                ELSE ledger._slot_count(b.schedule_spec, b.time_zone,
                                        greatest(b.done, ledger._view_now() - b.grace - ledger._missed_horizon()),
                                        ledger._view_now() - b.grace) END AS missed_slots,
           b.schedule IS NOT NULL AND (b.schedule_spec).kind <> 'interval'
               AND b.done < ledger._view_now() - b.grace - ledger._missed_horizon() AS missed_slots_capped
      FROM base b
), judged AS (
    SELECT c.*,
           CASE
               WHEN c.paused THEN 'paused'
               WHEN c.live AND c.max_runtime IS NOT NULL AND ledger._view_now() - c.running_started_at > c.max_runtime
               THEN 'overrun'
               WHEN c.live THEN 'running'
               WHEN c.missed_slots >= ledger._down_after_slots()
                    OR (c.down_after IS NOT NULL
                        AND ledger._view_now() - coalesce(c.last_success_at, c.created_at) > c.down_after) THEN 'down'
               WHEN c.missed_slots >= 1 THEN 'late'
               WHEN c.consecutive_failures >= 1 THEN 'failing'
               WHEN c.runs_started = 0 THEN 'never_run'
               ELSE 'ok'
           END AS state
      FROM counted c
), dated AS (
    -- The first slot missed, for late and down: the first after done,
    -- which the job's state keeps (next_due) when a success moved done on.
    SELECT j.*,
           CASE WHEN j.state IN ('late', 'down')
                THEN coalesce(j.next_due, ledger._slot_after(j.schedule_spec, j.time_zone, j.done)) END AS first_missed
      FROM judged j
)
SELECT j.job,
       j.state,
       CASE j.state
           WHEN 'paused' THEN j.paused_at
           WHEN 'overrun' THEN j.running_started_at + j.max_runtime
           WHEN 'running' THEN j.running_started_at
           WHEN 'down' THEN least(
               CASE WHEN j.missed_slots >= ledger._down_after_slots()
                    THEN ledger._slot_after(j.schedule_spec, j.time_zone,
                             ledger._slot_after(j.schedule_spec, j.time_zone,
                                 j.first_missed)) + j.grace END,
               CASE WHEN ledger._view_now() - coalesce(j.last_success_at, j.created_at) > j.down_after
                    THEN coalesce(j.last_success_at, j.created_at) + j.down_after END)
           WHEN 'late' THEN j.first_missed + j.grace
           WHEN 'failing' THEN coalesce(j.last_success_at, j.created_at)
           WHEN 'never_run' THEN j.created_at
           ELSE coalesce(j.last_success_at, j.last_completed_at)
       END                                                   AS since,
       CASE j.state
           WHEN 'paused' THEN CASE j.pause_reason
                                  WHEN 'failures' THEN format('paused after %s failure%s in a row',
                                                              j.consecutive_failures,
                                                              CASE WHEN j.consecutive_failures = 1 THEN ''
                                                                   ELSE 's' END)
                                  ELSE 'paused by an operator' END
           WHEN 'overrun' THEN format('running for %s, over its max_runtime %s',
                                      date_trunc('second', ledger._view_now() - j.running_started_at), j.max_runtime)
           WHEN 'running' THEN format('run %s running', j.running_run_id)
           WHEN 'down' THEN CASE WHEN j.missed_slots >= ledger._down_after_slots()
                                 THEN format('%s%s slots missed since the last success',
                                             CASE WHEN j.missed_slots_capped THEN 'at least ' ELSE '' END,
                                             j.missed_slots)
                                 ELSE format('no success for over %s', j.down_after) END
           WHEN 'late' THEN format('a slot due %s ago was not started within %s',
                                   date_trunc('second', ledger._view_now() - j.first_missed),
                                   j.grace)
           WHEN 'failing' THEN format('%s failure%s in a row', j.consecutive_failures,
                                      CASE WHEN j.consecutive_failures = 1 THEN '' ELSE 's' END)
           WHEN 'never_run' THEN 'no run yet'
           ELSE 'ok'
       END                                                   AS reason,
       j.pause_reason,
       j.last_success_at,
       ledger._view_now() - j.last_success_at                             AS last_success_age,
       j.last_success_at - j.last_success_started_at         AS last_success_duration,
       j.missed_slots,
       j.missed_slots_capped,
       j.grace                                               AS late_after,
       j.down_after,
       j.min_runtime,
       j.max_runtime,
       j.pause_after_failures,
       coalesce(j.consecutive_failures, 0)                   AS consecutive_failures,
       CASE WHEN j.live THEN j.running_run_id END            AS running_run_id,
       CASE WHEN j.live THEN ledger._view_now() - j.running_started_at END AS running_for
  FROM dated j;
COMMENT ON VIEW ledger.job_health IS
    'One health state per known job (paused, overrun, running, down, late, failing, never_run, ok), since when, why';

-- One row per live problem. Every part reads per job (the jobs' state,
-- ledger.counters: ledger.overlaps is the audit of the whole log), so
-- alerts do not grow with the log's length.
-- Read it with jit off (ledger.report.read_only_transaction and
-- ledger.sync_alerts do): JIT-compiling this plan costs more than running it.
CREATE VIEW ledger.alerts AS
WITH s AS MATERIALIZED (
    -- job_status once for the three parts that read it (its overdue test
    -- evaluates the schedule: paid once per job, not three times)
    SELECT s.job, s.running_run_id, s.running_for, s.overdue, s.consecutive_failures, s.last_run_id
      FROM ledger.job_status s
), t AS MATERIALIZED (
    SELECT t.job, t.ttl, t.longest_run, t.verdict FROM ledger.ttl_advice t
), h AS MATERIALIZED (
    SELECT h.job, h.state, h.since, h.reason, h.pause_reason, h.running_run_id FROM ledger.job_health h
)
SELECT 'long_running'::text AS alert, s.job, s.running_run_id AS run_id,
       format('running for %s, over twice its longest successful run (%s)',
              date_trunc('second', s.running_for), date_trunc('second', c.longest_success)) AS message,
       ledger._view_now() - s.running_for AS since
  FROM s JOIN ledger.counters c USING (job)
 WHERE s.running_run_id IS NOT NULL AND s.running_for > c.longest_success * 2
UNION ALL
-- From ledger.job_health: its late, down, overrun and failing states, and a
-- pause that pause_after_failures made.
SELECT h.state, h.job, h.running_run_id, h.reason, h.since
  FROM h
 WHERE h.state IN ('late', 'down', 'overrun', 'failing')
UNION ALL
SELECT 'paused', h.job, NULL, h.reason, h.since
  FROM h
 WHERE h.state = 'paused' AND h.pause_reason = 'failures'
UNION ALL
-- The newest success was shorter than min_runtime (from the job's state).
SELECT 'too_fast', c.job, NULL,
       format('the last success took %s, under its min_runtime %s',
              c.last_success_at - c.last_success_started_at, j.min_runtime),
       c.last_success_at
  FROM ledger.counters c JOIN ledger.jobs j ON j.job = c.job
 WHERE j.min_runtime IS NOT NULL AND c.last_success_at - c.last_success_started_at < j.min_runtime
UNION ALL
SELECT 'overdue', s.job, NULL,
       format('a slot is more than one ttl old and has not succeeded, with no live run on it; next slot %s',
              ledger._slot_after(j.schedule_spec, j.time_zone, ledger._view_now())),
       NULL
  FROM s JOIN ledger.jobs j ON j.job = s.job
 WHERE s.overdue
UNION ALL
SELECT 'consecutive_failures', s.job, s.last_run_id,
       format('%s failures in a row', s.consecutive_failures), NULL
  FROM s
 WHERE s.consecutive_failures >= 3
UNION ALL
-- A run that started before an earlier run of its job ended (the job's
-- state keeps the newest: ledger.counters.overlap_run_id): O(1) per job.
-- ledger.overlaps lists every pair, over the whole log.
SELECT 'overlap', c.job, c.overlap_run_id,
       format('run %s started before an earlier run of the job ended (ledger.overlaps lists the pairs)',
              c.overlap_run_id),
       r.started_at
  FROM ledger.counters c
  LEFT JOIN ledger.job_execution_log r ON r.run_id = c.overlap_run_id
 WHERE c.overlap_run_id IS NOT NULL
UNION ALL
SELECT 'ttl_too_short', t.job, NULL,
       format('ttl %s is under 1.5 times the longest successful run (%s)', t.ttl, t.longest_run), NULL
  FROM t
 WHERE t.verdict = 'too_short';
COMMENT ON VIEW ledger.alerts IS
    'One row per live problem: long_running, late, down, overrun, failing, paused, too_fast, overdue, '
    'consecutive_failures, overlap, ttl_too_short';
