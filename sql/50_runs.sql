-- Runs: the execution log. Every function that changes a job's runs first
-- locks the job's lease row, so all of them serialize per job in one order
-- (lease row, then the job's registration, then run rows, then the job's
-- state row, which ledger._set_state alone writes) and cannot deadlock
-- each other. The registration row is locked FOR NO KEY
-- UPDATE by whoever changes it in place (register_job), so that the key
-- share of a start's foreign keys never waits on it; only unregister_job,
-- after the lease row, deletes it. A row a call waited for may be gone
-- once it has the lease row: the call answers LD004 or LD005, as for a run
-- or a job that never was.

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
    v_ttl    interval;
    v_job    ledger.jobs;
    v_result ledger.run_start;
BEGIN
    -- Every argument checked once, in one expression; the helpers run only
    -- to raise the documented error, in the documented order.
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)
               AND (idempotency_key IS NULL
                    OR (char_length(idempotency_key) BETWEEN 1 AND 200
                        AND ledger._is_visible_text(idempotency_key))))
       OR (detail IS NOT NULL
           AND (jsonb_typeof(detail) <> 'object' OR octet_length(detail::text) > ledger._max_detail_bytes()))
       OR slot < ledger._min_instant() OR slot >= ledger._max_instant() OR NOT isfinite(slot) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
        PERFORM ledger._check_label(idempotency_key, 'idempotency_key', false);
        PERFORM ledger._check_detail(detail);
        PERFORM ledger._check_instant(slot, 'slot');
    END IF;
    -- One read of the job's registration serves the ttl default, the slot
    -- check and the pause.
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_run.job;
    v_ttl := coalesce(ttl, v_job.ttl);
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;
    IF slot IS NOT NULL AND v_job.schedule IS NOT NULL THEN
        PERFORM ledger._check_slot(v_job, slot);
    END IF;
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        v_result.slot := slot;
        RETURN v_result;
    END IF;
    RETURN ledger._start(job, owner, v_ttl, slot, idempotency_key, detail);
END
$$;
COMMENT ON FUNCTION ledger.start_run(text, text, interval, timestamptz, text, jsonb) IS
    'Check the previous run, take the lease and log a running run, in one transaction';

-- The one start path of start_run and start_due_run, for checked arguments
-- (`ttl` resolved and exact) of a job that is not paused. In the usual
-- cases it reads the lease row once: locked at once when it is free,
-- expired, released or already the caller's and nobody else writes it;
-- read without a lock when another owner holds it live, and then the skip
-- locks nothing and writes only ledger.skip_counts (UNLOGGED: its commit
-- waits for no WAL flush), issuing no token. Order of locks: the lease row,
-- then run rows, then counters.
CREATE FUNCTION ledger._start(
    job text, owner text, ttl interval, slot timestamptz, idempotency_key text, detail jsonb)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now      timestamptz;
    v_timeline integer;
    v_lease    ledger.leases;
    v_state    text := 'locked';
    v_took     record;
    v_running  ledger.job_execution_log;
    v_result   ledger.run_start;
