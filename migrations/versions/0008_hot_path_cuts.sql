-- 0008: hot path cuts (drafted by tools/draft_revision.py from sql/)

CREATE OR REPLACE FUNCTION ledger._set_state(job text, event text, run ledger.job_execution_log DEFAULT NULL::ledger.job_execution_log, slots bigint DEFAULT NULL::bigint)
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
BEGIN
    IF event NOT IN ('leased', 'started', 'ended', 'lost') THEN
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
            running_run_id     = run.run_id,
            running_token      = run.token,
            running_started_at = run.started_at,
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
            running_run_id          = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_run_id END,
            running_token           = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_token END,
            running_started_at      = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_started_at END,
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
            RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
            RETURN;
        ELSIF v_state <> 'locked' THEN
            RETURN;
        END IF;
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

CREATE OR REPLACE FUNCTION ledger._lock_run(run_id bigint, token bigint)
 RETURNS ledger.job_execution_log
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job text;
    v_run ledger.job_execution_log;
BEGIN
    IF run_id IS NULL OR token IS NULL OR run_id <= 0 OR token <= 0 THEN  -- the checks only to raise
        PERFORM ledger._check_token(run_id, 'run_id');
        PERFORM ledger._check_token(token);
    END IF;
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _lock_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    PERFORM FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;
    SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _lock_run.run_id;
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
    RETURN v_run;
END
$function$;
