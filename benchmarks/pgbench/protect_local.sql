-- The protected table, the token set in the transaction as the Python
-- client's run.transaction(conn) sets it: one more statement.
BEGIN;
SELECT set_config('ledger.job', 'protect-bench', true), set_config('ledger.token', :token, true);
INSERT INTO bench_protect.guarded (payload) SELECT 'payload' FROM generate_series(1, :rows);
COMMIT;
