-- 0009: scheduler wakeups (drafted by tools/draft_revision.py from sql/)

-- By hand: the locks first (leases, then jobs, as 0005; and triggers), so that no registration,
-- trigger or end slips between the backfill and the triggers; the table and its backfill (a mark at
-- now: the next round looks at every job once and writes its exact next start).
-- ACCESS EXCLUSIVE, as 0005 and 0007 take the first two (an upgrade from 0.1.0 already holds them):
-- held weaker here, 0010's ACCESS EXCLUSIVE in the same transaction deadlocks with the writers.
LOCK TABLE ledger.leases, ledger.jobs, ledger.triggers IN ACCESS EXCLUSIVE MODE;

CREATE TABLE ledger.wakeups (
    job ledger.label NOT NULL PRIMARY KEY REFERENCES ledger.jobs (job) ON DELETE CASCADE,
    at  timestamptz
);
COMMENT ON TABLE ledger.wakeups IS
    'Per job: when a scheduler should next look at it (at or before its next start; NULL: nothing can come due)';
CREATE INDEX wakeups_at ON ledger.wakeups (at, job) WHERE at IS NOT NULL;
ALTER TABLE ledger.wakeups OWNER TO ledger_owner;
REVOKE ALL ON ledger.wakeups FROM PUBLIC;
GRANT SELECT ON ledger.wakeups TO ledger_client, ledger_reader;

-- every job looked at by the next round (its next start computed then)
INSERT INTO ledger.wakeups (job, at) SELECT j.job, ledger._now() FROM ledger.jobs j;


CREATE OR REPLACE FUNCTION ledger._newest_done_slot(job text, except_run_id bigint DEFAULT NULL::bigint)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_generic_plan'
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION ledger._wake_job()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now timestamptz := ledger._now();
BEGIN
    IF TG_TABLE_NAME = 'leases' THEN
        UPDATE ledger.wakeups w SET at = v_now
          FROM ledger.jobs j
         WHERE w.job = NEW.job AND j.job = NEW.job AND (w.at IS NULL OR w.at > v_now)
           AND (j.schedule IS NOT NULL
                OR EXISTS (SELECT FROM ledger.triggers t WHERE t.job = NEW.job AND t.status = 'pending'));
    ELSE
        INSERT INTO ledger.wakeups AS w (job, at) VALUES (NEW.job, v_now)
        ON CONFLICT (job) DO UPDATE SET at = excluded.at WHERE w.at IS NULL OR w.at > excluded.at;
    END IF;
    RETURN NULL;
END
$function$;

ALTER FUNCTION ledger._wake_job() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._wake_job() FROM PUBLIC;

COMMENT ON FUNCTION ledger._wake_job() IS NULL;

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
     WHERE j.job = _next_start_of.job);
END
$function$;

ALTER FUNCTION ledger._next_start_of(text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._next_start_of(text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._next_start_of(text) IS NULL;

CREATE OR REPLACE FUNCTION ledger.next_start(jobs text[] DEFAULT NULL::text[])
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
        'SELECT w.job, w.at FROM ledger.wakeups w
          WHERE w.at IS NOT NULL AND ($1 IS NULL OR w.job = ANY ($1))
          ORDER BY w.at, w.job' USING jobs
    LOOP
        EXIT WHEN v_mark.at >= v_best;
        v_at := ledger._next_start_of(v_mark.job);
        IF v_at < v_best OR v_best IS NULL THEN
            v_best := v_at;
        END IF;
    END LOOP;
    RETURN v_best;
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
        -- started, and not under replace: nothing starts before the lease
        -- ends (_next_start_of's answer, without asking it)
        UPDATE ledger.wakeups w SET at = CASE WHEN (v_result.start).outcome = 'started' AND v_job.overlap_policy <> 'replace'
                                              THEN (v_result.start).expires_at
                                              ELSE ledger._next_start_of(v_name) END
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

-- By hand: the triggers that move a mark back to now, after their function.
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