BEGIN
    v_result.slot := slot;
    SELECT * INTO v_lease FROM ledger.leases l
     WHERE l.job = _start.job
       AND (l.released_at IS NOT NULL OR l.expires_at <= ledger._now() OR l.owner = _start.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _start.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now()
           AND v_lease.owner <> owner THEN
            v_state := 'held';
        ELSE
            v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
            v_took := ledger._lock_lease(job, owner, ttl, v_timeline);
            v_lease := v_took.lease;
            v_state := v_took.state;
        END IF;
    END IF;

    IF v_state IN ('held', 'busy') THEN
        -- That slot or key already succeeded or is running (wins over overlap).
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- Another owner's live lease (or a row another transaction holds
        -- past the lock bound): a normal skip, counted apart from failures,
        -- without a WAL flush.
        UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + 1
          FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                 WHERE t.job = _start.job AND t.shard = pg_backend_pid() % 16
                   FOR UPDATE SKIP LOCKED) free_
         WHERE s.job = free_.job AND s.shard = free_.shard;
        IF NOT FOUND THEN
            PERFORM ledger._count_skip(job, wait => CASE v_state WHEN 'held' THEN ledger._lock_wait() ELSE '10ms' END);
        END IF;
        v_result.outcome := 'skipped_overlap';
        v_result.holder := v_lease.owner;
        v_result.holder_expires_at := v_lease.expires_at;
        RETURN v_result;
    END IF;

    IF v_state = 'locked' THEN
        -- Read the clock once locked: a start that waited for the previous
        -- run to end must not date itself before that end.
        v_now := ledger._now();
        -- Seats mode: the row locked is the token counter, kept released.
        IF v_lease.multi THEN
            RETURN ledger._start_seat(job, owner, ttl, slot, idempotency_key, detail, v_now, v_lease.pool);
        END IF;
        -- The previous run, still running while its lease expired, ended
        -- or went to another token? Its runner is gone or a zombie: close
        -- it (counted once, in ledger._close_lost).
        SELECT * INTO v_running FROM ledger.job_execution_log r
         WHERE r.job = _start.job AND r.status = 'running';
        IF FOUND AND (v_lease.token <> v_running.token
                      OR v_lease.released_at IS NOT NULL
                      OR v_lease.expires_at <= v_now) THEN
            PERFORM ledger._close_lost(v_running,
                CASE WHEN v_lease.token <> v_running.token THEN 'superseded' ELSE 'lease_expired' END, v_now);
            v_running := NULL;
        END IF;
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- POOL CHECK: before a token is issued (the lease row carries the
        -- job's pool; a job in none pays one test)
        IF v_lease.pool IS NOT NULL THEN
            IF NOT ledger._pool_admits(job, v_lease.pool) THEN
                RETURN ledger._pool_full(job, slot);
            END IF;
            -- dated after the admission, so the log shows no more runs of
            -- the pool at once than it admitted (the place it took was
            -- freed by a run whose end committed before the count)
            v_now := ledger._now();
        END IF;
        -- The same owner still holds it: the new token wins.
        IF v_running.run_id IS NOT NULL THEN
            PERFORM ledger._close_lost(v_running, 'superseded', v_now);
        END IF;
        v_timeline := coalesce(v_timeline,
            ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer);
        UPDATE ledger.leases l SET
            owner       = _start.owner,
            -- ledger._next_token, inline
            token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                               ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
            ttl         = _start.ttl,
            acquired_at = v_now,
            expires_at  = v_now + _start.ttl,
            released_at = NULL,
            timeline    = v_timeline
         WHERE l.job = _start.job
        RETURNING * INTO v_lease;
    END IF;
    -- A first lease row, made by ledger._lock_lease in this transaction, of
    -- a job in a full pool: removed again (its token was never handed out,
    -- and no run, fence or other transaction has seen it).
    IF v_state = 'created' AND v_lease.pool IS NOT NULL THEN
        IF NOT ledger._pool_admits(job, v_lease.pool) THEN
            DELETE FROM ledger.leases l WHERE l.job = _start.job;
            RETURN ledger._pool_full(job, slot);
        END IF;
        v_now := ledger._now();  -- dated after the admission, as below
        UPDATE ledger.leases l SET acquired_at = v_now, expires_at = v_now + _start.ttl
         WHERE l.job = _start.job
        RETURNING * INTO v_lease;
    END IF;
    -- 'created' (a job with no lease row has no runs: nothing to check) or
    -- taken just now: log the running run, and the job's 'started'
    -- transition counts it and notes it as the job's last and running run.
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail)
    VALUES (v_lease.job, v_lease.owner, v_lease.token, _start.slot, _start.idempotency_key,
            'running', v_lease.acquired_at, v_lease.acquired_at, _start.detail)
    RETURNING * INTO v_running;
    PERFORM ledger._set_state(v_lease.job, 'started', v_running);
    v_result.run_id := v_running.run_id;
    v_result.outcome := 'started';
    v_result.token := v_lease.token;
    v_result.expires_at := v_lease.expires_at;
    RETURN v_result;
END
$$;

