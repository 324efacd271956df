-- One hot job, every client its own owner, looping start + complete: the
-- raw floor. The compare-and-set finds the row held by another owner most of
-- the time and writes nothing (a skip); the winner logs its run, then ends
-- it and releases the lease.
WITH l AS (
    UPDATE bench_raw.leases
       SET owner = 'c' || :client_id::text, token = token + 1,
           acquired_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 hour'
     WHERE job = 'hot'
       AND (expires_at <= clock_timestamp() OR owner = 'c' || :client_id::text)
    RETURNING job, owner, token),
r AS (
    INSERT INTO bench_raw.runs (job, owner, token, status, started_at)
    SELECT job, owner, token, 'running', clock_timestamp() FROM l
    RETURNING run_id, token)
SELECT coalesce(max(run_id), 0) AS run_id, coalesce(max(token), 0) AS token FROM r \gset
\if :run_id > 0
WITH r AS (
    UPDATE bench_raw.runs SET status = 'success', ended_at = clock_timestamp()
     WHERE run_id = :run_id AND token = :token AND status = 'running'
    RETURNING job, token)
UPDATE bench_raw.leases l SET expires_at = clock_timestamp()
  FROM r WHERE l.job = r.job AND l.token = r.token
RETURNING l.token AS released \gset
\endif
