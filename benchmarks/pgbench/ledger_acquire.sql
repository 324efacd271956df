-- ledger.acquire on a random one of the client's slice of the N jobs
-- (see raw_acquire.sql); \gset fails the client when no lease came back.
\set j :client_id * :per + random(1, :per)
SELECT token FROM ledger.acquire('job-' || :j::text, 'bench', interval '1 hour') \gset
