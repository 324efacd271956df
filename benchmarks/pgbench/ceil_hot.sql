-- The ceiling of the hot job's loop: raw_hot.sql's statements, each inside
-- a PL/pgSQL SECURITY DEFINER function with a fixed search_path (setup.sql).
-- A skip finds the row held by another owner and returns no run.
SELECT coalesce(s.run_id, 0) AS run_id, coalesce(s.token, 0) AS token
  FROM bench_ceil.start('hot', 'c' || :client_id::text) s \gset
\if :run_id > 0
SELECT bench_ceil.complete(:run_id, :token) AS released \gset
\endif
