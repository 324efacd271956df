-- 0007 undone: back to 0006

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
LOCK TABLE ledger.leases IN SHARE ROW EXCLUSIVE MODE;
LOCK TABLE ledger.jobs IN SHARE ROW EXCLUSIVE MODE;

-- By hand: refused while a job is paused as removed by sync_jobs (0006 knows no such pause), nothing
-- changed; then the 13-argument register_job goes first, so that the 10-argument one created below is
-- the only one (with both, every call of before would be ambiguous: 42725), and the view of triggers.
DO $$
BEGIN
    IF EXISTS (SELECT FROM ledger.jobs WHERE pause_reason = 'removed') THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = 'downgrade refused: jobs are paused as removed by sync_jobs (pause_reason removed)',
            HINT = 'Resume them or pause them by hand (ledger.pause_job) first.';
    END IF;
END
$$;

DROP FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer,interval,interval,text);

DROP VIEW ledger.trigger_status;


CREATE OR REPLACE FUNCTION ledger.register_job(job text, schedule text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, max_backfill integer DEFAULT NULL::integer, time_zone text DEFAULT NULL::text, late_after interval DEFAULT NULL::interval, down_after interval DEFAULT NULL::interval, min_runtime interval DEFAULT NULL::interval, max_runtime interval DEFAULT NULL::interval, pause_after_failures integer DEFAULT NULL::integer)
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
    IF v_job.schedule IS NOT NULL THEN
        -- parsed once, here: the spec depends on the schedule and the zone
        v_spec := ledger._parse_schedule(v_job.schedule, v_job.time_zone);
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
        updated_at           = CASE WHEN v_new THEN j.updated_at ELSE ledger._now() END
     WHERE j.job = register_job.job
    RETURNING * INTO v_job;
    -- The job's state row: its due marks follow the schedule as it is now.
    PERFORM ledger._set_state(register_job.job, 'registration');
    RETURN v_job;
END
$function$;

ALTER FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer) FROM PUBLIC;

COMMENT ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer) IS 'Register a job or change the options given: schedule, default ttl, catch-up bound, time zone, health bounds';

GRANT EXECUTE ON FUNCTION ledger.register_job(text,text,interval,integer,text,interval,interval,interval,interval,integer) TO ledger_client;

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
    RETURN FOUND;
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
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
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

-- By hand: the views that lose a column (skipped_deadline) and those that read them, dropped and
-- created as 0006 has them (a view cannot drop a column in place), with their owner, grants, comments;
-- (EXTRACT(...))::numeric as sql/ writes it, since on PostgreSQL 13 EXTRACT is double precision.
DROP VIEW ledger.ttl_advice, ledger.job_status, ledger.job_health, ledger.job_counters, ledger.alerts, ledger._job_state;

CREATE VIEW ledger._job_state AS
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
            WHEN 'down'::text THEN LEAST(
            CASE
                WHEN (c.down_due <= (n.at - s.grace)) THEN (c.down_due + s.grace)
                ELSE NULL::timestamp with time zone
            END,
            CASE
                WHEN ((n.at - COALESCE(c.last_success_at, j.created_at)) > j.down_after) THEN (COALESCE(c.last_success_at, j.created_at) + j.down_after)
                ELSE NULL::timestamp with time zone
            END)
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
        END AS ttl_verdict
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
                CASE
                    WHEN ((c.running_run_id IS NOT NULL) AND (NOT d.live)) THEN 'crashed'::text
                    WHEN (d.live AND ((n.at - c.running_started_at) > j.max_runtime)) THEN 'overrun'::text
                    WHEN j.paused THEN 'paused'::text
                    WHEN d.live THEN 'running'::text
                    WHEN ((c.down_due <= (n.at - d.grace)) OR ((n.at - COALESCE(c.last_success_at, j.created_at)) > j.down_after)) THEN 'down'::text
                    WHEN (c.next_due <= (n.at - d.grace)) THEN 'late'::text
                    WHEN (c.consecutive_failures >= ledger._failing_after()) THEN 'failing'::text
                    WHEN (c.last_run_id IS NULL) THEN 'never_run'::text
                    ELSE 'ok'::text
                END AS state
           FROM ( SELECT COALESCE(((l.token = c.running_token) AND (l.released_at IS NULL) AND (l.expires_at > n.at)), false) AS live,
                    COALESCE(j.late_after, GREATEST(COALESCE(j.ttl, l.ttl, '00:01:00'::interval), '00:01:00'::interval)) AS grace) d
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

