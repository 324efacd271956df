-- Operator commands: what an operator reaches for by hand (jobledger
-- unregister, release, cancel). Each follows the per-job lock order (the
-- lease row first) and records in the log what it does to a run.

-- Remove a job's registration (its schedule, bounds, pause, skipped
-- ranges). With with_history also its runs, counters and purge marks, so
-- that its slots and keys may run again; the lease row (the job's token
-- high-water mark) and its fences stay, so no token is ever issued twice.
-- Refused (22023 naming job) while a run of the job is live: cancel it or
-- force-release the lease first. LD005 when the ledger knows nothing of it.
CREATE FUNCTION ledger.unregister_job(job text, with_history boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
COMMENT ON FUNCTION ledger.unregister_job(text, boolean) IS
    'Remove a job''s registration, and with with_history its runs and counters; its token mark stays';

-- Force-release a job's lease, whoever holds it: a new token is issued on
-- a lease that is released at once, so the old holder's token is
-- superseded (its heartbeat answers NULL, its fence and its end are
-- refused with LD001) and its running run is closed as failure
-- (superseded). Returns the new token; NULL when the job has no lease row
-- (LD005 when the ledger knows nothing of the job).
CREATE FUNCTION ledger.force_release(job text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;
-- force_release of a job in seats mode, its lease row locked: every seat
-- gets a new token of its own, released at once (so each old holder's
-- token is superseded, as a single holder's is), and every running run is
-- closed (superseded). Returns the last token issued.
CREATE FUNCTION ledger._force_release_seats(job text, at timestamptz, timeline integer)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
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
$$;

COMMENT ON FUNCTION ledger.force_release(text) IS
    'Release a job''s lease whoever holds it: a new token supersedes the holder''s, its running run is closed';

-- An operator asks a running run to stop: the request is recorded on the
-- run (cancel_requested_at), and the holder's next heartbeat ends the run
-- as cancelled and answers NULL (the lease is lost to it). True when this
-- call made the request; false when it was made already. LD004 unknown,
-- LD003 when the run has ended.
CREATE FUNCTION ledger.request_cancel(run_id bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.label;
    v_run ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_token(run_id, 'run_id');
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = request_cancel.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    PERFORM FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;
    SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = request_cancel.run_id;
    IF v_run.status <> 'running' THEN
        PERFORM ledger._raise_not_running(v_run);
    END IF;
    UPDATE ledger.job_execution_log r SET cancel_requested_at = ledger._now()
     WHERE r.run_id = request_cancel.run_id AND r.cancel_requested_at IS NULL;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION ledger.request_cancel(bigint) IS
    'Ask a running run to stop: its holder''s next heartbeat ends it as cancelled and learns it lost the lease';

-- Run a scheduled job's slots in [from_slot, to_slot] (for example those
-- ledger.skipped_slots recorded), oldest first: a run for the oldest slot
-- of the range that is due (not in the future), has not succeeded and is
-- not running, taken under the lease as start_run takes it; 'nothing_due'
-- when none is left. A runner loops on it as on start_due_run. The range
-- holds at most 1000 slots (ledger._max_backfill), so a call walks at most
-- that many.
CREATE FUNCTION ledger.backfill(job text, owner text, from_slot timestamptz, to_slot timestamptz,
                                ttl interval DEFAULT NULL)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job    ledger.jobs;
    v_ttl    interval;
    v_slot   timestamptz;
    v_upto   timestamptz;
    v_count  bigint;
    v_result ledger.run_start;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    IF from_slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument from_slot must not be null';
    ELSIF to_slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument to_slot must not be null';
    END IF;
    PERFORM ledger._check_instant(from_slot, 'from_slot');
    PERFORM ledger._check_instant(to_slot, 'to_slot');
    PERFORM ledger._check_ttl(ttl);
    IF to_slot < from_slot THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument to_slot %s is before from_slot %s', to_slot, from_slot),
            DETAIL = jsonb_build_object('argument', 'to_slot', 'value', to_slot, 'from_slot', from_slot)::text;
    END IF;
    v_job := ledger._scheduled_job(job);  -- LD005, or 22023 without a schedule
    v_count := ledger._slot_count(v_job.schedule_spec, v_job.time_zone, from_slot - interval '1 microsecond',
                                  to_slot);
    IF v_count > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument to_slot: the range from %s to %s holds %s slots of job %s, more than %s; '
                             'backfill it in parts', from_slot, to_slot, v_count, job, ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'to_slot', 'job', job, 'from_slot', from_slot,
                                        'value', to_slot, 'slots', v_count, 'max', ledger._max_backfill())::text;
    END IF;
    v_ttl := ledger._resolve_ttl(job, ttl);
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;
    v_upto := least(to_slot, ledger._now());
    v_slot := ledger._slot_after(v_job.schedule_spec, v_job.time_zone, from_slot - interval '1 microsecond');
    WHILE v_slot IS NOT NULL AND v_slot <= v_upto LOOP
        IF NOT ledger._already_done(job, v_slot, NULL) THEN
            RETURN ledger._start(job, owner, v_ttl, v_slot, NULL, NULL);
        END IF;
        v_slot := ledger._slot_after(v_job.schedule_spec, v_job.time_zone, v_slot);
    END LOOP;
    v_result.outcome := 'nothing_due';
    RETURN v_result;
END
$$;
COMMENT ON FUNCTION ledger.backfill(text, text, timestamptz, timestamptz, interval) IS
    'Start a run for the oldest slot in the range that has not succeeded and is not running; nothing_due when none';
