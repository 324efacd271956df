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
    IF slot > clock_timestamp() THEN
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
       AND l.expires_at > clock_timestamp();
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

CREATE FUNCTION ledger.register_job(
    job text,
    schedule text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    max_backfill integer DEFAULT 1,
    time_zone text DEFAULT 'UTC')
RETURNS ledger.jobs
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_spec ledger.schedule_spec;
    v_job  ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF max_backfill IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument max_backfill must not be null';
    ELSIF max_backfill < 1 OR max_backfill > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_backfill must be from 1 to %s', ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'max_backfill', 'value', max_backfill,
                                        'max', ledger._max_backfill())::text;
    END IF;
    PERFORM ledger._check_ttl(ttl);
    PERFORM ledger._check_time_zone(time_zone);
    IF schedule IS NOT NULL THEN
        v_spec := ledger._parse_schedule(schedule, time_zone);  -- parsed once, here
    END IF;

    INSERT INTO ledger.jobs AS j
        (job, schedule, time_zone, ttl, max_backfill, schedule_spec)
    VALUES (register_job.job, register_job.schedule, register_job.time_zone, register_job.ttl,
            register_job.max_backfill, v_spec)
    ON CONFLICT ON CONSTRAINT jobs_pkey DO UPDATE SET
        schedule      = excluded.schedule,
        time_zone     = excluded.time_zone,
        ttl           = excluded.ttl,
        max_backfill  = excluded.max_backfill,
        schedule_spec = excluded.schedule_spec,
        updated_at    = clock_timestamp()
    RETURNING * INTO v_job;
    RETURN v_job;
END
$$;
COMMENT ON FUNCTION ledger.register_job(text, text, interval, integer, text) IS
    'Register or update a job: schedule (interval or cron), default ttl, catch-up bound, time zone';

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
    PERFORM ledger._registered_job(job);
    UPDATE ledger.jobs j SET paused = _set_paused.paused, updated_at = clock_timestamp()
     WHERE j.job = _set_paused.job AND j.paused <> _set_paused.paused;
    RETURN FOUND;
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
    RETURN QUERY SELECT unnest(ledger._due(v_job, coalesce(at, clock_timestamp()),
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
    v_due    timestamptz[];
    v_result ledger.run_start;
    v_lower  timestamptz;
    v_last   timestamptz;
    v_count  bigint;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    v_job := ledger._scheduled_job(job);
    PERFORM ledger._resolve_ttl(job, ttl);
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    v_due := ledger._due(v_job, clock_timestamp(), ledger._newest_done_slot(job));
    IF cardinality(v_due) = 0 THEN
        v_result.outcome := 'nothing_due';
        RETURN v_result;
    END IF;
    v_result := ledger.start_run(job, owner, ttl, slot => v_due[1]);
    IF v_result.outcome <> 'started' THEN
        RETURN v_result;
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
        PERFORM ledger._count(job, skipped_backfill => v_count);
    END IF;
    RETURN v_result;
END
$$;
COMMENT ON FUNCTION ledger.start_due_run(text, text, interval) IS
    'Start a run for the oldest due slot, recording the slots the catch-up bound drops; nothing_due when none';

CREATE FUNCTION ledger.purge_log(older_than interval)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cutoff  timestamptz;
    v_deleted bigint;
BEGIN
    IF older_than IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument older_than must not be null';
    END IF;
    PERFORM ledger._check_duration(older_than, 'older_than', ledger._max_older_than());
    v_cutoff := clock_timestamp() - older_than;

    -- Keep each job's newest success, by slot (catch-up starts from it) and
    -- by time (job_status shows it).
    WITH keep AS (
        SELECT newest.run_id
          FROM (SELECT DISTINCT job FROM ledger.job_execution_log) jobs_,
               LATERAL (
                   (SELECT r.run_id FROM ledger.job_execution_log r
                     WHERE r.job = jobs_.job AND r.status = 'success' AND r.slot IS NOT NULL
                     ORDER BY r.slot DESC LIMIT 1)
                   UNION ALL
                   (SELECT r.run_id FROM ledger.job_execution_log r
                     WHERE r.job = jobs_.job AND r.status = 'success'
                     ORDER BY r.completed_at DESC LIMIT 1)) newest
    ), purged AS (
        DELETE FROM ledger.job_execution_log r
         WHERE r.status <> 'running'
           AND r.completed_at < v_cutoff
           AND r.run_id NOT IN (SELECT keep.run_id FROM keep)
        RETURNING r.run_id, r.job, r.slot, r.idempotency_key, r.status, r.completed_at
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
    )
    SELECT count(*) INTO v_deleted FROM purged;

    -- Old drop records too, except each job's newest (catch-up starts after it).
    DELETE FROM ledger.skipped_slots s
     WHERE s.recorded_at < v_cutoff
       AND s.last_slot < (SELECT max(t.last_slot) FROM ledger.skipped_slots t WHERE t.job = s.job);
    RETURN v_deleted;
END
$$;
COMMENT ON FUNCTION ledger.purge_log(interval) IS
    'Delete ended runs older than that, never a job''s newest success; returns how many';
