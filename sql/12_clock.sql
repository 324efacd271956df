-- The ledger's clock: every lease expiry, slot, deadline and health bound is
-- read through these, never from clock_timestamp() or now() directly.
--
-- The seam is _clock_offset(), zero in every install. A test database's
-- owner moves the ledger's time by redefining it (CREATE OR REPLACE FUNCTION
-- ... SELECT interval '1 hour'), as River's tests inject their clock, so a
-- lease expires without sleeping out its ttl. Only the functions' owner can
-- redefine a function: no client can move the clock under a SECURITY
-- DEFINER API (nor rewind a lease, nor expire another holder's).
--
-- All three are one-line LANGUAGE sql functions that the planner inlines:
-- the hot path pays an interval addition, and a redefinition invalidates the
-- cached plans that inlined the old body. Their bodies are qualified down to
-- the operator, as an inlined body is parsed in the caller's search_path.
-- Audit columns' defaults (created_at, recorded_at, an event's at) keep the
-- real clock.
CREATE FUNCTION ledger._clock_offset()
RETURNS interval
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$ SELECT interval '0' $$;
COMMENT ON FUNCTION ledger._clock_offset() IS
    'How far the ledger''s clock runs ahead of the server''s: zero; a test database''s owner redefines it';

-- The instant of a decision (a lease taken, renewed, expired): the real
-- time of the call, as clock_timestamp(), so a caller that waited on a row
-- lock never dates its lease before the holder it waited for let go.
CREATE FUNCTION ledger._now()
RETURNS timestamptz
LANGUAGE sql
VOLATILE
PARALLEL SAFE
AS $$ SELECT pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) ledger._clock_offset() $$;
COMMENT ON FUNCTION ledger._now() IS 'The ledger''s clock for a decision: clock_timestamp() plus the offset';

-- The instant of a read (a view, a report): the transaction's time, as
-- now(), so every row and column of one read agrees on "now".
CREATE FUNCTION ledger._view_now()
RETURNS timestamptz
LANGUAGE sql
STABLE
PARALLEL SAFE
AS $$ SELECT pg_catalog.now() OPERATOR(pg_catalog.+) ledger._clock_offset() $$;
COMMENT ON FUNCTION ledger._view_now() IS 'The ledger''s clock for a read: now() plus the offset';
