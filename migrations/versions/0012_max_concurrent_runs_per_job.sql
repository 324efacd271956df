-- 0012: max concurrent runs per job (drafted by tools/draft_revision.py from sql/)

-- By hand: the locks, each waited for (at most the migration's 2 s lock_timeout), in 0005's order: the
-- views that read the tables changed below first (a no-op ALTER takes each; a reader takes a view before
-- its tables), then the tables as the writers take them, the lease rows first; every table altered
-- below ACCESS EXCLUSIVE at once, as ALTER TABLE will take it (0010: a lock strengthened later deadlocks
-- with live starts and scheduler rounds). A deadlock with a writer that took them in another order
-- undoes this try whole, and it is tried again (ledger.migrate).
ALTER VIEW ledger.alerts OWNER TO ledger_owner;
ALTER VIEW ledger.job_health OWNER TO ledger_owner;
ALTER VIEW ledger.ttl_advice OWNER TO ledger_owner;
ALTER VIEW ledger.job_status OWNER TO ledger_owner;
ALTER VIEW ledger.job_counters OWNER TO ledger_owner;
ALTER VIEW ledger._job_state OWNER TO ledger_owner;
ALTER VIEW ledger.pool_status OWNER TO ledger_owner;
ALTER VIEW ledger.overlaps OWNER TO ledger_owner;
LOCK TABLE ledger.leases IN ACCESS EXCLUSIVE MODE;
LOCK TABLE ledger.jobs IN ACCESS EXCLUSIVE MODE;
LOCK TABLE ledger.job_execution_log IN ACCESS EXCLUSIVE MODE;

-- By hand: the tables first (functions below read the new columns, views select them). The new columns
-- have constant defaults: no rewrite, and every job is a single holder after the upgrade (multi false,
-- seat 1 on every run); a job enters seats mode at its first register_job with max_concurrent > 1. The
-- one-running index is replaced by one on (job, seat), built before the old one goes, so the invariant
-- is never unguarded. The old signatures go first, so that each function created below is the only one
-- of its name (with both, a call that leaves the new trailing argument out is ambiguous: 42725), and
-- because a function whose argument defaults to the log's row type (ledger._set_state's `run`) keeps
-- the log from being altered (0A000).
DROP FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text,text);
DROP FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint);
DROP FUNCTION ledger._close_lost(ledger.job_execution_log,text,timestamp with time zone);
ALTER TABLE ledger.jobs
    ADD COLUMN max_concurrent integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT jobs_max_concurrent_valid CHECK (max_concurrent BETWEEN 1 AND 1000);
ALTER TABLE ledger.leases
    ADD COLUMN multi boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT leases_multi_released CHECK (NOT multi OR released_at IS NOT NULL);
CREATE TABLE ledger.lease_seats (
    job         ledger.label NOT NULL REFERENCES ledger.leases (job),
    seat        integer     NOT NULL,
    owner       ledger.label NOT NULL,
    token       bigint      NOT NULL,
    ttl         interval    NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_at timestamptz,
    run_id      bigint,
    CONSTRAINT lease_seats_pkey PRIMARY KEY (job, seat),
    CONSTRAINT lease_seats_one_per_token UNIQUE (job, token),
    CONSTRAINT lease_seats_seat_valid CHECK (seat BETWEEN 1 AND 1000),
    CONSTRAINT lease_seats_token_positive CHECK (token > 0),
    CONSTRAINT lease_seats_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT lease_seats_released_ends_lease CHECK (released_at IS NULL OR expires_at <= released_at)
);
COMMENT ON TABLE ledger.lease_seats IS 'Per job in seats mode (max_concurrent > 1): each seat''s holder, token, expiry';
ALTER TABLE ledger.lease_seats OWNER TO ledger_owner;
REVOKE ALL ON ledger.lease_seats FROM PUBLIC;
GRANT SELECT ON ledger.lease_seats TO ledger_client, ledger_reader;
ALTER TABLE ledger.job_execution_log
    ADD COLUMN seat integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT log_seat_valid CHECK (seat BETWEEN 1 AND 1000);
CREATE UNIQUE INDEX job_execution_log_one_running_new
    ON ledger.job_execution_log (job, seat) WHERE status = 'running';
DROP INDEX ledger.job_execution_log_one_running;
ALTER INDEX ledger.job_execution_log_one_running_new RENAME TO job_execution_log_one_running;

CREATE OR REPLACE FUNCTION ledger._max_concurrent()
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 1000 $function$;

ALTER FUNCTION ledger._max_concurrent() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._max_concurrent() FROM PUBLIC;

COMMENT ON FUNCTION ledger._max_concurrent() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._max_concurrent() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._max_concurrent() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._close_lost(run ledger.job_execution_log, reason text, at timestamp with time zone, seats boolean DEFAULT false)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF NOT ledger._close_run(run.run_id, reason, at) THEN
        RETURN;
    END IF;
    SELECT * INTO run FROM ledger.job_execution_log r WHERE r.run_id = run.run_id;
    IF seats THEN
        UPDATE ledger.lease_seats s SET run_id = NULL
         WHERE s.job = run.job AND s.seat = run.seat AND s.run_id = run.run_id;
    END IF;
    PERFORM ledger._set_state(run.job, 'lost', run, seats => seats);
END
$function$;

ALTER FUNCTION ledger._close_lost(ledger.job_execution_log,text,timestamp with time zone,boolean) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._close_lost(ledger.job_execution_log,text,timestamp with time zone,boolean) FROM PUBLIC;

COMMENT ON FUNCTION ledger._close_lost(ledger.job_execution_log,text,timestamp with time zone,boolean) IS NULL;

