-- The protected table, the token a session setting (PGOPTIONS, as `jobledger
-- run --pgoptions` gives a psql): the same statements as protect_plain.sql.
BEGIN;
INSERT INTO bench_protect.guarded (payload) SELECT 'payload' FROM generate_series(1, :rows);
COMMIT;
