-- A job's state: its row in ledger.counters (20_tables.sql), written by one
-- function (ledger._set_state), recomputed from the log by one function
-- (ledger._state_from_log), read as one state word with one vocabulary by
-- one view (ledger._job_state, which job_status, job_health, alerts and
-- ttl_advice select from), and audited by ledger.verify_state.

-- The first slot after `done` and the ledger._down_after_slots()th: the
-- instants at which, past the grace, the job is late and down. NULLs
-- without a schedule. Evaluated by the writers when `done` or the schedule
-- changes, so that no read ever evaluates a schedule.
CREATE FUNCTION ledger._due_marks(spec ledger.schedule_spec, time_zone text, done timestamptz,
                                  OUT next_due timestamptz, OUT down_due timestamptz)
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF spec.kind IS NULL OR done IS NULL THEN
        RETURN;
    END IF;
    next_due := ledger._slot_after(spec, time_zone, done);
    down_due := next_due;
    FOR i IN 2 .. ledger._down_after_slots() LOOP
        EXIT WHEN down_due IS NULL;
        down_due := ledger._slot_after(spec, time_zone, down_due);
    END LOOP;
END
$$;

-- The state columns of these jobs' rows as the log says them: what the
-- writers keep (20_tables.sql defines each), with what purge_log removed
-- added back (ledger.purged_state), and the due marks from the schedule.
-- Read-only: the body of the 'recomputed' transition and of verify_state.
-- Set-based: the jobs' rows of the log are read once, by one index scan per
-- job, and every column is an aggregate over them. A custom plan for every
-- call: the generic plan does not know how many jobs the array holds.
CREATE FUNCTION ledger._state_from_log(jobs text[])
RETURNS TABLE (job text, last_run_id bigint, last_status text, last_started_at timestamptz,
               last_completed_at timestamptz, last_success_started_at timestamptz, last_success_at timestamptz,
               running_run_id bigint, running_token bigint, running_started_at timestamptz,
               done_slot timestamptz, longest_success interval, consecutive_failures bigint,
               next_due timestamptz, latest_end timestamptz, overlap_run_id bigint, down_due timestamptz)
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
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
$$;