CREATE OR REPLACE FUNCTION ledger._state_from_log(jobs text[])
 RETURNS TABLE(job text, last_run_id bigint, last_status text, last_started_at timestamp with time zone, last_completed_at timestamp with time zone, last_success_started_at timestamp with time zone, last_success_at timestamp with time zone, running_run_id bigint, running_token bigint, running_started_at timestamp with time zone, done_slot timestamp with time zone, longest_success interval, consecutive_failures bigint, next_due timestamp with time zone, latest_end timestamp with time zone, overlap_run_id bigint, down_due timestamp with time zone)
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_custom_plan'
AS $function$
BEGIN
    RETURN QUERY
    WITH r AS MATERIALIZED (
        SELECT l.job, l.run_id, l.status, l.failure_reason, l.slot, l.token, l.started_at, l.completed_at,
               -- as ledger.overlaps defines an overlap: a run that started
               -- before a run started earlier in its seat had ended
               max(coalesce(l.completed_at, 'infinity')) OVER (
                   PARTITION BY l.job, l.seat ORDER BY l.started_at, l.run_id
                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
          FROM ledger.job_execution_log l WHERE l.job = ANY (_state_from_log.jobs)
    ), last_run AS (
        SELECT DISTINCT ON (r.job) r.job, r.run_id, r.status, r.started_at, r.completed_at
          FROM r ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), last_success AS (
        SELECT DISTINCT ON (r.job) r.job, r.started_at, r.completed_at
          FROM r WHERE r.status = 'success' ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), running AS (
        -- the newest running run (seats mode: of several)
        SELECT DISTINCT ON (r.job) r.job, r.run_id, r.token, r.started_at
          FROM r WHERE r.status = 'running' ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), totals AS (
        SELECT r.job,
               max(r.slot) FILTER (WHERE r.status = 'success') AS done_slot,
               max(r.completed_at - r.started_at) FILTER (WHERE r.status = 'success') AS longest_success,
               max(r.completed_at) AS latest_end
          FROM r GROUP BY r.job
    ), failures AS (
        -- a cancel is no failure of the streak
        SELECT r.job, count(*) AS streak
          FROM r LEFT JOIN last_success s ON s.job = r.job
         WHERE r.status = 'failure' AND r.failure_reason <> 'cancelled'
           AND r.started_at > coalesce(s.started_at, '-infinity')
         GROUP BY r.job
    ), overlap AS (
        SELECT DISTINCT ON (r.job) r.job, r.run_id
          FROM r WHERE r.earlier_end > r.started_at ORDER BY r.job, r.started_at DESC, r.run_id DESC
    )
    SELECT t.job::text, lr.run_id, lr.status, lr.started_at, lr.completed_at, ls.started_at, ls.completed_at,
           rn.run_id, rn.token, rn.started_at, tt.done_slot,
           greatest(tt.longest_success, p.longest_success),
           coalesce(f.streak, 0)
               + CASE WHEN p.streak_after IS NOT DISTINCT FROM ls.started_at THEN coalesce(p.streak_failures, 0)
                      ELSE 0 END,
           m.next_due, tt.latest_end, o.run_id, m.down_due
      FROM (SELECT DISTINCT u.job FROM unnest(_state_from_log.jobs) AS u(job)) t
      LEFT JOIN last_run lr ON lr.job = t.job
      LEFT JOIN last_success ls ON ls.job = t.job
      LEFT JOIN running rn ON rn.job = t.job
      LEFT JOIN totals tt ON tt.job = t.job
      LEFT JOIN failures f ON f.job = t.job
      LEFT JOIN overlap o ON o.job = t.job
      LEFT JOIN ledger.purged_state p ON p.job = t.job
      LEFT JOIN ledger.jobs j ON j.job = t.job
      LEFT JOIN LATERAL ledger._due_marks(j.schedule_spec, j.time_zone, coalesce(tt.done_slot, j.created_at)) m
             ON true;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._set_state(job text, event text, run ledger.job_execution_log DEFAULT NULL::ledger.job_execution_log, slots bigint DEFAULT NULL::bigint, seats boolean DEFAULT false)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job    ledger.jobs;
    v_streak bigint;
    v_counts boolean;  -- the run's end is a failure of the streak
    v_next   timestamptz;  -- the due marks after the run's slot
    v_down   timestamptz;
    v_other  ledger.job_execution_log;  -- seats mode: the newest run still running
BEGIN
    IF event NOT IN ('leased', 'started', 'ended', 'lost', 'skipped_pool_full') THEN
        PERFORM FROM ledger.leases l WHERE l.job = _set_state.job FOR UPDATE;
    END IF;
    CASE event
    WHEN 'leased' THEN
        INSERT INTO ledger.counters AS c (job) VALUES (_set_state.job)
        ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
    WHEN 'registration' THEN
        SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = _set_state.job;
        INSERT INTO ledger.counters AS c (job) VALUES (_set_state.job)
        ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
        UPDATE ledger.counters c SET (next_due, down_due) =
               (SELECT m.next_due, m.down_due
                  FROM ledger._due_marks(v_job.schedule_spec, v_job.time_zone,
                                         coalesce(c.done_slot, v_job.created_at)) m)
         WHERE c.job = _set_state.job;
    WHEN 'started' THEN
        -- The row is there but for a job's first start (no registration, no
        -- lease before): an UPDATE, and the upsert only when it found none.
        -- The upsert's ON CONFLICT DO UPDATE locks the row it conflicts with
        -- before it updates it, a WAL record more on every start.
        UPDATE ledger.counters c SET
            runs_started       = c.runs_started + 1,
            last_run_id        = CASE WHEN c.last_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.last_started_at, c.last_run_id)
                                      THEN run.run_id ELSE c.last_run_id END,
            last_status        = CASE WHEN c.last_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.last_started_at, c.last_run_id)
                                      THEN 'running' ELSE c.last_status END,
            last_completed_at  = CASE WHEN c.last_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.last_started_at, c.last_run_id)
                                      THEN NULL ELSE c.last_completed_at END,
            last_started_at    = CASE WHEN c.last_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.last_started_at, c.last_run_id)
                                      THEN run.started_at ELSE c.last_started_at END,
            -- the newest running run (a single holder's previous run ended
            -- before this start: none is noted)
            running_run_id     = CASE WHEN c.running_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.running_started_at, c.running_run_id)
                                      THEN run.run_id ELSE c.running_run_id END,
            running_token      = CASE WHEN c.running_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.running_started_at, c.running_run_id)
                                      THEN run.token ELSE c.running_token END,
            running_started_at = CASE WHEN c.running_run_id IS NULL
                                        OR (run.started_at, run.run_id) > (c.running_started_at, c.running_run_id)
                                      THEN run.started_at ELSE c.running_started_at END,
            -- started before an earlier run ended: only a clock stepped back
            -- can do that here (the start closed the previous run first)
            overlap_run_id     = CASE WHEN run.started_at < c.latest_end THEN run.run_id
                                      ELSE c.overlap_run_id END
         WHERE c.job = run.job;
        IF NOT FOUND THEN
            INSERT INTO ledger.counters AS c (job, runs_started, last_run_id, last_status, last_started_at,
                                              running_run_id, running_token, running_started_at)
            VALUES (run.job, 1, run.run_id, 'running', run.started_at, run.run_id, run.token, run.started_at)
            ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
                runs_started       = c.runs_started + 1,
                last_run_id        = CASE WHEN c.last_run_id IS NULL
                                            OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                          THEN excluded.last_run_id ELSE c.last_run_id END,
                last_status        = CASE WHEN c.last_run_id IS NULL
                                            OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                          THEN 'running' ELSE c.last_status END,
                last_completed_at  = CASE WHEN c.last_run_id IS NULL
                                            OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                          THEN NULL ELSE c.last_completed_at END,
                last_started_at    = CASE WHEN c.last_run_id IS NULL
                                            OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                          THEN excluded.last_started_at ELSE c.last_started_at END,
                running_run_id     = excluded.running_run_id,
                running_token      = excluded.running_token,
                running_started_at = excluded.running_started_at,
                -- started before an earlier run ended: only a clock stepped back
                -- can do that here (the start closed the previous run first)
                overlap_run_id     = CASE WHEN excluded.last_started_at < c.latest_end THEN excluded.running_run_id
                                          ELSE c.overlap_run_id END;
        END IF;
    WHEN 'ended', 'lost' THEN
        v_counts := run.status = 'failure' AND run.failure_reason <> 'cancelled';
        -- A success of a slot: the due marks after it, the schedule evaluated
        -- here, once, and never by a read (applied below if the slot is newer
        -- than the newest done).
        IF run.status = 'success' AND run.slot IS NOT NULL THEN
            SELECT m.next_due, m.down_due INTO v_next, v_down
              FROM ledger.jobs j, ledger._due_marks(j.schedule_spec, j.time_zone, run.slot) m
             WHERE j.job = run.job AND j.schedule IS NOT NULL;
        END IF;
        -- Seats mode: the job's running run is then the newest one left
        -- (a single holder has none left: no read).
        IF seats THEN
            SELECT * INTO v_other FROM ledger.job_execution_log r
             WHERE r.job = run.job AND r.status = 'running'
             ORDER BY r.started_at DESC, r.run_id DESC LIMIT 1;
        END IF;
        -- Count once, note the run's end, and fold in the skips counted
        -- since (those whose rows no skipper holds right now; the rest wait
        -- for the next end).
        WITH folded AS (
            UPDATE ledger.skip_counts s SET skipped_overlap = 0
              FROM (SELECT t.job, t.shard, t.skipped_overlap FROM ledger.skip_counts t
                     WHERE t.job = run.job AND t.skipped_overlap > 0
                       FOR UPDATE SKIP LOCKED) pending
             WHERE s.job = pending.job AND s.shard = pending.shard
            RETURNING pending.skipped_overlap
        )
        UPDATE ledger.counters c SET
            successes               = c.successes + CASE WHEN run.status = 'success' THEN 1 ELSE 0 END,
            failures                = c.failures + CASE WHEN run.status = 'success' THEN 0 ELSE 1 END,
            leases_lost             = c.leases_lost + CASE WHEN event = 'lost' THEN 1 ELSE 0 END,
            skipped_overlap         = c.skipped_overlap + coalesce((SELECT sum(f.skipped_overlap) FROM folded f), 0),
            last_status             = CASE WHEN c.last_run_id = run.run_id THEN run.status ELSE c.last_status END,
            last_completed_at       = CASE WHEN c.last_run_id = run.run_id THEN run.completed_at
                                           ELSE c.last_completed_at END,
            running_run_id          = CASE WHEN c.running_run_id = run.run_id THEN v_other.run_id ELSE c.running_run_id END,
            running_token           = CASE WHEN c.running_run_id = run.run_id THEN v_other.token ELSE c.running_token END,
            running_started_at      = CASE WHEN c.running_run_id = run.run_id THEN v_other.started_at
                                           ELSE c.running_started_at END,
            last_success_started_at = CASE WHEN run.status = 'success'
                                            AND run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                           THEN run.started_at ELSE c.last_success_started_at END,
            last_success_at         = CASE WHEN run.status = 'success'
                                            AND run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                           THEN run.completed_at ELSE c.last_success_at END,
            done_slot               = CASE WHEN run.status = 'success' AND run.slot IS NOT NULL
                                           THEN greatest(c.done_slot, run.slot) ELSE c.done_slot END,
            -- a success that moves done_slot on moves the due marks on
            next_due                = CASE WHEN v_next IS NOT NULL AND run.slot > coalesce(c.done_slot, '-infinity')
                                           THEN v_next ELSE c.next_due END,
            down_due                = CASE WHEN v_next IS NOT NULL AND run.slot > coalesce(c.done_slot, '-infinity')
                                           THEN v_down ELSE c.down_due END,
            longest_success         = CASE WHEN run.status = 'success'
                                           THEN greatest(c.longest_success, run.completed_at - run.started_at)
                                           ELSE c.longest_success END,
            latest_end              = greatest(c.latest_end, run.completed_at),
            -- failures that started after the last success: none after this
            -- one; a cancel neither adds nor resets
            consecutive_failures    = CASE
                                          WHEN v_counts
                                          THEN c.consecutive_failures
                                               + CASE WHEN run.started_at > coalesce(c.last_success_started_at, '-infinity')
                                                      THEN 1 ELSE 0 END
                                          WHEN run.status = 'success'
                                           AND run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                          THEN 0
                                          ELSE c.consecutive_failures END
         WHERE c.job = run.job
        RETURNING c.consecutive_failures INTO v_streak;
        IF NOT FOUND THEN
            -- A run written past the functions, with no state row yet: one
            -- from the log, which has this end already.
            INSERT INTO ledger.counters AS c (job, successes, failures, leases_lost)
            VALUES (run.job, CASE WHEN run.status = 'success' THEN 1 ELSE 0 END,
                    CASE WHEN run.status = 'success' THEN 0 ELSE 1 END, CASE WHEN event = 'lost' THEN 1 ELSE 0 END);
            PERFORM ledger._set_state(run.job, 'recomputed');
            SELECT c.consecutive_failures INTO v_streak FROM ledger.counters c WHERE c.job = run.job;
        END IF;
        -- A failure may pause the job (pause_after_failures): one more
        -- statement on the failure path only, none on a success or a cancel.
        IF v_counts THEN
            PERFORM ledger._auto_pause(run.job, v_streak, run.completed_at);
        END IF;
    WHEN 'skipped_backfill' THEN
        UPDATE ledger.counters c SET skipped_backfill = c.skipped_backfill + slots WHERE c.job = _set_state.job;
    WHEN 'skipped_pool_full' THEN
        -- a start the job's pool did not admit (its caller holds the lease
        -- row, or the lock that stands for it)
        INSERT INTO ledger.counters AS c (job, skipped_pool_full) VALUES (_set_state.job, 1)
        ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET skipped_pool_full = c.skipped_pool_full + 1;
    WHEN 'skipped_deadline' THEN
        UPDATE ledger.counters c SET skipped_deadline = c.skipped_deadline + slots WHERE c.job = _set_state.job;
    WHEN 'forgotten' THEN
        DELETE FROM ledger.counters c WHERE c.job = _set_state.job;
        DELETE FROM ledger.purged_state p WHERE p.job = _set_state.job;
    WHEN 'recomputed' THEN
        INSERT INTO ledger.counters AS c (job) VALUES (_set_state.job)
        ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
        UPDATE ledger.counters c SET
            last_run_id = s.last_run_id, last_status = s.last_status, last_started_at = s.last_started_at,
            last_completed_at = s.last_completed_at, last_success_started_at = s.last_success_started_at,
            last_success_at = s.last_success_at, running_run_id = s.running_run_id,
            running_token = s.running_token, running_started_at = s.running_started_at,
            done_slot = s.done_slot, longest_success = s.longest_success,
            consecutive_failures = s.consecutive_failures, next_due = s.next_due, down_due = s.down_due,
            latest_end = s.latest_end, overlap_run_id = s.overlap_run_id
          FROM ledger._state_from_log(ARRAY[_set_state.job]) s
         WHERE c.job = _set_state.job;
    ELSE
        RAISE EXCEPTION 'ledger._set_state: unknown event %', event;
    END CASE;
END
$function$;

ALTER FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint,boolean) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint,boolean) FROM PUBLIC;

COMMENT ON FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint,boolean) IS NULL;

CREATE OR REPLACE FUNCTION ledger.acquire(job text, owner text, ttl interval DEFAULT NULL::interval)
 RETURNS SETOF ledger.lease
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_ttl      interval := ttl;
    v_timeline integer;
    v_lease    ledger.leases;
    v_state    text;
    v_took     record;
    v_now      timestamptz;