-- ledger._start for a job in seats mode (ledger.leases.multi), its lease
-- row locked: the runs whose seat is no longer theirs or no longer live are
-- closed (superseded, lease_expired), then a slot or key done answers
-- already_done, then a free seat is taken with a new token (none free: a
-- skip, counted as ledger._start counts one; the job's pool full:
-- skipped_pool_full) and the run logged in it. Order of locks: the lease
-- row (the caller's), the seats, the pool's row, run rows, counters.
CREATE FUNCTION ledger._start_seat(
    job text, owner text, ttl interval, slot timestamptz, idempotency_key text, detail jsonb, at timestamptz,
    pool text)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run    ledger.job_execution_log;
    v_free   integer;
    v_seat   ledger.lease_seats;
    v_result ledger.run_start;
BEGIN
    v_result.slot := slot;
    PERFORM ledger._close_lost_seats(job, at);
    IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
       AND ledger._already_done(job, slot, idempotency_key) THEN
        v_result.outcome := 'already_done';
        RETURN v_result;
    END IF;
    v_free := ledger._free_seat(job, at);
    IF v_free IS NULL THEN
        -- every seat live: a skip, counted apart from failures, without a WAL flush
        PERFORM ledger._count_skip(job, wait => '10ms');
        -- the holder whose seat frees first
        SELECT s.owner, s.expires_at INTO v_result.holder, v_result.holder_expires_at
          FROM ledger.lease_seats s
         WHERE s.job = _start_seat.job AND s.released_at IS NULL AND s.expires_at > at
         ORDER BY s.expires_at, s.seat LIMIT 1;
        v_result.outcome := 'skipped_overlap';
        RETURN v_result;
    END IF;
    -- a seat is free: the job's own limit allows the run, now its pool's
    IF pool IS NOT NULL THEN
        IF NOT ledger._pool_admits(job, pool) THEN
            RETURN ledger._pool_full(job, slot);
        END IF;
        at := ledger._now();  -- dated after the admission, as a single holder's
    END IF;
    v_seat := ledger._take_seat(job, v_free, owner, ttl, at);
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail, seat)
    VALUES (v_seat.job, v_seat.owner, v_seat.token, _start_seat.slot, _start_seat.idempotency_key,
            'running', v_seat.acquired_at, v_seat.acquired_at, _start_seat.detail, v_seat.seat)
    RETURNING * INTO v_run;
    UPDATE ledger.lease_seats s SET run_id = v_run.run_id WHERE s.job = v_seat.job AND s.seat = v_seat.seat;
    PERFORM ledger._set_state(v_seat.job, 'started', v_run);
    v_result.run_id := v_run.run_id;
    v_result.outcome := 'started';
    v_result.token := v_seat.token;
    v_result.expires_at := v_seat.expires_at;
    RETURN v_result;
END
$$;

-- The runs of a job in seats mode whose seat is no longer live or went to
-- another token, closed (lease_expired, superseded), and their seats
-- released, its lease row locked by the caller: the first step of a start
-- and of an acquire, so that a seat is never taken over while its lost run
-- is still marked running, and reap_expired's for such a job. Returns the
-- number closed.
CREATE FUNCTION ledger._close_lost_seats(job text, at timestamptz)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run    ledger.job_execution_log;
    v_seat   ledger.lease_seats;
    v_closed integer := 0;
BEGIN
    PERFORM FROM ledger.lease_seats s WHERE s.job = _close_lost_seats.job ORDER BY s.seat FOR UPDATE;
    FOR v_run IN SELECT r.* FROM ledger.job_execution_log r
                  WHERE r.job = _close_lost_seats.job AND r.status = 'running' ORDER BY r.seat LOOP
        SELECT * INTO v_seat FROM ledger.lease_seats s WHERE s.job = v_run.job AND s.seat = v_run.seat;
        CONTINUE WHEN v_seat.job IS NOT NULL AND v_seat.token = v_run.token
                      AND v_seat.released_at IS NULL AND v_seat.expires_at > at;
        PERFORM ledger._close_lost(v_run, CASE WHEN v_seat.job IS NULL OR v_seat.token <> v_run.token
                                               THEN 'superseded' ELSE 'lease_expired' END, at, true);
        UPDATE ledger.lease_seats s SET released_at = at, expires_at = least(s.expires_at, at)
         WHERE s.job = v_run.job AND s.seat = v_run.seat AND s.token = v_run.token AND s.released_at IS NULL;
        v_closed := v_closed + 1;
    END LOOP;
    RETURN v_closed;
END
$$;

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
    IF v_lease.multi THEN
        RETURN ledger._heartbeat_seat(v_run, heartbeat.ttl);
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
$$;
-- heartbeat of a running run of a job in seats mode, its lease row locked:
-- the run's seat, as heartbeat does the lease row.
CREATE FUNCTION ledger._heartbeat_seat(run ledger.job_execution_log, ttl interval)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_seat ledger.lease_seats;
    v_now  timestamptz;