ALTER VIEW ledger._job_state OWNER TO ledger_owner;

REVOKE ALL ON ledger._job_state FROM PUBLIC;

GRANT SELECT ON ledger._job_state TO ledger_client;

GRANT SELECT ON ledger._job_state TO ledger_reader;

COMMENT ON VIEW ledger._job_state IS 'Internal: every known job with its state (the one state machine: ledger.job_status, job_health, alerts, ttl_advice read it)';

CREATE VIEW ledger.alerts AS
 SELECT a.alert,
    s.job,
    a.run_id,
    a.message,
    a.since
   FROM (ledger._job_state s
     CROSS JOIN LATERAL UNNEST(ARRAY[
        CASE
            WHEN ((s.state = ANY (ARRAY['crashed'::text, 'overrun'::text, 'down'::text, 'late'::text, 'failing'::text])) OR ((s.state = 'paused'::text) AND (s.pause_reason = 'failures'::text))) THEN s.state
            ELSE NULL::text
        END,
        CASE
            WHEN (s.live AND (s.state <> 'overrun'::text) AND (s.running_for > (s.longest_success * (2)::double precision))) THEN 'long_running'::text
            ELSE NULL::text
        END,
        CASE
            WHEN ((s.last_success_at - s.last_success_started_at) < s.min_runtime) THEN 'too_fast'::text
            ELSE NULL::text
        END,
        CASE
            WHEN (s.overlap_run_id IS NOT NULL) THEN 'overlap'::text
            ELSE NULL::text
        END,
        CASE
            WHEN (s.ttl_verdict = 'too_short'::text) THEN 'ttl_too_short'::text
            ELSE NULL::text
        END], ARRAY[
        CASE
            WHEN (s.state = ANY (ARRAY['crashed'::text, 'overrun'::text])) THEN s.running_run_id
            ELSE NULL::bigint
        END, s.running_run_id, NULL::bigint, s.overlap_run_id, NULL::bigint], ARRAY[
        CASE
            WHEN (s.state = ANY (ARRAY['crashed'::text, 'overrun'::text, 'down'::text, 'late'::text, 'failing'::text, 'paused'::text])) THEN s.reason
            ELSE NULL::text
        END,
        CASE
            WHEN (s.live AND (s.running_for > (s.longest_success * (2)::double precision))) THEN format('running for %s, over twice its longest successful run (%s)'::text, date_trunc('second'::text, s.running_for), date_trunc('second'::text, s.longest_success))
            ELSE NULL::text
        END,
        CASE
            WHEN ((s.last_success_at - s.last_success_started_at) < s.min_runtime) THEN format('the last success took %s, under its min_runtime %s'::text, (s.last_success_at - s.last_success_started_at), s.min_runtime)
            ELSE NULL::text
        END,
        CASE
            WHEN (s.overlap_run_id IS NOT NULL) THEN format('run %s started before an earlier run of the job ended (ledger.overlaps lists the pairs)'::text, s.overlap_run_id)
            ELSE NULL::text
        END,
        CASE
            WHEN (s.ttl_verdict = 'too_short'::text) THEN format('ttl %s is under 1.5 times the longest successful run (%s)'::text, s.ttl, s.advice_longest)
            ELSE NULL::text
        END], ARRAY[s.since, s.running_started_at, s.last_success_at,
        CASE
            WHEN (s.overlap_run_id IS NOT NULL) THEN ( SELECT r.started_at
               FROM ledger.job_execution_log r
              WHERE (r.run_id = s.overlap_run_id))
            ELSE NULL::timestamp with time zone
        END, NULL::timestamp with time zone]) a(alert, run_id, message, since))
  WHERE (a.alert IS NOT NULL);

ALTER VIEW ledger.alerts OWNER TO ledger_owner;

REVOKE ALL ON ledger.alerts FROM PUBLIC;

GRANT SELECT ON ledger.alerts TO ledger_client;

GRANT SELECT ON ledger.alerts TO ledger_reader;

COMMENT ON VIEW ledger.alerts IS 'One row per live problem, one per job and cause: crashed, overrun, down, late, failing, paused (by failures), long_running, too_fast, overlap, ttl_too_short';

