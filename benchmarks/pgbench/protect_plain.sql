-- The unprotected table: :rows rows in one INSERT, in its own transaction.
BEGIN;
INSERT INTO bench_protect.plain (payload) SELECT 'payload' FROM generate_series(1, :rows);
COMMIT;