BEGIN
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
    END IF;
    IF v_ttl IS NULL THEN
        SELECT j.ttl INTO v_ttl FROM ledger.jobs j WHERE j.job = acquire.job;
    END IF;
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;

    -- Free, expired, released or already ours, and nobody else writing it:
    -- locked at once. Another owner's live lease is not locked (the WHERE
    -- fails first), and is read below without a lock.
    SELECT * INTO v_lease FROM ledger.leases l
     WHERE l.job = acquire.job
       AND (l.released_at IS NOT NULL OR l.expires_at <= ledger._now() OR l.owner = acquire.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = acquire.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now()
           AND v_lease.owner <> owner THEN
            RETURN;  -- held: no row, no lock, nothing written
        END IF;
        v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
        v_took := ledger._lock_lease(job, owner, v_ttl, v_timeline);
        v_lease := v_took.lease;
        v_state := v_took.state;
        IF v_state = 'created' THEN
            PERFORM ledger._set_state(job, 'leased');
            -- a first lease row of a job in a full pool: removed again (its
            -- token was never handed out, and no one else has seen the row)
            IF v_lease.pool IS NOT NULL AND NOT ledger._pool_admits(job, v_lease.pool) THEN
                DELETE FROM ledger.leases l WHERE l.job = acquire.job;
                PERFORM ledger._set_state(job, 'skipped_pool_full');
                RETURN;
            END IF;
            RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
            RETURN;
        ELSIF v_state <> 'locked' THEN
            RETURN;
        END IF;
    END IF;

    -- Seats mode: the row locked is the token counter; a seat is the lease.
    IF v_lease.multi THEN
        RETURN QUERY SELECT * FROM ledger._acquire_seat(job, owner, v_ttl, v_lease.pool);
        RETURN;
    END IF;

    -- POOL CHECK: before a token is issued (the lease row carries the
    -- job's pool; a job in none pays one test). Not admitted: no row.
    IF v_lease.pool IS NOT NULL AND NOT ledger._pool_admits(job, v_lease.pool) THEN
        PERFORM ledger._set_state(job, 'skipped_pool_full');
        RETURN;
    END IF;
    -- Locked, and free, expired or ours: take it with a new token. The
    -- clock is read once the row is locked: a caller that waited for the
    -- previous holder must not date its lease before that holder let go.
    v_now := ledger._now();
    v_timeline := coalesce(v_timeline,
        ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer);
    UPDATE ledger.leases l SET
        owner       = acquire.owner,
        -- ledger._next_token, inline
        token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                           ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
        ttl         = v_ttl,
        acquired_at = v_now,
        expires_at  = v_now + v_ttl,
        released_at = NULL,
        timeline    = v_timeline
     WHERE l.job = acquire.job
    RETURNING * INTO v_lease;
    -- A job that holds a lease is known (job_status lists it): its state row
    -- exists, or exists from now on (after unregister_job with history). The
    -- 'leased' transition only makes the row; a read under the lease row's
    -- lock (no other writer of this job's row can run) saves the call when
    -- the row is there, as it is for every job but a first or forgotten one.
    IF NOT EXISTS (SELECT FROM ledger.counters c WHERE c.job = acquire.job) THEN
        PERFORM ledger._set_state(job, 'leased');
    END IF;
    RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._free_seat(job text, at timestamp with time zone)
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_max  integer;
    v_live integer;
BEGIN
    SELECT j.max_concurrent INTO v_max FROM ledger.jobs j WHERE j.job = _free_seat.job;
    v_max := coalesce(v_max, 1);  -- unregistered: one seat
    -- the seats, locked in seat order (after the lease row, as every writer)
    PERFORM FROM ledger.lease_seats s WHERE s.job = _free_seat.job ORDER BY s.seat FOR UPDATE;
    SELECT count(*) INTO v_live FROM ledger.lease_seats s
     WHERE s.job = _free_seat.job AND s.released_at IS NULL AND s.expires_at > at;
    IF v_live >= v_max THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT g.n FROM generate_series(1, v_max) AS g(n)
             WHERE NOT EXISTS (SELECT FROM ledger.lease_seats s
                                WHERE s.job = _free_seat.job AND s.seat = g.n
                                  AND s.released_at IS NULL AND s.expires_at > at)
             ORDER BY g.n LIMIT 1);
END
$function$;

ALTER FUNCTION ledger._free_seat(text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._free_seat(text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._free_seat(text,timestamp with time zone) IS NULL;

CREATE OR REPLACE FUNCTION ledger._take_seat(job text, seat integer, owner text, ttl interval, at timestamp with time zone)
 RETURNS ledger.lease_seats
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_timeline integer;
    v_token    bigint;
    v_row      ledger.lease_seats;
BEGIN
    v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
    -- The row stays released: only the counter moves (ledger._next_token, inline).
    UPDATE ledger.leases l SET
        owner       = _take_seat.owner,
        token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                           ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
        ttl         = _take_seat.ttl,
        acquired_at = at,
        expires_at  = at,
        released_at = at,
        timeline    = v_timeline
     WHERE l.job = _take_seat.job
    RETURNING l.token INTO v_token;
    INSERT INTO ledger.lease_seats AS s (job, seat, owner, token, ttl, acquired_at, expires_at, released_at)
    VALUES (_take_seat.job, _take_seat.seat, _take_seat.owner, v_token, _take_seat.ttl, at, at + _take_seat.ttl, NULL)
    ON CONFLICT ON CONSTRAINT lease_seats_pkey DO UPDATE SET
        owner = excluded.owner, token = excluded.token, ttl = excluded.ttl,
        acquired_at = excluded.acquired_at, expires_at = excluded.expires_at, released_at = NULL, run_id = NULL
    RETURNING * INTO v_row;
    RETURN v_row;
END
$function$;

ALTER FUNCTION ledger._take_seat(text,integer,text,interval,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._take_seat(text,integer,text,interval,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._take_seat(text,integer,text,interval,timestamp with time zone) IS NULL;

CREATE OR REPLACE FUNCTION ledger._acquire_seat(job text, owner text, ttl interval, pool text)
 RETURNS SETOF ledger.lease
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now  timestamptz := ledger._now();
    v_free integer;
    v_seat ledger.lease_seats;
BEGIN
    -- a seat's lost run is closed before anyone takes the seat (as a start does)
    PERFORM ledger._close_lost_seats(job, v_now);
    v_free := ledger._free_seat(job, v_now);
    IF v_free IS NULL THEN
        RETURN;
    END IF;
    IF pool IS NOT NULL THEN
        IF NOT ledger._pool_admits(job, pool) THEN
            PERFORM ledger._set_state(job, 'skipped_pool_full');
            RETURN;
        END IF;
        v_now := ledger._now();  -- dated after the admission, as a single holder's
    END IF;
    v_seat := ledger._take_seat(job, v_free, owner, ttl, v_now);
    IF NOT EXISTS (SELECT FROM ledger.counters c WHERE c.job = _acquire_seat.job) THEN
        PERFORM ledger._set_state(job, 'leased');
    END IF;
    RETURN NEXT (v_seat.job, v_seat.owner, v_seat.token, v_seat.acquired_at, v_seat.expires_at)::ledger.lease;
END
$function$;

ALTER FUNCTION ledger._acquire_seat(text,text,interval,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._acquire_seat(text,text,interval,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._acquire_seat(text,text,interval,text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._live_seat(job text, token bigint)
 RETURNS ledger.lease_seats
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_seat ledger.lease_seats;
BEGIN
    SELECT * INTO v_seat FROM ledger.lease_seats s
     WHERE s.job = _live_seat.job AND s.token = _live_seat.token
       AND s.released_at IS NULL AND s.expires_at > ledger._now();
    RETURN v_seat;
END
$function$;

ALTER FUNCTION ledger._live_seat(text,bigint) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._live_seat(text,bigint) FROM PUBLIC;

COMMENT ON FUNCTION ledger._live_seat(text,bigint) IS NULL;

CREATE OR REPLACE FUNCTION ledger.renew(job text, owner text, token bigint, ttl interval DEFAULT NULL::interval)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_token(token);
    PERFORM ledger._check_ttl(ttl);

    -- Owner and token must both match: a stale holder can never extend the
    -- lease of whoever took over. An expired lease nobody took may be renewed.
    -- The ttl exact (ledger._exact): the expiry is not the session's TimeZone's.
    UPDATE ledger.leases l
       SET expires_at = ledger._now() + ledger._exact(coalesce(renew.ttl, l.ttl)),
           ttl        = ledger._exact(coalesce(renew.ttl, l.ttl))
     WHERE l.job = renew.job
       AND l.owner = renew.owner
       AND l.token = renew.token
       AND l.released_at IS NULL
    RETURNING l.expires_at INTO v_expires;
    IF NOT FOUND THEN
        -- Seats mode (or a lost lease): the seat that holds the token, under
        -- the job's lease row lock.
        PERFORM FROM ledger.leases l WHERE l.job = renew.job AND l.multi FOR UPDATE;
        IF FOUND THEN
            UPDATE ledger.lease_seats s
               SET expires_at = ledger._now() + ledger._exact(coalesce(renew.ttl, s.ttl)),
                   ttl        = ledger._exact(coalesce(renew.ttl, s.ttl))
             WHERE s.job = renew.job AND s.owner = renew.owner AND s.token = renew.token
               AND s.released_at IS NULL
            RETURNING s.expires_at INTO v_expires;
        END IF;
    END IF;
    RETURN v_expires;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.release(job text, owner text, token bigint)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now timestamptz := ledger._now();
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_token(token);

    -- The token stays in the row: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at  = least(l.expires_at, v_now),
           released_at = v_now
     WHERE l.job = release.job
       AND l.owner = release.owner
       AND l.token = release.token
       AND l.released_at IS NULL;
    IF FOUND THEN
        RETURN true;
    END IF;
    -- Seats mode: the seat that holds the token, under the lease row lock.
    PERFORM FROM ledger.leases l WHERE l.job = release.job AND l.multi FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE ledger.lease_seats s
       SET expires_at  = least(s.expires_at, v_now),
           released_at = v_now
     WHERE s.job = release.job AND s.owner = release.owner AND s.token = release.token
       AND s.released_at IS NULL;
    -- a seat freed wakes the job and its pool (trigger lease_seats_wake)
    RETURN FOUND;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.is_current(job text, token bigint)
 RETURNS boolean
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_token(token);
    RETURN EXISTS (
        SELECT FROM ledger.leases l
         WHERE l.job = is_current.job
           AND l.token = is_current.token
           AND l.released_at IS NULL
           AND l.expires_at > ledger._now())
        -- seats mode: a live seat with the token
        OR EXISTS (
        SELECT FROM ledger.lease_seats s
         WHERE s.job = is_current.job
           AND s.token = is_current.token
           AND s.released_at IS NULL
           AND s.expires_at > ledger._now());
END
$function$;

CREATE OR REPLACE FUNCTION ledger._assert_live(job text, token bigint)
 RETURNS void
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_lease ledger.leases;
BEGIN
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _assert_live.job;
    IF v_lease.token = token AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now() THEN
        RETURN;
    END IF;
    -- Seats mode: a live seat with the token (each holder its own token).
    IF v_lease.multi AND (ledger._live_seat(job, token)).job IS NOT NULL THEN
        RETURN;
    END IF;
    PERFORM ledger._raise('LD001',
        format('lease superseded: token %s is not the current lease of job %s', token, job),
        jsonb_build_object(
            'job', job,
            'token', token,
            'current_token', v_lease.token,
            'holder', v_lease.owner,
            'expires_at', v_lease.expires_at,
            'released', v_lease.released_at IS NOT NULL));
END
$function$;

CREATE OR REPLACE FUNCTION ledger._pool_used(pool text, job text DEFAULT NULL::text)
 RETURNS integer
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN (SELECT count(*) FROM ledger._pool_holders h
             WHERE h.pool = _pool_used.pool
               AND (h.job IS DISTINCT FROM _pool_used.job OR h.seat IS NOT NULL)
               AND h.released_at IS NULL AND h.expires_at > ledger._now());
END
$function$;

CREATE OR REPLACE FUNCTION ledger._start(job text, owner text, ttl interval, slot timestamp with time zone, idempotency_key text, detail jsonb)
 RETURNS ledger.run_start
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now      timestamptz;
    v_timeline integer;
    v_lease    ledger.leases;
    v_state    text := 'locked';
    v_took     record;
    v_running  ledger.job_execution_log;
    v_result   ledger.run_start;
BEGIN
    v_result.slot := slot;
    SELECT * INTO v_lease FROM ledger.leases l
     WHERE l.job = _start.job
       AND (l.released_at IS NOT NULL OR l.expires_at <= ledger._now() OR l.owner = _start.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _start.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now()
           AND v_lease.owner <> owner THEN
            v_state := 'held';
        ELSE
            v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
            v_took := ledger._lock_lease(job, owner, ttl, v_timeline);
            v_lease := v_took.lease;
            v_state := v_took.state;
        END IF;
    END IF;

    IF v_state IN ('held', 'busy') THEN
        -- That slot or key already succeeded or is running (wins over overlap).
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- Another owner's live lease (or a row another transaction holds
        -- past the lock bound): a normal skip, counted apart from failures,
        -- without a WAL flush.
        UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + 1
          FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                 WHERE t.job = _start.job AND t.shard = pg_backend_pid() % 16
                   FOR UPDATE SKIP LOCKED) free_
         WHERE s.job = free_.job AND s.shard = free_.shard;
        IF NOT FOUND THEN
            PERFORM ledger._count_skip(job, wait => CASE v_state WHEN 'held' THEN ledger._lock_wait() ELSE '10ms' END);
        END IF;
        v_result.outcome := 'skipped_overlap';
        v_result.holder := v_lease.owner;
        v_result.holder_expires_at := v_lease.expires_at;
        RETURN v_result;
    END IF;

    IF v_state = 'locked' THEN
        -- Read the clock once locked: a start that waited for the previous
        -- run to end must not date itself before that end.
        v_now := ledger._now();
        -- Seats mode: the row locked is the token counter, kept released.
        IF v_lease.multi THEN
            RETURN ledger._start_seat(job, owner, ttl, slot, idempotency_key, detail, v_now, v_lease.pool);
        END IF;
        -- The previous run, still running while its lease expired, ended
        -- or went to another token? Its runner is gone or a zombie: close
        -- it (counted once, in ledger._close_lost).
        SELECT * INTO v_running FROM ledger.job_execution_log r
         WHERE r.job = _start.job AND r.status = 'running';
        IF FOUND AND (v_lease.token <> v_running.token
                      OR v_lease.released_at IS NOT NULL
                      OR v_lease.expires_at <= v_now) THEN
            PERFORM ledger._close_lost(v_running,
                CASE WHEN v_lease.token <> v_running.token THEN 'superseded' ELSE 'lease_expired' END, v_now);
            v_running := NULL;
        END IF;
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- POOL CHECK: before a token is issued (the lease row carries the
        -- job's pool; a job in none pays one test)
        IF v_lease.pool IS NOT NULL THEN
            IF NOT ledger._pool_admits(job, v_lease.pool) THEN
                RETURN ledger._pool_full(job, slot);
            END IF;
            -- dated after the admission, so the log shows no more runs of
            -- the pool at once than it admitted (the place it took was
            -- freed by a run whose end committed before the count)
            v_now := ledger._now();
        END IF;
        -- The same owner still holds it: the new token wins.
        IF v_running.run_id IS NOT NULL THEN
            PERFORM ledger._close_lost(v_running, 'superseded', v_now);
        END IF;
        v_timeline := coalesce(v_timeline,
            ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer);
        UPDATE ledger.leases l SET
            owner       = _start.owner,
            -- ledger._next_token, inline
            token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                               ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
            ttl         = _start.ttl,
            acquired_at = v_now,
            expires_at  = v_now + _start.ttl,
            released_at = NULL,
            timeline    = v_timeline
         WHERE l.job = _start.job
        RETURNING * INTO v_lease;
    END IF;
    -- A first lease row, made by ledger._lock_lease in this transaction, of
    -- a job in a full pool: removed again (its token was never handed out,
    -- and no run, fence or other transaction has seen it).
    IF v_state = 'created' AND v_lease.pool IS NOT NULL THEN
        IF NOT ledger._pool_admits(job, v_lease.pool) THEN
            DELETE FROM ledger.leases l WHERE l.job = _start.job;
            RETURN ledger._pool_full(job, slot);
        END IF;
        v_now := ledger._now();  -- dated after the admission, as below
        UPDATE ledger.leases l SET acquired_at = v_now, expires_at = v_now + _start.ttl
         WHERE l.job = _start.job
        RETURNING * INTO v_lease;
    END IF;
    -- 'created' (a job with no lease row has no runs: nothing to check) or
    -- taken just now: log the running run, and the job's 'started'
    -- transition counts it and notes it as the job's last and running run.
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail)
    VALUES (v_lease.job, v_lease.owner, v_lease.token, _start.slot, _start.idempotency_key,
            'running', v_lease.acquired_at, v_lease.acquired_at, _start.detail)
    RETURNING * INTO v_running;
    PERFORM ledger._set_state(v_lease.job, 'started', v_running);
    v_result.run_id := v_running.run_id;
    v_result.outcome := 'started';
    v_result.token := v_lease.token;
    v_result.expires_at := v_lease.expires_at;
    RETURN v_result;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._start_seat(job text, owner text, ttl interval, slot timestamp with time zone, idempotency_key text, detail jsonb, at timestamp with time zone, pool text)
 RETURNS ledger.run_start
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_run    ledger.job_execution_log;
    v_free   integer;
    v_seat   ledger.lease_seats;
    v_result ledger.run_start;
BEGIN
    v_result.slot := slot;
    PERFORM ledger._close_lost_seats(job, at);
    IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
       AND ledger._already_done(job, slot, idempotency_key) THEN
        v_result.outcome := 'already_done';
        RETURN v_result;
    END IF;
    v_free := ledger._free_seat(job, at);
    IF v_free IS NULL THEN
        -- every seat live: a skip, counted apart from failures, without a WAL flush
        PERFORM ledger._count_skip(job, wait => '10ms');
        -- the holder whose seat frees first
        SELECT s.owner, s.expires_at INTO v_result.holder, v_result.holder_expires_at
          FROM ledger.lease_seats s
         WHERE s.job = _start_seat.job AND s.released_at IS NULL AND s.expires_at > at
         ORDER BY s.expires_at, s.seat LIMIT 1;
        v_result.outcome := 'skipped_overlap';
        RETURN v_result;
    END IF;
    -- a seat is free: the job's own limit allows the run, now its pool's
    IF pool IS NOT NULL THEN
        IF NOT ledger._pool_admits(job, pool) THEN
            RETURN ledger._pool_full(job, slot);
        END IF;
        at := ledger._now();  -- dated after the admission, as a single holder's
    END IF;
    v_seat := ledger._take_seat(job, v_free, owner, ttl, at);
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail, seat)
    VALUES (v_seat.job, v_seat.owner, v_seat.token, _start_seat.slot, _start_seat.idempotency_key,
            'running', v_seat.acquired_at, v_seat.acquired_at, _start_seat.detail, v_seat.seat)
    RETURNING * INTO v_run;
    UPDATE ledger.lease_seats s SET run_id = v_run.run_id WHERE s.job = v_seat.job AND s.seat = v_seat.seat;
    PERFORM ledger._set_state(v_seat.job, 'started', v_run);
    v_result.run_id := v_run.run_id;
    v_result.outcome := 'started';
    v_result.token := v_seat.token;
    v_result.expires_at := v_seat.expires_at;
    RETURN v_result;
END
$function$;

ALTER FUNCTION ledger._start_seat(text,text,interval,timestamp with time zone,text,jsonb,timestamp with time zone,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._start_seat(text,text,interval,timestamp with time zone,text,jsonb,timestamp with time zone,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._start_seat(text,text,interval,timestamp with time zone,text,jsonb,timestamp with time zone,text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._close_lost_seats(job text, at timestamp with time zone)
 RETURNS integer
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_run    ledger.job_execution_log;
    v_seat   ledger.lease_seats;
    v_closed integer := 0;
BEGIN
    PERFORM FROM ledger.lease_seats s WHERE s.job = _close_lost_seats.job ORDER BY s.seat FOR UPDATE;
    FOR v_run IN SELECT r.* FROM ledger.job_execution_log r
                  WHERE r.job = _close_lost_seats.job AND r.status = 'running' ORDER BY r.seat LOOP
        SELECT * INTO v_seat FROM ledger.lease_seats s WHERE s.job = v_run.job AND s.seat = v_run.seat;
        CONTINUE WHEN v_seat.job IS NOT NULL AND v_seat.token = v_run.token
                      AND v_seat.released_at IS NULL AND v_seat.expires_at > at;
        PERFORM ledger._close_lost(v_run, CASE WHEN v_seat.job IS NULL OR v_seat.token <> v_run.token
                                               THEN 'superseded' ELSE 'lease_expired' END, at, true);
        UPDATE ledger.lease_seats s SET released_at = at, expires_at = least(s.expires_at, at)
         WHERE s.job = v_run.job AND s.seat = v_run.seat AND s.token = v_run.token AND s.released_at IS NULL;
        v_closed := v_closed + 1;
    END LOOP;
    RETURN v_closed;
END
$function$;

ALTER FUNCTION ledger._close_lost_seats(text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._close_lost_seats(text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._close_lost_seats(text,timestamp with time zone) IS NULL;

CREATE OR REPLACE FUNCTION ledger.heartbeat(run_id bigint, token bigint, ttl interval DEFAULT NULL::interval)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_run   ledger.job_execution_log;
    v_lease ledger.leases;
    v_now   timestamptz;
BEGIN
    IF ttl IS NOT NULL THEN  -- NULL is valid (the lease's own ttl): no call for it
        PERFORM ledger._check_ttl(ttl);
    END IF;
    v_run := ledger._lock_run(run_id, token);
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_run.job;

    IF v_run.status <> 'running' THEN
        -- Closed by a takeover, the reaper or an operator's cancel request:
        -- that is a lost lease, not a misuse.
        IF v_run.failure_reason IN ('lease_expired', 'superseded')
           OR (v_run.failure_reason = 'cancelled' AND v_run.cancel_requested_at IS NOT NULL) THEN
            RETURN NULL;
        END IF;
        PERFORM ledger._raise_not_running(v_run);
    END IF;
    IF v_lease.multi THEN
        RETURN ledger._heartbeat_seat(v_run, heartbeat.ttl);
    END IF;
    IF v_lease.token <> v_run.token OR v_lease.released_at IS NOT NULL THEN
        RETURN NULL;
    END IF;
    -- An operator asked the run to stop (ledger.request_cancel): end it as
    -- cancelled, release the lease, and tell the holder it lost the lease.
    IF v_run.cancel_requested_at IS NOT NULL THEN
        PERFORM ledger._end_run(v_run.run_id, v_run.token, 'failure', 'cancelled',
                                format('cancelled by an operator (ledger.request_cancel at %s)',
                                       v_run.cancel_requested_at), NULL);
        RETURN NULL;
    END IF;

    v_now := ledger._now();
    UPDATE ledger.leases l
       SET expires_at = v_now + ledger._exact(coalesce(heartbeat.ttl, l.ttl)),
           ttl        = ledger._exact(coalesce(heartbeat.ttl, l.ttl))
     WHERE l.job = v_run.job
    RETURNING l.expires_at INTO v_lease.expires_at;
    UPDATE ledger.job_execution_log r SET heartbeat_at = v_now WHERE r.run_id = v_run.run_id;
    RETURN v_lease.expires_at;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._heartbeat_seat(run ledger.job_execution_log, ttl interval)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_seat ledger.lease_seats;
    v_now  timestamptz;
BEGIN
    SELECT * INTO v_seat FROM ledger.lease_seats s WHERE s.job = run.job AND s.seat = run.seat FOR UPDATE;
    IF v_seat.job IS NULL OR v_seat.token <> run.token OR v_seat.released_at IS NOT NULL THEN
        RETURN NULL;
    END IF;
    IF run.cancel_requested_at IS NOT NULL THEN
        PERFORM ledger._end_run(run.run_id, run.token, 'failure', 'cancelled',
                                format('cancelled by an operator (ledger.request_cancel at %s)',
                                       run.cancel_requested_at), NULL);
        RETURN NULL;
    END IF;
    v_now := ledger._now();
    UPDATE ledger.lease_seats s
       SET expires_at = v_now + ledger._exact(coalesce(_heartbeat_seat.ttl, s.ttl)),
           ttl        = ledger._exact(coalesce(_heartbeat_seat.ttl, s.ttl))
     WHERE s.job = run.job AND s.seat = run.seat
    RETURNING s.expires_at INTO v_seat.expires_at;
    UPDATE ledger.job_execution_log r SET heartbeat_at = v_now WHERE r.run_id = run.run_id;
    RETURN v_seat.expires_at;
END
$function$;

ALTER FUNCTION ledger._heartbeat_seat(ledger.job_execution_log,interval) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._heartbeat_seat(ledger.job_execution_log,interval) FROM PUBLIC;

COMMENT ON FUNCTION ledger._heartbeat_seat(ledger.job_execution_log,interval) IS NULL;

CREATE OR REPLACE FUNCTION ledger._end_run(run_id bigint, token bigint, status text, failure_reason text, error text, detail jsonb)
 RETURNS ledger.job_execution_log
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job    ledger.label;
    v_run    ledger.job_execution_log;
    v_lease  ledger.leases;
    v_seat   ledger.lease_seats;
    v_detail jsonb;
    v_error  text := CASE WHEN error IS NULL OR char_length(error) <= ledger._max_error_length() THEN error
                          ELSE ledger._bounded_error(error) END;
BEGIN
    IF detail IS NOT NULL THEN
        PERFORM ledger._check_detail(detail);
    END IF;
    IF run_id IS NULL OR token IS NULL OR run_id <= 0 OR token <= 0 THEN
        PERFORM ledger._check_token(run_id, 'run_id');
        PERFORM ledger._check_token(token);
    END IF;
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    -- The per-job order every writer follows: the lease row first.
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;

    IF detail IS NULL THEN
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(ledger._now(), r.started_at)
         WHERE r.run_id = _end_run.run_id AND r.token = _end_run.token
           AND r.token = v_lease.token AND r.status = 'running' AND NOT v_lease.multi
        RETURNING * INTO v_run;
    END IF;
    IF v_run.run_id IS NULL THEN
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
        IF NOT FOUND THEN  -- purged or unregistered while this call waited for the lease row
            PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
                jsonb_build_object('run_id', run_id));
        END IF;
        IF v_run.token <> token THEN
            PERFORM ledger._raise('LD001',
                format('lease superseded: run %s holds token %s, not %s', run_id, v_run.token, token),
                jsonb_build_object('run_id', run_id, 'job', v_run.job, 'token', token,
                                   'run_token', v_run.token));
        END IF;
        -- Seats mode: the run's seat is its lease.
        IF v_lease.multi THEN
            SELECT * INTO v_seat FROM ledger.lease_seats s
             WHERE s.job = v_run.job AND s.seat = v_run.seat FOR UPDATE;
            IF v_seat.job IS NULL OR v_seat.token <> v_run.token THEN
                PERFORM ledger._raise('LD001',
                    format('lease superseded: seat %s of job %s is now held with token %s, run %s had token %s',
                           v_run.seat, v_run.job, v_seat.token, v_run.run_id, v_run.token),
                    jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                       'seat', v_run.seat, 'current_token', v_seat.token,
                                       'holder', v_seat.owner, 'verdict', v_run.failure_reason));
            END IF;
        -- A newer token took the job over: the zombie learns it lost, and the
        -- row keeps the takeover's verdict.
        ELSIF v_lease.token <> v_run.token THEN
            PERFORM ledger._raise('LD001',
                format('lease superseded: job %s is now held with token %s, run %s had token %s',
                       v_run.job, v_lease.token, v_run.run_id, v_run.token),
                jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                   'current_token', v_lease.token, 'holder', v_lease.owner,
                                   'verdict', v_run.failure_reason));
        END IF;
        IF v_run.status <> 'running' THEN
            PERFORM ledger._raise_not_running(v_run);
        END IF;
        -- The detail recorded is the start's merged with this one (its keys
        -- win), and the merge is held to the same bound as either part: two
        -- details of 40 kB each would otherwise record 80 kB.
        IF detail IS NOT NULL THEN
            v_detail := coalesce(v_run.detail, '{}'::jsonb) || detail;
            IF octet_length(v_detail::text) > ledger._max_detail_bytes() THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('argument detail, merged with the detail run %s started with, must be at most '
                                     '%s bytes as JSON text', v_run.run_id, ledger._max_detail_bytes()),
                    DETAIL = jsonb_build_object('argument', 'detail', 'run_id', v_run.run_id,
                                                'bytes', octet_length(v_detail::text),
                                                'given_bytes', octet_length(detail::text),
                                                'recorded_bytes', octet_length(v_run.detail::text),
                                                'max', ledger._max_detail_bytes())::text;
            END IF;
        END IF;
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(ledger._now(), r.started_at),
            detail         = coalesce(v_detail, r.detail)
         WHERE r.run_id = v_run.run_id
        RETURNING * INTO v_run;
    END IF;

    IF v_lease.multi THEN
        -- the seat ends with its run (which wakes the job and its pool:
        -- trigger lease_seats_wake)
        UPDATE ledger.lease_seats s
           SET expires_at = least(s.expires_at, v_run.completed_at),
               released_at = coalesce(s.released_at, v_run.completed_at), run_id = NULL
         WHERE s.job = v_run.job AND s.seat = v_run.seat AND s.token = v_run.token;
        PERFORM ledger._set_state(v_run.job, 'ended', v_run, seats => true);
        RETURN v_run;
    END IF;
    -- The token stays: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at = least(l.expires_at, v_run.completed_at), released_at = v_run.completed_at
     WHERE l.job = v_run.job AND l.released_at IS NULL;
    -- Counted, noted as the job's state, and the pending skips folded in,
    -- by the job's one writer.
    PERFORM ledger._set_state(v_run.job, 'ended', v_run);
    RETURN v_run;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.reap_expired(job text DEFAULT NULL::text)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now    timestamptz := ledger._now();
    v_closed integer := 0;
    v_lease  ledger.leases;
    v_run    ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_label(job, 'job', false);
    -- SKIP LOCKED: a job whose lease row is locked is being started, renewed
    -- or ended right now, and that writer settles it; concurrent reapers
    -- split the work instead of waiting on each other. FOR UPDATE returns the
    -- row as locked, so the expiry tested below is current, not a snapshot.
    FOR v_lease IN
        SELECT l.* FROM ledger.leases l
         WHERE (reap_expired.job IS NULL OR l.job = reap_expired.job)
           AND EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = l.job AND r.status = 'running')
           FOR UPDATE OF l SKIP LOCKED
    LOOP
        IF v_lease.multi THEN
            v_closed := v_closed + ledger._close_lost_seats(v_lease.job, v_now);
            CONTINUE;
        END IF;
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.job = v_lease.job AND r.status = 'running';
        CONTINUE WHEN NOT FOUND
                   OR (v_lease.token = v_run.token AND v_lease.released_at IS NULL AND v_lease.expires_at > v_now);
        -- closed, counted and noted (a failure that may pause the job), by
        -- the job's 'lost' transition
        PERFORM ledger._close_lost(v_run, CASE WHEN v_lease.token <> v_run.token THEN 'superseded'
                                               ELSE 'lease_expired' END, v_now);
        -- A reaped lease is over: its late holder may not renew it.
        UPDATE ledger.leases l SET released_at = v_now, expires_at = least(l.expires_at, v_now)
         WHERE l.job = v_lease.job AND l.token = v_run.token AND l.released_at IS NULL;
        v_closed := v_closed + 1;
    END LOOP;
    RETURN v_closed;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.register_job(job text, schedule text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, max_backfill integer DEFAULT NULL::integer, time_zone text DEFAULT NULL::text, late_after interval DEFAULT NULL::interval, down_after interval DEFAULT NULL::interval, min_runtime interval DEFAULT NULL::interval, max_runtime interval DEFAULT NULL::interval, pause_after_failures integer DEFAULT NULL::integer, jitter interval DEFAULT NULL::interval, start_deadline interval DEFAULT NULL::interval, overlap_policy text DEFAULT NULL::text, pool text DEFAULT NULL::text, max_concurrent integer DEFAULT NULL::integer)
 RETURNS ledger.jobs
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_spec  ledger.schedule_spec;
    v_old   ledger.jobs;
    v_job   ledger.jobs;
    v_ahead timestamptz;  -- the newest slot done
    v_new   boolean;
    v_lease ledger.leases;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    -- a pool's name, or '' for none (NULL keeps the job's)
    IF pool <> '' THEN
        PERFORM ledger._check_label(pool, 'pool');
    END IF;
    IF max_concurrent < 1 OR max_concurrent > ledger._max_concurrent() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_concurrent must be from 1 to %s', ledger._max_concurrent()),
            DETAIL = jsonb_build_object('argument', 'max_concurrent', 'value', max_concurrent,
                                        'max', ledger._max_concurrent())::text;
    END IF;
    IF max_backfill < 1 OR max_backfill > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_backfill must be from 1 to %s', ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'max_backfill', 'value', max_backfill,
                                        'max', ledger._max_backfill())::text;
    END IF;
    PERFORM ledger._check_ttl(ttl);
    IF time_zone IS NOT NULL THEN
        PERFORM ledger._check_time_zone(time_zone);
    END IF;
    PERFORM ledger._check_health_bound(late_after, 'late_after');
    PERFORM ledger._check_health_bound(down_after, 'down_after');
    PERFORM ledger._check_health_bound(min_runtime, 'min_runtime');
    PERFORM ledger._check_health_bound(max_runtime, 'max_runtime');
    IF pause_after_failures < 0 OR pause_after_failures > ledger._max_pause_after_failures() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument pause_after_failures must be from 0 (never) to %s',
                             ledger._max_pause_after_failures()),
            DETAIL = jsonb_build_object('argument', 'pause_after_failures', 'value', pause_after_failures,
                                        'max', ledger._max_pause_after_failures())::text;
    END IF;
    PERFORM ledger._check_health_bound(start_deadline, 'start_deadline');
    PERFORM ledger._check_overlap_policy(overlap_policy);
    -- jitter's bounds without the schedule first (its gap is checked below)
    PERFORM ledger._check_jitter(jitter, NULL, NULL, NULL);

    -- The per-job order every writer follows: the lease row first (when the
    -- job has none: the registration, ledger._lock_registration), then the
    -- registration as it is, locked (a first one: created, then locked). FOR NO KEY UPDATE, as the UPDATE below would: a
    -- start's foreign key checks (FOR KEY SHARE) on this row must never wait
    -- on a registration.
    v_lease := ledger._lock_registration(register_job.job);
    SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = register_job.job FOR NO KEY UPDATE;
    v_new := NOT FOUND;
    IF v_new THEN
        INSERT INTO ledger.jobs AS j (job) VALUES (register_job.job)
        ON CONFLICT ON CONSTRAINT jobs_pkey DO NOTHING;
        SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = register_job.job FOR NO KEY UPDATE;
    END IF;
    v_job := v_old;
    v_job.schedule := coalesce(register_job.schedule, v_old.schedule);
    v_job.time_zone := coalesce(register_job.time_zone, v_old.time_zone);
    v_job.ttl := coalesce(ledger._exact(register_job.ttl), v_old.ttl);
    v_job.max_backfill := coalesce(register_job.max_backfill, v_old.max_backfill);
    v_job.late_after := CASE WHEN register_job.late_after IS NULL THEN v_old.late_after
                             ELSE nullif(ledger._exact(register_job.late_after), interval '0') END;
    v_job.down_after := CASE WHEN register_job.down_after IS NULL THEN v_old.down_after
                             ELSE nullif(ledger._exact(register_job.down_after), interval '0') END;
    v_job.min_runtime := CASE WHEN register_job.min_runtime IS NULL THEN v_old.min_runtime
                              ELSE nullif(ledger._exact(register_job.min_runtime), interval '0') END;
    v_job.max_runtime := CASE WHEN register_job.max_runtime IS NULL THEN v_old.max_runtime
                              ELSE nullif(ledger._exact(register_job.max_runtime), interval '0') END;
    v_job.pause_after_failures := CASE WHEN register_job.pause_after_failures IS NULL THEN v_old.pause_after_failures
                                       ELSE nullif(register_job.pause_after_failures, 0) END;
    v_job.jitter := CASE WHEN register_job.jitter IS NULL THEN v_old.jitter
                         ELSE nullif(ledger._exact(register_job.jitter), interval '0') END;
    v_job.start_deadline := CASE WHEN register_job.start_deadline IS NULL THEN v_old.start_deadline
                                 ELSE nullif(ledger._exact(register_job.start_deadline), interval '0') END;
    v_job.overlap_policy := coalesce(register_job.overlap_policy, v_old.overlap_policy);
    v_job.pool := CASE WHEN register_job.pool IS NULL THEN v_old.pool ELSE nullif(register_job.pool, '') END;
    IF v_job.pool IS DISTINCT FROM v_old.pool AND v_job.pool IS NOT NULL THEN
        PERFORM ledger._registered_pool(v_job.pool);  -- LD008 (the row's foreign key holds it from here)
    END IF;
    v_job.max_concurrent := coalesce(register_job.max_concurrent, v_old.max_concurrent);
    -- replace and buffer_one speak of the one running run: not with seats
    -- (nor for a job in seats mode whose max_concurrent went back to 1)
    IF (v_job.max_concurrent > 1 OR coalesce(v_lease.multi, false))
       AND v_job.overlap_policy IN ('replace', 'buffer_one') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s: overlap_policy %s needs max_concurrent 1 (job %s would have '
                             'overlap_policy %s and max_concurrent %s); use catch_up or skip',
                             CASE WHEN register_job.overlap_policy IS NOT NULL THEN 'overlap_policy'
                                  ELSE 'max_concurrent' END,
                             v_job.overlap_policy, job, v_job.overlap_policy, v_job.max_concurrent),
            DETAIL = jsonb_build_object('argument', CASE WHEN register_job.overlap_policy IS NOT NULL
                                                         THEN 'overlap_policy' ELSE 'max_concurrent' END,
                                        'overlap_policy', v_job.overlap_policy,
                                        'max_concurrent', v_job.max_concurrent)::text;
    END IF;
    IF v_job.schedule IS NOT NULL THEN
        -- parsed once, here: the spec depends on the schedule and the zone
        v_spec := ledger._parse_schedule(v_job.schedule, v_job.time_zone);
        -- the jitter, given or kept, stays under the schedule's gaps
        IF v_job.jitter IS NOT NULL
           AND (register_job.jitter IS NOT NULL OR register_job.schedule IS NOT NULL OR register_job.time_zone IS NOT NULL) THEN
            PERFORM ledger._check_jitter(v_job.jitter, v_spec, v_job.time_zone, ledger._now());
        END IF;
    END IF;
    IF register_job.schedule IS NOT NULL THEN
        -- An unscheduled job takes any slot, also one years ahead. Catch-up
        -- starts after the newest slot done (ledger._newest_done_slot, and
        -- ledger.purged_slots answers already_done up to its mark), so a
        -- schedule given now would have nothing due until that slot passed:
        -- the job would fall silent without an alert. Refuse it instead.
        v_ahead := greatest(
            (SELECT max(r.slot) FROM ledger.job_execution_log r
              WHERE r.job = register_job.job AND r.status IN ('running', 'success')),
            (SELECT p.done_through FROM ledger.purged_slots p WHERE p.job = register_job.job));
        IF v_ahead > ledger._now() THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument schedule cannot be given to job %s: its slot %s succeeded or is running, '
                                 'and is in the future, so no slot would be due before it; register the schedule '
                                 'once that slot has passed, or under another job name', job, v_ahead),
                DETAIL = jsonb_build_object('argument', 'schedule', 'job', job, 'value', schedule,
                                            'slot', v_ahead, 'now', ledger._now())::text;
        END IF;
    END IF;

    UPDATE ledger.jobs j SET
        schedule             = v_job.schedule,
        time_zone            = v_job.time_zone,
        ttl                  = v_job.ttl,
        max_backfill         = v_job.max_backfill,
        schedule_spec        = v_spec,
        late_after           = v_job.late_after,
        down_after           = v_job.down_after,
        min_runtime          = v_job.min_runtime,
        max_runtime          = v_job.max_runtime,
        pause_after_failures = v_job.pause_after_failures,
        jitter               = v_job.jitter,
        start_deadline       = v_job.start_deadline,
        overlap_policy       = v_job.overlap_policy,
        pool                 = v_job.pool,
        max_concurrent       = v_job.max_concurrent,
        updated_at           = CASE WHEN v_new THEN j.updated_at ELSE ledger._now() END
     WHERE j.job = register_job.job
    RETURNING * INTO v_job;
    -- seats first: a lease row it makes takes the pool's copy below
    IF v_job.max_concurrent > 1 AND NOT coalesce(v_lease.multi, false) THEN
        PERFORM ledger._enter_seats(register_job.job, v_lease);
    END IF;
    IF v_job.pool IS DISTINCT FROM v_old.pool THEN
        -- the copy on the lease row, under its lock (taken above)
        UPDATE ledger.leases l SET pool = v_job.pool WHERE l.job = register_job.job;
        IF v_old.pool IS NOT NULL THEN
            PERFORM ledger._wake_pool(v_old.pool);  -- a place there may have freed
        END IF;
        UPDATE ledger.wakeups w SET at = least(w.at, w.waiting_since), pool_wait = NULL, waiting_since = NULL
         WHERE w.job = register_job.job AND w.pool_wait IS NOT NULL;
    END IF;
    -- The job's state row: its due marks follow the schedule as it is now.
    PERFORM ledger._set_state(register_job.job, 'registration');
    PERFORM pg_notify('ledger_scheduler', register_job.job);
    RETURN v_job;
END
$function$;

ALTER FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text,text,integer) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text,text,integer) FROM PUBLIC;

COMMENT ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text,text,integer) IS 'Register a job or change the options given: schedule, default ttl, catch-up bound, time zone, health bounds, jitter, start deadline, overlap policy, pool, max concurrent runs';

GRANT EXECUTE ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text,text,integer) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._enter_seats(job text, lease ledger.leases)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now      timestamptz := ledger._now();
    v_timeline integer;
BEGIN
    IF lease.job IS NULL THEN
        v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
        INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, released_at, timeline,
                                   pool, multi)
        VALUES (_enter_seats.job, _enter_seats.job, ledger._next_token(NULL, NULL, v_timeline),
                interval '1 second', v_now, v_now, v_now, v_timeline,
                (SELECT j.pool FROM ledger.jobs j WHERE j.job = _enter_seats.job), true);
        RETURN;
    END IF;
    INSERT INTO ledger.lease_seats (job, seat, owner, token, ttl, acquired_at, expires_at, released_at, run_id)
    VALUES (lease.job, 1, lease.owner, lease.token, lease.ttl, lease.acquired_at, lease.expires_at,
            lease.released_at,
            (SELECT r.run_id FROM ledger.job_execution_log r
              WHERE r.job = lease.job AND r.status = 'running' AND r.token = lease.token));
    UPDATE ledger.leases l
       SET multi = true, released_at = coalesce(l.released_at, greatest(v_now, l.acquired_at)),
           expires_at = least(l.expires_at, coalesce(l.released_at, greatest(v_now, l.acquired_at)))
     WHERE l.job = lease.job;