CREATE VIEW ledger.job_counters AS
 SELECT k.job,
    COALESCE(c.runs_started, (0)::bigint) AS runs_started,
    COALESCE(c.successes, (0)::bigint) AS successes,
    COALESCE(c.failures, (0)::bigint) AS failures,
    (COALESCE(c.skipped_overlap, (0)::bigint) + (COALESCE(( SELECT sum(s.skipped_overlap) AS sum
           FROM ledger.skip_counts s
          WHERE ((s.job)::text = (k.job)::text)), (0)::numeric))::bigint) AS skipped_overlap,
    COALESCE(c.skipped_backfill, (0)::bigint) AS skipped_backfill,
    COALESCE(c.leases_lost, (0)::bigint) AS leases_lost
   FROM (( SELECT t.job
           FROM ledger.counters t
        UNION
         SELECT t.job
           FROM ledger.jobs t
        UNION
         SELECT t.job
           FROM ledger.skip_counts t) k
     LEFT JOIN ledger.counters c ON (((c.job)::text = (k.job)::text)));

ALTER VIEW ledger.job_counters OWNER TO ledger_owner;

REVOKE ALL ON ledger.job_counters FROM PUBLIC;

GRANT SELECT ON ledger.job_counters TO ledger_client;

GRANT SELECT ON ledger.job_counters TO ledger_reader;

COMMENT ON VIEW ledger.job_counters IS 'Per job: runs started, successes, failures, skips by overlap and by backfill limit, leases lost';

CREATE VIEW ledger.job_health AS
 SELECT s.job,
    s.state,
    s.since,
    s.reason,
    s.pause_reason,
    s.last_success_at,
    (s.at - s.last_success_at) AS last_success_age,
    (s.last_success_at - s.last_success_started_at) AS last_success_duration,
    s.missed_slots,
    s.missed_slots_capped,
    s.grace AS late_after,
    s.down_after,
    s.min_runtime,
    s.max_runtime,
    s.pause_after_failures,
    s.consecutive_failures,
        CASE
            WHEN s.live THEN s.running_run_id
            ELSE NULL::bigint
        END AS running_run_id,
        CASE
            WHEN s.live THEN s.running_for
            ELSE NULL::interval
        END AS running_for
   FROM ledger._job_state s;

ALTER VIEW ledger.job_health OWNER TO ledger_owner;

REVOKE ALL ON ledger.job_health FROM PUBLIC;

GRANT SELECT ON ledger.job_health TO ledger_client;

GRANT SELECT ON ledger.job_health TO ledger_reader;

COMMENT ON VIEW ledger.job_health IS 'One state per known job (crashed, overrun, paused, running, down, late, failing, never_run, ok), since when, why';

CREATE VIEW ledger.job_status AS
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
    s.state
   FROM ledger._job_state s;

ALTER VIEW ledger.job_status OWNER TO ledger_owner;

REVOKE ALL ON ledger.job_status FROM PUBLIC;

GRANT SELECT ON ledger.job_status TO ledger_client;

GRANT SELECT ON ledger.job_status TO ledger_reader;

COMMENT ON VIEW ledger.job_status IS 'One row per known job: lease, last run, last success, current run, next slot, state, failures, counters';

CREATE VIEW ledger.ttl_advice AS
 SELECT s.job,
    s.ttl,
    s.advice_longest AS longest_run,
        CASE
            WHEN (s.advice_longest IS NOT NULL) THEN GREATEST((s.advice_longest * (1.5)::double precision), ledger._advice_min_ttl())
            ELSE NULL::interval
        END AS recommended_min,
        CASE
            WHEN (s.advice_longest IS NOT NULL) THEN GREATEST((s.advice_longest * (2)::double precision), ledger._advice_min_ttl())
            ELSE NULL::interval
        END AS recommended_max,
    (s.ttl / (3)::double precision) AS renew_every,
    s.ttl_verdict AS verdict,
    s.successes
   FROM ledger._job_state s;

ALTER VIEW ledger.ttl_advice OWNER TO ledger_owner;

REVOKE ALL ON ledger.ttl_advice FROM PUBLIC;

GRANT SELECT ON ledger.ttl_advice TO ledger_client;

GRANT SELECT ON ledger.ttl_advice TO ledger_reader;

