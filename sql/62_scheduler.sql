-- The scheduler's SQL (issue 23): jitter, start deadlines and overlap
-- policies (applied by start_due_run, start_due_runs, and so run_guarded),
-- run now (trigger), the loop's earliest next start (next_start), the
-- batched start (start_due_runs), the schedulers' registry and upkeep
-- election (scheduler_heartbeat, scheduler_stop), and a jobs file in one
-- atomic call (sync_jobs). docs/contract.md, "The scheduler", defines them.

-- A slot's start offset in [0, bound): a hash of (job, slot), so every host
-- and session computes the same one and the thousand jobs of `0 * * * *`
-- spread over the bound. Pure: the job's name and the slot's instant only
-- (a label holds no control character, so the separator is unambiguous).
CREATE FUNCTION ledger._jitter(job text, slot timestamptz, bound interval)
RETURNS interval
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_hash  bigint;
    v_micros bigint;
BEGIN
    IF bound IS NULL OR slot IS NULL OR bound <= interval '0' THEN
        RETURN interval '0';
    END IF;
    v_hash := hashtextextended(job || E'\x1f' || (extract(epoch FROM slot) * 1000000)::bigint::text, 0);
    v_micros := (extract(epoch FROM bound) * 1000000)::bigint;
    -- (hash mod 2^31) / 2^31 is in [0, 1): the offset is below the bound
    RETURN floor(((v_hash & 2147483647)::float8 / 2147483648.0::float8) * v_micros::float8)::bigint
           * interval '1 microsecond';
END
$$;

-- The shortest gap between a schedule's next slots (an interval schedule's
-- own length; for a cron expression the shortest among its next 50 slots):
-- jitter must stay below it, so a slot's offset never carries it past the
-- next slot.
CREATE FUNCTION ledger._shortest_gap(spec ledger.schedule_spec, time_zone text, after timestamptz)
RETURNS interval
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slot timestamptz;
    v_next timestamptz;
    v_gap  interval;
BEGIN
    IF spec.kind IS NULL THEN
        RETURN NULL;
    END IF;
    IF spec.kind = 'interval' AND spec.every_months = 0 AND spec.every_days = 0 THEN
        RETURN spec.every_micros * interval '1 microsecond';
    END IF;
    v_slot := ledger._slot_after(spec, time_zone, after);
    FOR i IN 1 .. 50 LOOP
        EXIT WHEN v_slot IS NULL;
        v_next := ledger._slot_after(spec, time_zone, v_slot);
        EXIT WHEN v_next IS NULL;
        v_gap := least(v_gap, v_next - v_slot);
        v_slot := v_next;
    END LOOP;
    RETURN v_gap;
END
$$;

-- register_job's jitter: 0 (clears it), or an exact duration with no
-- negative part, at most 24 hours and under the schedule's shortest gap.
CREATE FUNCTION ledger._check_jitter(value interval, spec ledger.schedule_spec, time_zone text, at timestamptz)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_gap interval;
BEGIN
    IF value IS NULL OR value = interval '0' AND date_trunc('month', value) = interval '0' THEN
        RETURN;
    END IF;
    IF date_trunc('month', value) <> interval '0' OR value < interval '0' OR ledger._exact(value) > interval '24 hours'
       OR date_trunc('day', value) < interval '0' OR value - date_trunc('day', value) < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument jitter must be 0 (none) or an exact duration with no month part and no negative part, '
                      'at most 24 hours',
            DETAIL = jsonb_build_object('argument', 'jitter', 'value', value::text, 'max', '24:00:00')::text;
    END IF;
    v_gap := ledger._shortest_gap(spec, time_zone, at);
    IF v_gap IS NOT NULL AND ledger._exact(value) >= v_gap THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument jitter %s must be shorter than the shortest gap between the schedule''s slots (%s)',
                             value, v_gap),
            DETAIL = jsonb_build_object('argument', 'jitter', 'value', value::text, 'shortest_gap', v_gap::text)::text;
    END IF;
