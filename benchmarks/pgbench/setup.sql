-- Scratch objects for benchmarks/pgbench/*.sql, in the scratch database the
-- harness creates (benchmarks/harness.py), after the ledger is installed:
--     psql -v ON_ERROR_STOP=1 -v jobs=10000 -f setup.sql
-- jobs 'job-1' .. 'job-N' registered in the ledger, the raw floor's tables
-- with the same N jobs, N fenced resources whose jobs hold a live lease, one
-- hot job, ShedLock's table. The raw floor is what the ledger's semantics cost
-- at the very least: a compare-and-set on a lease row keyed by the job's name
-- (text, like ledger.leases), a log row, no checks.
\set QUIET on
SET client_min_messages = warning;

-- The ledger side: N registered jobs (acquire, start_run + complete_run).
SELECT count(ledger.register_job('job-' || i, ttl => interval '1 hour')) AS registered
  FROM generate_series(1, :jobs) i \gset

-- The raw floor.
CREATE SCHEMA bench_raw;
CREATE TABLE bench_raw.leases (
    job         text PRIMARY KEY,
    owner       text NOT NULL,
    token       bigint NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);
CREATE TABLE bench_raw.runs (
    run_id     bigserial PRIMARY KEY,
    job        text NOT NULL,
    owner      text NOT NULL,
    token      bigint NOT NULL,
    status     text NOT NULL,
    started_at timestamptz NOT NULL,
    ended_at   timestamptz
);
INSERT INTO bench_raw.leases (job, owner, token, acquired_at, expires_at)
SELECT 'job-' || i, 'nobody', 1, now() - interval '1 day', now() - interval '1 day'
  FROM generate_series(1, :jobs) i;
INSERT INTO bench_raw.leases (job, owner, token, acquired_at, expires_at)
VALUES ('hot', 'nobody', 1, now() - interval '1 day', now() - interval '1 day');

-- Fenced writes: jobs 'fence-1' .. 'fence-N' hold a live lease (owner
-- 'fencer', one day), each fence already created once (its steady state);
-- the application's table takes the writes of both sides.
SELECT count(*) AS fence_leases
  FROM generate_series(1, :jobs) i, ledger.acquire('fence-' || i, 'fencer', interval '1 day') \gset
SELECT count(ledger.fence(l.job, 'res-' || substr(l.job, 7), l.token)) AS fences
  FROM ledger.leases l WHERE l.job LIKE 'fence-%' \gset
CREATE SCHEMA bench_app;
CREATE TABLE bench_app.writes (
    id      bigserial PRIMARY KEY,
    job     integer NOT NULL,
    token   bigint,
    payload text NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- ShedLock's table (its documented PostgreSQL DDL), one row per job name.
CREATE SCHEMA bench_ref;
CREATE TABLE bench_ref.shedlock (
    name       varchar(64)  NOT NULL PRIMARY KEY,
    lock_until timestamp    NOT NULL,
    locked_at  timestamp    NOT NULL,
    locked_by  varchar(255) NOT NULL
);
INSERT INTO bench_ref.shedlock (name, lock_until, locked_at, locked_by)
SELECT 'job-' || i, timezone('utc', now()) - interval '1 day', timezone('utc', now()) - interval '1 day', 'nobody'
  FROM generate_series(1, :jobs) i;

VACUUM ANALYZE;

-- The ceiling (issue 24): the raw floor's very statements, each wrapped in
-- the kind of function the ledger's API is, PL/pgSQL SECURITY DEFINER with a
-- fixed search_path. What a function-based API costs at the very least:
-- between the floor and it lies the wrapper; between it and the ledger, the
-- ledger's own work. ../shared/bench-ceiling/run.sh compares the kinds.
CREATE SCHEMA bench_ceil;
CREATE FUNCTION bench_ceil.acquire(job text, owner text) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE v_token bigint;
BEGIN
    UPDATE bench_raw.leases l
       SET owner = acquire.owner, token = l.token + 1,
           acquired_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 hour'
     WHERE l.job = acquire.job
       AND (l.expires_at <= clock_timestamp() OR l.owner = acquire.owner)
    RETURNING l.token INTO v_token;
    RETURN v_token;
END $$;
CREATE FUNCTION bench_ceil.start(job text, owner text, OUT run_id bigint, OUT token bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    WITH l AS (
        UPDATE bench_raw.leases l
           SET owner = start.owner, token = l.token + 1,
               acquired_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 hour'
         WHERE l.job = start.job
           AND (l.expires_at <= clock_timestamp() OR l.owner = start.owner)
        RETURNING l.job, l.owner, l.token)
    INSERT INTO bench_raw.runs AS r (job, owner, token, status, started_at)
    SELECT l.job, l.owner, l.token, 'running', clock_timestamp() FROM l
    RETURNING r.run_id, r.token INTO run_id, token;
END $$;
CREATE FUNCTION bench_ceil.complete(run_id bigint, token bigint) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE v_released bigint;
BEGIN
    WITH r AS (
        UPDATE bench_raw.runs r SET status = 'success', ended_at = clock_timestamp()
         WHERE r.run_id = complete.run_id AND r.token = complete.token AND r.status = 'running'
        RETURNING r.job, r.token)
    UPDATE bench_raw.leases l SET expires_at = clock_timestamp()
      FROM r WHERE l.job = r.job AND l.token = r.token
    RETURNING l.token INTO v_released;
    RETURN v_released;
END $$;
CREATE FUNCTION bench_ceil.write(job integer, payload text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO bench_app.writes (job, payload) VALUES (write.job, write.payload);
END $$;