COMMENT ON VIEW ledger.ttl_advice IS 'Per job: ttl, longest successful run, recommended ttl range (1.5-2x, at least 1 s, after 5 successes), renew interval, verdict';

DROP FUNCTION ledger._check_jitter(interval,ledger.schedule_spec,text,timestamp with time zone);

DROP FUNCTION ledger._skip_where(text,timestamp with time zone[],boolean[],text);

DROP FUNCTION ledger.next_start(text[]);

DROP FUNCTION ledger.scheduler_heartbeat(text,text,integer,text,text[],interval,boolean);

DROP FUNCTION ledger.scheduler_stop(text);

DROP FUNCTION ledger.slot_jitter(text,timestamp with time zone);

DROP FUNCTION ledger.start_due_runs(text[],text,integer,interval);

DROP FUNCTION ledger.sync_jobs(jsonb,text,text);

DROP FUNCTION ledger.trigger(text,text,jsonb);

-- Left in place for the calls in flight across this change (old bodies call them):
--   ledger._apply_definition(text,jsonb)
--   ledger._check_jobs(text[],boolean)
--   ledger._check_overlap_policy(text)
--   ledger._definition_keys()
--   ledger._jitter(text,timestamp with time zone,interval)
--   ledger._lock_job(text,boolean)
--   ledger._next_starts(text[])
--   ledger._record_skipped(text,timestamp with time zone[],integer,integer,text)
--   ledger._shortest_gap(ledger.schedule_spec,text,timestamp with time zone)
--   ledger._skip_floor(text)
--   ledger._skip_trigger(bigint,text)
--   ledger._start_scheduled(ledger.jobs,text,interval,boolean)
--   ledger._supersede(text,timestamp with time zone)

-- By hand: the tables back as 0006 has them, after the views that read their new columns.
DELETE FROM ledger.skipped_slots WHERE reason IN ('start_deadline', 'overlap');  -- the old code knows no such skip
DELETE FROM ledger.events WHERE kind = 'job_redefined';
DROP TABLE ledger.upkeep_leader;
DROP TABLE ledger.scheduler_jobs;
DROP TABLE ledger.schedulers;
DROP TABLE ledger.triggers;
ALTER TABLE ledger.events DROP CONSTRAINT events_kind_valid, DROP CONSTRAINT events_run_has_run_id;
ALTER TABLE ledger.events
    ADD CONSTRAINT events_kind_valid CHECK (kind IN (
        'run_started', 'run_ended', 'run_lost', 'run_cancelled', 'cancel_requested',
        'job_paused', 'job_resumed', 'alert_raised', 'alert_cleared')),
    ADD CONSTRAINT events_run_has_run_id CHECK (run_id IS NOT NULL
                                                OR kind IN ('job_paused', 'job_resumed', 'alert_raised', 'alert_cleared'));
ALTER TABLE ledger.counters DROP CONSTRAINT counters_non_negative;
ALTER TABLE ledger.counters DROP COLUMN skipped_deadline;
ALTER TABLE ledger.counters ADD CONSTRAINT counters_non_negative CHECK (
    runs_started >= 0 AND successes >= 0 AND failures >= 0
    AND skipped_overlap >= 0 AND skipped_backfill >= 0 AND leases_lost >= 0
    AND consecutive_failures >= 0);
ALTER TABLE ledger.skipped_slots DROP CONSTRAINT skipped_slots_reason_valid;
ALTER TABLE ledger.skipped_slots ADD CONSTRAINT skipped_slots_reason_valid CHECK (reason IN ('backfill_limit'));
COMMENT ON TABLE ledger.skipped_slots IS 'Ranges of schedule slots the catch-up bound dropped';
ALTER TABLE ledger.jobs DROP CONSTRAINT jobs_pause_reason_valid, DROP CONSTRAINT jobs_overlap_policy_valid,
                        DROP CONSTRAINT jobs_jitter_valid, DROP CONSTRAINT jobs_start_deadline_positive;
ALTER TABLE ledger.jobs DROP COLUMN jitter, DROP COLUMN start_deadline, DROP COLUMN overlap_policy,
                        DROP COLUMN defined_by;
ALTER TABLE ledger.jobs
    ADD CONSTRAINT jobs_pause_reason_valid CHECK (pause_reason IS NULL
                                                  OR (pause_reason IN ('operator', 'failures') AND paused));
