-- ledger.renew of a random one of the N leases 'renew-1' .. 'renew-N' (owner
-- 'bench', all with the first token of a fresh database: benchmarks/
-- bench_held_snapshot.py); \gset fails the client when the lease was lost.
\set j random(1, :jobs)
SELECT e FROM ledger.renew('renew-' || :j::text, 'bench', :token) AS e WHERE e IS NOT NULL \gset
