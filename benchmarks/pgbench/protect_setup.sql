-- Scratch objects for benchmarks/bench_protect.py, after the ledger is
-- installed: job protect-bench holds a live lease (owner bencher, one day);
-- three tables alike, one left alone, one protected for the job, one that
-- the explicit fence guards (its fence created once: its steady state).
\set QUIET on
SET client_min_messages = warning;
CREATE SCHEMA bench_protect;
CREATE TABLE bench_protect.plain   (id bigserial PRIMARY KEY, payload text NOT NULL);
CREATE TABLE bench_protect.guarded (id bigserial PRIMARY KEY, payload text NOT NULL);
CREATE TABLE bench_protect.fenced  (id bigserial PRIMARY KEY, payload text NOT NULL);
CREATE TABLE bench_protect.strict  (id bigserial PRIMARY KEY, payload text NOT NULL);
SELECT token FROM ledger.acquire('protect-bench', 'bencher', interval '1 day') \gset
SELECT ledger.protect('bench_protect.guarded', 'protect-bench');
SELECT ledger.protect('bench_protect.strict', 'protect-bench', mode => 'strict');
SELECT ledger.fence('protect-bench', 'bench_protect.fenced', :token);
BEGIN;
SELECT set_config('ledger.token', :'token', true);
INSERT INTO bench_protect.guarded (payload) VALUES ('first');
COMMIT;

-- The server side alone (no round trip, no commit): `statements` INSERTs of
-- `rows` rows each, in the caller's transaction, on one side; microseconds
-- per statement. The token is the caller's session setting.
CREATE FUNCTION bench_protect.loop(side text, rows integer, statements integer) RETURNS double precision
LANGUAGE plpgsql AS $f$
DECLARE
    t0    timestamptz := clock_timestamp();
    token bigint := current_setting('ledger.token')::bigint;
BEGIN
    FOR i IN 1 .. statements LOOP
        IF side = 'plain' THEN
            INSERT INTO bench_protect.plain (payload) SELECT 'payload' FROM generate_series(1, rows);
        ELSIF side = 'lenient' THEN
            INSERT INTO bench_protect.guarded (payload) SELECT 'payload' FROM generate_series(1, rows);
        ELSIF side = 'strict' THEN
            INSERT INTO bench_protect.strict (payload) SELECT 'payload' FROM generate_series(1, rows);
        ELSE
            PERFORM ledger.fence('protect-bench', 'bench_protect.fenced', token);
            INSERT INTO bench_protect.fenced (payload) SELECT 'payload' FROM generate_series(1, rows);
        END IF;
    END LOOP;
    RETURN extract(epoch FROM clock_timestamp() - t0) * 1e6 / statements;
END
$f$;
VACUUM ANALYZE;