END
$$;

CREATE FUNCTION ledger._check_overlap_policy(value text)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NOT NULL AND value NOT IN ('catch_up', 'skip', 'buffer_one', 'replace') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument overlap_policy must be one of catch_up, skip, buffer_one, replace',
            DETAIL = jsonb_build_object('argument', 'overlap_policy', 'value', left(value, 200),
                                        'accepted', jsonb_build_array('catch_up', 'skip', 'buffer_one', 'replace'))::text;
    END IF;
END
$$;

CREATE FUNCTION ledger.slot_jitter(job text, slot timestamptz)
RETURNS interval
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument slot must not be null';
    END IF;
    PERFORM ledger._check_instant(slot, 'slot');
    RETURN ledger._jitter(job, slot, (ledger._registered_job(job)).jitter);
END
$$;
COMMENT ON FUNCTION ledger.slot_jitter(text, timestamptz) IS
    'The start offset of a slot of the job: in [0, jitter), the same on every host (a hash of job and slot)';

-- The newest slot a drop recorded (ledger.skipped_slots): slots at or
-- before it are not due again. Ranges never overlap and grow with
-- first_slot, so the newest first_slot has the newest last_slot.
CREATE FUNCTION ledger._skip_floor(job text)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT s.last_slot FROM ledger.skipped_slots s WHERE s.job = _skip_floor.job
             ORDER BY s.first_slot DESC LIMIT 1);
END
$$;

-- Record slots due[from_i .. to_i] (consecutive slots of the schedule) as
-- skipped for `reason`, and count them: start_deadline in the job's
-- skipped_deadline, overlap in skipped_overlap (as a skip by the overlap
-- check is counted: ledger.skip_counts, folded at the next end).
CREATE FUNCTION ledger._record_skipped(job text, due timestamptz[], from_i integer, to_i integer, reason text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count bigint := to_i - from_i + 1;
BEGIN
    IF v_count < 1 THEN
        RETURN;
    END IF;
    INSERT INTO ledger.skipped_slots (job, first_slot, last_slot, slot_count, reason)
    VALUES (job, due[from_i], due[to_i], v_count, reason);
    IF reason = 'start_deadline' THEN
        PERFORM ledger._set_state(job, 'skipped_deadline', slots => v_count);
    ELSE
        PERFORM ledger._count_skips(job, ledger._lock_wait(), v_count);
    END IF;
END
$$;

-- Each true run of `keep` among due[1 .. n] that is false: recorded as
-- skipped for `reason`, range by range (the due slots are consecutive).
-- Returns the slots kept.
CREATE FUNCTION ledger._skip_where(job text, due timestamptz[], skip boolean[], reason text)
RETURNS timestamptz[]
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_kept  timestamptz[] := ARRAY[]::timestamptz[];
    v_first integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(due), 0) + 1 LOOP
        IF i <= cardinality(due) AND skip[i] THEN
            v_first := coalesce(v_first, i);
        ELSE
            IF v_first IS NOT NULL THEN
                PERFORM ledger._record_skipped(job, due, v_first, i - 1, reason);
                v_first := NULL;
            END IF;
            IF i <= cardinality(due) THEN
                v_kept := v_kept || due[i];
            END IF;
        END IF;
    END LOOP;
    RETURN v_kept;
END
$$;

