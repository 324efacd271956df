-- One hot job, every client its own owner, looping start_run + complete_run:
-- mostly skipped_overlap (no run_id), then no complete_run.
SELECT coalesce(run_id, 0) AS run_id, coalesce(token, 0) AS token
  FROM ledger.start_run('hot', 'c' || :client_id::text, interval '1 hour') \gset
\if :run_id > 0
SELECT status FROM ledger.complete_run(:run_id, :token) \gset
\endif
