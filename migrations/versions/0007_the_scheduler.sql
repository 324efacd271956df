-- 0007: the scheduler (drafted by tools/draft_revision.py from sql/)

-- By hand: the locks, each waited for (at most the migration's 2 s lock_timeout), in 0005's order: the
-- views that read the tables changed below first (a no-op ALTER takes each; a reader takes a view before
-- its tables), then the tables as the writers take them, the lease rows first. A deadlock with a writer
-- that took them in another order undoes this try whole, and it is tried again (ledger.migrate).
ALTER VIEW ledger.alerts OWNER TO ledger_owner;
ALTER VIEW ledger.job_health OWNER TO ledger_owner;
ALTER VIEW ledger.ttl_advice OWNER TO ledger_owner;
ALTER VIEW ledger.job_status OWNER TO ledger_owner;
ALTER VIEW ledger.job_counters OWNER TO ledger_owner;
ALTER VIEW ledger._job_state OWNER TO ledger_owner;
-- ACCESS EXCLUSIVE at once, with the other tables it alters, as 0005 takes them (an upgrade from
-- 0.1.0 already holds them all): a lock strengthened later deadlocks with the writers.
LOCK TABLE ledger.leases IN ACCESS EXCLUSIVE MODE;
LOCK TABLE ledger.jobs IN ACCESS EXCLUSIVE MODE;
LOCK TABLE ledger.counters, ledger.events, ledger.skipped_slots IN ACCESS EXCLUSIVE MODE;

-- By hand: the tables first (functions below take ledger.triggers' row type, views read the new
-- columns). New columns have no default or a constant one: no rewrite. The new CHECKs are supersets
-- of the old ones (each validated by a scan of its table, under the lock this revision holds).
-- ledger.jobs: the scheduler's options and the sync source
ALTER TABLE ledger.jobs
    ADD COLUMN jitter         interval,
    ADD COLUMN start_deadline interval,
    ADD COLUMN overlap_policy text NOT NULL DEFAULT 'catch_up',
    ADD COLUMN defined_by     text;
ALTER TABLE ledger.jobs DROP CONSTRAINT jobs_pause_reason_valid;
ALTER TABLE ledger.jobs
    ADD CONSTRAINT jobs_pause_reason_valid CHECK (pause_reason IS NULL
                                                  OR (pause_reason IN ('operator', 'failures', 'removed') AND paused)),
    ADD CONSTRAINT jobs_overlap_policy_valid CHECK (overlap_policy IN ('catch_up', 'skip', 'buffer_one', 'replace')),
    ADD CONSTRAINT jobs_jitter_valid CHECK (jitter > interval '0' AND jitter <= interval '24 hours'),
    ADD CONSTRAINT jobs_start_deadline_positive CHECK (start_deadline > interval '0');

-- ledger.skipped_slots: two more reasons
ALTER TABLE ledger.skipped_slots DROP CONSTRAINT skipped_slots_reason_valid;
ALTER TABLE ledger.skipped_slots
    ADD CONSTRAINT skipped_slots_reason_valid CHECK (reason IN ('backfill_limit', 'start_deadline', 'overlap'));
COMMENT ON TABLE ledger.skipped_slots IS
    'Ranges of schedule slots not run: dropped by the catch-up bound, past their start deadline, or skipped by the overlap policy';

-- ledger.counters: the deadline's counter
ALTER TABLE ledger.counters ADD COLUMN skipped_deadline bigint NOT NULL DEFAULT 0;
ALTER TABLE ledger.counters DROP CONSTRAINT counters_non_negative;
ALTER TABLE ledger.counters ADD CONSTRAINT counters_non_negative CHECK (
    runs_started >= 0 AND successes >= 0 AND failures >= 0
    AND skipped_overlap >= 0 AND skipped_backfill >= 0 AND leases_lost >= 0
    AND consecutive_failures >= 0 AND skipped_deadline >= 0);

-- ledger.events: one more kind
ALTER TABLE ledger.events DROP CONSTRAINT events_kind_valid, DROP CONSTRAINT events_run_has_run_id;
ALTER TABLE ledger.events
    ADD CONSTRAINT events_kind_valid CHECK (kind IN (
        'run_started', 'run_ended', 'run_lost', 'run_cancelled', 'cancel_requested',
        'job_paused', 'job_resumed', 'alert_raised', 'alert_cleared', 'job_redefined')),
    ADD CONSTRAINT events_run_has_run_id CHECK (run_id IS NOT NULL
                                                OR kind IN ('job_paused', 'job_resumed', 'alert_raised', 'alert_cleared',
                                                            'job_redefined'));

-- new tables (as in sql/20_tables.sql, with their comments)
CREATE TABLE ledger.triggers (
    trigger_id   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job          ledger.label NOT NULL REFERENCES ledger.jobs (job) ON DELETE CASCADE,
    requested_by text,
    requested_at timestamptz NOT NULL,
    detail       jsonb,
    status       text        NOT NULL DEFAULT 'pending',
    run_id       bigint,
    skip_reason  text,
    resolved_at  timestamptz,
    CONSTRAINT triggers_status_valid CHECK (status IN ('pending', 'started', 'skipped')),
    CONSTRAINT triggers_run_iff_started CHECK ((status = 'started') = (run_id IS NOT NULL)),
    CONSTRAINT triggers_reason_iff_skipped CHECK ((status = 'skipped') = (skip_reason IS NOT NULL)),
    CONSTRAINT triggers_skip_reason_valid CHECK (skip_reason IN ('overlap', 'paused')),
    CONSTRAINT triggers_resolved_iff_done CHECK ((status = 'pending') = (resolved_at IS NULL)),
    CONSTRAINT triggers_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT triggers_requested_by_valid CHECK (char_length(requested_by) BETWEEN 1 AND 200)
);
COMMENT ON TABLE ledger.triggers IS 'Manual runs asked for (ledger.trigger): pending, started (run_id) or skipped';
CREATE UNIQUE INDEX triggers_one_pending ON ledger.triggers (job) WHERE status = 'pending';
CREATE INDEX triggers_job_requested ON ledger.triggers (job, requested_at);

CREATE TABLE ledger.schedulers (
    scheduler    ledger.label PRIMARY KEY,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    version      text        NOT NULL,
    jobs         text[]      NOT NULL,
    started_at   timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    stopping     boolean     NOT NULL DEFAULT false,
    CONSTRAINT schedulers_expiry_after_heartbeat CHECK (expires_at > heartbeat_at)
);
COMMENT ON TABLE ledger.schedulers IS 'Schedulers that heartbeat: host, pid, version, jobs served, expiry';

CREATE TABLE ledger.scheduler_jobs (
    job       ledger.label NOT NULL,
    scheduler ledger.label NOT NULL REFERENCES ledger.schedulers (scheduler) ON DELETE CASCADE,
    CONSTRAINT scheduler_jobs_pkey PRIMARY KEY (job, scheduler)
);
COMMENT ON TABLE ledger.scheduler_jobs IS 'The jobs each scheduler serves (ledger.schedulers.jobs), one row per pair';
CREATE INDEX scheduler_jobs_scheduler ON ledger.scheduler_jobs (scheduler);

CREATE TABLE ledger.upkeep_leader (
    singleton   boolean     PRIMARY KEY DEFAULT true,
    scheduler   text,
    term        bigint      NOT NULL DEFAULT 0,
    acquired_at timestamptz,
    expires_at  timestamptz,
    CONSTRAINT upkeep_leader_one_row CHECK (singleton),
    CONSTRAINT upkeep_leader_held CHECK ((scheduler IS NULL) = (expires_at IS NULL))
);
COMMENT ON TABLE ledger.upkeep_leader IS 'One row: the scheduler that runs the ledger''s upkeep, and until when';
INSERT INTO ledger.upkeep_leader DEFAULT VALUES;

ALTER TABLE ledger.triggers OWNER TO ledger_owner;
ALTER TABLE ledger.schedulers OWNER TO ledger_owner;
ALTER TABLE ledger.scheduler_jobs OWNER TO ledger_owner;
ALTER TABLE ledger.upkeep_leader OWNER TO ledger_owner;
GRANT SELECT ON ledger.triggers, ledger.schedulers, ledger.scheduler_jobs, ledger.upkeep_leader TO ledger_client, ledger_reader;


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
    PERFORM FROM ledger.leases l WHERE l.job = _set_state.job FOR UPDATE;
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

CREATE OR REPLACE FUNCTION ledger.register_job(job text, schedule text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, max_backfill integer DEFAULT NULL::integer, time_zone text DEFAULT NULL::text, late_after interval DEFAULT NULL::interval, down_after interval DEFAULT NULL::interval, min_runtime interval DEFAULT NULL::interval, max_runtime interval DEFAULT NULL::interval, pause_after_failures integer DEFAULT NULL::integer, jitter interval DEFAULT NULL::interval, start_deadline interval DEFAULT NULL::interval, overlap_policy text DEFAULT NULL::text)
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
BEGIN
    PERFORM ledger._check_label(job, 'job');
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
    PERFORM ledger._lock_registration(register_job.job);
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
        updated_at           = CASE WHEN v_new THEN j.updated_at ELSE ledger._now() END
     WHERE j.job = register_job.job
    RETURNING * INTO v_job;
    -- The job's state row: its due marks follow the schedule as it is now.
    PERFORM ledger._set_state(register_job.job, 'registration');
    PERFORM pg_notify('ledger_scheduler', register_job.job);
    RETURN v_job;
END
$function$;

ALTER FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text) IS 'Register a job or change the options given: schedule, default ttl, catch-up bound, time zone, health bounds, jitter, start deadline, overlap policy';

