-- ledger.start_run + ledger.complete_run, two commits, run_id and token
-- carried by \gset (a skip leaves them empty and complete_run fails the client).
\set j :client_id * :per + random(1, :per)
SELECT run_id, token FROM ledger.start_run('job-' || :j::text, 'bench', interval '1 hour') \gset
SELECT status FROM ledger.complete_run(:run_id, :token) \gset
