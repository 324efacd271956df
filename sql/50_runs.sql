-- Runs: the execution log. Every function that changes a job's runs first
-- locks the job's lease row, so all of them serialize per job in one order
-- (lease row, then run rows, then counters) and cannot deadlock each other.

CREATE FUNCTION ledger.start_run(
    job text,
    owner text,
    ttl interval DEFAULT NULL,
    slot timestamptz DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    detail jsonb DEFAULT NULL)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now      timestamptz;
    v_ttl      interval;
    v_timeline integer;
    v_took     record;
    v_lease    ledger.leases;
    v_running  ledger.job_execution_log;
    v_lost     bigint := 0::bigint;
    v_result   ledger.run_start;
    v_job      ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_label(idempotency_key, 'idempotency_key', false);
    PERFORM ledger._check_detail(detail);
    PERFORM ledger._check_instant(slot, 'slot');
    -- One read of the job's registration serves the ttl default, the slot
    -- check and the pause.
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_run.job;
    v_ttl := ledger._resolve_ttl(job, coalesce(ttl, v_job.ttl));
    IF slot IS NOT NULL AND v_job.schedule IS NOT NULL THEN
        PERFORM ledger._check_slot(v_job, slot);
    END IF;
    v_result.slot := slot;

    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    v_timeline := ledger._timeline();
    v_took := ledger._lock_lease(job, owner, v_ttl, v_timeline);
    v_lease := v_took.lease;
    IF v_took.state = 'created' THEN
        -- A job with no lease row has no runs: nothing to check.
        RETURN ledger._insert_run(v_lease, slot, idempotency_key, detail, 0);
    END IF;
    -- Read the clock once locked: a start that waited for the previous run
    -- to end must not date itself before that end.
    v_now := clock_timestamp();

    IF v_took.state = 'locked' THEN
        -- The previous run: still running while its lease expired, ended or
        -- went to another token? Its runner is gone or a zombie: close it.
        SELECT * INTO v_running FROM ledger.job_execution_log r
         WHERE r.job = start_run.job AND r.status = 'running';
        IF FOUND AND (v_lease.token <> v_running.token
                      OR v_lease.released_at IS NOT NULL
                      OR v_lease.expires_at <= v_now) THEN
            PERFORM ledger._close_run(v_running.run_id,
                CASE WHEN v_lease.token <> v_running.token THEN 'superseded' ELSE 'lease_expired' END,
                v_now);
            v_lost := v_lost + 1;
            v_running := NULL;
        END IF;
    END IF;

    -- That slot or key already succeeded or is running (wins over overlap).
    IF ledger._already_done(job, slot, idempotency_key) THEN
        IF v_lost > 0 THEN
            PERFORM ledger._count(job, failures => v_lost, leases_lost => v_lost);
        END IF;
        v_result.outcome := 'already_done';
        RETURN v_result;
    END IF;

    -- Another owner's live lease (or a row another transaction holds past
    -- the lock bound): a normal skip, counted apart from failures.
    IF v_took.state IN ('held', 'busy')
       OR (v_lease.released_at IS NULL AND v_lease.expires_at > v_now AND v_lease.owner <> owner) THEN
        IF v_took.state = 'locked' THEN
            PERFORM ledger._count(job, skipped_overlap => 1, failures => v_lost, leases_lost => v_lost);
        ELSE
            PERFORM ledger._count_skip(job, wait => CASE v_took.state WHEN 'held' THEN ledger._lock_wait()
                                                                      ELSE '10ms' END);
        END IF;
        v_result.outcome := 'skipped_overlap';
        v_result.holder := v_lease.owner;
        v_result.holder_expires_at := v_lease.expires_at;
        RETURN v_result;
    END IF;

    -- The same owner still holds it: the new token wins.
    IF v_running.run_id IS NOT NULL THEN
        PERFORM ledger._close_run(v_running.run_id, 'superseded', v_now);
        v_lost := v_lost + 1;
    END IF;

    UPDATE ledger.leases l SET
        owner       = start_run.owner,
        token       = ledger._next_token(l.token, l.timeline, v_timeline),
        ttl         = v_ttl,
        acquired_at = v_now,
        expires_at  = v_now + v_ttl,
        released_at = NULL,
        timeline    = v_timeline
     WHERE l.job = start_run.job
    RETURNING * INTO v_lease;
    RETURN ledger._insert_run(v_lease, slot, idempotency_key, detail, v_lost);
END
$$;
COMMENT ON FUNCTION ledger.start_run(text, text, interval, timestamptz, text, jsonb) IS
    'Check the previous run, take the lease and log a running run, in one transaction';

