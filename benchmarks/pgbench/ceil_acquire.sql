-- The ceiling of `acquire`: raw_acquire.sql's CAS UPDATE inside a PL/pgSQL
-- SECURITY DEFINER function with a fixed search_path (bench_ceil.acquire,
-- setup.sql). Every call takes the lease, as in raw_acquire.sql (one owner).
\set j :client_id * :per + random(1, :per)
SELECT bench_ceil.acquire('job-' || :j::text, 'bench') AS token \gset
