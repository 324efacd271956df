-- The ceiling of a run: raw_cycle.sql's two statements, each inside a
-- PL/pgSQL SECURITY DEFINER function with a fixed search_path (setup.sql).
\set j :client_id * :per + random(1, :per)
SELECT run_id, token FROM bench_ceil.start('job-' || :j::text, 'bench') \gset
SELECT bench_ceil.complete(:run_id, :token) AS released \gset
