-- Reference: a session advisory lock, try-lock and unlock (two round trips,
-- nothing written: not durable, no token, gone with the session). \gset
-- fails the client when the lock was not taken.
\set j :client_id * :per + random(1, :per)
SELECT 1 AS got WHERE pg_try_advisory_lock(:j) \gset
SELECT pg_advisory_unlock(:j) AS unlocked \gset
