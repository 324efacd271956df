-- The application's bare write, in its own transaction.
\set j :client_id * :per + random(1, :per)
BEGIN;
INSERT INTO bench_app.writes (job, payload) VALUES (:j, 'payload');
COMMIT;