END
$function$;

ALTER FUNCTION ledger._enter_seats(text,ledger.leases) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._enter_seats(text,ledger.leases) FROM PUBLIC;

COMMENT ON FUNCTION ledger._enter_seats(text,ledger.leases) IS NULL;

CREATE OR REPLACE FUNCTION ledger.unregister_job(job text, with_history boolean DEFAULT false)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_lease   ledger.leases;
    v_running ledger.job_execution_log;
    v_found   boolean;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF with_history IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument with_history must not be null';
    END IF;
    v_lease := ledger._lock_registration(unregister_job.job);
    IF NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = unregister_job.job)
       AND (NOT with_history OR v_lease.job IS NULL) THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
            jsonb_build_object('job', job));
    END IF;
    -- live: its token is the lease's (seats mode: its seat's), and that is live
    SELECT r.* INTO v_running FROM ledger.job_execution_log r
      LEFT JOIN ledger.lease_seats s ON v_lease.multi AND s.job = r.job AND s.seat = r.seat
     WHERE r.job = unregister_job.job AND r.status = 'running'
       AND CASE WHEN v_lease.multi THEN s.token = r.token AND s.released_at IS NULL AND s.expires_at > ledger._now()
                ELSE v_lease.token = r.token AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now() END
     LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument job names %s, whose run %s is live: cancel it (ledger.request_cancel) or '
                             'force-release its lease (ledger.force_release) first', job, v_running.run_id),
            DETAIL = jsonb_build_object('argument', 'job', 'job', job, 'run_id', v_running.run_id,
                                        'owner', v_running.owner)::text;
    END IF;
    -- out of its pool first: the lease row (kept) counts against none
    UPDATE ledger.leases l SET pool = NULL WHERE l.job = unregister_job.job AND l.pool IS NOT NULL;
    DELETE FROM ledger.jobs j WHERE j.job = unregister_job.job;  -- skipped_slots cascade
    v_found := FOUND;
    IF with_history THEN
        UPDATE ledger.lease_seats s SET run_id = NULL WHERE s.job = unregister_job.job AND s.run_id IS NOT NULL;
        DELETE FROM ledger.job_execution_log r WHERE r.job = unregister_job.job;
        DELETE FROM ledger.skip_counts s WHERE s.job = unregister_job.job;
        DELETE FROM ledger.purged_slots p WHERE p.job = unregister_job.job;
        DELETE FROM ledger.purged_keys k WHERE k.job = unregister_job.job;
        -- The state row goes with the log it was kept from: the job is no
        -- longer known (job_status, job_health and alerts list no ghost),
        -- though its lease row stays.
        PERFORM ledger._set_state(unregister_job.job, 'forgotten');
        v_found := true;
    ELSIF v_lease.job IS NULL THEN
        -- It never took a lease, so it has no runs: nothing is left of it.
        PERFORM ledger._set_state(unregister_job.job, 'forgotten');
    ELSE
        -- Known still, by its lease and runs: no schedule, so no slot is due.
        PERFORM ledger._set_state(unregister_job.job, 'registration');
    END IF;
    RETURN v_found;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.force_release(job text)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now      timestamptz;
    v_lease    ledger.leases;
    v_running  ledger.job_execution_log;
    v_timeline integer;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = force_release.job FOR UPDATE;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = force_release.job) THEN
            PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
                jsonb_build_object('job', job));
        END IF;
        RETURN NULL;
    END IF;
    v_now := ledger._now();
    v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
    IF v_lease.multi THEN
        RETURN ledger._force_release_seats(job, v_now, v_timeline);
    END IF;
    UPDATE ledger.leases l SET
        token       = ledger._next_token(l.token, l.timeline, v_timeline),
        timeline    = v_timeline,
        acquired_at = v_now,
        expires_at  = v_now,
        released_at = v_now
     WHERE l.job = force_release.job
    RETURNING * INTO v_lease;
    SELECT * INTO v_running FROM ledger.job_execution_log r
     WHERE r.job = force_release.job AND r.status = 'running';
    IF FOUND THEN
        PERFORM ledger._close_lost(v_running, 'superseded', v_now);
    END IF;
    RETURN v_lease.token;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._force_release_seats(job text, at timestamp with time zone, timeline integer)
 RETURNS bigint
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_seat    ledger.lease_seats;
    v_token   bigint;
    v_running ledger.job_execution_log;
