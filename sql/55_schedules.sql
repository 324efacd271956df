-- Schedules and bounded catch-up. The slot arithmetic (cron, intervals,
-- daylight saving) is in 15_schedule_eval.sql; this file decides which slots
-- are due and records what the catch-up bound drops.

-- The registered job, or LD005.
CREATE FUNCTION ledger._registered_job(job text)
RETURNS ledger.jobs
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs;
BEGIN
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = _registered_job.job;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
            jsonb_build_object('job', job));
    END IF;
    RETURN v_job;
END
$$;

-- The registered job with a schedule, or LD005 / 22023.
CREATE FUNCTION ledger._scheduled_job(job text)
RETURNS ledger.jobs
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs := ledger._registered_job(job);
BEGIN
    IF v_job.schedule IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument job names %s, which has no schedule', job),
            DETAIL = jsonb_build_object('argument', 'job', 'job', job)::text;
    END IF;
    RETURN v_job;
END
$$;

-- An explicit slot for a scheduled job must be one of its schedule's slots
-- and not in the future: a run for '200000-01-01' would otherwise succeed,
-- leave nothing due for ever, and silence the job without an alert.
CREATE FUNCTION ledger._check_slot(job ledger.jobs, slot timestamptz)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF slot > ledger._now() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument slot %s is in the future: job %s runs a slot once it is due', slot, job.job),
            DETAIL = jsonb_build_object('argument', 'slot', 'job', job.job, 'value', slot)::text;
    END IF;
    IF ledger._slot_at_or_before(job.schedule_spec, job.time_zone, slot) IS DISTINCT FROM slot THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument slot %s is not a slot of job %s (schedule %s in %s)',
                             slot, job.job, job.schedule, job.time_zone),
            DETAIL = jsonb_build_object('argument', 'slot', 'job', job.job, 'value', slot,
                                        'schedule', job.schedule, 'time_zone', job.time_zone,
                                        'previous_slot', ledger._slot_at_or_before(job.schedule_spec, job.time_zone, slot))::text;
    END IF;
END
$$;

-- The newest slot that succeeded or is running: where catch-up starts. A
-- run still marked running whose lease expired (its runner crashed) does not
-- count: its slot stays due, and start_run closes it before retrying.
-- Served by the unique partial indexes on (job, slot) and on running runs.
CREATE FUNCTION ledger._newest_done_slot(job text, except_run_id bigint DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_succeeded timestamptz;
    v_running   timestamptz;
BEGIN
    SELECT r.slot INTO v_succeeded FROM ledger.job_execution_log r
     WHERE r.job = _newest_done_slot.job
       AND r.status = 'success'
       AND r.slot IS NOT NULL
       AND r.run_id IS DISTINCT FROM except_run_id
     ORDER BY r.slot DESC
     LIMIT 1;
    SELECT r.slot INTO v_running FROM ledger.job_execution_log r
      JOIN ledger.leases l ON l.job = r.job AND l.token = r.token
     WHERE r.job = _newest_done_slot.job
       AND r.status = 'running'
       AND r.run_id IS DISTINCT FROM except_run_id
       AND l.released_at IS NULL
       AND l.expires_at > ledger._now();
    RETURN greatest(v_succeeded, v_running);
END
$$;

-- The due slots, oldest first: of the slots after `done` up to `at`, the
-- newest max_backfill; only the latest one when the job never ran. Walks
-- back at most max_backfill slots, whatever the length of the downtime.
CREATE FUNCTION ledger._due(job ledger.jobs, at timestamptz, done timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slot  timestamptz := ledger._slot_at_or_before(job.schedule_spec, job.time_zone, at);
    v_slots timestamptz[] := ARRAY[]::timestamptz[];
BEGIN
    IF v_slot IS NULL THEN
        RETURN v_slots;
    ELSIF done IS NULL THEN
        RETURN ARRAY[v_slot];
    END IF;
    FOR i IN 1 .. job.max_backfill LOOP
        EXIT WHEN v_slot IS NULL OR v_slot <= done;
        v_slots := v_slot || v_slots;
        v_slot := ledger._slot_at_or_before(job.schedule_spec, job.time_zone, v_slot - interval '1 microsecond');
    END LOOP;
    RETURN v_slots;
END
$$;

-- A health bound argument (late_after, down_after, min_runtime,
-- max_runtime) when given: 0 (clear it), or an exact positive duration of
-- at most 365 days.
CREATE FUNCTION ledger._check_health_bound(value interval, arg text)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR (date_trunc('month', value) = interval '0' AND extract(day FROM value) = 0
                         AND value - date_trunc('day', value) = interval '0') THEN
        RETURN;
    END IF;
    IF date_trunc('month', value) <> interval '0' OR value <= interval '0' OR value > ledger._max_health_bound()
       OR date_trunc('day', value) < interval '0' OR value - date_trunc('day', value) < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be 0 (none) or an exact duration with no month part and no '
                             'negative part, at most %s', arg, ledger._max_health_bound()),
            DETAIL = jsonb_build_object('argument', arg, 'value', value::text,
                                        'max', ledger._max_health_bound()::text)::text;
    END IF;
END
$$;

-- Register a job, or change the options given of one registered before:
-- an argument left NULL keeps what the job has (on a first registration:
-- no schedule, no ttl, max_backfill 1, UTC, no health bounds). A bound of
-- 0 clears it. Re-registering resets nothing else: not the pause, not the
-- history, not the counters. The scheduler's options (jitter,
-- start_deadline, overlap_policy: 62_scheduler.sql) likewise; a change
-- wakes the schedulers that LISTEN on ledger_scheduler.
CREATE FUNCTION ledger.register_job(
    job text,
    schedule text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    max_backfill integer DEFAULT NULL,
    time_zone text DEFAULT NULL,
    late_after interval DEFAULT NULL,
    down_after interval DEFAULT NULL,
    min_runtime interval DEFAULT NULL,
    max_runtime interval DEFAULT NULL,
    pause_after_failures integer DEFAULT NULL,
    jitter interval DEFAULT NULL,
    start_deadline interval DEFAULT NULL,
    overlap_policy text DEFAULT NULL,
    pool text DEFAULT NULL,
    max_concurrent integer DEFAULT NULL)
