-- An unprotected table guarded by the explicit fence in the write's
-- transaction, as docs/contract.md shows it: one more statement.
BEGIN;
SELECT ledger.fence('protect-bench', 'bench_protect.fenced', :token);
INSERT INTO bench_protect.fenced (payload) SELECT 'payload' FROM generate_series(1, :rows);
COMMIT;