BEGIN
    SELECT * INTO v_seat FROM ledger.lease_seats s WHERE s.job = run.job AND s.seat = run.seat FOR UPDATE;
    IF v_seat.job IS NULL OR v_seat.token <> run.token OR v_seat.released_at IS NOT NULL THEN
        RETURN NULL;
    END IF;
    IF run.cancel_requested_at IS NOT NULL THEN
        PERFORM ledger._end_run(run.run_id, run.token, 'failure', 'cancelled',
                                format('cancelled by an operator (ledger.request_cancel at %s)',
                                       run.cancel_requested_at), NULL);
        RETURN NULL;
    END IF;
    v_now := ledger._now();
    UPDATE ledger.lease_seats s
       SET expires_at = v_now + ledger._exact(coalesce(_heartbeat_seat.ttl, s.ttl)),
           ttl        = ledger._exact(coalesce(_heartbeat_seat.ttl, s.ttl))
     WHERE s.job = run.job AND s.seat = run.seat
    RETURNING s.expires_at INTO v_seat.expires_at;
    UPDATE ledger.job_execution_log r SET heartbeat_at = v_now WHERE r.run_id = run.run_id;
    RETURN v_seat.expires_at;
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
-- complete_run, fail_run and cancel_run. The usual case (the run's own live
-- token, no detail) is one locked read of the lease row and three writes:
-- the run, the lease, and the job's counters and state (with the job's
-- pending skips folded in); anything else goes the long way, which raises
-- the documented error in the documented order.
CREATE FUNCTION ledger._end_run(
    run_id bigint, token bigint, status text, failure_reason text, error text, detail jsonb)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job    ledger.label;
    v_run    ledger.job_execution_log;
    v_lease  ledger.leases;
    v_seat   ledger.lease_seats;
    v_detail jsonb;
    v_error  text := CASE WHEN error IS NULL OR char_length(error) <= ledger._max_error_length() THEN error
                          ELSE ledger._bounded_error(error) END;
BEGIN
    IF detail IS NOT NULL THEN
        PERFORM ledger._check_detail(detail);
    END IF;
    IF run_id IS NULL OR token IS NULL OR run_id <= 0 OR token <= 0 THEN
        PERFORM ledger._check_token(run_id, 'run_id');
        PERFORM ledger._check_token(token);
    END IF;
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    -- The per-job order every writer follows: the lease row first.
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;

    IF detail IS NULL THEN
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(ledger._now(), r.started_at)
         WHERE r.run_id = _end_run.run_id AND r.token = _end_run.token
           AND r.token = v_lease.token AND r.status = 'running' AND NOT v_lease.multi
        RETURNING * INTO v_run;
    END IF;
    IF v_run.run_id IS NULL THEN
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
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
        -- Seats mode: the run's seat is its lease.
        IF v_lease.multi THEN
            SELECT * INTO v_seat FROM ledger.lease_seats s
             WHERE s.job = v_run.job AND s.seat = v_run.seat FOR UPDATE;
            IF v_seat.job IS NULL OR v_seat.token <> v_run.token THEN
                PERFORM ledger._raise('LD001',
                    format('lease superseded: seat %s of job %s is now held with token %s, run %s had token %s',
                           v_run.seat, v_run.job, v_seat.token, v_run.run_id, v_run.token),
                    jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                       'seat', v_run.seat, 'current_token', v_seat.token,
                                       'holder', v_seat.owner, 'verdict', v_run.failure_reason));
            END IF;
        -- A newer token took the job over: the zombie learns it lost, and the
        -- row keeps the takeover's verdict.
        ELSIF v_lease.token <> v_run.token THEN
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
        -- The detail recorded is the start's merged with this one (its keys
        -- win), and the merge is held to the same bound as either part: two
        -- details of 40 kB each would otherwise record 80 kB.
        IF detail IS NOT NULL THEN
            v_detail := coalesce(v_run.detail, '{}'::jsonb) || detail;
            IF octet_length(v_detail::text) > ledger._max_detail_bytes() THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('argument detail, merged with the detail run %s started with, must be at most '
                                     '%s bytes as JSON text', v_run.run_id, ledger._max_detail_bytes()),
                    DETAIL = jsonb_build_object('argument', 'detail', 'run_id', v_run.run_id,
                                                'bytes', octet_length(v_detail::text),
                                                'given_bytes', octet_length(detail::text),
                                                'recorded_bytes', octet_length(v_run.detail::text),
                                                'max', ledger._max_detail_bytes())::text;
            END IF;
        END IF;
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(ledger._now(), r.started_at),
            detail         = coalesce(v_detail, r.detail)
         WHERE r.run_id = v_run.run_id
        RETURNING * INTO v_run;
    END IF;

    IF v_lease.multi THEN
        -- the seat ends with its run (which wakes the job and its pool:
        -- trigger lease_seats_wake)
        UPDATE ledger.lease_seats s
           SET expires_at = least(s.expires_at, v_run.completed_at),
               released_at = coalesce(s.released_at, v_run.completed_at), run_id = NULL
         WHERE s.job = v_run.job AND s.seat = v_run.seat AND s.token = v_run.token;
        PERFORM ledger._set_state(v_run.job, 'ended', v_run, seats => true);
        RETURN v_run;
    END IF;
    -- The token stays: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at = least(l.expires_at, v_run.completed_at), released_at = v_run.completed_at
     WHERE l.job = v_run.job AND l.released_at IS NULL;
    -- Counted, noted as the job's state, and the pending skips folded in,
    -- by the job's one writer.
    PERFORM ledger._set_state(v_run.job, 'ended', v_run);
    RETURN v_run;
