-- The raw floor of `acquire`: one compare-and-set UPDATE on the job's lease
-- row (free, expired or already ours: take it with the next token). Each
-- client draws from its own slice of the N jobs (-D per=N/clients), so no
-- two clients collide; the owner is the same for every client, as for
-- ledger_acquire.sql, so every call takes the lease (\gset fails on no row).
\set j :client_id * :per + random(1, :per)
UPDATE bench_raw.leases
   SET owner = 'bench', token = token + 1,
       acquired_at = clock_timestamp(), expires_at = clock_timestamp() + interval '1 hour'
 WHERE job = 'job-' || :j::text
   AND (expires_at <= clock_timestamp() OR owner = 'bench')
RETURNING token \gset