BEGIN
    FOR v_seat IN SELECT * FROM ledger.lease_seats s WHERE s.job = _force_release_seats.job
                   ORDER BY s.seat FOR UPDATE LOOP
        UPDATE ledger.leases l SET
            token       = ledger._next_token(l.token, l.timeline, _force_release_seats.timeline),
            timeline    = _force_release_seats.timeline,
            acquired_at = at, expires_at = at, released_at = at
         WHERE l.job = _force_release_seats.job
        RETURNING l.token INTO v_token;
        UPDATE ledger.lease_seats s SET token = v_token, acquired_at = at, expires_at = at, released_at = at
         WHERE s.job = v_seat.job AND s.seat = v_seat.seat;
    END LOOP;
    IF v_token IS NULL THEN  -- no seat yet: a new token all the same
        UPDATE ledger.leases l SET
            token       = ledger._next_token(l.token, l.timeline, _force_release_seats.timeline),
            timeline    = _force_release_seats.timeline,
            acquired_at = at, expires_at = at, released_at = at
         WHERE l.job = _force_release_seats.job
        RETURNING l.token INTO v_token;
    END IF;
    FOR v_running IN SELECT r.* FROM ledger.job_execution_log r
                      WHERE r.job = _force_release_seats.job AND r.status = 'running' ORDER BY r.seat LOOP
        PERFORM ledger._close_lost(v_running, 'superseded', at, true);
    END LOOP;
    RETURN v_token;
