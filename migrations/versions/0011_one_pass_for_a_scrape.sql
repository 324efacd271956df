-- 0011: one pass for a scrape (drafted by tools/draft_revision.py from sql/)

-- By hand: the two views as sql/ writes them (its (EXTRACT(...))::numeric: on PostgreSQL 13 EXTRACT is
-- double precision), as CREATE OR REPLACE: _job_state gains a last column (alerts) and every other
-- column keeps its name, type and order; ledger.alerts, which reads it, after it. Their owner, grants
-- and comments stay. No table is changed and no lock is taken but the views' own.
CREATE OR REPLACE VIEW ledger._job_state AS
SELECT c.job,
       j.schedule, j.time_zone, j.max_backfill, coalesce(j.paused, false) AS paused, j.paused_at, j.pause_reason,
       j.created_at, j.down_after, j.min_runtime, j.max_runtime, j.pause_after_failures,
       coalesce(j.ttl, l.ttl)                                             AS ttl,
       CASE WHEN l.released_at IS NULL AND l.expires_at > n.at THEN l.owner END AS holder,
       l.token,
       l.expires_at                                                       AS lease_expires_at,
       c.last_run_id, c.last_status, c.last_started_at, c.last_completed_at, c.last_success_started_at,
       c.last_success_at, c.running_run_id, c.running_started_at,
       n.at - c.running_started_at                                        AS running_for,
       c.done_slot, c.longest_success, c.consecutive_failures, c.next_due, c.down_due, c.latest_end,
       c.overlap_run_id, c.runs_started, c.successes, c.failures,
       c.skipped_overlap + coalesce(sk.pending, 0)::bigint                AS skipped_overlap,
       c.skipped_backfill, c.leases_lost,
       n.at, s.live, s.grace,
       s.state,
       CASE s.state
           WHEN 'crashed' THEN CASE WHEN l.token = c.running_token THEN l.expires_at ELSE l.acquired_at END
           WHEN 'overrun' THEN c.running_started_at + j.max_runtime
           WHEN 'paused' THEN j.paused_at
           WHEN 'running' THEN c.running_started_at
           WHEN 'down' THEN coalesce(s.unserved_since, least(
               CASE WHEN c.down_due <= n.at - s.grace THEN c.down_due + s.grace END,
               CASE WHEN n.at - coalesce(c.last_success_at, j.created_at) > j.down_after
                    THEN coalesce(c.last_success_at, j.created_at) + j.down_after END))
           WHEN 'late' THEN c.next_due + s.grace
           WHEN 'failing' THEN coalesce(c.last_success_at, j.created_at)
           WHEN 'never_run' THEN j.created_at
           ELSE coalesce(c.last_success_at, c.last_completed_at)
       END                                                                AS since,
       CASE s.state
           WHEN 'crashed' THEN format('run %s is still marked running, but its lease %s: its runner is gone '
                                      '(ledger.reap_expired, or the next start, closes it)', c.running_run_id,
                                      CASE WHEN l.token <> c.running_token THEN format('went to token %s', l.token)
                                           WHEN l.released_at IS NOT NULL THEN 'was released'
                                           ELSE format('expired %s ago', date_trunc('second', n.at - l.expires_at))
                                      END)
           WHEN 'overrun' THEN format('running for %s, over its max_runtime %s',
                                      date_trunc('second', n.at - c.running_started_at), j.max_runtime)
           WHEN 'paused' THEN CASE j.pause_reason
                                  WHEN 'failures' THEN format('paused after %s failure%s in a row',
                                                              c.consecutive_failures,
                                                              CASE WHEN c.consecutive_failures = 1 THEN ''
                                                                   ELSE 's' END)
                                  ELSE 'paused by an operator' END
           WHEN 'running' THEN format('run %s running', c.running_run_id)
           WHEN 'down' THEN CASE WHEN s.unserved_since IS NOT NULL THEN 'no live scheduler serves it'
                                 WHEN c.down_due <= n.at - s.grace
                                 THEN format('%s%s slots missed since the last success',
                                             CASE WHEN m.missed_slots_capped THEN 'at least ' ELSE '' END,
                                             m.missed_slots)
                                 ELSE format('no success for over %s', j.down_after) END
           WHEN 'late' THEN format('a slot due %s ago was not started within %s',
                                   date_trunc('second', n.at - c.next_due), s.grace)
           WHEN 'failing' THEN format('%s failure%s in a row', c.consecutive_failures,
                                      CASE WHEN c.consecutive_failures = 1 THEN '' ELSE 's' END)
           WHEN 'never_run' THEN 'no run yet'
           ELSE 'ok'
       END                                                                AS reason,
       m.missed_slots, m.missed_slots_capped,
       CASE WHEN c.successes >= ledger._advice_min_runs() THEN c.longest_success END AS advice_longest,
       v.ttl_verdict,
       c.skipped_deadline,
       c.skipped_pool_full,
       j.pool::text                                                       AS pool,
       -- The kinds of ledger.alerts the job raises now, in its order (none:
       -- '{}'): the one definition of which alerts a job has. ledger.alerts
       -- unnests it; the metrics scrape counts it, in the pass that writes
       -- the job's lines. The problems that are no state: long_running (a
       -- live run not overrun, over twice the longest success), too_fast
       -- (the newest success under min_runtime), overlap (overlap_run_id)
       -- and ttl_too_short (ledger.ttl_advice's verdict).
       array_remove(ARRAY[
           CASE WHEN s.state IN ('crashed', 'overrun', 'down', 'late', 'failing')
                     OR (s.state = 'paused' AND j.pause_reason = 'failures') THEN s.state END,
           CASE WHEN s.live AND s.state <> 'overrun' AND n.at - c.running_started_at > c.longest_success * 2
                THEN 'long_running' END,
           CASE WHEN c.last_success_at - c.last_success_started_at < j.min_runtime THEN 'too_fast' END,
           CASE WHEN c.overlap_run_id IS NOT NULL THEN 'overlap' END,
           CASE WHEN v.ttl_verdict = 'too_short' THEN 'ttl_too_short' END], NULL) AS alerts
  FROM ledger.counters c
  LEFT JOIN ledger.jobs j ON j.job = c.job
  LEFT JOIN ledger.leases l ON l.job = c.job
  -- skips not yet folded into the state row (ledger.skip_counts)
  LEFT JOIN (SELECT k.job, sum(k.skipped_overlap) AS pending FROM ledger.skip_counts k GROUP BY k.job) sk
         ON sk.job = c.job
  -- the last expiry of the schedulers that serve it (none: NULL), joined
  -- rather than a subquery per job (a read of every job cost a quarter more)
  LEFT JOIN (SELECT sj.job, max(x.expires_at) AS expires_at
               FROM ledger.scheduler_jobs sj JOIN ledger.schedulers x ON x.scheduler = sj.scheduler
              GROUP BY sj.job) sv
         ON sv.job = c.job
 CROSS JOIN LATERAL (SELECT ledger._view_now() AS at) n
 -- The state, worked out once per row (OFFSET 0 keeps the planner from
 -- copying its expression into every column that reads it; a lateral
 -- subquery still lets a read of one job use the primary keys).
 CROSS JOIN LATERAL (
       SELECT d.live, d.grace, d.unserved_since,
              CASE
                  WHEN c.running_run_id IS NOT NULL AND NOT d.live THEN 'crashed'
                  WHEN d.live AND n.at - c.running_started_at > j.max_runtime THEN 'overrun'
                  WHEN j.paused THEN 'paused'
                  WHEN d.live THEN 'running'
                  WHEN d.unserved_since IS NOT NULL
                       OR c.down_due <= n.at - d.grace
                       OR n.at - coalesce(c.last_success_at, j.created_at) > j.down_after THEN 'down'
                  WHEN c.next_due <= n.at - d.grace THEN 'late'
                  WHEN c.consecutive_failures >= ledger._failing_after() THEN 'failing'
                  WHEN c.last_run_id IS NULL THEN 'never_run'
                  ELSE 'ok'
              END AS state
         FROM (SELECT coalesce(l.token = c.running_token AND l.released_at IS NULL AND l.expires_at > n.at, false)
                          AS live,
                      coalesce(j.late_after, greatest(coalesce(j.ttl, l.ttl, interval '1 minute'), interval '1 minute'))
                          AS grace,
                      -- served by schedulers that all expired: since the last expiry
                      CASE WHEN sv.expires_at > n.at THEN NULL ELSE sv.expires_at END AS unserved_since) d
       OFFSET 0) s
 -- The slots missed since the newest done (or the registration): counted
 -- by arithmetic for an interval of fixed length (its slots are whole
 -- multiples of it since 2000-01-01 00:00 local, as ledger._interval_index
 -- counts them); otherwise from the due marks, 1 or
 -- ledger._down_after_slots(), as a lower bound (missed_slots_capped).
 CROSS JOIN LATERAL (
       SELECT CASE
                  WHEN j.schedule IS NULL THEN NULL
                  WHEN c.next_due IS NULL OR c.next_due > n.at - s.grace THEN 0::bigint
                  WHEN (j.schedule_spec).kind = 'interval' AND (j.schedule_spec).every_months = 0
                       AND (j.schedule_spec).every_days = 0
                  THEN floor(((extract(epoch FROM n.at - s.grace))::numeric
                              - (extract(epoch FROM timestamp '2000-01-01 00:00' AT TIME ZONE j.time_zone))::numeric)
                             * 1000000 / (j.schedule_spec).every_micros)::bigint
                       - floor(((extract(epoch FROM coalesce(c.done_slot, j.created_at)))::numeric
                                - (extract(epoch FROM timestamp '2000-01-01 00:00' AT TIME ZONE j.time_zone))::numeric)
                               * 1000000 / (j.schedule_spec).every_micros)::bigint
                  WHEN c.down_due <= n.at - s.grace THEN ledger._down_after_slots()::bigint
                  ELSE 1::bigint
              END AS missed_slots,
              coalesce(j.schedule IS NOT NULL AND c.next_due <= n.at - s.grace
                       AND NOT ((j.schedule_spec).kind = 'interval' AND (j.schedule_spec).every_months = 0
                                AND (j.schedule_spec).every_days = 0), false) AS missed_slots_capped) m
 -- ledger.ttl_advice's verdict (the alerts' ttl_too_short): no advice
 -- before ledger._advice_min_runs() successes
 CROSS JOIN LATERAL (
       SELECT CASE
                  WHEN coalesce(j.ttl, l.ttl) IS NULL OR c.successes < ledger._advice_min_runs()
                       OR c.longest_success IS NULL THEN 'no_data'
                  WHEN coalesce(j.ttl, l.ttl) < greatest(c.longest_success * 1.5, ledger._advice_min_ttl())
                  THEN 'too_short'
                  WHEN coalesce(j.ttl, l.ttl) > greatest(c.longest_success * 2, ledger._advice_min_ttl())
                  THEN 'too_long'
                  ELSE 'ok'
              END AS ttl_verdict) v;

CREATE OR REPLACE VIEW ledger.alerts AS
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