-- The first lock of a scheduled start, in the per-job order: the job's
-- lease row (or, while it has none, the lock that stands for it). wait:
-- up to ledger._lock_wait() (start_due_run, as its other path waits);
-- otherwise SKIP LOCKED (start_due_runs: another scheduler is at that job,
-- and this one moves on). False when it was not taken.
CREATE FUNCTION ledger._lock_job(job text, wait boolean)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wait text := current_setting('lock_timeout');
BEGIN
    IF wait THEN
        BEGIN
            PERFORM set_config('lock_timeout', ledger._lock_wait(), true);
            PERFORM ledger._lock_registration(job);
            PERFORM set_config('lock_timeout', v_wait, true);
            RETURN true;
        EXCEPTION WHEN lock_not_available THEN
            RETURN false;
        END;
    END IF;
    PERFORM FROM ledger.leases l WHERE l.job = _lock_job.job FOR UPDATE SKIP LOCKED;
    IF FOUND THEN
        RETURN true;
    ELSIF EXISTS (SELECT FROM ledger.leases l WHERE l.job = _lock_job.job) THEN
        RETURN false;  -- another transaction has it
    ELSIF NOT pg_try_advisory_xact_lock(hashtext('ledger.leases'), hashtext(job)) THEN
        RETURN false;
    END IF;
    -- made meanwhile (its maker held the lock just taken, and has committed)
    PERFORM FROM ledger.leases l WHERE l.job = _lock_job.job FOR UPDATE SKIP LOCKED;
    RETURN FOUND OR NOT EXISTS (SELECT FROM ledger.leases l WHERE l.job = _lock_job.job);
END
$$;