END
$$;

-- fenced names the resources the run's writes fenced (ledger.fence,
-- advance_fence, a protected table): the ledger's safety net for a write that
-- did not commit. A driver can lose a COMMIT without an error (pgjdbc behind a
-- transaction pooler ran another client's ROLLBACK under the name of its
-- COMMIT, docs/sql-clients.md); then neither the write nor its fence exists,
-- and a success recorded now would be a lie. A fence that does not hold this
-- run's token is such a write (the first fence of a resource inserts its row,
-- so an unknown resource is one too): the run is recorded as failure instead,
-- and the call still commits and returns the row, with a WARNING of SQLSTATE
-- LD007. It cannot raise: the error would roll back the failure it records,
-- and the run would stay running until its lease expired, its lost write
-- reported as nothing more than a lost lease.
CREATE FUNCTION ledger.complete_run(run_id bigint, token bigint, detail jsonb DEFAULT NULL,
                                    fenced text[] DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run      ledger.job_execution_log;
    v_resource text;
    v_missing  jsonb := '[]'::jsonb;
    v_held     jsonb := '{}'::jsonb;
    v_fence    ledger.fences;
BEGIN
    IF fenced IS NULL OR cardinality(fenced) = 0 THEN
        RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
    END IF;
    IF array_ndims(fenced) > 1 OR cardinality(fenced) > ledger._max_fenced() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument fenced must be a list of at most %s resources', ledger._max_fenced()),
            DETAIL = jsonb_build_object('argument', 'fenced', 'count', cardinality(fenced),
                                        'dimensions', array_ndims(fenced), 'max', ledger._max_fenced())::text;
    END IF;
    -- A NULL element is an invalid value of a list that is not NULL: 22023.
    IF array_position(fenced, NULL) IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument fenced must not contain null (element %s)', array_position(fenced, NULL)),
            DETAIL = jsonb_build_object('argument', 'fenced', 'element', array_position(fenced, NULL))::text;
    END IF;
    FOREACH v_resource IN ARRAY fenced LOOP
        PERFORM ledger._check_label(v_resource, 'fenced');
    END LOOP;
    IF detail IS NOT NULL THEN
        PERFORM ledger._check_detail(detail);
    END IF;
    -- The run's own token is checked by _end_run (LD004, LD001, LD003, in
    -- that order, before anything is written): a run that is not this
    -- caller's to end is answered as without fenced.
    SELECT * INTO v_run FROM ledger.job_execution_log r
     WHERE r.run_id = complete_run.run_id AND r.token = complete_run.token AND r.status = 'running';
    IF FOUND THEN
        FOR v_resource IN SELECT DISTINCT u.resource FROM unnest(fenced) AS u(resource) ORDER BY 1 LOOP
            -- What has committed (or this transaction wrote): a fenced write
            -- still in flight on another connection is not committed yet.
            SELECT * INTO v_fence FROM ledger.fences f WHERE f.resource = v_resource;
            IF FOUND AND v_fence.job <> v_run.job THEN
                PERFORM ledger._raise('LD006',
                    format('fence of another job: resource %s belongs to job %s, not %s',
                           v_resource, v_fence.job, v_run.job),
                    jsonb_build_object('resource', v_resource, 'job', v_run.job, 'bound_job', v_fence.job,
                                       'token', v_run.token, 'argument', 'fenced'));
            END IF;
            IF NOT FOUND OR v_fence.token <> v_run.token THEN
                v_missing := v_missing || to_jsonb(v_resource);
                v_held := v_held || jsonb_build_object(v_resource, v_fence.token);
            END IF;
        END LOOP;
    END IF;
    IF jsonb_array_length(v_missing) = 0 THEN
        RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
    END IF;
    v_run := ledger._end_run(run_id, token, 'failure', 'error',
        format('fence not committed: %s', (
            SELECT string_agg(format('%s holds %s', m.resource,
                                     coalesce('token ' || (v_held ->> m.resource), 'no token')), ', ')
              FROM jsonb_array_elements_text(v_missing) AS m(resource)))
        || format(', not the run''s token %s: the fenced write did not commit (a rolled back or lost COMMIT)',
                  token),
        coalesce(detail, '{}'::jsonb) || jsonb_build_object('fence_not_committed', v_missing,
                                                            'fence_tokens', v_held));
    RAISE WARNING USING ERRCODE = 'LD007',
        MESSAGE = format('fence not committed: run %s of job %s is recorded as failure, not success: '
                         'the fence of %s does not hold its token %s',
                         v_run.run_id, v_run.job,
                         (SELECT string_agg(m.resource, ', ') FROM jsonb_array_elements_text(v_missing) AS m(resource)),
                         token),
        DETAIL = jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                    'resources', v_missing, 'fence_tokens', v_held)::text;
    RETURN v_run;
