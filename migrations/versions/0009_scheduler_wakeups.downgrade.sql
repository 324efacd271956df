-- 0009 undone: back to 0008

-- By hand: the triggers and the table first (the function they call is dropped below).
LOCK TABLE ledger.leases, ledger.jobs, ledger.triggers IN SHARE ROW EXCLUSIVE MODE;
DROP TRIGGER leases_wake ON ledger.leases;
DROP TRIGGER triggers_wake ON ledger.triggers;
DROP TRIGGER jobs_wake ON ledger.jobs;
DROP TABLE ledger.wakeups;


CREATE OR REPLACE FUNCTION ledger._newest_done_slot(job text, except_run_id bigint DEFAULT NULL::bigint)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
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

DROP FUNCTION ledger._wake_job();

-- Left in place for the calls in flight across this change (old bodies call them):
--   ledger._next_start_of(text)