END
$function$;

ALTER FUNCTION ledger._force_release_seats(text,timestamp with time zone,integer) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._force_release_seats(text,timestamp with time zone,integer) FROM PUBLIC;

COMMENT ON FUNCTION ledger._force_release_seats(text,timestamp with time zone,integer) IS NULL;

CREATE OR REPLACE FUNCTION ledger._start_scheduled(v_job ledger.jobs, owner text, ttl interval, batch boolean, OUT start ledger.run_start, OUT trigger_id bigint)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now     timestamptz := ledger._now();
    v_lease   ledger.leases;
    v_state   ledger.counters;
    v_trigger ledger.triggers;
    v_last    ledger.job_execution_log;
    v_live    boolean;
    v_floor   timestamptz;
    v_due     timestamptz[];
    v_skip    boolean[];
    v_n       integer;
    v_newest  integer;
    v_at      timestamptz;
    v_prev    timestamptz;
BEGIN
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_job.job;
    SELECT * INTO v_state FROM ledger.counters c WHERE c.job = v_job.job;
    SELECT * INTO v_trigger FROM ledger.triggers t WHERE t.job = v_job.job AND t.status = 'pending';
    IF v_job.paused THEN
        IF v_trigger.trigger_id IS NOT NULL THEN
            PERFORM ledger._skip_trigger(v_trigger.trigger_id, 'paused');
        END IF;
        start.outcome := 'paused';
        RETURN;
    END IF;
    v_live := v_lease.job IS NOT NULL AND v_lease.released_at IS NULL AND v_lease.expires_at > v_now;

    IF v_live THEN
        IF v_job.overlap_policy = 'replace' THEN
            IF v_trigger.trigger_id IS NULL THEN
                -- a slot due after the running one (and its jitter passed)?
                v_floor := greatest(ledger._newest_done_slot(v_job.job), ledger._skip_floor(v_job.job));
                IF v_job.schedule IS NOT NULL THEN
                    v_due := ledger._due(v_job, v_now, v_floor);
                    v_n := cardinality(v_due);
                    IF v_n > 0 AND v_due[v_n] + ledger._jitter(v_job.job, v_due[v_n], v_job.jitter) > v_now THEN
                        v_n := v_n - 1;
                    END IF;
                END IF;
            END IF;
            IF v_trigger.trigger_id IS NOT NULL OR coalesce(v_n, 0) > 0 THEN
                PERFORM ledger._supersede(v_job.job, v_now);
                SELECT * INTO v_state FROM ledger.counters c WHERE c.job = v_job.job;
                v_live := false;
            END IF;
        ELSIF v_job.overlap_policy = 'skip' AND v_trigger.trigger_id IS NOT NULL THEN
            PERFORM ledger._skip_trigger(v_trigger.trigger_id, 'overlap');
            v_trigger := NULL;
        END IF;
        IF v_live THEN
            start.outcome := 'skipped_overlap';
            start.holder := v_lease.owner;
            start.holder_expires_at := v_lease.expires_at;
            RETURN;
        END IF;
    END IF;

    IF v_trigger.trigger_id IS NOT NULL THEN
        start := ledger._start(v_job.job, owner, ttl, NULL, NULL,
                               jsonb_strip_nulls(jsonb_build_object('trigger', 'manual', 'trigger_id', v_trigger.trigger_id,
                                                                    'requested_by', v_trigger.requested_by)));
        IF start.outcome = 'started' THEN
            UPDATE ledger.triggers t SET status = 'started', run_id = start.run_id, resolved_at = v_now
             WHERE t.trigger_id = v_trigger.trigger_id;
            trigger_id := v_trigger.trigger_id;
        END IF;
        RETURN;
    END IF;
    IF v_job.schedule IS NULL THEN
        start.outcome := 'nothing_due';
        RETURN;
    END IF;

    v_floor := greatest(ledger._newest_done_slot(v_job.job), ledger._skip_floor(v_job.job));
    IF v_lease.multi THEN
        -- seats: the slots running in the other seats are taken too
        v_floor := greatest(v_floor, (SELECT max(r.slot) FROM ledger.job_execution_log r
                                       WHERE r.job = v_job.job AND r.status = 'running'));
    END IF;
    IF batch AND v_state.last_run_id IS NOT NULL THEN
        -- start_due_runs never retries a slot whose run failed or was
        -- cancelled (a command's retries are its runner's): catch-up goes on
        -- after it. A lost run (lease_expired, superseded) is retried.
        SELECT * INTO v_last FROM ledger.job_execution_log r WHERE r.run_id = v_state.last_run_id;
        IF v_last.status = 'failure' AND v_last.failure_reason IN ('error', 'cancelled') THEN
            v_floor := greatest(v_floor, v_last.slot);
        END IF;
    END IF;
    v_due := ledger._due(v_job, v_now, v_floor);
    v_n := cardinality(v_due);
    IF batch AND v_floor IS NULL AND v_n > 0 AND v_due[v_n] <= v_job.created_at THEN
        -- start_due_runs starts a new job's first slot after its registration
        v_n := 0;
    END IF;
    IF v_n > 0 AND v_job.jitter IS NOT NULL
       AND v_due[v_n] + ledger._jitter(v_job.job, v_due[v_n], v_job.jitter) > v_now THEN
        v_due := v_due[1 : v_n - 1];
        v_n := v_n - 1;
    END IF;
    IF v_n = 0 THEN
        start.outcome := 'nothing_due';
        RETURN;
    END IF;

    -- The slots the catch-up bound drops: after the floor, before the window.
    IF v_floor IS NOT NULL THEN
        v_prev := ledger._slot_at_or_before(v_job.schedule_spec, v_job.time_zone, v_due[1] - interval '1 microsecond');
        IF v_prev IS NOT NULL AND v_prev > v_floor THEN
            v_at := ledger._slot_after(v_job.schedule_spec, v_job.time_zone, v_floor);
            INSERT INTO ledger.skipped_slots (job, first_slot, last_slot, slot_count, reason)
            VALUES (v_job.job, v_at, v_prev,
                    ledger._slot_count(v_job.schedule_spec, v_job.time_zone, v_floor, v_prev), 'backfill_limit');
            PERFORM ledger._set_state(v_job.job, 'skipped_backfill',
                                      slots => ledger._slot_count(v_job.schedule_spec, v_job.time_zone, v_floor, v_prev));
        END IF;
    END IF;

    -- The overlap policy: the slots that came due while the last run was live.
    IF v_job.overlap_policy IN ('skip', 'buffer_one', 'replace') AND v_state.last_started_at IS NOT NULL
       AND v_state.last_completed_at IS NOT NULL THEN
        v_skip := ARRAY[]::boolean[];
        v_newest := NULL;
        FOR i IN 1 .. v_n LOOP
            v_at := v_due[i] + ledger._jitter(v_job.job, v_due[i], v_job.jitter);
            v_skip := v_skip || (v_at > v_state.last_started_at AND v_at <= v_state.last_completed_at);
            IF v_skip[i] THEN
                v_newest := i;
            END IF;
        END LOOP;
        IF v_newest IS NOT NULL THEN
            IF v_job.overlap_policy IN ('buffer_one', 'replace') THEN
                v_skip[v_newest] := false;  -- the newest of them runs now
            END IF;
            v_due := ledger._skip_where(v_job.job, v_due, v_skip, 'overlap');
            v_n := cardinality(v_due);
        END IF;
    END IF;

    -- The start deadline: a slot not started within it never runs late.
    IF v_job.start_deadline IS NOT NULL AND v_n > 0 THEN
        v_skip := ARRAY[]::boolean[];
        FOR i IN 1 .. v_n LOOP
            v_skip := v_skip || (v_due[i] + ledger._jitter(v_job.job, v_due[i], v_job.jitter) + v_job.start_deadline
                                 < v_now);
        END LOOP;
        v_due := ledger._skip_where(v_job.job, v_due, v_skip, 'start_deadline');
        v_n := cardinality(v_due);
    END IF;
    IF v_n = 0 THEN
        start.outcome := 'nothing_due';
        RETURN;
    END IF;
    start := ledger._start(v_job.job, owner, ttl, v_due[1], NULL, NULL);