GRANT EXECUTE ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._set_paused(job text, paused boolean)
 RETURNS boolean
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION ledger.start_due_run(job text, owner text, ttl interval DEFAULT NULL::interval)
 RETURNS ledger.run_start
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION ledger._jitter(job text, slot timestamp with time zone, bound interval)
 RETURNS interval
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._jitter(text,timestamp with time zone,interval) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._jitter(text,timestamp with time zone,interval) FROM PUBLIC;

COMMENT ON FUNCTION ledger._jitter(text,timestamp with time zone,interval) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._jitter(text,timestamp with time zone,interval) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._jitter(text,timestamp with time zone,interval) TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._shortest_gap(spec ledger.schedule_spec, time_zone text, after timestamp with time zone)
 RETURNS interval
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._shortest_gap(ledger.schedule_spec,text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._shortest_gap(ledger.schedule_spec,text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._shortest_gap(ledger.schedule_spec,text,timestamp with time zone) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._shortest_gap(ledger.schedule_spec,text,timestamp with time zone) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._shortest_gap(ledger.schedule_spec,text,timestamp with time zone) TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._check_jitter(value interval, spec ledger.schedule_spec, time_zone text, at timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._check_jitter(interval,ledger.schedule_spec,text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._check_jitter(interval,ledger.schedule_spec,text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._check_jitter(interval,ledger.schedule_spec,text,timestamp with time zone) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._check_jitter(interval,ledger.schedule_spec,text,timestamp with time zone) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._check_jitter(interval,ledger.schedule_spec,text,timestamp with time zone) TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._check_overlap_policy(value text)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF value IS NOT NULL AND value NOT IN ('catch_up', 'skip', 'buffer_one', 'replace') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument overlap_policy must be one of catch_up, skip, buffer_one, replace',
            DETAIL = jsonb_build_object('argument', 'overlap_policy', 'value', left(value, 200),
                                        'accepted', jsonb_build_array('catch_up', 'skip', 'buffer_one', 'replace'))::text;
    END IF;
END
$function$;

ALTER FUNCTION ledger._check_overlap_policy(text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._check_overlap_policy(text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._check_overlap_policy(text) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._check_overlap_policy(text) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._check_overlap_policy(text) TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger.slot_jitter(job text, slot timestamp with time zone)
 RETURNS interval
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument slot must not be null';
    END IF;
    PERFORM ledger._check_instant(slot, 'slot');
    RETURN ledger._jitter(job, slot, (ledger._registered_job(job)).jitter);
END
$function$;

ALTER FUNCTION ledger.slot_jitter(text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.slot_jitter(text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger.slot_jitter(text,timestamp with time zone) IS 'The start offset of a slot of the job: in [0, jitter), the same on every host (a hash of job and slot)';

GRANT EXECUTE ON FUNCTION ledger.slot_jitter(text,timestamp with time zone) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._skip_floor(job text)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN (SELECT s.last_slot FROM ledger.skipped_slots s WHERE s.job = _skip_floor.job
             ORDER BY s.first_slot DESC LIMIT 1);
END
$function$;

ALTER FUNCTION ledger._skip_floor(text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._skip_floor(text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._skip_floor(text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._record_skipped(job text, due timestamp with time zone[], from_i integer, to_i integer, reason text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (_record_skipped.job, (pg_backend_pid() % 16)::smallint, v_count)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + excluded.skipped_overlap;
    END IF;
END
$function$;

ALTER FUNCTION ledger._record_skipped(text,timestamp with time zone[],integer,integer,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._record_skipped(text,timestamp with time zone[],integer,integer,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._record_skipped(text,timestamp with time zone[],integer,integer,text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._skip_where(job text, due timestamp with time zone[], skip boolean[], reason text)
 RETURNS timestamp with time zone[]
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._skip_where(text,timestamp with time zone[],boolean[],text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._skip_where(text,timestamp with time zone[],boolean[],text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._skip_where(text,timestamp with time zone[],boolean[],text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._lock_job(job text, wait boolean)
 RETURNS boolean
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._lock_job(text,boolean) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._lock_job(text,boolean) FROM PUBLIC;

COMMENT ON FUNCTION ledger._lock_job(text,boolean) IS NULL;

CREATE OR REPLACE FUNCTION ledger._supersede(job text, at timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._supersede(text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._supersede(text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._supersede(text,timestamp with time zone) IS NULL;

CREATE OR REPLACE FUNCTION ledger._skip_trigger(trigger_id bigint, reason text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job text;
BEGIN
    UPDATE ledger.triggers t SET status = 'skipped', skip_reason = reason, resolved_at = ledger._now()
     WHERE t.trigger_id = _skip_trigger.trigger_id AND t.status = 'pending'
    RETURNING t.job INTO v_job;
    IF FOUND AND reason = 'overlap' THEN
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (v_job, (pg_backend_pid() % 16)::smallint, 1)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + 1;
    END IF;
END
$function$;

ALTER FUNCTION ledger._skip_trigger(bigint,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._skip_trigger(bigint,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._skip_trigger(bigint,text) IS NULL;

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

ALTER FUNCTION ledger._start_scheduled(ledger.jobs,text,interval,boolean) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._start_scheduled(ledger.jobs,text,interval,boolean) FROM PUBLIC;

COMMENT ON FUNCTION ledger._start_scheduled(ledger.jobs,text,interval,boolean) IS NULL;

CREATE OR REPLACE FUNCTION ledger._next_starts(jobs text[])
 RETURNS TABLE(job text, at timestamp with time zone)
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_custom_plan'
AS $function$
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
$function$;

ALTER FUNCTION ledger._next_starts(text[]) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._next_starts(text[]) FROM PUBLIC;

COMMENT ON FUNCTION ledger._next_starts(text[]) IS NULL;

CREATE OR REPLACE FUNCTION ledger.next_start(jobs text[] DEFAULT NULL::text[])
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM ledger._check_jobs(jobs, false);
    RETURN (SELECT min(n.at) FROM ledger._next_starts(jobs) n);
END
$function$;

ALTER FUNCTION ledger.next_start(text[]) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.next_start(text[]) FROM PUBLIC;

COMMENT ON FUNCTION ledger.next_start(text[]) IS 'The earliest moment at which start_due_runs over these jobs (NULL: all) would start something; NULL when never';

GRANT EXECUTE ON FUNCTION ledger.next_start(text[]) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._check_jobs(jobs text[], required boolean)
 RETURNS void
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._check_jobs(text[],boolean) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._check_jobs(text[],boolean) FROM PUBLIC;

COMMENT ON FUNCTION ledger._check_jobs(text[],boolean) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._check_jobs(text[],boolean) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._check_jobs(text[],boolean) TO ledger_reader;

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
BEGIN
    PERFORM ledger._check_jobs(jobs, true);
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_ttl(ttl);
    IF max_runs < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_runs must be positive (or null: no cap), not %s', max_runs),
            DETAIL = jsonb_build_object('argument', 'max_runs', 'value', max_runs)::text;
    END IF;
    -- The jobs whose next start has come, earliest first; each taken SKIP
    -- LOCKED, so that concurrent schedulers split them and never wait.
    FOR v_name IN
        SELECT n.job FROM ledger._next_starts(jobs) n WHERE n.at <= ledger._now() ORDER BY n.at, n.job
    LOOP
        EXIT WHEN v_started >= max_runs;
        CONTINUE WHEN NOT ledger._lock_job(v_name, false);
        SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = v_name;
        CONTINUE WHEN NOT FOUND;  -- unregistered meanwhile
        v_ttl := coalesce(ledger._exact(start_due_runs.ttl), v_job.ttl);
        IF v_ttl IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument ttl is required: job %s has no registered ttl', v_name),
                DETAIL = jsonb_build_object('argument', 'ttl', 'job', v_name)::text;
        END IF;
        v_result := ledger._start_scheduled(v_job, owner, v_ttl, true);
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

ALTER FUNCTION ledger.start_due_runs(text[],text,integer,interval) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.start_due_runs(text[],text,integer,interval) FROM PUBLIC;

COMMENT ON FUNCTION ledger.start_due_runs(text[],text,integer,interval) IS 'Start, in one call, what is due of these jobs (slots with jitter, deadline and overlap policy; triggers); one row per started run';

GRANT EXECUTE ON FUNCTION ledger.start_due_runs(text[],text,integer,interval) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger.trigger(job text, requested_by text DEFAULT NULL::text, detail jsonb DEFAULT NULL::jsonb)
 RETURNS bigint
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger.trigger(text,text,jsonb) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.trigger(text,text,jsonb) FROM PUBLIC;

COMMENT ON FUNCTION ledger.trigger(text,text,jsonb) IS 'Ask for a manual run now: picked by the next start_due_run(s) under the lease and the overlap policy; the trigger id';

GRANT EXECUTE ON FUNCTION ledger.trigger(text,text,jsonb) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger.scheduler_heartbeat(scheduler text, host text, pid integer, version text, jobs text[], ttl interval, stopping boolean DEFAULT false)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger.scheduler_heartbeat(text,text,integer,text,text[],interval,boolean) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.scheduler_heartbeat(text,text,integer,text,text[],interval,boolean) FROM PUBLIC;

COMMENT ON FUNCTION ledger.scheduler_heartbeat(text,text,integer,text,text[],interval,boolean) IS 'Keep this scheduler''s row live for ttl (jobs served, version); true when it is the upkeep leader';

GRANT EXECUTE ON FUNCTION ledger.scheduler_heartbeat(text,text,integer,text,text[],interval,boolean) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger.scheduler_stop(scheduler text)
 RETURNS void
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM ledger._check_label(scheduler, 'scheduler');
    DELETE FROM ledger.schedulers s WHERE s.scheduler = scheduler_stop.scheduler;
    UPDATE ledger.upkeep_leader u SET scheduler = NULL, expires_at = NULL
     WHERE u.singleton AND u.scheduler = scheduler_stop.scheduler;
END
$function$;

ALTER FUNCTION ledger.scheduler_stop(text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.scheduler_stop(text) FROM PUBLIC;

COMMENT ON FUNCTION ledger.scheduler_stop(text) IS 'Remove the scheduler''s row and its upkeep leadership (a graceful stop)';

GRANT EXECUTE ON FUNCTION ledger.scheduler_stop(text) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._definition_keys()
 RETURNS jsonb
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN '{"schedule": null, "ttl": null, "max_backfill": 1, "time_zone": "UTC", "late_after": "0",
             "down_after": "0", "min_runtime": "0", "max_runtime": "0", "pause_after_failures": 0,
             "jitter": "0", "start_deadline": "0", "overlap_policy": "catch_up"}'::jsonb;
END
$function$;

ALTER FUNCTION ledger._definition_keys() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._definition_keys() FROM PUBLIC;

COMMENT ON FUNCTION ledger._definition_keys() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._definition_keys() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._definition_keys() TO ledger_reader;

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
        v_key := NULL;
        RETURN ledger.register_job(job => job, schedule => v_s, ttl => v_ttl, max_backfill => v_mb,
                                   time_zone => v_tz, late_after => v_la, down_after => v_da, min_runtime => v_mi,
                                   max_runtime => v_ma, pause_after_failures => v_paf, jitter => v_ji,
                                   start_deadline => v_sd, overlap_policy => v_op);
    EXCEPTION WHEN data_exception OR SQLSTATE 'LD005' THEN
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

ALTER FUNCTION ledger._apply_definition(text,jsonb) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._apply_definition(text,jsonb) FROM PUBLIC;

COMMENT ON FUNCTION ledger._apply_definition(text,jsonb) IS NULL;

CREATE OR REPLACE FUNCTION ledger.sync_jobs(definitions jsonb, source text, removed text DEFAULT 'pause'::text)
 RETURNS TABLE(job text, action text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger.sync_jobs(jsonb,text,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.sync_jobs(jsonb,text,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger.sync_jobs(jsonb,text,text) IS 'A jobs file in one atomic call: jobs registered or changed, those the source no longer has paused or unregistered';

GRANT EXECUTE ON FUNCTION ledger.sync_jobs(jsonb,text,text) TO ledger_client;

CREATE OR REPLACE VIEW ledger._job_state AS
 SELECT c.job,
    j.schedule,
    j.time_zone,
    j.max_backfill,
    COALESCE(j.paused, false) AS paused,
    j.paused_at,
    j.pause_reason,
    j.created_at,
    j.down_after,
    j.min_runtime,
    j.max_runtime,
    j.pause_after_failures,
    COALESCE(j.ttl, l.ttl) AS ttl,
        CASE
            WHEN ((l.released_at IS NULL) AND (l.expires_at > n.at)) THEN (l.owner)::text
            ELSE NULL::text
        END AS holder,
    l.token,
    l.expires_at AS lease_expires_at,
    c.last_run_id,
    c.last_status,
    c.last_started_at,
    c.last_completed_at,
    c.last_success_started_at,
    c.last_success_at,
    c.running_run_id,
    c.running_started_at,
    (n.at - c.running_started_at) AS running_for,
    c.done_slot,
    c.longest_success,
    c.consecutive_failures,
    c.next_due,
    c.down_due,
    c.latest_end,
    c.overlap_run_id,
    c.runs_started,
    c.successes,
    c.failures,
    (c.skipped_overlap + (COALESCE(sk.pending, (0)::numeric))::bigint) AS skipped_overlap,
    c.skipped_backfill,
    c.leases_lost,
    n.at,
    s.live,
    s.grace,
    s.state,
        CASE s.state
            WHEN 'crashed'::text THEN
            CASE
                WHEN (l.token = c.running_token) THEN l.expires_at
                ELSE l.acquired_at
            END
            WHEN 'overrun'::text THEN (c.running_started_at + j.max_runtime)
            WHEN 'paused'::text THEN j.paused_at
            WHEN 'running'::text THEN c.running_started_at
            WHEN 'down'::text THEN COALESCE(s.unserved_since, LEAST(
            CASE
                WHEN (c.down_due <= (n.at - s.grace)) THEN (c.down_due + s.grace)
                ELSE NULL::timestamp with time zone
            END,
            CASE
                WHEN ((n.at - COALESCE(c.last_success_at, j.created_at)) > j.down_after) THEN (COALESCE(c.last_success_at, j.created_at) + j.down_after)
                ELSE NULL::timestamp with time zone
            END))
            WHEN 'late'::text THEN (c.next_due + s.grace)
            WHEN 'failing'::text THEN COALESCE(c.last_success_at, j.created_at)
            WHEN 'never_run'::text THEN j.created_at
            ELSE COALESCE(c.last_success_at, c.last_completed_at)
        END AS since,
        CASE s.state
            WHEN 'crashed'::text THEN format('run %s is still marked running, but its lease %s: its runner is gone (ledger.reap_expired, or the next start, closes it)'::text, c.running_run_id,
            CASE
                WHEN (l.token <> c.running_token) THEN format('went to token %s'::text, l.token)
                WHEN (l.released_at IS NOT NULL) THEN 'was released'::text
                ELSE format('expired %s ago'::text, date_trunc('second'::text, (n.at - l.expires_at)))
            END)
            WHEN 'overrun'::text THEN format('running for %s, over its max_runtime %s'::text, date_trunc('second'::text, (n.at - c.running_started_at)), j.max_runtime)
            WHEN 'paused'::text THEN
            CASE j.pause_reason
                WHEN 'failures'::text THEN format('paused after %s failure%s in a row'::text, c.consecutive_failures,
                CASE
                    WHEN (c.consecutive_failures = 1) THEN ''::text
                    ELSE 's'::text
                END)
                ELSE 'paused by an operator'::text
            END
            WHEN 'running'::text THEN format('run %s running'::text, c.running_run_id)
            WHEN 'down'::text THEN
            CASE
                WHEN (s.unserved_since IS NOT NULL) THEN 'no live scheduler serves it'::text
                WHEN (c.down_due <= (n.at - s.grace)) THEN format('%s%s slots missed since the last success'::text,
                CASE
                    WHEN m.missed_slots_capped THEN 'at least '::text
                    ELSE ''::text
                END, m.missed_slots)
                ELSE format('no success for over %s'::text, j.down_after)
            END
            WHEN 'late'::text THEN format('a slot due %s ago was not started within %s'::text, date_trunc('second'::text, (n.at - c.next_due)), s.grace)
            WHEN 'failing'::text THEN format('%s failure%s in a row'::text, c.consecutive_failures,
            CASE
                WHEN (c.consecutive_failures = 1) THEN ''::text
                ELSE 's'::text
            END)
            WHEN 'never_run'::text THEN 'no run yet'::text
            ELSE 'ok'::text
        END AS reason,
    m.missed_slots,
    m.missed_slots_capped,
        CASE
            WHEN (c.successes >= ledger._advice_min_runs()) THEN c.longest_success
            ELSE NULL::interval
        END AS advice_longest,
        CASE
            WHEN ((COALESCE(j.ttl, l.ttl) IS NULL) OR (c.successes < ledger._advice_min_runs()) OR (c.longest_success IS NULL)) THEN 'no_data'::text
            WHEN (COALESCE(j.ttl, l.ttl) < GREATEST((c.longest_success * (1.5)::double precision), ledger._advice_min_ttl())) THEN 'too_short'::text
            WHEN (COALESCE(j.ttl, l.ttl) > GREATEST((c.longest_success * (2)::double precision), ledger._advice_min_ttl())) THEN 'too_long'::text
            ELSE 'ok'::text
        END AS ttl_verdict,
    c.skipped_deadline
   FROM ((((((ledger.counters c
     LEFT JOIN ledger.jobs j ON (((j.job)::text = (c.job)::text)))
     LEFT JOIN ledger.leases l ON (((l.job)::text = (c.job)::text)))
     LEFT JOIN ( SELECT k.job,
            sum(k.skipped_overlap) AS pending
           FROM ledger.skip_counts k
          GROUP BY k.job) sk ON (((sk.job)::text = (c.job)::text)))
     CROSS JOIN LATERAL ( SELECT ledger._view_now() AS at) n)
     CROSS JOIN LATERAL ( SELECT d.live,
            d.grace,
            d.unserved_since,
                CASE
                    WHEN ((c.running_run_id IS NOT NULL) AND (NOT d.live)) THEN 'crashed'::text
                    WHEN (d.live AND ((n.at - c.running_started_at) > j.max_runtime)) THEN 'overrun'::text
                    WHEN j.paused THEN 'paused'::text
                    WHEN d.live THEN 'running'::text
                    WHEN ((d.unserved_since IS NOT NULL) OR (c.down_due <= (n.at - d.grace)) OR ((n.at - COALESCE(c.last_success_at, j.created_at)) > j.down_after)) THEN 'down'::text
                    WHEN (c.next_due <= (n.at - d.grace)) THEN 'late'::text
                    WHEN (c.consecutive_failures >= ledger._failing_after()) THEN 'failing'::text
                    WHEN (c.last_run_id IS NULL) THEN 'never_run'::text
                    ELSE 'ok'::text
                END AS state
           FROM ( SELECT COALESCE(((l.token = c.running_token) AND (l.released_at IS NULL) AND (l.expires_at > n.at)), false) AS live,
                    COALESCE(j.late_after, GREATEST(COALESCE(j.ttl, l.ttl, '00:01:00'::interval), '00:01:00'::interval)) AS grace,
                    ( SELECT
                                CASE
                                    WHEN bool_or((x.expires_at > n.at)) THEN NULL::timestamp with time zone
                                    ELSE max(x.expires_at)
                                END AS max
                           FROM (ledger.scheduler_jobs sj
                             JOIN ledger.schedulers x ON (((x.scheduler)::text = (sj.scheduler)::text)))
                          WHERE ((sj.job)::text = (c.job)::text)) AS unserved_since) d
         OFFSET 0) s)
     CROSS JOIN LATERAL ( SELECT
                CASE
                    WHEN (j.schedule IS NULL) THEN NULL::bigint
                    WHEN ((c.next_due IS NULL) OR (c.next_due > (n.at - s.grace))) THEN (0)::bigint
                    WHEN (((j.schedule_spec).kind = 'interval'::text) AND ((j.schedule_spec).every_months = 0) AND ((j.schedule_spec).every_days = 0)) THEN ((floor(((((EXTRACT(epoch FROM (n.at - s.grace)))::numeric - (EXTRACT(epoch FROM ('2000-01-01 00:00:00'::timestamp without time zone AT TIME ZONE j.time_zone)))::numeric) * (1000000)::numeric) / ((j.schedule_spec).every_micros)::numeric)))::bigint - (floor(((((EXTRACT(epoch FROM COALESCE(c.done_slot, j.created_at)))::numeric - (EXTRACT(epoch FROM ('2000-01-01 00:00:00'::timestamp without time zone AT TIME ZONE j.time_zone)))::numeric) * (1000000)::numeric) / ((j.schedule_spec).every_micros)::numeric)))::bigint)
                    WHEN (c.down_due <= (n.at - s.grace)) THEN (ledger._down_after_slots())::bigint
                    ELSE (1)::bigint
                END AS missed_slots,
            COALESCE(((j.schedule IS NOT NULL) AND (c.next_due <= (n.at - s.grace)) AND (NOT (((j.schedule_spec).kind = 'interval'::text) AND ((j.schedule_spec).every_months = 0) AND ((j.schedule_spec).every_days = 0)))), false) AS missed_slots_capped) m);

CREATE OR REPLACE VIEW ledger.job_counters AS
 SELECT k.job,
    COALESCE(c.runs_started, (0)::bigint) AS runs_started,
    COALESCE(c.successes, (0)::bigint) AS successes,
    COALESCE(c.failures, (0)::bigint) AS failures,
    (COALESCE(c.skipped_overlap, (0)::bigint) + (COALESCE(( SELECT sum(s.skipped_overlap) AS sum
           FROM ledger.skip_counts s
          WHERE ((s.job)::text = (k.job)::text)), (0)::numeric))::bigint) AS skipped_overlap,
    COALESCE(c.skipped_backfill, (0)::bigint) AS skipped_backfill,
    COALESCE(c.leases_lost, (0)::bigint) AS leases_lost,
    COALESCE(c.skipped_deadline, (0)::bigint) AS skipped_deadline
   FROM (( SELECT t.job
           FROM ledger.counters t
        UNION
         SELECT t.job
           FROM ledger.jobs t
        UNION
         SELECT t.job
           FROM ledger.skip_counts t) k
     LEFT JOIN ledger.counters c ON (((c.job)::text = (k.job)::text)));

COMMENT ON VIEW ledger.job_counters IS 'Per job: runs started, successes, failures, skips by overlap and by backfill limit, leases lost, skips by start deadline';

CREATE OR REPLACE VIEW ledger.job_status AS
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
        CASE
            WHEN ((s.schedule IS NOT NULL) AND (NOT s.paused)) THEN s.next_due
            ELSE NULL::timestamp with time zone
        END AS next_slot,
    (s.state = ANY (ARRAY['late'::text, 'down'::text])) AS overdue,
    s.consecutive_failures,
    s.runs_started,
    s.successes,
    s.failures,
    s.skipped_overlap,
    s.skipped_backfill,
    s.leases_lost,
    s.state,
    s.skipped_deadline
   FROM ledger._job_state s;

DROP FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer);

-- By hand: the new view of manual runs, after the tables and functions.
CREATE VIEW ledger.trigger_status AS
SELECT t.trigger_id, t.job, t.requested_by, t.requested_at, t.status, t.skip_reason, t.run_id, t.resolved_at,
       r.status AS run_status, t.detail
  FROM ledger.triggers t
  LEFT JOIN ledger.job_execution_log r ON r.run_id = t.run_id;

ALTER VIEW ledger.trigger_status OWNER TO ledger_owner;

REVOKE ALL ON ledger.trigger_status FROM PUBLIC;

GRANT SELECT ON ledger.trigger_status TO ledger_client, ledger_reader;

COMMENT ON VIEW ledger.trigger_status IS 'Manual runs asked for: pending, started (with the run''s status) or skipped';