-- A slot or an idempotency key that succeeded or is running, including
-- those whose runs purge_log removed (it leaves ledger.purged_slots and
-- ledger.purged_keys behind, so a purge never revives them).
CREATE FUNCTION ledger._already_done(job text, slot timestamptz, idempotency_key text)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (slot IS NOT NULL AND (
               EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = _already_done.job AND r.slot = _already_done.slot
                          AND r.status IN ('running', 'success'))
               OR EXISTS (SELECT FROM ledger.purged_slots p
                           WHERE p.job = _already_done.job AND p.done_through >= _already_done.slot)))
        OR (idempotency_key IS NOT NULL AND (
               EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = _already_done.job
                          AND r.idempotency_key = _already_done.idempotency_key
                          AND r.status IN ('running', 'success'))
               OR EXISTS (SELECT FROM ledger.purged_keys k
                           WHERE k.job = _already_done.job
                             AND k.idempotency_key = _already_done.idempotency_key)));
END
$$;

-- Log a running run under a lease the caller has just taken (and holds
-- locked); count it, with `lost` earlier runs closed on the way.
CREATE FUNCTION ledger._insert_run(
    lease ledger.leases, slot timestamptz, idempotency_key text, detail jsonb, lost bigint)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_result ledger.run_start;
BEGIN
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail)
    VALUES (lease.job, lease.owner, lease.token, _insert_run.slot, _insert_run.idempotency_key,
            'running', lease.acquired_at, lease.acquired_at, _insert_run.detail)
    RETURNING run_id INTO v_result.run_id;
    PERFORM ledger._count(lease.job, runs_started => 1, failures => lost, leases_lost => lost);
    v_result.outcome := 'started';
    v_result.token := lease.token;
    v_result.expires_at := lease.expires_at;
    v_result.slot := slot;
    RETURN v_result;
END
$$;

-- Close a running run as failed because its lease was lost. The caller
-- holds the job's lease row lock and does the counting.
CREATE FUNCTION ledger._close_run(run_id bigint, reason text, at timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE ledger.job_execution_log r
       SET status = 'failure',
           failure_reason = reason,
           completed_at = greatest(at, r.started_at),
           error = CASE reason
                       WHEN 'superseded' THEN 'lease superseded by a newer token'
                       ELSE 'lease expired before the run ended'
                   END
     WHERE r.run_id = _close_run.run_id AND r.status = 'running';
END
$$;

CREATE FUNCTION ledger.heartbeat(run_id bigint, token bigint, ttl interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run   ledger.job_execution_log;
    v_lease ledger.leases;
    v_now   timestamptz;
BEGIN
    PERFORM ledger._check_ttl(ttl);
    v_run := ledger._lock_run(run_id, token);
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_run.job;

    IF v_run.status <> 'running' THEN
        -- Closed by a takeover or the reaper: that is a lost lease, not a misuse.
        IF v_run.failure_reason IN ('lease_expired', 'superseded') THEN
            RETURN NULL;
        END IF;
        PERFORM ledger._raise_not_running(v_run);
    END IF;
    IF v_lease.token <> v_run.token OR v_lease.released_at IS NOT NULL THEN
        RETURN NULL;
    END IF;

    v_now := clock_timestamp();
    UPDATE ledger.leases l
       SET expires_at = v_now + coalesce(heartbeat.ttl, l.ttl),
           ttl        = coalesce(heartbeat.ttl, l.ttl)
     WHERE l.job = v_run.job
    RETURNING l.expires_at INTO v_lease.expires_at;
    UPDATE ledger.job_execution_log r SET heartbeat_at = v_now WHERE r.run_id = v_run.run_id;
    RETURN v_lease.expires_at;
END
$$;
COMMENT ON FUNCTION ledger.heartbeat(bigint, bigint, interval) IS
    'Renew the run''s lease and stamp heartbeat_at; NULL when the lease is lost';

-- Check run_id and token, find the run, lock its job's lease row (the per-job
-- order every writer follows), then read the run again as it is under that
-- lock. LD004 when unknown, LD001 when `token` is not the run's token.
CREATE FUNCTION ledger._lock_run(run_id bigint, token bigint)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job text;
    v_run ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_token(run_id, 'run_id');
    PERFORM ledger._check_token(token);
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _lock_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    PERFORM FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;
    SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _lock_run.run_id;
    IF v_run.token <> token THEN
        PERFORM ledger._raise('LD001',
            format('lease superseded: run %s holds token %s, not %s', run_id, v_run.token, token),
            jsonb_build_object('run_id', run_id, 'job', v_run.job, 'token', token,
                               'run_token', v_run.token));
    END IF;
    RETURN v_run;
END
$$;

CREATE FUNCTION ledger._raise_not_running(run ledger.job_execution_log)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._raise('LD003',
        format('run not running: run %s of job %s already ended as %s', run.run_id, run.job, run.status),
        jsonb_build_object('run_id', run.run_id, 'job', run.job, 'status', run.status,
                           'failure_reason', run.failure_reason, 'completed_at', run.completed_at));
END
$$;

-- End a run and release its lease in one transaction: the body of
-- complete_run, fail_run and cancel_run.
CREATE FUNCTION ledger._end_run(
    run_id bigint, token bigint, status text, failure_reason text, error text, detail jsonb)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run   ledger.job_execution_log;
    v_lease ledger.leases;
    v_now   timestamptz;
BEGIN
    PERFORM ledger._check_detail(detail);
    v_run := ledger._lock_run(run_id, token);
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_run.job;

    -- A newer token took the job over: the zombie learns it lost, and the
    -- row keeps the takeover's verdict.
    IF v_lease.token <> v_run.token THEN
        PERFORM ledger._raise('LD001',
            format('lease superseded: job %s is now held with token %s, run %s had token %s',
                   v_run.job, v_lease.token, v_run.run_id, v_run.token),
            jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                               'current_token', v_lease.token, 'holder', v_lease.owner,
                               'verdict', v_run.failure_reason));
    END IF;
    IF v_run.status <> 'running' THEN
        PERFORM ledger._raise_not_running(v_run);
    END IF;

    v_now := greatest(clock_timestamp(), v_run.started_at);
    UPDATE ledger.job_execution_log r SET
        status         = _end_run.status,
        failure_reason = _end_run.failure_reason,
        error          = ledger._bounded_error(_end_run.error),
        completed_at   = v_now,
        detail         = CASE WHEN _end_run.detail IS NULL THEN r.detail
                              ELSE coalesce(r.detail, '{}'::jsonb) || _end_run.detail END
     WHERE r.run_id = v_run.run_id
    RETURNING * INTO v_run;
    -- The token stays: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at = least(l.expires_at, v_now), released_at = v_now
     WHERE l.job = v_run.job AND l.released_at IS NULL;
    IF status = 'success' THEN
        PERFORM ledger._count(v_run.job, successes => 1);
    ELSE
        PERFORM ledger._count(v_run.job, failures => 1);
    END IF;
    RETURN v_run;