-- The live run superseded by the overlap policy replace: closed as
-- cancelled (no failure of the job's streak), with cancel_requested_at set
-- so that its holder's next heartbeat answers NULL (lost), and the lease
-- released, so the start that follows issues a new token and the old one's
-- fenced writes and its end are refused (LD001) from this moment on. The
-- caller holds the job's lease row.
CREATE FUNCTION ledger._supersede(job text, at timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run ledger.job_execution_log;
BEGIN
    UPDATE ledger.job_execution_log r SET
        status              = 'failure',
        failure_reason      = 'cancelled',
        completed_at        = greatest(at, r.started_at),
        cancel_requested_at = coalesce(r.cancel_requested_at, greatest(at, r.started_at)),
        error               = 'superseded: the overlap policy replace started a newer run'
     WHERE r.job = _supersede.job AND r.status = 'running'
    RETURNING * INTO v_run;
    UPDATE ledger.leases l SET released_at = at, expires_at = least(l.expires_at, at)
     WHERE l.job = _supersede.job AND l.released_at IS NULL;
    IF v_run.run_id IS NOT NULL THEN
        PERFORM ledger._set_state(job, 'ended', v_run);
    END IF;
END
$$;

-- A pending trigger resolved as skipped (reason overlap: counted as a
-- skip by the overlap check; paused).
CREATE FUNCTION ledger._skip_trigger(trigger_id bigint, reason text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job text;
BEGIN
    UPDATE ledger.triggers t SET status = 'skipped', skip_reason = reason, resolved_at = ledger._now()
     WHERE t.trigger_id = _skip_trigger.trigger_id AND t.status = 'pending'
    RETURNING t.job INTO v_job;
    IF FOUND AND reason = 'overlap' THEN
        PERFORM ledger._count_skips(v_job, ledger._lock_wait(), 1);
    END IF;
END
$$;

-- The scheduled start of one job, under the job's lease row (the caller
-- took it: ledger._lock_job) and with checked arguments: what
-- start_due_run does for a job with a scheduler option or a pending
-- trigger, and what start_due_runs does for every job. In order:
--   paused: nothing (a pending trigger is skipped, reason paused);
--   a live lease: under replace, when a trigger is pending or a slot came
--     due after the running one, the run is superseded (ledger._supersede)
--     and the start goes on; otherwise nothing starts (a pending trigger
--     is skipped under skip, waits under catch_up and buffer_one);
--   a pending trigger: a manual run (no slot; detail trigger, trigger_id);
--   the due slots (catch-up: the newest max_backfill after the newest slot
--     done or skipped; for start_due_runs also after a slot whose run
--     failed or was cancelled, which it never retries, and for a job that
--     never ran, none before its registration), the newest left out
--     while its jitter has not passed; the slots the bound dropped before
--     them recorded (backfill_limit); under skip, those that came due while
--     the job's last run was live recorded skipped (overlap), under
--     buffer_one and replace all of them but the newest; those past their start
--     deadline recorded skipped (start_deadline); the oldest left starts.
CREATE FUNCTION ledger._start_scheduled(v_job ledger.jobs, owner text, ttl interval, batch boolean,
                                        OUT start ledger.run_start, OUT trigger_id bigint)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

-- A job's wakeup mark moved back to now (ledger.wakeups): something that
-- can make its next start earlier happened. A registration or a change of
-- it (schedule, zone, pause or resume, jitter, deadline, overlap policy),
-- a trigger asked for, a lease released or cut short (a run's end, a
-- release, supersede, revoke). A lease of a job with no schedule and no
-- pending trigger moves nothing: no start can come of it. Never later than
-- the mark was: only start_due_runs, which computes the next start under
-- the job's lease row and mark, moves a mark forward.
CREATE FUNCTION ledger._wake_job()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

CREATE TRIGGER jobs_wake
    AFTER INSERT OR UPDATE OF schedule, schedule_spec, time_zone, created_at, paused, jitter, start_deadline,
                              overlap_policy ON ledger.jobs
    FOR EACH ROW EXECUTE FUNCTION ledger._wake_job();
CREATE TRIGGER triggers_wake
    AFTER INSERT ON ledger.triggers
    FOR EACH ROW WHEN (NEW.status = 'pending') EXECUTE FUNCTION ledger._wake_job();
CREATE TRIGGER leases_wake
    AFTER UPDATE OF released_at, expires_at ON ledger.leases
    FOR EACH ROW WHEN ((OLD.released_at IS NULL AND NEW.released_at IS NOT NULL) OR NEW.expires_at < OLD.expires_at)
    EXECUTE FUNCTION ledger._wake_job();
-- a seat's end, release or cut (seats mode): a place of the job, and of
-- its pool, freed
CREATE TRIGGER lease_seats_wake
    AFTER UPDATE OF released_at, expires_at ON ledger.lease_seats
    FOR EACH ROW WHEN ((OLD.released_at IS NULL AND NEW.released_at IS NOT NULL) OR NEW.expires_at < OLD.expires_at)
    EXECUTE FUNCTION ledger._wake_job();

-- Kept for the calls in flight across revision 0009 (a start_due_runs or next_start begun in
-- 0007's bodies calls it after the commit): nothing calls it now; a later revision drops it.
CREATE FUNCTION ledger._next_starts(jobs text[])
RETURNS TABLE (job text, at timestamptz)
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    v_now timestamptz := ledger._now();
BEGIN
    RETURN QUERY
    SELECT j.job::text,
           CASE
               WHEN j.paused THEN NULL
               WHEN x.live AND j.overlap_policy = 'replace' AND t.trigger_id IS NOT NULL THEN v_now
               WHEN x.live AND j.overlap_policy = 'replace' THEN
                   (SELECT s.slot + CASE WHEN j.jitter IS NULL THEN interval '0' ELSE ledger._jitter(j.job, s.slot, j.jitter) END
                      FROM (SELECT ledger._slot_after(j.schedule_spec, j.time_zone,
                                                      greatest(c.done_slot, rr.slot, f.last_slot, j.created_at)) AS slot) s)
               WHEN x.live THEN l.expires_at
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
           SELECT coalesce(l.released_at IS NULL AND l.expires_at > v_now, false) AS live,
                  greatest(c.done_slot, f.last_slot,
                           CASE WHEN lr.status = 'failure' AND lr.failure_reason IN ('error', 'cancelled')
                                THEN lr.slot END) AS floor) x
     WHERE (_next_starts.jobs IS NULL OR j.job = ANY (_next_starts.jobs));
END
$$;

-- A job's next start as start_due_runs would see it: NULL when nothing
-- will be due (paused, no schedule and no trigger); now for a pending
-- trigger; while a lease is live, under replace the next slot (+ jitter)
-- after the running one, otherwise the lease's expiry (nothing starts
-- before it ends; whoever ends it asks again); else the first slot after
-- the newest done or skipped slot (and after a failed or cancelled last
-- run's slot), plus its jitter. One job's rows by key, the schedule
-- evaluated only where the state row's next_due is not the answer.
CREATE FUNCTION ledger._next_start_of(job text)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
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
$$;

CREATE FUNCTION ledger.next_start(jobs text[] DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_mark record;
    v_at   timestamptz;
    v_best timestamptz;
BEGIN
    PERFORM ledger._check_jobs(jobs, false);
    -- The marks, earliest first: each is at or before its job's next start,
    -- so once a mark is not before the best start found, none after it is.
    -- Mostly one job's start computed; more while marks are behind (jobs
    -- due, or not yet visited since a change).
    -- EXECUTE: planned with the list as a constant, so that membership is
    -- a hash probe, not a walk of the array per mark.
    FOR v_mark IN EXECUTE
        'SELECT w.job, w.at, w.pool_wait FROM ledger.wakeups w
          WHERE w.at IS NOT NULL AND ($1 IS NULL OR w.job = ANY ($1))
          ORDER BY w.at, w.job' USING jobs
    LOOP
        EXIT WHEN v_mark.at >= v_best;
        -- A job waiting a place in its pool: its mark is when one frees at
        -- the latest (an end in the pool moves it back sooner).
        v_at := CASE WHEN v_mark.pool_wait IS NOT NULL THEN v_mark.at ELSE ledger._next_start_of(v_mark.job) END;
        IF v_at < v_best OR v_best IS NULL THEN
            v_best := v_at;
        END IF;
    END LOOP;
    RETURN v_best;
END
$$;
COMMENT ON FUNCTION ledger.next_start(text[]) IS
    'The earliest moment at which start_due_runs over these jobs (NULL: all) would start something; NULL when never';

-- A list of job names: each a label (22023 naming `jobs`, DETAIL the
-- position), at most 100,000 of them; NULL only when allowed.
CREATE FUNCTION ledger._check_jobs(jobs text[], required boolean)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bad integer;
BEGIN
    IF jobs IS NULL THEN
        IF required THEN
            RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument jobs must not be null';
        END IF;
        RETURN;
    END IF;
    IF cardinality(jobs) > 100000 OR array_ndims(jobs) > 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument jobs must be a one-dimensional array of at most 100000 job names',
            DETAIL = jsonb_build_object('argument', 'jobs', 'length', cardinality(jobs), 'max', 100000)::text;
    END IF;
    SELECT min(u.i) INTO v_bad FROM unnest(jobs) WITH ORDINALITY AS u(job, i)
     WHERE u.job IS NULL OR NOT (char_length(u.job) BETWEEN 1 AND 200 AND ledger._is_visible_text(u.job));
    IF v_bad IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument jobs: element %s must be a job name of 1 to 200 characters without control, '
                             'format or separator characters', v_bad),
            DETAIL = jsonb_build_object('argument', 'jobs', 'position', v_bad)::text;
    END IF;
END
$$;

CREATE FUNCTION ledger.start_due_runs(jobs text[], owner text, max_runs integer DEFAULT NULL, ttl interval DEFAULT NULL)
RETURNS TABLE (job text, outcome text, run_id bigint, token bigint, expires_at timestamptz, slot timestamptz,
               trigger_id bigint)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
COMMENT ON FUNCTION ledger.start_due_runs(text[], text, integer, interval) IS
    'Start, in one call, what is due of these jobs (slots with jitter, deadline and overlap policy; triggers); one row per started run';

CREATE FUNCTION ledger.trigger(job text, requested_by text DEFAULT NULL, detail jsonb DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job     ledger.jobs;
    v_lease   ledger.leases;
    v_id      bigint;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(requested_by, 'requested_by', false);
    PERFORM ledger._check_detail(detail);
    v_lease := ledger._lock_registration(job);  -- the per-job order: the lease row first
    v_job := ledger._registered_job(job);
    SELECT t.trigger_id INTO v_id FROM ledger.triggers t WHERE t.job = trigger.job AND t.status = 'pending';
    IF v_id IS NULL THEN
        INSERT INTO ledger.triggers (job, requested_by, requested_at, detail)
        VALUES (job, requested_by, ledger._now(), detail)
        RETURNING trigger_id INTO v_id;
        IF v_job.paused THEN
            PERFORM ledger._skip_trigger(v_id, 'paused');
        ELSIF v_job.overlap_policy = 'skip' AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now() THEN
            -- a live run under skip: this run now is skipped, and counted so
            PERFORM ledger._skip_trigger(v_id, 'overlap');
        END IF;
    END IF;
    PERFORM pg_notify('ledger_scheduler', job);
    RETURN v_id;
END
$$;
COMMENT ON FUNCTION ledger.trigger(text, text, jsonb) IS
    'Ask for a manual run now: picked by the next start_due_run(s) under the lease and the overlap policy; the trigger id';

-- The schedulers' registry and the upkeep election.
CREATE FUNCTION ledger.scheduler_heartbeat(scheduler text, host text, pid integer, version text, jobs text[],
                                           ttl interval, stopping boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now  timestamptz;
    v_ttl  interval;
    v_jobs text[];
BEGIN
    PERFORM ledger._check_label(scheduler, 'scheduler');
    PERFORM ledger._check_label(host, 'host');
    PERFORM ledger._check_label(version, 'version');
    IF pid IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument pid must not be null';
    ELSIF pid < 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'argument pid must not be negative',
            DETAIL = jsonb_build_object('argument', 'pid', 'value', pid)::text;
    END IF;
    PERFORM ledger._check_jobs(jobs, true);
    IF ttl IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument ttl must not be null';
    END IF;
    PERFORM ledger._check_ttl(ttl);
    IF stopping IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument stopping must not be null';
    END IF;
    v_ttl := ledger._exact(ttl);
    v_now := ledger._now();
    SELECT s.jobs INTO v_jobs FROM ledger.schedulers s WHERE s.scheduler = scheduler_heartbeat.scheduler FOR UPDATE;
    INSERT INTO ledger.schedulers AS s (scheduler, host, pid, version, jobs, started_at, heartbeat_at, expires_at,
                                        stopping)
    VALUES (scheduler, host, pid, version, jobs, v_now, v_now, v_now + v_ttl, stopping)
    ON CONFLICT ON CONSTRAINT schedulers_pkey DO UPDATE SET
        host = excluded.host, pid = excluded.pid, version = excluded.version, jobs = excluded.jobs,
        -- a new process under the old name starts anew
        started_at = CASE WHEN s.pid = excluded.pid AND s.host = excluded.host THEN s.started_at
                          ELSE excluded.started_at END,
        heartbeat_at = excluded.heartbeat_at, expires_at = excluded.expires_at, stopping = excluded.stopping;
    -- the pairs, rewritten only when the list changed (a heartbeat is one
    -- row's update otherwise)
    IF v_jobs IS DISTINCT FROM jobs THEN
        DELETE FROM ledger.scheduler_jobs sj WHERE sj.scheduler = scheduler_heartbeat.scheduler;
        INSERT INTO ledger.scheduler_jobs (job, scheduler)
        SELECT DISTINCT u.job, scheduler_heartbeat.scheduler FROM unnest(jobs) AS u(job);
    END IF;
    IF stopping THEN
        UPDATE ledger.upkeep_leader u SET scheduler = NULL, expires_at = NULL
         WHERE u.singleton AND u.scheduler = scheduler_heartbeat.scheduler;
        RETURN false;
    END IF;
    -- Compare-and-set on the one row: kept by the leader, taken when free
    -- or expired. Concurrent callers queue on the row and each re-reads it,
    -- so at most one holds it at any instant.
    UPDATE ledger.upkeep_leader u SET
        term        = u.term + CASE WHEN u.scheduler IS DISTINCT FROM scheduler_heartbeat.scheduler THEN 1 ELSE 0 END,
        acquired_at = CASE WHEN u.scheduler IS DISTINCT FROM scheduler_heartbeat.scheduler THEN v_now
                           ELSE u.acquired_at END,
        scheduler   = scheduler_heartbeat.scheduler,
        expires_at  = v_now + v_ttl
     WHERE u.singleton
       AND (u.scheduler = scheduler_heartbeat.scheduler OR u.scheduler IS NULL OR u.expires_at <= v_now);
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION ledger.scheduler_heartbeat(text, text, integer, text, text[], interval, boolean) IS
    'Keep this scheduler''s row live for ttl (jobs served, version); true when it is the upkeep leader';

CREATE FUNCTION ledger.scheduler_stop(scheduler text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(scheduler, 'scheduler');
    DELETE FROM ledger.schedulers s WHERE s.scheduler = scheduler_stop.scheduler;
    UPDATE ledger.upkeep_leader u SET scheduler = NULL, expires_at = NULL
     WHERE u.singleton AND u.scheduler = scheduler_stop.scheduler;
END
$$;
COMMENT ON FUNCTION ledger.scheduler_stop(text) IS 'Remove the scheduler''s row and its upkeep leadership (a graceful stop)';

-- The register_job arguments a jobs file may set, with the value a key
-- left out of a definition stands for (a definition is the whole of it):
-- NULL keeps what the job has (a schedule or a ttl cannot be removed).
CREATE FUNCTION ledger._definition_keys()
RETURNS jsonb
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN '{"schedule": null, "ttl": null, "max_backfill": 1, "time_zone": "UTC", "late_after": "0",
             "down_after": "0", "min_runtime": "0", "max_runtime": "0", "pause_after_failures": 0,
             "jitter": "0", "start_deadline": "0", "overlap_policy": "catch_up", "pool": "",
             "max_concurrent": 1}'::jsonb;
END
$$;

-- One job of a jobs file registered: register_job with each key of the
-- definition (absent keys: ledger._definition_keys()); a key whose value
-- does not cast, or that register_job refuses, raises 22023 naming the job
-- and the key.
CREATE FUNCTION ledger._apply_definition(job text, definition jsonb)
RETURNS ledger.jobs
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

CREATE FUNCTION ledger.sync_jobs(definitions jsonb, source text, removed text DEFAULT 'pause')
RETURNS TABLE (job text, action text)
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_name   text;
    v_key    text;
    v_old    ledger.jobs;
    v_new    ledger.jobs;
    v_action text;
BEGIN
    IF definitions IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument definitions must not be null';
    ELSIF jsonb_typeof(definitions) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument definitions must be a JSON object {job: {register_job argument: value}}',
            DETAIL = jsonb_build_object('argument', 'definitions', 'type', jsonb_typeof(definitions))::text;
    END IF;
    PERFORM ledger._check_label(source, 'source');
    IF removed IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument removed must not be null';
    ELSIF removed NOT IN ('pause', 'unregister') THEN
        RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = 'argument removed must be pause or unregister',
            DETAIL = jsonb_build_object('argument', 'removed', 'value', left(removed, 200))::text;
    END IF;
    -- The shape first, every job: a name, an object, known keys only.
    FOR v_name IN SELECT k FROM jsonb_object_keys(definitions) k ORDER BY 1 LOOP
        IF NOT (char_length(v_name) BETWEEN 1 AND 200 AND ledger._is_visible_text(v_name)) THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument definitions: job name %s must be 1 to 200 characters without control, '
                                 'format or separator characters', left(v_name, 200)),
                DETAIL = jsonb_build_object('argument', 'definitions', 'job', left(v_name, 200))::text;
        ELSIF jsonb_typeof(definitions -> v_name) <> 'object' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument definitions: job %s must be an object of register_job arguments', v_name),
                DETAIL = jsonb_build_object('argument', 'definitions', 'job', v_name)::text;
        END IF;
        SELECT min(k) INTO v_key FROM jsonb_object_keys(definitions -> v_name) k
         WHERE NOT ledger._definition_keys() ? k;
        IF v_key IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument definitions: job %s, key %s: unknown key (the keys are register_job''s '
                                 'arguments: %s)', v_name, left(v_key, 200),
                                 (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(ledger._definition_keys()) k)),
                DETAIL = jsonb_build_object('argument', 'definitions', 'job', v_name, 'key', left(v_key, 200))::text;
        END IF;
    END LOOP;

    FOR v_name IN SELECT k FROM jsonb_object_keys(definitions) k ORDER BY 1 LOOP
        PERFORM ledger._lock_registration(v_name);
        SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = v_name;
        v_new := ledger._apply_definition(v_name, definitions -> v_name);
        IF v_old.job IS NULL THEN
            v_action := 'created';
        ELSIF (to_jsonb(v_old) - 'updated_at' - 'defined_by') IS DISTINCT FROM (to_jsonb(v_new) - 'updated_at' - 'defined_by') THEN
            v_action := CASE WHEN v_old.defined_by IS DISTINCT FROM source AND v_old.defined_by IS NOT NULL
                             THEN 'overridden' ELSE 'changed' END;
        ELSE
            v_action := 'unchanged';
        END IF;
        -- A job this source paused when it left the file is back in it.
        IF v_new.paused AND v_new.pause_reason = 'removed' THEN
            PERFORM ledger._set_paused(v_name, false);
            v_action := CASE WHEN v_action = 'unchanged' THEN 'changed' ELSE v_action END;
        END IF;
        UPDATE ledger.jobs j SET defined_by = source WHERE j.job = v_name AND j.defined_by IS DISTINCT FROM source;
        IF v_action = 'overridden' THEN
            INSERT INTO ledger.events (kind, job, detail)
            VALUES ('job_redefined', v_name,
                    jsonb_build_object('source', source, 'previous_source', v_old.defined_by,
                                       'definition', definitions -> v_name));
        END IF;
        job := v_name;
        action := v_action;
        RETURN NEXT;
    END LOOP;

    -- The jobs this source defined that its file no longer has.
    FOR v_name IN
        SELECT j.job FROM ledger.jobs j WHERE j.defined_by = source AND NOT definitions ? j.job ORDER BY 1
    LOOP
        job := v_name;
        IF removed = 'unregister' THEN
            BEGIN
                PERFORM ledger.unregister_job(v_name);
            EXCEPTION WHEN SQLSTATE '22023' THEN
                GET STACKED DIAGNOSTICS v_key = MESSAGE_TEXT;
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('argument definitions: job %s left the file and cannot be unregistered: %s',
                                     v_name, v_key),
                    DETAIL = jsonb_build_object('argument', 'definitions', 'job', v_name)::text;
            END;
            action := 'unregistered';
            RETURN NEXT;
        ELSE
            PERFORM ledger._lock_registration(v_name);
            UPDATE ledger.jobs j SET paused = true, paused_at = ledger._now(), pause_reason = 'removed',
                                     updated_at = ledger._now()
             WHERE j.job = v_name AND NOT j.paused;
            IF FOUND THEN
                PERFORM pg_notify('ledger_scheduler', v_name);
                action := 'paused';
                RETURN NEXT;
            END IF;
        END IF;
    END LOOP;
END
$$;
COMMENT ON FUNCTION ledger.sync_jobs(jsonb, text, text) IS
    'A jobs file in one atomic call: jobs registered or changed, those the source no longer has paused or unregistered';

-- The triggers, newest first, with what came of them (a view over the
-- table, for the CLI and the dashboard).
CREATE VIEW ledger.trigger_status AS
SELECT t.trigger_id, t.job, t.requested_by, t.requested_at, t.status, t.skip_reason, t.run_id, t.resolved_at,
       r.status AS run_status, t.detail
  FROM ledger.triggers t
  LEFT JOIN ledger.job_execution_log r ON r.run_id = t.run_id;
COMMENT ON VIEW ledger.trigger_status IS 'Manual runs asked for: pending, started (with the run''s status) or skipped';