END
$function$;

CREATE OR REPLACE FUNCTION ledger._wake_job()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now  timestamptz := ledger._now();
    v_pool text;
BEGIN
    IF TG_TABLE_NAME IN ('leases', 'lease_seats') THEN
        UPDATE ledger.wakeups w SET at = v_now
          FROM ledger.jobs j
         WHERE w.job = NEW.job AND j.job = NEW.job AND (w.at IS NULL OR w.at > v_now)
           AND (j.schedule IS NOT NULL
                OR EXISTS (SELECT FROM ledger.triggers t WHERE t.job = NEW.job AND t.status = 'pending'));
        -- a place in the job's pool freed: the jobs waiting for one (a
        -- seat's pool is on its job's lease row, locked by the writer)
        IF TG_TABLE_NAME = 'leases' THEN
            v_pool := NEW.pool;
        ELSE
            SELECT l.pool INTO v_pool FROM ledger.leases l WHERE l.job = NEW.job;
        END IF;
        IF v_pool IS NOT NULL THEN
            PERFORM ledger._wake_pool(v_pool);
        END IF;
    ELSE
        INSERT INTO ledger.wakeups AS w (job, at) VALUES (NEW.job, v_now)
        ON CONFLICT (job) DO UPDATE SET at = excluded.at WHERE w.at IS NULL OR w.at > excluded.at;
    END IF;
    RETURN NULL;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._next_start_of(job text)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
DECLARE
    v_now timestamptz := ledger._now();
BEGIN
    RETURN (
    SELECT CASE
               WHEN j.paused THEN NULL
               WHEN x.live AND j.overlap_policy = 'replace' AND t.trigger_id IS NOT NULL THEN v_now
               WHEN x.live AND j.overlap_policy = 'replace' THEN
                   (SELECT s.slot + CASE WHEN j.jitter IS NULL THEN interval '0' ELSE ledger._jitter(j.job, s.slot, j.jitter) END
                      FROM (SELECT ledger._slot_after(j.schedule_spec, j.time_zone,
                                                      greatest(c.done_slot, rr.slot, f.last_slot, j.created_at)) AS slot) s)
               WHEN x.live THEN x.live_until
               WHEN t.trigger_id IS NOT NULL THEN v_now
               WHEN j.schedule IS NULL THEN NULL
               ELSE (SELECT s.slot + CASE WHEN j.jitter IS NULL THEN interval '0' ELSE ledger._jitter(j.job, s.slot, j.jitter) END
                       FROM (SELECT CASE WHEN x.floor IS NULL
                                         -- never ran: the latest slot, or the first after the registration
                                         THEN greatest(ledger._slot_at_or_before(j.schedule_spec, j.time_zone, v_now),
                                                       ledger._slot_after(j.schedule_spec, j.time_zone, j.created_at))
                                         WHEN x.floor = c.done_slot AND c.next_due IS NOT NULL
                                         THEN c.next_due
                                         ELSE ledger._slot_after(j.schedule_spec, j.time_zone,
                                                                 coalesce(x.floor, j.created_at)) END AS slot) s)
           END
      FROM ledger.jobs j
      LEFT JOIN ledger.counters c ON c.job = j.job
      LEFT JOIN ledger.leases l ON l.job = j.job
      LEFT JOIN ledger.triggers t ON t.job = j.job AND t.status = 'pending'
      LEFT JOIN ledger.job_execution_log lr ON lr.run_id = c.last_run_id
      LEFT JOIN ledger.job_execution_log rr ON rr.run_id = c.running_run_id
      LEFT JOIN LATERAL (SELECT k.last_slot FROM ledger.skipped_slots k WHERE k.job = j.job
                          ORDER BY k.first_slot DESC LIMIT 1) f ON true
     CROSS JOIN LATERAL (
           -- seats mode: live while every seat is, until the first one frees
           SELECT CASE WHEN l.multi
                       THEN (SELECT count(*) >= j.max_concurrent FROM ledger.lease_seats ls
                              WHERE ls.job = j.job AND ls.released_at IS NULL AND ls.expires_at > v_now)
                       ELSE coalesce(l.released_at IS NULL AND l.expires_at > v_now, false) END AS live,
                  CASE WHEN l.multi
                       THEN (SELECT min(ls.expires_at) FROM ledger.lease_seats ls
                              WHERE ls.job = j.job AND ls.released_at IS NULL AND ls.expires_at > v_now)
                       ELSE l.expires_at END AS live_until,
                  greatest(c.done_slot, f.last_slot,
                           -- seats: the slots running in the other seats are taken too
                           CASE WHEN l.multi THEN (SELECT max(r.slot) FROM ledger.job_execution_log r
                                                    WHERE r.job = j.job AND r.status = 'running') END,
                           CASE WHEN lr.status = 'failure' AND lr.failure_reason IN ('error', 'cancelled')
                                THEN lr.slot END) AS floor) x
     WHERE j.job = _next_start_of.job);
END
$function$;

CREATE OR REPLACE FUNCTION ledger.start_due_runs(jobs text[], owner text, max_runs integer DEFAULT NULL::integer, ttl interval DEFAULT NULL::interval)
 RETURNS TABLE(job text, outcome text, run_id bigint, token bigint, expires_at timestamp with time zone, slot timestamp with time zone, trigger_id bigint)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_name    text;
    v_job     ledger.jobs;
    v_ttl     interval;
    v_started integer := 0;
    v_result  record;
    v_at      timestamptz;