-- The end of a failure that made `streak` failures in a row pauses the job
-- when its pause_after_failures is at most that (in the transaction of the
-- end); a job paused already stays as it is.
CREATE FUNCTION ledger._auto_pause(job text, streak bigint, at timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE ledger.jobs j SET paused = true, paused_at = at, pause_reason = 'failures', updated_at = at
     WHERE j.job = _auto_pause.job AND NOT j.paused AND j.pause_after_failures <= streak;
END
$$;

-- The one writer of a job's state row. Every change of a job's runs or
-- registration calls it, in the transaction of the change, with what
-- happened:
--   'leased'           the job took a lease: its row exists (acquire);
--   'registration'     its registration changed (register_job,
--                      unregister_job without history): the due marks
--                      follow the schedule as it is now;
--   'started'          `run` was just logged running (start_run,
--                      start_due_run, backfill);
--   'ended'            `run` was just ended by its holder: success,
--                      failure, or cancelled (no failure of the streak);
--   'lost'             `run` was just closed as lost (lease_expired,
--                      superseded: the reaper, a takeover, force_release);
--   'skipped_backfill' the catch-up bound dropped `slots` slots;
--   'skipped_deadline' `slots` slots passed their start deadline unstarted;
--   'skipped_pool_full' a start its pool did not admit (ledger._pool_full);
--   'forgotten'        its history went (unregister_job with history): the
--                      row goes with it, and the job is no longer known;
--   'recomputed'       a write past the functions changed its log: the row
--                      is recomputed from the log (ledger._state_from_log).
-- It takes the job's lease row first, as every writer of a job does, so
-- two transitions of a job never interleave; the hot path's transitions
-- ('leased', 'started', 'ended', 'lost', 'skipped_pool_full') skip that
-- lock, since their callers (acquire, ledger._start, ledger._end_run,
-- ledger._close_lost's callers)
-- hold the row already, locked or inserted in this transaction, and a second
-- lock of a row one just updated is no wait but a WAL record of its own.
-- purge_log writes no state row: what it removes stays counted
-- (ledger.purged_state).
CREATE FUNCTION ledger._set_state(job text, event text, run ledger.job_execution_log DEFAULT NULL,
                                   slots bigint DEFAULT NULL, seats boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- These jobs' state rows recomputed from the log, one 'recomputed'
-- transition each (tests and the trigger below call it). after_purge is
-- ignored: it is the signature of 0004 and earlier, kept so that a call in
-- flight across the upgrade to 0005 still finds the function (a second
-- overload would make every one-argument call ambiguous).
CREATE FUNCTION ledger._refresh_state(jobs text[], after_purge boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job text;
BEGIN
    FOR v_job IN SELECT DISTINCT u.job FROM unnest(jobs) AS u(job) ORDER BY 1 LOOP
        PERFORM ledger._set_state(v_job, 'recomputed');
    END LOOP;
END
$$;

-- Add to a job's counters. Nothing in sql/ calls it any more (a job's state
-- row has one writer, ledger._set_state): it stays for the bodies of 0004
-- and earlier that call it while in flight across the upgrade to 0005, and
-- goes in a later revision.
CREATE FUNCTION ledger._count(
    job text,
    runs_started bigint DEFAULT 0,
    successes bigint DEFAULT 0,
    failures bigint DEFAULT 0,
    skipped_overlap bigint DEFAULT 0,
    skipped_backfill bigint DEFAULT 0,
    leases_lost bigint DEFAULT 0)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO ledger.counters AS c
        (job, runs_started, successes, failures, skipped_overlap, skipped_backfill, leases_lost)
    VALUES (_count.job, _count.runs_started, _count.successes, _count.failures,
            _count.skipped_overlap, _count.skipped_backfill, _count.leases_lost)
    ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
        runs_started     = c.runs_started     + excluded.runs_started,
        successes        = c.successes        + excluded.successes,
        failures         = c.failures         + excluded.failures,
        skipped_overlap  = c.skipped_overlap  + excluded.skipped_overlap,
        skipped_backfill = c.skipped_backfill + excluded.skipped_backfill,
        leases_lost      = c.leases_lost      + excluded.leases_lost;
END
$$;

-- A row of the log written by anyone but the ledger's own functions (which
-- run as ledger_owner and make their transitions themselves): recompute that
-- job's state, so the views never disagree with the log. The trigger's WHEN
-- keeps it off the functions' path.
CREATE FUNCTION ledger._foreign_log_write()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM ledger._refresh_state(ARRAY[OLD.job]::text[]);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM ledger._refresh_state(ARRAY[NEW.job]::text[]);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER job_execution_log_foreign_write
    AFTER INSERT OR UPDATE OR DELETE ON ledger.job_execution_log
    FOR EACH ROW WHEN (current_user <> 'ledger_owner')
    EXECUTE FUNCTION ledger._foreign_log_write();

-- A registration or a lease written past the functions (a superuser's
-- INSERT or UPDATE, a restore): the job's transition, as the function would
-- have made it, so that the job is known and its due marks follow its
-- schedule and registration time. Off the functions' path, as above.
CREATE FUNCTION ledger._foreign_job_write()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_TABLE_NAME = 'leases' THEN
        PERFORM ledger._set_state(NEW.job, 'leased');
    ELSIF TG_OP = 'DELETE' THEN
        -- as unregister_job without history: known still by a lease, else gone
        PERFORM ledger._set_state(OLD.job, CASE WHEN EXISTS (SELECT FROM ledger.leases l WHERE l.job = OLD.job)
                                                 THEN 'registration' ELSE 'forgotten' END);
    ELSE
        PERFORM ledger._set_state(NEW.job, 'registration');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_foreign_write
    AFTER INSERT OR DELETE OR UPDATE OF schedule, schedule_spec, time_zone, created_at ON ledger.jobs
    FOR EACH ROW WHEN (current_user <> 'ledger_owner')
    EXECUTE FUNCTION ledger._foreign_job_write();

CREATE TRIGGER leases_foreign_write
    AFTER INSERT ON ledger.leases
    FOR EACH ROW WHEN (current_user <> 'ledger_owner')
    EXECUTE FUNCTION ledger._foreign_job_write();

-- The audit of the state rows, as ledger.overlaps is the audit of the log:
-- every job's state recomputed from the log, what purge_log removed of it,
-- its schedule (ledger._state_from_log), against its stored row. One row
-- per job whose stored state differs: its state word as read now, and the
-- columns that differ (`row` when the job has runs or a registration but no
-- state row). Always empty when the ledger holds. It reads the whole log.
CREATE TYPE ledger.state_difference AS (
    job         text,
    state       text,    -- the job's state as read now (ledger.job_health)
    differences jsonb    -- per column that differs: {"stored": ..., "expected": ...}
);

CREATE FUNCTION ledger.verify_state()
RETURNS SETOF ledger.state_difference
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN QUERY
    WITH known AS (
        SELECT c.job::text AS job FROM ledger.counters c
        UNION SELECT j.job::text FROM ledger.jobs j
        UNION SELECT DISTINCT r.job::text FROM ledger.job_execution_log r
    ), expected AS (
        SELECT to_jsonb(e) - 'job' AS doc, e.job FROM ledger._state_from_log(ARRAY(SELECT k.job FROM known k)) e
    ), compared AS (
        SELECT x.job,
               CASE WHEN c.job IS NULL THEN jsonb_build_object('row', jsonb_build_object('stored', NULL,
                                                                                          'expected', 'present'))
                    ELSE (SELECT jsonb_object_agg(e.key, jsonb_build_object('stored', to_jsonb(c) -> e.key,
                                                                           'expected', e.value))
                            FROM jsonb_each(x.doc) e
                           WHERE (to_jsonb(c) -> e.key) IS DISTINCT FROM e.value) END AS differences
          FROM expected x LEFT JOIN ledger.counters c ON c.job = x.job
    )
    SELECT d.job, s.state, d.differences
      FROM compared d LEFT JOIN ledger._job_state s ON s.job = d.job
     WHERE d.differences IS NOT NULL
     ORDER BY d.job;
END
$$;
COMMENT ON FUNCTION ledger.verify_state() IS
    'Jobs whose stored state differs from its recomputation from the log and the schedule; always empty when the ledger holds';

-- Every known job (one row per state row) with its state, read at the
-- instant of the read: the one place the state machine is written. Each
-- job's rows of counters, jobs, leases (one primary-key lookup each, or one
-- hash join over all jobs), never the log and never a schedule, so a read
-- of every job costs microseconds per job. The first state that holds:
--   crashed    a run is marked running but its lease is not live (expired,
--              released, or gone to a newer token): its runner is gone.
--              Read from the lease's expiry, so it shows within one ttl of
--              the last renewal with no reaper; reap_expired (or the next
--              start) closes the run, as lease_expired;
--   overrun    a live run has run longer than max_runtime;
--   paused     the job is paused (pause_reason: 'operator' or 'failures');
--   running    a live run;
--   down       ledger._down_after_slots() slots missed (down_due past the
--              grace), or no success for longer than down_after (since the
--              registration when none ever succeeded), or every scheduler
--              that served it (ledger.schedulers) has expired;
--   late       a slot missed (next_due past the grace);
--   failing    ledger._failing_after() failures in a row
--              (consecutive_failures; a cancel is no failure);
--   never_run  no run yet;
--   ok         otherwise.
-- A crash and an overrun outrank the pause: a pause stops the next runs,
-- not the one at hand, and a crashed run of a paused job is never closed by
-- a start. A live run outranks down and late: it is the catch-up. The grace
-- is late_after, by default the ttl but at least 1 minute.
CREATE VIEW ledger._job_state AS
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
COMMENT ON VIEW ledger._job_state IS
    'Internal: every known job with its state (the one state machine: ledger.job_status, job_health, alerts, ttl_advice read it)';