END
$$;

CREATE FUNCTION ledger.complete_run(run_id bigint, token bigint, detail jsonb DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
END
$$;
COMMENT ON FUNCTION ledger.complete_run(bigint, bigint, jsonb) IS
    'End the run as success and release its lease';

CREATE FUNCTION ledger.fail_run(run_id bigint, token bigint, error text, detail jsonb DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF error IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument error must not be null';
    END IF;
    RETURN ledger._end_run(run_id, token, 'failure', 'error', error, detail);
END
$$;
COMMENT ON FUNCTION ledger.fail_run(bigint, bigint, text, jsonb) IS
    'End the run as failure (reason error) and release its lease';

CREATE FUNCTION ledger.cancel_run(run_id bigint, token bigint, error text DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._end_run(run_id, token, 'failure', 'cancelled', error, NULL);
END
$$;
COMMENT ON FUNCTION ledger.cancel_run(bigint, bigint, text) IS
    'End the run as failure (reason cancelled: the runner was told to stop) and release its lease';

CREATE FUNCTION ledger.reap_expired(job text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now    timestamptz := clock_timestamp();
    v_closed bigint;
BEGIN
    PERFORM ledger._check_label(job, 'job', false);
    -- SKIP LOCKED: a job whose lease row is locked is being started, renewed
    -- or ended right now, and that writer settles it; concurrent reapers
    -- split the work instead of waiting on each other. FOR UPDATE returns the
    -- row as locked, so the expiry tested below is current, not a snapshot.
    WITH lost AS (
        SELECT l.job, l.token, l.expires_at, l.released_at
          FROM ledger.leases l
         WHERE (reap_expired.job IS NULL OR l.job = reap_expired.job)
           AND EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = l.job AND r.status = 'running')
           FOR UPDATE OF l SKIP LOCKED
    ), closed AS (
        UPDATE ledger.job_execution_log r SET
            status         = 'failure',
            failure_reason = CASE WHEN lost.token <> r.token THEN 'superseded' ELSE 'lease_expired' END,
            completed_at   = greatest(v_now, r.started_at),
            error          = CASE WHEN lost.token <> r.token THEN 'lease superseded by a newer token'
                                  ELSE 'lease expired before the run ended' END
          FROM lost
         WHERE r.job = lost.job AND r.status = 'running'
           AND (lost.token <> r.token OR lost.released_at IS NOT NULL OR lost.expires_at <= v_now)
        RETURNING r.job, r.token, r.failure_reason
    ), released AS (
        -- A reaped lease is over: its late holder may not renew it.
        UPDATE ledger.leases l SET released_at = v_now, expires_at = least(l.expires_at, v_now)
          FROM closed
         WHERE l.job = closed.job AND l.token = closed.token AND l.released_at IS NULL
    ), counted AS (
        INSERT INTO ledger.counters AS c (job, failures, leases_lost)
        SELECT closed.job, count(*), count(*) FROM closed GROUP BY closed.job
        ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
            failures    = c.failures + excluded.failures,
            leases_lost = c.leases_lost + excluded.leases_lost
    )
    SELECT count(*) INTO v_closed FROM closed;
    RETURN v_closed::integer;
END
$$;
COMMENT ON FUNCTION ledger.reap_expired(text) IS
    'Close every running run whose lease expired as failure (lease_expired); safe to call concurrently';
