-- The fence folded into the write's statement (INSERT ... SELECT
-- ledger.fence(...), docs/pg_cron.md): no extra round trip.
\set j :client_id * :per + random(1, :per)
BEGIN;
INSERT INTO bench_app.writes (job, token, payload)
SELECT :j, ledger.fence('fence-' || :j::text, 'res-' || :j::text, :token), 'payload';
COMMIT;
