-- The same write guarded by the fence, as the docs show it: ledger.fence in
-- the write's transaction, one more round trip. Job fence-J holds a live
-- lease whose token the harness passes (-D token=...).
\set j :client_id * :per + random(1, :per)
BEGIN;
SELECT ledger.fence('fence-' || :j::text, 'res-' || :j::text, :token) \gset
INSERT INTO bench_app.writes (job, payload) VALUES (:j, 'payload');
COMMIT;
