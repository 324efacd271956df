-- Pools: a named limit shared by jobs. A job belongs to at most one pool
-- (ledger.jobs.pool, copied on its lease row: ledger.leases.pool); a pool
-- admits at most `size` live leases of its jobs at once, whichever jobs
-- they are. A start (start_run, start_due_run(s), run_guarded, backfill,
-- acquire) that finds the pool full issues no token and is answered
-- skipped_pool_full (acquire: no row), counted apart like the other
-- skips, never an error; the scheduler retries such a slot once a place
-- frees, the oldest due first.
--
-- The count is exact under concurrency: every admission locks the pool's
-- row (after the job's own lease row: the per-job lock order, then the
-- pool), counts the live leases of the other jobs of the pool with a
-- snapshot taken after that lock, and writes the row. Two starts of one
-- pool therefore serialize on its row for the length of their
-- transactions; a start that waits longer than ledger._lock_wait() for it
-- (the other start runs inside a long transaction of its caller's) is
-- answered skipped_pool_full rather than wait.

-- A pool name: a label (22004 when NULL, 22023 otherwise), as a job name.
-- A pool size: 1 to ledger._max_pool_size() (22023 naming `size`).
CREATE FUNCTION ledger._check_pool_size(size integer)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF size IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument size must not be null';
    END IF;
    IF size < 1 OR size > ledger._max_pool_size() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument size must be from 1 to %s, not %s', ledger._max_pool_size(), size),
            DETAIL = jsonb_build_object('argument', 'size', 'value', size, 'max', ledger._max_pool_size())::text;
    END IF;
END
$$;

-- The pool's row, or LD008 naming the argument that named it.
CREATE FUNCTION ledger._registered_pool(pool text, arg text DEFAULT 'pool')
RETURNS ledger.pools
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_pool ledger.pools;
BEGIN
    SELECT * INTO v_pool FROM ledger.pools p WHERE p.pool = _registered_pool.pool;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD008', format('pool not found: %s (argument %s) was never registered', pool, arg),
            jsonb_build_object('pool', pool, 'argument', arg));
    END IF;
    RETURN v_pool;
END
$$;

-- Every holder of a pool's place, live or not: the lease row of each
-- member job with a single holder, each seat of a member job in seats
-- mode (whose lease row is only its token counter). The one definition of
-- what a pool counts: its readers keep the live ones (released_at NULL,
-- expires_at ahead).
CREATE VIEW ledger._pool_holders AS
SELECT l.pool, l.job, NULL::integer AS seat, l.expires_at, l.released_at
  FROM ledger.leases l
 WHERE l.pool IS NOT NULL AND NOT l.multi
UNION ALL
SELECT l.pool, s.job, s.seat, s.expires_at, s.released_at
  FROM ledger.leases l
  JOIN ledger.lease_seats s ON s.job = l.job
 WHERE l.pool IS NOT NULL AND l.multi;