BEGIN
    PERFORM ledger._check_jobs(jobs, true);
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_ttl(ttl);
    IF max_runs < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_runs must be positive (or null: no cap), not %s', max_runs),
            DETAIL = jsonb_build_object('argument', 'max_runs', 'value', max_runs)::text;
    END IF;
    -- The jobs whose wakeup mark has passed (an index range: not every job
    -- served), earliest first; each taken SKIP LOCKED, so that concurrent
    -- schedulers split them and never wait. Under the job's lease row and
    -- its mark (a trigger or an end meanwhile waits, then moves the mark
    -- back), its next start is computed, what is due started, and the mark
    -- set to the next start after that.
    -- (EXECUTE: the list planned as a constant, a hash probe per mark; the
    -- loop's own statements keep their cached plans.)
    FOR v_name IN EXECUTE
        'SELECT w.job FROM ledger.wakeups w
          WHERE w.at <= ledger._now() AND w.job = ANY ($1)
          ORDER BY w.at, w.job' USING jobs
    LOOP
        EXIT WHEN v_started >= max_runs;
        CONTINUE WHEN NOT ledger._lock_job(v_name, false);
        PERFORM FROM ledger.wakeups w WHERE w.job = v_name FOR UPDATE;
        SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = v_name;
        CONTINUE WHEN NOT FOUND;  -- unregistered meanwhile
        v_at := ledger._next_start_of(v_name);
        IF v_at IS NULL OR v_at > ledger._now() THEN
            UPDATE ledger.wakeups w SET at = v_at WHERE w.job = v_name;  -- nothing due yet
            CONTINUE;
        END IF;
        v_ttl := coalesce(ledger._exact(start_due_runs.ttl), v_job.ttl);
        IF v_ttl IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument ttl is required: job %s has no registered ttl', v_name),
                DETAIL = jsonb_build_object('argument', 'ttl', 'job', v_name)::text;
        END IF;
        v_result := ledger._start_scheduled(v_job, owner, v_ttl, true);
        IF (v_result.start).outcome = 'skipped_pool_full' THEN
            -- The pool is full: the job waits a place, its due mark kept
            -- (it orders the waiting: the oldest waits least), looked at
            -- again when an end in the pool wakes it (ledger._wake_pool),
            -- or when the pool's earliest live lease expires, or after 10 s
            -- at most (a pool row held past the lock bound).
            UPDATE ledger.wakeups w
               SET pool_wait = v_job.pool,
                   waiting_since = coalesce(w.waiting_since, w.at),
                   at = least(ledger._now() + interval '10 seconds',
                              (SELECT min(h.expires_at) FROM ledger._pool_holders h
                                WHERE h.pool = v_job.pool AND h.released_at IS NULL AND h.expires_at > ledger._now()))
             WHERE w.job = v_name;
            CONTINUE;
        END IF;
        -- started, and not under replace: nothing starts before the lease
        -- ends (_next_start_of's answer, without asking it)
        -- (with seats, a free one may start the next slot: asked)
        UPDATE ledger.wakeups w SET at = CASE WHEN (v_result.start).outcome = 'started' AND v_job.overlap_policy <> 'replace'
                                                   AND v_job.max_concurrent = 1
                                              THEN (v_result.start).expires_at
                                              ELSE ledger._next_start_of(v_name) END,
                                    pool_wait = NULL, waiting_since = NULL
         WHERE w.job = v_name;
        IF (v_result.start).outcome = 'started' THEN
            v_started := v_started + 1;
            job := v_name;
            outcome := 'started';
            run_id := (v_result.start).run_id;
            token := (v_result.start).token;
            expires_at := (v_result.start).expires_at;
            slot := (v_result.start).slot;
            trigger_id := v_result.trigger_id;
            RETURN NEXT;
        END IF;
    END LOOP;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._definition_keys()
 RETURNS jsonb
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN '{"schedule": null, "ttl": null, "max_backfill": 1, "time_zone": "UTC", "late_after": "0",
             "down_after": "0", "min_runtime": "0", "max_runtime": "0", "pause_after_failures": 0,
             "jitter": "0", "start_deadline": "0", "overlap_policy": "catch_up", "pool": "",
             "max_concurrent": 1}'::jsonb;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._apply_definition(job text, definition jsonb)
 RETURNS ledger.jobs
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_def   jsonb := ledger._definition_keys() || jsonb_strip_nulls(definition);
    v_key   text := 'schedule';
    v_state text;
    v_msg   text;
    v_detail text;
    v_arg   text;
    v_s     text;
    v_tz    text;
    v_ttl   interval;
    v_mb    integer;
    v_la    interval;
    v_da    interval;
    v_mi    interval;
    v_ma    interval;
    v_paf   integer;
    v_ji    interval;
    v_sd    interval;
    v_op    text;
    v_pool  text;
    v_mc    integer;
BEGIN
    BEGIN
        FOR v_key IN SELECT k FROM jsonb_object_keys(v_def) k ORDER BY 1 LOOP
            IF jsonb_typeof(v_def -> v_key) NOT IN ('string', 'number', 'null') THEN
                RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = format('must be a string or a number, not %s',
                                                                          jsonb_typeof(v_def -> v_key));
            END IF;
        END LOOP;
        v_key := 'schedule';       v_s := v_def ->> 'schedule';
        v_key := 'time_zone';      v_tz := v_def ->> 'time_zone';
        v_key := 'ttl';            v_ttl := (v_def ->> 'ttl')::interval;
        v_key := 'max_backfill';   v_mb := (v_def ->> 'max_backfill')::integer;
        v_key := 'late_after';     v_la := (v_def ->> 'late_after')::interval;
        v_key := 'down_after';     v_da := (v_def ->> 'down_after')::interval;
        v_key := 'min_runtime';    v_mi := (v_def ->> 'min_runtime')::interval;
        v_key := 'max_runtime';    v_ma := (v_def ->> 'max_runtime')::interval;
        v_key := 'pause_after_failures'; v_paf := (v_def ->> 'pause_after_failures')::integer;
        v_key := 'jitter';         v_ji := (v_def ->> 'jitter')::interval;
        v_key := 'start_deadline'; v_sd := (v_def ->> 'start_deadline')::interval;
        v_key := 'overlap_policy'; v_op := v_def ->> 'overlap_policy';
        v_key := 'pool';           v_pool := v_def ->> 'pool';
        v_key := 'max_concurrent'; v_mc := (v_def ->> 'max_concurrent')::integer;
        v_key := NULL;
        RETURN ledger.register_job(job => job, schedule => v_s, ttl => v_ttl, max_backfill => v_mb,
                                   time_zone => v_tz, late_after => v_la, down_after => v_da, min_runtime => v_mi,
                                   max_runtime => v_ma, pause_after_failures => v_paf, jitter => v_ji,
                                   start_deadline => v_sd, overlap_policy => v_op, pool => v_pool,
                                   max_concurrent => v_mc);
    EXCEPTION WHEN data_exception OR SQLSTATE 'LD005' OR SQLSTATE 'LD008' THEN
        GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT, v_detail = PG_EXCEPTION_DETAIL;
        BEGIN
            v_arg := (v_detail::jsonb) ->> 'argument';
        EXCEPTION WHEN OTHERS THEN
            v_arg := NULL;
        END;
        v_key := coalesce(v_key, v_arg, 'job');
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument definitions: job %s, key %s: %s', job, v_key, v_msg),
            DETAIL = jsonb_build_object('argument', 'definitions', 'job', job, 'key', v_key, 'sqlstate', v_state,
                                        'value', left(v_def ->> v_key, 200))::text;
    END;
END
$function$;

-- By hand: as sql/ writes it ((EXTRACT(...))::numeric: on PostgreSQL 13 EXTRACT is double precision).
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
                                      CASE WHEN l.multi THEN 'or another run''s seat is not live'
                                           WHEN l.token <> c.running_token THEN format('went to token %s', l.token)
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
         FROM (SELECT CASE WHEN NOT coalesce(l.multi, false)
                           THEN coalesce(l.token = c.running_token AND l.released_at IS NULL AND l.expires_at > n.at,
                                         false)
                           -- seats mode: runs are marked running, and every seat with a
                           -- running run is live (the seats, not the log: per job)
                           ELSE c.running_run_id IS NOT NULL AND NOT EXISTS (
                                    SELECT FROM ledger.lease_seats ls
                                     WHERE ls.job = c.job AND ls.run_id IS NOT NULL
                                       AND NOT (ls.released_at IS NULL AND ls.expires_at > n.at))
                      END AS live,
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

-- By hand: the new view, after the tables it reads and before the view that reads it.
CREATE VIEW ledger._pool_holders AS
SELECT l.pool, l.job, NULL::integer AS seat, l.expires_at, l.released_at
  FROM ledger.leases l
 WHERE l.pool IS NOT NULL AND NOT l.multi
UNION ALL
SELECT l.pool, s.job, s.seat, s.expires_at, s.released_at
  FROM ledger.leases l
  JOIN ledger.lease_seats s ON s.job = l.job
 WHERE l.pool IS NOT NULL AND l.multi;
ALTER VIEW ledger._pool_holders OWNER TO ledger_owner;
REVOKE ALL ON ledger._pool_holders FROM PUBLIC;
GRANT SELECT ON ledger._pool_holders TO ledger_client, ledger_reader;

CREATE OR REPLACE VIEW ledger.pool_status AS
 SELECT (p.pool)::text AS pool,
    p.size,
    (( SELECT count(*) AS count
           FROM ledger._pool_holders h
          WHERE (((h.pool)::text = (p.pool)::text) AND (h.released_at IS NULL) AND (h.expires_at > ledger._view_now()))))::integer AS used,
    (( SELECT count(*) AS count
           FROM (ledger.jobs j
             JOIN ledger.job_execution_log r ON ((((r.job)::text = (j.job)::text) AND (r.status = 'running'::text))))
          WHERE ((j.pool)::text = (p.pool)::text)))::integer AS running,
    (( SELECT count(*) AS count
           FROM ledger.jobs j
          WHERE ((j.pool)::text = (p.pool)::text)))::integer AS jobs,
    (( SELECT count(*) AS count
           FROM ledger.wakeups w
          WHERE ((w.pool_wait)::text = (p.pool)::text)))::integer AS waiting,
    (COALESCE(( SELECT sum(c.skipped_pool_full) AS sum
           FROM (ledger.jobs j
             JOIN ledger.counters c ON (((c.job)::text = (j.job)::text)))
          WHERE ((j.pool)::text = (p.pool)::text)), (0)::numeric))::bigint AS skipped_pool_full,
    p.created_at,
    p.updated_at
   FROM ledger.pools p;

CREATE OR REPLACE VIEW ledger."overlaps" AS
 WITH ordered AS (
         SELECT r.run_id,
            r.job,
            r.started_at,
            max(COALESCE(r.completed_at, 'infinity'::timestamp with time zone)) OVER (PARTITION BY r.job, r.seat ORDER BY r.started_at, r.run_id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
           FROM ledger.job_execution_log r
        )
 SELECT a.job,
    a.run_id,
    a.owner,
    a.token,
    a.started_at,
    a.completed_at,
    b.run_id AS other_run_id,
    b.owner AS other_owner,
    b.token AS other_token,
    b.started_at AS other_started_at,
    b.completed_at AS other_completed_at
   FROM ((ordered o
     JOIN ledger.job_execution_log b ON ((b.run_id = o.run_id)))
     JOIN ledger.job_execution_log a ON ((((a.job)::text = (o.job)::text) AND (a.seat = b.seat) AND (ROW(a.started_at, a.run_id) < ROW(o.started_at, o.run_id)) AND (COALESCE(a.completed_at, 'infinity'::timestamp with time zone) > o.started_at))))
  WHERE (o.earlier_end > o.started_at);

CREATE OR REPLACE FUNCTION ledger._count_skip(job text, wait text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_wait  text := current_setting('lock_timeout');
    v_shard smallint;
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait, true);
        FOR v_spare IN 0 .. 3 LOOP
            v_shard := (pg_backend_pid() % 16 + 16 * v_spare)::smallint;
            UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + 1
              FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                     WHERE t.job = _count_skip.job AND t.shard = v_shard
                       FOR UPDATE SKIP LOCKED) free_
             WHERE s.job = free_.job AND s.shard = free_.shard;
            IF NOT FOUND THEN
                -- no row, or a held one: DO NOTHING waits for no row lock
                INSERT INTO ledger.skip_counts (job, shard, skipped_overlap)
                VALUES (_count_skip.job, v_shard, 1)
                ON CONFLICT ON CONSTRAINT skip_counts_pkey DO NOTHING;
            END IF;
            IF FOUND THEN
                PERFORM set_config('lock_timeout', v_wait, true);
                RETURN;
            END IF;
        END LOOP;
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (_count_skip.job, (pg_backend_pid() % 16)::smallint, 1)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + 1;
        PERFORM set_config('lock_timeout', v_wait, true);
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
END
$function$;

-- By hand: a seat's end wakes its job and its pool, as a lease's does (ledger._wake_job, above).
CREATE TRIGGER lease_seats_wake
    AFTER UPDATE OF released_at, expires_at ON ledger.lease_seats
    FOR EACH ROW WHEN ((OLD.released_at IS NULL AND NEW.released_at IS NOT NULL) OR NEW.expires_at < OLD.expires_at)
    EXECUTE FUNCTION ledger._wake_job();
