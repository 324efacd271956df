-- The raw floor of a run: two commits. First the compare-and-set on the
-- lease row and the log row of the running run (one statement); then the
-- run's end and the lease's release (one statement). \gset fails the client
-- when either finds no row.
\set j :client_id * :per + random(1, :per)
WITH l AS (
    UPDATE bench_raw.leases
       SET owner = 'bench', token = token + 1,
           acquired_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 hour'
     WHERE job = 'job-' || :j::text
       AND (expires_at <= clock_timestamp() OR owner = 'bench')
    RETURNING job, owner, token)
INSERT INTO bench_raw.runs (job, owner, token, status, started_at)
SELECT job, owner, token, 'running', clock_timestamp() FROM l
RETURNING run_id, token \gset
WITH r AS (
    UPDATE bench_raw.runs SET status = 'success', ended_at = clock_timestamp()
     WHERE run_id = :run_id AND token = :token AND status = 'running'
    RETURNING job, token)
UPDATE bench_raw.leases l SET expires_at = clock_timestamp()
  FROM r WHERE l.job = r.job AND l.token = r.token
RETURNING l.token AS released \gset