END
$$;
COMMENT ON FUNCTION ledger.complete_run(bigint, bigint, jsonb, text[]) IS
    'End the run as success and release its lease; as failure (warning LD007) when a fence named in fenced does not hold its token';

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
    'End the run as cancelled (status failure, reason cancelled: the runner was told to stop; no failure of the job) and release its lease';

CREATE FUNCTION ledger.reap_expired(job text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now    timestamptz := ledger._now();
    v_closed integer := 0;
    v_lease  ledger.leases;
    v_run    ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_label(job, 'job', false);
    -- SKIP LOCKED: a job whose lease row is locked is being started, renewed
    -- or ended right now, and that writer settles it; concurrent reapers
    -- split the work instead of waiting on each other. FOR UPDATE returns the
    -- row as locked, so the expiry tested below is current, not a snapshot.
    FOR v_lease IN
        SELECT l.* FROM ledger.leases l
         WHERE (reap_expired.job IS NULL OR l.job = reap_expired.job)
           AND EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = l.job AND r.status = 'running')
           FOR UPDATE OF l SKIP LOCKED
    LOOP
        IF v_lease.multi THEN
            v_closed := v_closed + ledger._close_lost_seats(v_lease.job, v_now);
            CONTINUE;
        END IF;
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.job = v_lease.job AND r.status = 'running';
        CONTINUE WHEN NOT FOUND
                   OR (v_lease.token = v_run.token AND v_lease.released_at IS NULL AND v_lease.expires_at > v_now);
        -- closed, counted and noted (a failure that may pause the job), by
        -- the job's 'lost' transition
        PERFORM ledger._close_lost(v_run, CASE WHEN v_lease.token <> v_run.token THEN 'superseded'
                                               ELSE 'lease_expired' END, v_now);
        -- A reaped lease is over: its late holder may not renew it.
        UPDATE ledger.leases l SET released_at = v_now, expires_at = least(l.expires_at, v_now)
         WHERE l.job = v_lease.job AND l.token = v_run.token AND l.released_at IS NULL;
        v_closed := v_closed + 1;
    END LOOP;
    RETURN v_closed;
END
$$;
COMMENT ON FUNCTION ledger.reap_expired(text) IS
    'Close every running run whose lease expired as failure (lease_expired); safe to call concurrently';
