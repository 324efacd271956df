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