RETURNS ledger.jobs
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
COMMENT ON FUNCTION ledger.register_job(text, text, interval, integer, text, interval, interval, interval,
                                        interval, integer, interval, interval, text, text, integer) IS
    'Register a job or change the options given: schedule, default ttl, catch-up bound, time zone, health bounds, '
    'jitter, start deadline, overlap policy, pool, max concurrent runs';

-- A job enters seats mode (its first max_concurrent > 1), under its lease
-- row lock (`lease`, NULL when it has none, the lock that stands for it
-- held: ledger._lock_registration): the lease row becomes the token
-- counter, kept released, and its holder, live or not, moves into seat 1
-- with its token and expiry, so its run (seat 1) keeps its lease. A job
-- without a lease row gets one, with its first token spent on none. A job
-- stays in seats mode for good (max_concurrent lowered to 1: one seat).
CREATE FUNCTION ledger._enter_seats(job text, lease ledger.leases)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- Set a registered job's pause flag: true when that changed it (LD005 when
-- the job was never registered). The body of pause_job and resume_job.
CREATE FUNCTION ledger._set_paused(job text, paused boolean)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._lock_registration(_set_paused.job);  -- the per-job order: the lease row first
    PERFORM ledger._registered_job(job);
    UPDATE ledger.jobs j SET paused       = _set_paused.paused,
                             paused_at    = CASE WHEN _set_paused.paused THEN ledger._now() END,
                             pause_reason = CASE WHEN _set_paused.paused THEN 'operator' END,
                             updated_at   = ledger._now()
     WHERE j.job = _set_paused.job AND j.paused <> _set_paused.paused;
    IF FOUND THEN
        PERFORM pg_notify('ledger_scheduler', job);
        RETURN true;
    END IF;
    RETURN false;
END
$$;

