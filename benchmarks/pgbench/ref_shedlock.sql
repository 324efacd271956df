-- Reference: ShedLock's PostgreSQL lock provider (server time), lock and
-- unlock, two commits: the upsert takes the row when its lock_until has
-- passed; unlock sets lock_until to now (lockAtLeastFor 0). \gset fails the
-- client when the lock was not taken.
\set j :client_id * :per + random(1, :per)
INSERT INTO bench_ref.shedlock AS s (name, lock_until, locked_at, locked_by)
VALUES ('job-' || :j::text, timezone('utc', CURRENT_TIMESTAMP) + interval '1 hour',
        timezone('utc', CURRENT_TIMESTAMP), 'bench')
ON CONFLICT (name) DO UPDATE
   SET lock_until = timezone('utc', CURRENT_TIMESTAMP) + interval '1 hour',
       locked_at = timezone('utc', CURRENT_TIMESTAMP), locked_by = 'bench'
 WHERE s.lock_until <= timezone('utc', CURRENT_TIMESTAMP)
RETURNING name \gset
UPDATE bench_ref.shedlock SET lock_until = timezone('utc', CURRENT_TIMESTAMP)
 WHERE name = 'job-' || :j::text AND locked_by = 'bench'
RETURNING name \gset
