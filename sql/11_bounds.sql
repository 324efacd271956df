-- The ledger's bounds: every argument a client sends is checked against
-- these, so that no value can push a function or a view out of range (a ttl
-- of 100000 years breaks every timestamp sum in the views) or make it slow
-- (a catch-up bound of a billion slots). docs/contract.md lists them.
--
-- LANGUAGE sql constants without SET clauses: the planner inlines them into
-- the expressions that use them, so a check costs no function call. Quoted
-- bodies, not RETURN: PostgreSQL 13 has no SQL-standard bodies.

-- The ledger's time range for instants given by a client (slot, at).
CREATE FUNCTION ledger._min_instant() RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT timestamptz '1970-01-01 00:00:00+00' $$;

CREATE FUNCTION ledger._max_instant() RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT timestamptz '2200-01-01 00:00:00+00' $$;

-- The longest lease: renewed every ttl/3, a ttl need not cover a whole run.
CREATE FUNCTION ledger._max_ttl() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '30 days' $$;

-- Interval schedules: from 10 milliseconds (tests and demos) to one year.
CREATE FUNCTION ledger._min_every() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '10 milliseconds' $$;

CREATE FUNCTION ledger._max_every() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '1 year' $$;

-- A pool's size (ledger.pools): each start of a member job counts the
-- pool's live leases.
CREATE FUNCTION ledger._max_pool_size() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 100000 $$;

-- The catch-up bound: due_slots walks back at most this many slots.
CREATE FUNCTION ledger._max_backfill() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

-- max_concurrent: live runs of one job at once (each a seat, ledger.lease_seats).
CREATE FUNCTION ledger._max_concurrent() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

-- The most resources one complete_run names in fenced: each is looked up in
-- ledger.fences, and the ones that do not hold the run's token go into the
-- run's detail, which must stay within _max_detail_bytes.
CREATE FUNCTION ledger._max_fenced() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 100 $$;

-- The most slots one schedule preview lists (next_slots, preview_slots).
CREATE FUNCTION ledger._max_preview_slots() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

-- purge_log's horizon: 100 years of 365 days. In days, since a duration
-- has no month part (ledger._check_duration).
CREATE FUNCTION ledger._max_older_than() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '36500 days' $$;

-- A run's detail (JSON text) and a failure's error text.
CREATE FUNCTION ledger._max_detail_bytes() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 65536 $$;

CREATE FUNCTION ledger._max_error_length() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 8192 $$;

-- The longest schedule text (a cron expression or an interval).
CREATE FUNCTION ledger._max_schedule_length() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 200 $$;

-- The number of bits set in a non-negative bigint (the schedule masks).
-- Not bit_count(): PostgreSQL 13 has none, and one source serves every
-- version.
CREATE FUNCTION ledger._popcount(value bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT length(replace(value::bit(64)::text, '0', '')) $$;

-- True when the text has no character that is invisible or changes how the
-- text around it reads: control (Cc), format (Cf: bidirectional overrides,
-- zero-width characters, the BOM) and separators (Zl, Zp, and Zs but the
-- ASCII space), so two labels that look alike are alike. The class is
-- generated from the Unicode 15 tables (Python's unicodedata, plus the
-- Egyptian format controls U+13439-U+1343F that Unicode 15 added).
CREATE FUNCTION ledger._is_visible_text(value text) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT value !~ '[\u0001-\u001F\u007F-\u00A0\u00AD\u0600-\u0605\u061C\u06DD\u070F\u0890-\u0891\u08E2\u1680\u180E\u2000-\u200F\u2028-\u202F\u205F-\u2064\u2066-\u206F\u3000\uFEFF\uFFF9-\uFFFB\U000110BD\U000110CD\U00013430-\U0001343F\U0001BCA0-\U0001BCA3\U0001D173-\U0001D17A\U000E0001\U000E0020-\U000E007F]' $$;

-- A label (job, owner, resource, idempotency key): 1 to 200 characters, all
-- visible. The functions raise 22023 first; this is the backstop.
CREATE DOMAIN ledger.label AS text
    CONSTRAINT label_valid CHECK (char_length(VALUE) BETWEEN 1 AND 200 AND ledger._is_visible_text(VALUE));

-- A job's health bounds (late_after, down_after, min_runtime, max_runtime):
-- an exact duration up to a year of 365 days.
CREATE FUNCTION ledger._max_health_bound() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '365 days' $$;

-- pause_after_failures: 1 to 1000 failures in a row.
CREATE FUNCTION ledger._max_pause_after_failures() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

-- A job's state (ledger._job_state): this many slots missed (each past its
-- grace) make a job down; this many failures in a row (consecutive_failures)
-- make it failing. The one threshold of each: the state, its alert and the
-- surfaces that show them all read it from here.
CREATE FUNCTION ledger._down_after_slots() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 3 $$;

CREATE FUNCTION ledger._failing_after() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1 $$;

-- ledger.ttl_advice: no advice before this many successes, and never a
-- ttl under this floor.
CREATE FUNCTION ledger._advice_min_runs() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 5 $$;

CREATE FUNCTION ledger._advice_min_ttl() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '1 second' $$;