CREATE FUNCTION ledger.pause_job(job text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._set_paused(job, true);
END
$$;
COMMENT ON FUNCTION ledger.pause_job(text) IS 'Pause a job: its runs return paused; true when it was running free';

CREATE FUNCTION ledger.resume_job(job text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._set_paused(job, false);
END
$$;
COMMENT ON FUNCTION ledger.resume_job(text) IS 'Resume a paused job; true when it was paused';

CREATE FUNCTION ledger.due_slots(job text, at timestamptz DEFAULT NULL)
RETURNS SETOF timestamptz
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_instant(at, 'at');
    v_job := ledger._scheduled_job(job);
    IF v_job.paused THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT unnest(ledger._due(v_job, coalesce(at, ledger._now()),
                                          ledger._newest_done_slot(job)));
END
$$;
COMMENT ON FUNCTION ledger.due_slots(text, timestamptz) IS
    'The slots a runner should execute at `at` (default now), oldest first; no side effects';

CREATE FUNCTION ledger.start_due_run(job text, owner text, ttl interval DEFAULT NULL)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job    ledger.jobs;
    v_ttl    interval;
    v_due    timestamptz[];
    v_result ledger.run_start;
    v_lower  timestamptz;
    v_last   timestamptz;
    v_count  bigint;
BEGIN
    -- Checked once, read once: the start path (ledger._start) is shared with
    -- start_run, and a due slot is a slot of the schedule by construction.
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
    END IF;
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_due_run.job;
    IF v_job.schedule IS NULL THEN
        v_job := ledger._scheduled_job(job);  -- raises LD005 or 22023
    END IF;
    v_ttl := coalesce(ttl, v_job.ttl);
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;
    IF v_job.paused AND v_job.overlap_policy = 'catch_up' THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    -- A scheduler option or a pending trigger: the scheduled start
    -- (62_scheduler.sql), under the job's lease row. Otherwise the path of
    -- 0.1.0, unchanged.
    IF v_job.jitter IS NOT NULL OR v_job.start_deadline IS NOT NULL OR v_job.overlap_policy <> 'catch_up'
       OR EXISTS (SELECT FROM ledger.triggers t WHERE t.job = start_due_run.job AND t.status = 'pending') THEN
        IF NOT ledger._lock_job(job, true) THEN
            v_result.outcome := 'skipped_overlap';  -- another transaction holds the row past the bound
            RETURN v_result;
        END IF;
        SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_due_run.job;
        IF NOT FOUND THEN
            PERFORM ledger._raise('LD005', format('job not found: %s was unregistered while this start waited', job),
                jsonb_build_object('job', job));
        END IF;
        RETURN (ledger._start_scheduled(v_job, owner, v_ttl, false)).start;
    END IF;

    v_due := ledger._due(v_job, ledger._now(), ledger._newest_done_slot(job));
    IF cardinality(v_due) = 0 THEN
        v_result.outcome := 'nothing_due';
        RETURN v_result;
    END IF;
    v_result := ledger._start(job, owner, v_ttl, v_due[1], NULL, NULL);
    IF v_result.outcome <> 'started' THEN
        RETURN v_result;
    END IF;
    -- The lease row is ours: an unregister_job that held it has committed.
    -- Its job is gone, and so is this start (the raise undoes it).
    PERFORM FROM ledger.jobs j WHERE j.job = start_due_run.job;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was unregistered while this start waited', job),
            jsonb_build_object('job', job));
    END IF;

    -- Started: this transaction holds the job's lease row, so the slots the
    -- bound drops are accounted once, by the winner, from a stable view.
    -- They lie after the newest done slot (or the last recorded drop) and
    -- before the slot just started.
    v_lower := ledger._newest_done_slot(job, except_run_id => v_result.run_id);
    IF v_lower IS NULL THEN
        RETURN v_result;  -- never ran before: nothing was missed
    END IF;
    v_lower := greatest(v_lower, (SELECT max(s.last_slot) FROM ledger.skipped_slots s
                                   WHERE s.job = start_due_run.job));
    v_last := ledger._slot_at_or_before(v_job.schedule_spec, v_job.time_zone,
                                        v_result.slot - interval '1 microsecond');
    IF v_last IS NOT NULL AND v_last > v_lower THEN
        v_count := ledger._slot_count(v_job.schedule_spec, v_job.time_zone, v_lower, v_last);
        INSERT INTO ledger.skipped_slots (job, first_slot, last_slot, slot_count, reason)
        VALUES (job, ledger._slot_after(v_job.schedule_spec, v_job.time_zone, v_lower), v_last,
                v_count, 'backfill_limit');
        PERFORM ledger._set_state(job, 'skipped_backfill', slots => v_count);
    END IF;
    RETURN v_result;
END
$$;
COMMENT ON FUNCTION ledger.start_due_run(text, text, interval) IS
    'Start a run for the oldest due slot, recording the slots the catch-up bound drops; nothing_due when none';

-- One batch of a purge: the ended runs older than cutoff among the run ids
-- from from_run_id to from_run_id + 9,999, in one DELETE, so that no
-- statement holds more than a batch of row locks or scans more than a batch
-- of rows. next_run_id: the first run id of the next batch (gaps in the ids
-- skipped), NULL after the last.
--
-- A purge writes no state row, so it never overwrites a transition that
-- commits while it runs, and it locks no lease row. The runs a job's state is
-- read from stay: its last run, its last success (by start) and its newest
-- success by slot (catch-up starts after it), the run that ended last, and
-- the runs of its overlap. What else the state counts is remembered
-- (ledger.purged_state): the longest success, and the failures of the
-- current streak, so a purge never counts a streak or a longest run down.
-- What is kept is read from the state row of the statement's snapshot, which
-- is the log's (the writers change both in one transaction): O(1) per run.
CREATE FUNCTION ledger._purge_batch(cutoff timestamptz, from_run_id bigint,
                                    OUT deleted bigint, OUT next_run_id bigint)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    batch constant integer := 10000;  -- run ids per DELETE
BEGIN
    WITH doomed AS (
        -- Found by primary key: the DELETE joins the batch, not the log.
        SELECT r.run_id FROM ledger.job_execution_log r
          JOIN ledger.counters c ON c.job = r.job
          LEFT JOIN ledger.job_execution_log o ON o.run_id = c.overlap_run_id
         WHERE r.run_id >= from_run_id AND r.run_id < from_run_id + batch
           AND r.status <> 'running' AND r.completed_at < cutoff
           AND r.run_id IS DISTINCT FROM c.last_run_id
           AND NOT coalesce(r.status = 'success' AND (r.started_at = c.last_success_started_at
                                                      OR r.slot = c.done_slot), false)
           AND r.completed_at < c.latest_end
           AND NOT coalesce(r.run_id = o.run_id
                            OR (r.started_at < o.started_at AND r.completed_at > o.started_at), false)
    ), purged AS (
        DELETE FROM ledger.job_execution_log r
         USING doomed
         WHERE r.run_id = doomed.run_id
        RETURNING r.run_id, r.job, r.slot, r.idempotency_key, r.status, r.failure_reason, r.started_at,
                  r.completed_at
    ), slots_done AS (
        -- What a purge must not forget: the slots and keys that succeeded.
        INSERT INTO ledger.purged_slots AS p (job, done_through)
        SELECT purged.job, max(purged.slot) FROM purged
         WHERE purged.status = 'success' AND purged.slot IS NOT NULL
         GROUP BY purged.job
        ON CONFLICT ON CONSTRAINT purged_slots_pkey DO UPDATE SET
            done_through = greatest(p.done_through, excluded.done_through)
    ), keys_done AS (
        INSERT INTO ledger.purged_keys (job, idempotency_key, run_id, completed_at)
        SELECT purged.job, purged.idempotency_key, purged.run_id, purged.completed_at FROM purged
         WHERE purged.status = 'success' AND purged.idempotency_key IS NOT NULL
        ON CONFLICT ON CONSTRAINT purged_keys_pkey DO NOTHING
    ), state_kept AS (
        -- ...and what the state counts of them: their longest success, and
        -- the failures (not cancels) that started after the job's last
        -- success, which stay in its streak while that is the last success.
        INSERT INTO ledger.purged_state AS p (job, longest_success, streak_failures, streak_after)
        SELECT purged.job,
               max(purged.completed_at - purged.started_at) FILTER (WHERE purged.status = 'success'),
               count(*) FILTER (WHERE purged.status = 'failure' AND purged.failure_reason <> 'cancelled'
                                  AND purged.started_at > coalesce(c.last_success_started_at, '-infinity')),
               c.last_success_started_at
          FROM purged JOIN ledger.counters c ON c.job = purged.job
         GROUP BY purged.job, c.last_success_started_at
        HAVING count(*) FILTER (WHERE purged.status = 'success'
                                   OR (purged.status = 'failure' AND purged.failure_reason <> 'cancelled'
                                       AND purged.started_at > coalesce(c.last_success_started_at, '-infinity'))) > 0
        ON CONFLICT ON CONSTRAINT purged_state_pkey DO UPDATE SET
            longest_success = greatest(p.longest_success, excluded.longest_success),
            streak_failures = CASE WHEN p.streak_after IS NOT DISTINCT FROM excluded.streak_after
                                   THEN p.streak_failures + excluded.streak_failures
                                   ELSE excluded.streak_failures END,
            streak_after    = excluded.streak_after
    )
    SELECT count(*) INTO deleted FROM purged;
    SELECT min(r.run_id) INTO next_run_id FROM ledger.job_execution_log r
     WHERE r.run_id >= from_run_id + batch;
END
$$;

-- Old drop records too, except each job's newest (catch-up starts after it).
CREATE FUNCTION ledger._purge_skipped(cutoff timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM ledger.skipped_slots s
     WHERE s.recorded_at < cutoff
       AND s.last_slot < (SELECT max(t.last_slot) FROM ledger.skipped_slots t WHERE t.job = s.job);
END
$$;

-- The purge horizon: older_than checked, subtracted exactly (not in the
-- session's TimeZone).
CREATE FUNCTION ledger._purge_cutoff(older_than interval)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF older_than IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument older_than must not be null';
    END IF;
    PERFORM ledger._check_duration(older_than, 'older_than', ledger._max_older_than());
    RETURN ledger._now() - ledger._exact(older_than);
END
$$;

-- All batches in the caller's transaction: what it removed is gone, or
-- nothing is. It writes no state row, so no run's end waits for it; but the
-- rows it deleted stay locked, and its WAL and dead rows grow, until that
-- transaction ends: a purge of millions of rows belongs to
-- ledger.purge_log_in_batches.
CREATE FUNCTION ledger.purge_log(older_than interval)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cutoff  timestamptz := ledger._purge_cutoff(older_than);
    v_deleted bigint := 0::bigint;
    v_from    bigint;
    v_count   bigint;
BEGIN
    SELECT min(r.run_id) INTO v_from FROM ledger.job_execution_log r;
    WHILE v_from IS NOT NULL LOOP
        SELECT b.deleted, b.next_run_id INTO v_count, v_from FROM ledger._purge_batch(v_cutoff, v_from) b;
        v_deleted := v_deleted + v_count;
    END LOOP;
    PERFORM ledger._purge_skipped(v_cutoff);
    RETURN v_deleted;
END
$$;
COMMENT ON FUNCTION ledger.purge_log(interval) IS
    'Delete ended runs older than that, never a job''s newest success, in batches of run ids, in one transaction; returns how many';

-- What one batch of a purge did, and where the next one starts.
CREATE TYPE ledger.purge_batch AS (
    deleted     bigint,   -- runs this batch deleted
    next_run_id bigint    -- from_run_id of the next batch; NULL: this was the last
);

-- One batch, for a caller that commits between batches
-- (ledger.purge_log_in_batches, jobledger purge): from from_run_id (NULL:
-- the oldest run), the next 10,000 run ids. After the last batch
-- (next_run_id NULL) the old drop records go too.
CREATE FUNCTION ledger.purge_log_batch(older_than interval, from_run_id bigint DEFAULT NULL)
RETURNS ledger.purge_batch
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cutoff timestamptz := ledger._purge_cutoff(older_than);
    v_from   bigint;
    v_batch  ledger.purge_batch := ROW(0::bigint, NULL::bigint);
BEGIN
    IF from_run_id < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument from_run_id must be positive (or null: from the oldest run), not %s', from_run_id),
            DETAIL = jsonb_build_object('argument', 'from_run_id', 'value', from_run_id)::text;
    END IF;
    SELECT min(r.run_id) INTO v_from FROM ledger.job_execution_log r
     WHERE r.run_id >= coalesce(from_run_id, 1);
    IF v_from IS NOT NULL THEN
        SELECT b.deleted, b.next_run_id INTO v_batch.deleted, v_batch.next_run_id
          FROM ledger._purge_batch(v_cutoff, v_from) b;
    END IF;
    IF v_batch.next_run_id IS NULL THEN
        PERFORM ledger._purge_skipped(v_cutoff);
    END IF;
    RETURN v_batch;
END
$$;
COMMENT ON FUNCTION ledger.purge_log_batch(interval, bigint) IS
    'One batch of purge_log (10,000 run ids from from_run_id): how many it deleted and where the next batch starts, NULL after the last';

-- A purge that commits after every batch: no lock is held longer than one
-- batch (a fraction of a second), and a purge stopped half-way keeps the
-- batches it committed, each of them whole. Deliberately neither SECURITY
-- DEFINER nor SET (either forbids COMMIT): it calls only the public
-- ledger.purge_log_batch, so the caller needs ledger_client. Inside a
-- transaction block the first COMMIT fails (2D000) and nothing is removed.
CREATE PROCEDURE ledger.purge_log_in_batches(older_than interval, INOUT deleted bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_next  bigint;
    v_count bigint;
BEGIN
    deleted := 0;
    LOOP
        SELECT b.deleted, b.next_run_id INTO v_count, v_next
          FROM ledger.purge_log_batch(older_than => older_than, from_run_id => v_next) b;
        deleted := deleted + v_count;
        COMMIT;
        EXIT WHEN v_next IS NULL;
    END LOOP;
END
$$;
COMMENT ON PROCEDURE ledger.purge_log_in_batches(interval, bigint) IS
    'purge_log, committing after every batch of 10,000 run ids; returns how many it deleted';