-- The live holders of the pool other than `job`'s single lease (whose
-- lease row the caller holds, and is about to take or retake; a seat being
-- taken is free, so not counted anyway).
CREATE FUNCTION ledger._pool_used(pool text, job text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (SELECT count(*) FROM ledger._pool_holders h
             WHERE h.pool = _pool_used.pool
               AND (h.job IS DISTINCT FROM _pool_used.job OR h.seat IS NOT NULL)
               AND h.released_at IS NULL AND h.expires_at > ledger._now());
END
$$;

-- True when the pool admits one more live lease for `job`, whose lease row
-- the caller holds locked; the admission is then recorded on the pool's
-- row, which stays locked until the caller's transaction ends. False when
-- the pool is full, or its row is held past ledger._lock_wait(). A pool
-- dropped meanwhile (the job left it) admits.
CREATE FUNCTION ledger._pool_admits(job text, pool text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_size integer;
    v_wait text;
BEGIN
    SELECT p.size INTO v_size FROM ledger.pools p WHERE p.pool = _pool_admits.pool
       FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        -- Locked by another admission (or gone): wait within the bound. The
        -- block is a subtransaction, paid only here.
        v_wait := current_setting('lock_timeout');
        BEGIN
            PERFORM set_config('lock_timeout', ledger._lock_wait(), true);
            SELECT p.size INTO v_size FROM ledger.pools p WHERE p.pool = _pool_admits.pool FOR NO KEY UPDATE;
            PERFORM set_config('lock_timeout', v_wait, true);
        EXCEPTION WHEN lock_not_available THEN
            RETURN false;
        END;
        IF v_size IS NULL THEN
            RETURN true;
        END IF;
    END IF;
    -- A new statement: its snapshot sees every admission committed before
    -- this one had the row.
    IF ledger._pool_used(pool, job) >= v_size THEN
        RETURN false;
    END IF;
    UPDATE ledger.pools p SET admitted_at = ledger._now() WHERE p.pool = _pool_admits.pool;
    RETURN true;
END
$$;

-- The answer to a start the pool did not admit: counted (the state row's
-- skipped_pool_full, by its one writer), no token, nothing else written.
CREATE FUNCTION ledger._pool_full(job text, slot timestamptz)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_result ledger.run_start;
BEGIN
    PERFORM ledger._set_state(job, 'skipped_pool_full');
    v_result.outcome := 'skipped_pool_full';
    v_result.slot := slot;
    RETURN v_result;
END
$$;

-- The jobs waiting a place in the pool (ledger.wakeups.pool_wait) are
-- looked at again: their marks back to their due times, and the schedulers
-- told. Called when a place may have freed: an end or a release in the
-- pool (ledger._wake_job), a larger size, a job leaving it.
CREATE FUNCTION ledger._wake_pool(pool text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE ledger.wakeups w SET at = least(w.at, w.waiting_since), pool_wait = NULL, waiting_since = NULL
     WHERE w.pool_wait = _wake_pool.pool;
    IF FOUND THEN
        PERFORM pg_notify('ledger_scheduler', pool);
    END IF;
END
$$;

-- Create a pool, or change the size of one: the pool's row. A smaller
-- size than the pool's live leases stops nothing that runs: no start is
-- admitted until they are fewer than the size.
CREATE FUNCTION ledger.register_pool(pool text, size integer)
RETURNS ledger.pools
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_pool ledger.pools;
BEGIN
    PERFORM ledger._check_label(pool, 'pool');
    PERFORM ledger._check_pool_size(size);
    INSERT INTO ledger.pools AS p (pool, size, created_at, updated_at)
    VALUES (register_pool.pool, register_pool.size, ledger._now(), ledger._now())
    ON CONFLICT ON CONSTRAINT pools_pkey DO UPDATE
       SET size = excluded.size,
           updated_at = CASE WHEN p.size = excluded.size THEN p.updated_at ELSE excluded.updated_at END
    RETURNING * INTO v_pool;
    PERFORM ledger._wake_pool(pool);
    RETURN v_pool;
END
$$;
COMMENT ON FUNCTION ledger.register_pool(text, integer) IS
    'Create a pool (a limit of live leases shared by its jobs) or change its size';

CREATE FUNCTION ledger.resize_pool(pool text, size integer)
RETURNS ledger.pools
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_pool ledger.pools;
BEGIN
    PERFORM ledger._check_label(pool, 'pool');
    PERFORM ledger._check_pool_size(size);
    PERFORM ledger._registered_pool(pool);
    UPDATE ledger.pools p
       SET size = resize_pool.size,
           updated_at = CASE WHEN p.size = resize_pool.size THEN p.updated_at ELSE ledger._now() END
     WHERE p.pool = resize_pool.pool
    RETURNING * INTO v_pool;
    PERFORM ledger._wake_pool(pool);
    RETURN v_pool;
END
$$;
COMMENT ON FUNCTION ledger.resize_pool(text, integer) IS
    'Change the size of a registered pool (LD008 when unknown)';

-- Drop a pool: refused (2BP01, DETAIL its jobs) while jobs belong to it,
-- unless detach, which takes them out of it first (each in the per-job
-- order: its lease row, then its registration). False when no such pool.
CREATE FUNCTION ledger.drop_pool(pool text, detach boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobs text[];
    v_job  text;
BEGIN
    PERFORM ledger._check_label(pool, 'pool');
    IF detach IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument detach must not be null';
    END IF;
    IF NOT EXISTS (SELECT FROM ledger.pools p WHERE p.pool = drop_pool.pool) THEN
        RETURN false;
    END IF;
    SELECT array_agg(j.job ORDER BY j.job) INTO v_jobs FROM ledger.jobs j WHERE j.pool = drop_pool.pool;
    IF v_jobs IS NOT NULL AND NOT detach THEN
        RAISE EXCEPTION USING ERRCODE = '2BP01',
            MESSAGE = format('argument pool names %s, which %s job(s) belong to (%s): move them out '
                             '(register_job(..., pool => '''')) or drop it with detach => true',
                             pool, cardinality(v_jobs), array_to_string(v_jobs[1:10], ', ')),
            DETAIL = jsonb_build_object('argument', 'pool', 'pool', pool, 'jobs', to_jsonb(v_jobs))::text;
    END IF;
    FOREACH v_job IN ARRAY coalesce(v_jobs, ARRAY[]::text[]) LOOP
        PERFORM ledger._lock_registration(v_job);
        UPDATE ledger.leases l SET pool = NULL WHERE l.job = v_job AND l.pool = drop_pool.pool;
        UPDATE ledger.jobs j SET pool = NULL, updated_at = ledger._now()
         WHERE j.job = v_job AND j.pool = drop_pool.pool;
    END LOOP;
    -- A job that joined meanwhile (its registration committed after the
    -- list was read) holds the delete back with its foreign key: 23503.
    PERFORM ledger._wake_pool(pool);  -- its waiting jobs, in no pool now
    DELETE FROM ledger.pools p WHERE p.pool = drop_pool.pool;
    PERFORM pg_notify('ledger_scheduler', pool);
    RETURN true;
END
$$;
COMMENT ON FUNCTION ledger.drop_pool(text, boolean) IS
    'Drop a pool: refused (2BP01) while jobs belong to it, unless detach takes them out';

-- Each pool: its size, its live leases (used) and running runs, its jobs,
-- the jobs waiting a place (the scheduler's), and the starts it refused.
CREATE VIEW ledger.pool_status AS
SELECT p.pool::text,
       p.size,
       (SELECT count(*) FROM ledger._pool_holders h
         WHERE h.pool = p.pool AND h.released_at IS NULL AND h.expires_at > ledger._view_now())::integer AS used,
       (SELECT count(*) FROM ledger.jobs j JOIN ledger.job_execution_log r ON r.job = j.job AND r.status = 'running'
         WHERE j.pool = p.pool)::integer                                                         AS running,
       (SELECT count(*) FROM ledger.jobs j WHERE j.pool = p.pool)::integer                       AS jobs,
       (SELECT count(*) FROM ledger.wakeups w WHERE w.pool_wait = p.pool)::integer               AS waiting,
       coalesce((SELECT sum(c.skipped_pool_full) FROM ledger.jobs j JOIN ledger.counters c ON c.job = j.job
                  WHERE j.pool = p.pool), 0)::bigint                                              AS skipped_pool_full,
       p.created_at,
       p.updated_at
  FROM ledger.pools p;
COMMENT ON VIEW ledger.pool_status IS
    'Each pool: size, live leases (used), running runs, jobs, jobs waiting a place, starts skipped as full';
