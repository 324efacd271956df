-- The ceiling of the application's write: raw_insert.sql's INSERT inside a
-- PL/pgSQL SECURITY DEFINER function with a fixed search_path (setup.sql),
-- in its own transaction.
\set j :client_id * :per + random(1, :per)
BEGIN;
SELECT bench_ceil.write(:j, 'payload');
COMMIT;
