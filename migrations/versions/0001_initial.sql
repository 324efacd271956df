-- The ledger's tables, types and invariants. Everything lives in schema
-- `ledger`; uninstall is `DROP SCHEMA ledger CASCADE`.
-- Invariants are enforced here (constraints, unique partial indexes), not
-- only by the functions that write these tables.

-- IF NOT EXISTS: an upgrade (env.py) or install_script() creates it first,
-- to hold alembic's version table.
CREATE SCHEMA IF NOT EXISTS ledger;
COMMENT ON SCHEMA ledger IS 'Postgres-native job ledger: leases, fencing tokens, execution log';

-- Roles are cluster-wide: create them once, leave them if they exist (also
-- when another database of the cluster is installing at the same moment).
--   ledger_owner   NOLOGIN; owns the ledger's tables and functions, so the
--                  SECURITY DEFINER functions run with the ledger's own
--                  privileges and never as the (super)user who installed.
--   ledger_client  EXECUTE on the API and SELECT; ledger_reader SELECT only.
-- Without CREATEROLE the roles must exist already (an administrator creates
-- them: see docs); checking first avoids PostgreSQL's "permission denied to
-- create role", which it raises before it looks whether the role exists.
DO $roles$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['ledger_owner', 'ledger_client', 'ledger_reader'] LOOP
        CONTINUE WHEN EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.rolname = role_name);
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        WHEN insufficient_privilege THEN
            RAISE EXCEPTION USING ERRCODE = '42501',
                MESSAGE = format('role %s does not exist and %s may not create it', role_name, current_user),
                HINT = 'An administrator runs once: CREATE ROLE ledger_owner NOLOGIN; CREATE ROLE ledger_client NOLOGIN; '
                       'CREATE ROLE ledger_reader NOLOGIN; GRANT ledger_owner TO <installing user>;';
        END;
    END LOOP;
END
$roles$;

-- Declared result types (as pgmq does): PL/pgSQL refuses an OUT column
-- named like an argument, and a declared type is readable from \dT.
CREATE TYPE ledger.lease AS (
    job         text,
    owner       text,
    token       bigint,
    acquired_at timestamptz,
    expires_at  timestamptz
);

CREATE TYPE ledger.run_start AS (
    outcome           text,
    run_id            bigint,
    token             bigint,
    expires_at        timestamptz,
    slot              timestamptz,
    holder            text,
    holder_expires_at timestamptz
);
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

-- The catch-up bound: due_slots walks back at most this many slots.
CREATE FUNCTION ledger._max_backfill() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 1000 $$;

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

-- ledger.job_health: a job with this many slots missed (past its grace) is
-- down; a cron job's missed slots are counted over at most this far back
-- (beyond it the count reads "at least").
CREATE FUNCTION ledger._down_after_slots() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 3 $$;

CREATE FUNCTION ledger._missed_horizon() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '8784 hours' $$;

-- ledger.ttl_advice: no advice before this many successes, and never a
-- ttl under this floor.
CREATE FUNCTION ledger._advice_min_runs() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT 5 $$;

CREATE FUNCTION ledger._advice_min_ttl() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '1 second' $$;
-- Schedule evaluation. A schedule is parsed once, at registration, into a
-- ledger.schedule_spec; the evaluators then answer "the newest slot <= at",
-- "the oldest slot > after" and "how many slots in (after, upto]" without
-- enumerating slots: counting a year of one-minute slots takes some 60 probes
-- for DST transitions, not 525,600 steps.
--
-- Pure functions, no tables. The evaluators are IMMUTABLE, like PostgreSQL's
-- own AT TIME ZONE; the parser is STABLE (it reads pg_timezone_names). None
-- depends on the session's TimeZone: instants are only moved by intervals
-- without day or month parts, and calendars are walked on local timestamps
-- (timestamp without time zone).
--
-- Cron slots. L is the set of local wall-clock minutes that match the five
-- fields (Vixie rules); local(u) is the wall clock of instant u in time_zone.
--   Wildcard expressions (the minute or the hour field starts with '*'): the
--     slots are all instants u with local(u) in L. A local time in a
--     spring-forward gap has no instant and is skipped; one in a fall-back
--     overlap has two, and both fire.
--   Fixed expressions (all others): the slots are f(t) for t in L, where
--     f(t) is the first instant u with local(u) >= t. A local time in a gap
--     fires at the end of the gap, and several merge into that one slot; a
--     repeated local time fires once, at its first occurrence. This is
--     cronie's behaviour.
--   Since f is monotone, f(t) > after <=> t > M(after), where M(after) is the
--   highest wall-clock time reached up to `after` (ledger._local_high).
--
-- Interval slots. Slot k = ((2000-01-01 00:00 local + k * the interval's
-- month and day parts, on the local calendar) AT TIME ZONE time_zone)
-- + k * its time part (absolute time). This is exactly what
-- `SET TimeZone = time_zone; SELECT '2000-01-01'::timestamptz + k * every`
-- gives: '1 day' stays at 00:00 local across DST, '24 hours' does not, and
-- '90 minutes' keeps its rhythm in absolute time. A local time in a gap
-- resolves like PostgreSQL (with the offset before the transition, so 02:30
-- becomes 03:30), a repeated one to its later occurrence.
--
-- Time zone data assumptions, checked against the tzdata shipped with the
-- server from 1970 on: two UTC offset changes of a zone are at least 6.9 days
-- apart (Asia/Gaza and three Brazilian zones come closest), and a jump is at
-- most 24 hours. So a day either side of an instant holds at most one
-- transition, and a transition is found by probing every 144 hours and a
-- binary search to the second.
--
-- Bit masks. A cron field is held as a mask, bit n set <=> value n matches,
-- so that every question about a field is a few bit operations:
--   (1 << n) - 1        the values below n;   ~ of it: n and above
--   (2 << n) - 1        the values up to n
--   (2 << n) - 2        the values 1 to n (the days of an n-day month)
--   v & -v              the lowest value in v, a power of two
-- The masks with every value set are named where they are used
-- (v_all_months, v_all_days_of_month, v_all_weekdays), and so is ln 2
-- (v_ln2), which turns a power of two into its bit number. They are locals,
-- not LANGUAGE sql constants: every function of this file is PL/pgSQL with a
-- fixed search_path (tests/test_schedule_eval.py), and a constant local costs
-- next to nothing. A call to a PL/pgSQL helper costs microseconds, so the
-- loops below inline their bit scans instead of calling one.

CREATE TYPE ledger.schedule_spec AS (
    kind            text,       -- 'cron' or 'interval'
    minutes         bigint,     -- cron: bit m set <=> minute m (0-59) matches
    hours           integer,    -- cron: bit h (0-23)
    doms            bigint,     -- cron: bit d (1-31), day of month
    months          integer,    -- cron: bit m (1-12)
    dows            integer,    -- cron: bit w (0-6, 0 = Sunday; 7 folded into 0)
    dom_restricted  boolean,    -- day-of-month field does not start with '*'
    dow_restricted  boolean,    -- day-of-week field does not start with '*'
    wildcard        boolean,    -- minute or hour field starts with '*' (DST rule)
    every           interval,   -- interval schedules: the interval as given
    every_months    integer,    -- its month part (local calendar)
    every_days      integer,    -- its day part (local calendar)
    every_micros    bigint      -- its time part in microseconds (absolute)
);

-- ---------------------------------------------------------------- validation

-- A schedule's time zone must be a time zone name: a zone of the server's
-- tz database, which means the same on every host and in every session.
-- The server also loads POSIX TZ strings ('UTC+3' is three hours west,
-- 'EST5EDT,M3.2.0,M11.1.0' has its own DST rules, and so are 'Mars/Olympus2'
-- and 'Etc/GMT-15': anything with a digit after its name, slash or not),
-- numeric offsets, abbreviations ('PST' never changes to PDT; 'CET' read as
-- an abbreviation has no DST, and AT TIME ZONE reads it so, by the session's
-- timezone_abbreviations), leap-second 'right/' zones (off by the leap
-- seconds) and the host's own 'localtime' and 'posixrules' (whatever the
-- server's machine is set to): each would silently fire at other times than
-- the client meant, or differently on another server. So:
--   a name the server does not load is unknown;
--   'right/...', 'localtime' and 'posixrules' are refused by name;
--   a name with a slash and no digit that the server loads is a zone file
--     (a POSIX TZ string needs a digit: its offset), the usual case, decided
--     without the catalog;
--   any other name must be a zone of pg_timezone_names (case-insensitive),
--     and a name without a slash must not be a time zone abbreviation
--     either, the UTC aliases of ledger._is_utc aside.
-- The catalog is slow (it reads every zone file: some 30 ms), hence the
-- shortcut.
CREATE FUNCTION ledger._check_time_zone(time_zone text)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF time_zone IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument time_zone must not be null';
    END IF;
    IF time_zone !~ '^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$'
       OR lower(time_zone) LIKE 'right/%' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: not an IANA time zone name', time_zone),
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END IF;
    IF lower(time_zone) ~ '(^|/)(localtime|posixrules)$' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: it is whatever zone the server''s host is set to; '
                             'name the zone (such as Europe/Berlin)', time_zone),
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END IF;
    BEGIN
        PERFORM timestamptz '2000-01-01 00:00+00' AT TIME ZONE time_zone;
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: unknown time zone', time_zone),
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END;
    IF position('/' in time_zone) > 0 AND time_zone !~ '[0-9]' THEN
        RETURN;  -- a zone file: the usual case
    END IF;
    IF position('/' in time_zone) = 0 AND ledger._is_utc(time_zone) THEN
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_timezone_names n WHERE lower(n.name) = lower(time_zone)) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: not a time zone name (PostgreSQL reads it as a POSIX TZ '
                             'string or an abbreviation, which are not accepted)', time_zone),
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END IF;
    IF position('/' in time_zone) = 0
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_timezone_abbrevs a WHERE lower(a.abbrev) = lower(time_zone)) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: PostgreSQL reads it as a time zone abbreviation, with a fixed '
                             'offset (abbreviations are not accepted); name the zone (such as Europe/Paris)',
                             time_zone),
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END IF;
END
$$;

-- One value of a cron field: a number or, where the field has them, a name
-- ('jan', 'mon'). At most six digits, so that the cast to integer cannot
-- overflow: a longer number is an invalid value, not an internal error.
CREATE FUNCTION ledger._cron_value(schedule text, value text, label text, low integer, high integer, names text[])
RETURNS integer
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_number integer;
BEGIN
    IF value ~ '^[0-9]{1,6}$' THEN
        v_number := value::integer;
    ELSIF names IS NOT NULL AND array_position(names, value) IS NOT NULL THEN
        v_number := array_position(names, value) - 1 + low;
    ELSE
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %L: invalid %s value %L', schedule, label, value),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    IF v_number < low OR v_number > high THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %L: %s value %s is out of range %s-%s',
                             schedule, label, v_number, low, high),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    RETURN v_number;
END
$$;

-- One cron field as a bit mask (bit n set <=> value n matches), so that the
-- evaluators answer every question about it with bit operations. The field
-- is comma-separated items, each '*', 'a' or 'a-b', optionally followed by
-- '/step'; 'a/step' means 'a-high/step' (Vixie cron). A range a-b with
-- a > b is refused, except in the day-of-week field (0 to 7, both Sunday) a
-- range that ends on Sunday written as 0 or 'sun': it ends at 7, as cronie
-- reads it since its 2025 fix ('sat-sun' is 6-7, 'fri-0' is 5-7, 'mon-sun'
-- is 1-7; cronie before 1.6 refused them, 1.6 to 1.7.2 set no day for
-- them). With a step ('mon-sun/2') cronie still sets no day, so that one is
-- refused, with the way to write it ('1-7/2'). Other wrap-arounds
-- ('fri-mon') stay refused: cronie sets no day for them either.
CREATE FUNCTION ledger._cron_field(schedule text, field text, label text, low integer, high integer, names text[])
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_sunday       CONSTANT integer := 0;
    v_sunday_again CONSTANT integer := 7;   -- the day-of-week field's high end: Sunday once more
    v_mask      bigint := 0::bigint;
    v_item      text;
    v_range     text;     -- the item without its '/step'
    v_step_text text;
    v_bounds    text[];
    v_step      integer;
    v_first     integer;
    v_last      integer;
BEGIN
    FOREACH v_item IN ARRAY string_to_array(field, ',') LOOP
        IF v_item = '' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid schedule %L: empty list element in the %s field', schedule, label),
                DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
        END IF;
        v_step := NULL;
        v_range := v_item;
        IF position('/' in v_item) > 0 THEN
            v_range := split_part(v_item, '/', 1);
            v_step_text := substr(v_item, length(v_range) + 2);
            IF v_step_text !~ '^[0-9]{1,6}$' THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('invalid schedule %L: invalid step %L in the %s field',
                                     schedule, v_step_text, label),
                    DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
            v_step := v_step_text::integer;
            IF v_step = 0 THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('invalid schedule %L: step 0 in the %s field', schedule, label),
                    DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
            IF v_step > high - low + 1 THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('invalid schedule %L: step %s is larger than the %s field''s range %s-%s',
                                     schedule, v_step, label, low, high),
                    DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
        END IF;
        IF v_range = '*' THEN
            v_first := low;
            v_last := high;
        ELSE
            v_bounds := string_to_array(v_range, '-');
            IF v_range = '' OR cardinality(v_bounds) > 2 THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('invalid schedule %L: invalid %s element %L', schedule, label, v_item),
                    DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
            v_first := ledger._cron_value(schedule, v_bounds[1], label, low, high, names);
            IF cardinality(v_bounds) = 2 THEN
                v_last := ledger._cron_value(schedule, v_bounds[2], label, low, high, names);
                IF v_first > v_last AND v_last = v_sunday AND high = v_sunday_again AND v_step IS NULL THEN
                    v_last := v_sunday_again;   -- cronie: 'sat-sun' is 6-7, 'mon-0' is 1-7
                END IF;
                IF v_first > v_last AND v_last = v_sunday AND high = v_sunday_again THEN
                    RAISE EXCEPTION USING ERRCODE = '22023',
                        MESSAGE = format('invalid schedule %L: range %L in the %s field ends on Sunday as 0 '
                                         'and has a step, which cronie runs on no day; write Sunday as 7 (%s-7/%s)',
                                         schedule, v_item, label, v_first, v_step),
                        DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
                ELSIF v_first > v_last THEN
                    RAISE EXCEPTION USING ERRCODE = '22023',
                        MESSAGE = format('invalid schedule %L: reversed range %L in the %s field',
                                         schedule, v_range, label),
                        DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
                END IF;
            ELSIF v_step IS NOT NULL THEN
                v_last := high;
            ELSE
                v_last := v_first;
            END IF;
        END IF;
        FOR matched IN v_first .. v_last BY coalesce(v_step, 1) LOOP
            v_mask := v_mask | (1::bigint << matched);
        END LOOP;
    END LOOP;
    RETURN v_mask;
END
$$;

-- A schedule text, parsed once (at registration) so that the evaluators on
-- the hot path never parse: a macro, a five-field cron expression or an
-- interval. Five fields that are no cron expression may still be an interval
-- ('1 day 2 hours 3'); when they are neither, the cron error is the one
-- reported, as the more useful.
CREATE FUNCTION ledger._parse_schedule(schedule text, time_zone text)
RETURNS ledger.schedule_spec
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_spec       ledger.schedule_spec;
    v_text       text;     -- trimmed, lower case, macros expanded
    v_fields     text[];
    v_every      interval;
    v_months     integer;
    v_days       integer;
    v_micros     numeric;
    v_cron_error text;
BEGIN
    IF schedule IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument schedule must not be null';
    END IF;
    PERFORM ledger._check_time_zone(time_zone);
    IF char_length(schedule) > ledger._max_schedule_length() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument schedule must be at most %s characters', ledger._max_schedule_length()),
            DETAIL = jsonb_build_object('argument', 'schedule', 'length', char_length(schedule),
                                        'max', ledger._max_schedule_length())::text;
    END IF;
    v_text := lower(btrim(schedule, E' \t\r\n'));
    IF v_text = '' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'invalid schedule: must not be empty',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    v_text := CASE v_text
        WHEN '@hourly'   THEN '0 * * * *'
        WHEN '@daily'    THEN '0 0 * * *'
        WHEN '@midnight' THEN '0 0 * * *'
        WHEN '@weekly'   THEN '0 0 * * 0'
        WHEN '@monthly'  THEN '0 0 1 * *'
        WHEN '@yearly'   THEN '0 0 1 1 *'
        WHEN '@annually' THEN '0 0 1 1 *'
        ELSE v_text END;
    IF v_text ~ '^@[a-z]+$' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %L: unknown macro (use @hourly, @daily, @midnight, @weekly, '
                             '@monthly, @yearly or @annually)', schedule),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;

    v_fields := regexp_split_to_array(v_text, '\s+');
    IF cardinality(v_fields) = 5 THEN
        BEGIN
            RETURN ledger._parse_cron(schedule, v_fields);
        EXCEPTION WHEN invalid_parameter_value THEN
            GET STACKED DIAGNOSTICS v_cron_error = MESSAGE_TEXT;
        END;
    END IF;

    -- An interval? Only interval characters (PostgreSQL reads '*/15 * * * *'
    -- as 15 seconds), and no bare number, which would mean seconds.
    IF v_text ~ '^[0-9a-z .:+-]+$' AND v_text !~ '^[0-9. ]+$' THEN
        BEGIN
            v_every := btrim(schedule, E' \t\r\n')::interval;  -- ISO 8601 ('PT45M') wants upper case
        EXCEPTION WHEN OTHERS THEN
            v_every := NULL;
        END;
    END IF;
    IF v_every IS NULL THEN
        IF v_cron_error IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = v_cron_error,
                DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
        END IF;
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %L: expected an interval such as ''45 minutes'' or a five-field '
                             'cron expression (got %s fields)', schedule, cardinality(v_fields)),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    -- Split as the evaluators use it: months and days move on the local
    -- calendar, the rest in absolute time.
    v_months := (extract(year FROM v_every) * 12 + extract(month FROM v_every))::integer;
    v_days := extract(day FROM v_every)::integer;
    v_micros := extract(epoch FROM v_every - make_interval(months => v_months, days => v_days)) * 1000000;
    IF v_months < 0 OR v_days < 0 OR v_micros < 0 OR (v_months = 0 AND v_days = 0 AND v_micros = 0) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %L: the interval must be positive, with no negative part', schedule),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    IF v_every < ledger._min_every() OR v_every > ledger._max_every() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %L: an interval schedule must be from %s to %s',
                             schedule, ledger._min_every(), ledger._max_every()),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule,
                                        'min', ledger._min_every()::text, 'max', ledger._max_every()::text)::text;
    END IF;
    v_spec.kind := 'interval';
    v_spec.every := v_every;
    v_spec.every_months := v_months;
    v_spec.every_days := v_days;
    v_spec.every_micros := v_micros::bigint;
    RETURN v_spec;
END
$$;

-- The five fields of a cron expression (lower case), parsed and checked. A
-- schedule that can never fire is refused here: the evaluators would search
-- in vain, and the job would never be due without anyone noticing.
CREATE FUNCTION ledger._parse_cron(schedule text, fields text[])
RETURNS ledger.schedule_spec
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_all_weekdays CONSTANT integer := (1 << 7) - 1;   -- bits 0 to 6
    v_spec         ledger.schedule_spec;
    v_dows         bigint;    -- bits 0 to 7, Sunday twice
    v_can_fire     boolean := false;
BEGIN
    v_spec.kind := 'cron';
    v_spec.minutes := ledger._cron_field(schedule, fields[1], 'minute', 0, 59, NULL);
    v_spec.hours := ledger._cron_field(schedule, fields[2], 'hour', 0, 23, NULL)::integer;
    v_spec.doms := ledger._cron_field(schedule, fields[3], 'day-of-month', 1, 31, NULL);
    v_spec.months := ledger._cron_field(schedule, fields[4], 'month', 1, 12,
        ARRAY['jan','feb','mar','apr','may','jun','jul','aug','sep','oct','nov','dec'])::integer;
    v_dows := ledger._cron_field(schedule, fields[5], 'day-of-week', 0, 7,
        ARRAY['sun','mon','tue','wed','thu','fri','sat']);
    v_spec.dows := ((v_dows | (v_dows >> 7)) & v_all_weekdays)::integer;  -- 7 is Sunday too
    v_spec.dom_restricted := left(fields[3], 1) <> '*';
    v_spec.dow_restricted := left(fields[5], 1) <> '*';
    v_spec.wildcard := left(fields[1], 1) = '*' OR left(fields[2], 1) = '*';

    -- Can it ever fire? With both day fields restricted either one suffices
    -- and any weekday occurs. Otherwise some allowed month must have an
    -- allowed day (Feb 29 counts); every date falls on every weekday in
    -- some year, so the weekday field cannot make it impossible.
    IF NOT (v_spec.dom_restricted AND v_spec.dow_restricted) THEN
        FOR month_number IN 1 .. 12 LOOP
            -- the days 1 to the month's longest length
            IF (v_spec.months >> month_number) & 1 = 1
               AND v_spec.doms & ((2::bigint << (CASE WHEN month_number = 2 THEN 29
                                                      WHEN month_number IN (4, 6, 9, 11) THEN 30
                                                      ELSE 31 END)) - 2) <> 0 THEN
                v_can_fire := true;
            END IF;
        END LOOP;
        IF NOT v_can_fire THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid schedule %L: no allowed month has an allowed day of month, '
                                 'it can never fire', schedule),
                DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
        END IF;
    END IF;
    RETURN v_spec;
END
$$;

-- ---------------------------------------------------------------- local calendar

-- The days of month year-month that match the day-of-month and day-of-week
-- fields (bits 1 to 31), as one mask: the day walks then skip a whole month
-- that has none. Vixie's rule: with both fields restricted a day matches
-- either, otherwise both.
CREATE FUNCTION ledger._day_mask(spec ledger.schedule_spec, year integer, month integer)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_all_weekdays  CONSTANT integer := (1 << 7) - 1;   -- bits 0 to 6
    v_month_length  integer;
    v_month_days    bigint;   -- bits 1 to v_month_length
    v_first_weekday integer;
    v_week          bigint;   -- the weekday field, bit 0 = the weekday of day 1
    v_weekday_days  bigint;   -- the days of the month on a matching weekday
BEGIN
    v_month_length := CASE WHEN month = 2 THEN
                               CASE WHEN (year % 4 = 0 AND year % 100 <> 0) OR year % 400 = 0 THEN 29 ELSE 28 END
                           WHEN month IN (4, 6, 9, 11) THEN 30
                           ELSE 31 END;
    v_month_days := (2::bigint << v_month_length) - 2;
    IF spec.dows = v_all_weekdays AND NOT (spec.dom_restricted AND spec.dow_restricted) THEN
        RETURN spec.doms & v_month_days;
    END IF;
    -- weekday of day 1 (2000-01-02 was a Sunday), then the weekday pattern
    -- rotated to start on day 1 and repeated over five weeks
    v_first_weekday := (((make_date(year, month, 1) - date '2000-01-02') % 7) + 7) % 7;
    v_week := (((spec.dows >> v_first_weekday) | (spec.dows << (7 - v_first_weekday))) & v_all_weekdays)::bigint;
    v_weekday_days := (v_week | (v_week << 7) | (v_week << 14) | (v_week << 21) | (v_week << 28)) << 1;
    IF spec.dom_restricted AND spec.dow_restricted THEN
        RETURN (spec.doms | v_weekday_days) & v_month_days;
    END IF;
    RETURN spec.doms & v_weekday_days & v_month_days;
END
$$;

-- The first local time >= earliest that matches the cron fields, found field
-- by field instead of minute by minute: each turn of the loop either returns
-- or moves to the start of the next candidate month, day or hour (a handful
-- of turns; bounded for safety). The bit scans are inlined, since a call to
-- a function with SET costs microseconds: v & -v isolates the lowest set bit,
-- a power of two and so exact in float8, and round(ln(p) / ln 2) is its bit
-- number.
CREATE FUNCTION ledger._local_next(spec ledger.schedule_spec, earliest timestamp)
RETURNS timestamp
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ln2    CONSTANT float8 := ln(2::float8);
    v_start  timestamp := date_trunc('minute', earliest);
    v_year   integer;
    v_month  integer;
    v_day    integer;
    v_hour   integer;
    v_minute integer;
    v_bits   bigint;    -- the field's values from the current one on
BEGIN
    IF v_start < earliest THEN
        v_start := v_start + interval '1 minute';
    END IF;
    v_year := date_part('year', v_start)::integer;
    v_month := date_part('month', v_start)::integer;
    v_day := date_part('day', v_start)::integer;
    v_hour := date_part('hour', v_start)::integer;
    v_minute := date_part('minute', v_start)::integer;
    FOR turn IN 1 .. 10000 LOOP
        v_bits := spec.months & ~((1::bigint << v_month) - 1);
        IF v_bits = 0 THEN
            v_year := v_year + 1; v_month := 1; v_day := 1; v_hour := 0; v_minute := 0;
            CONTINUE;
        END IF;
        v_bits := round(ln((v_bits & -v_bits)::float8) / v_ln2)::bigint;
        IF v_bits > v_month THEN
            v_month := v_bits::integer; v_day := 1; v_hour := 0; v_minute := 0;
        END IF;
        v_bits := ledger._day_mask(spec, v_year, v_month) & ~((1::bigint << v_day) - 1);
        IF v_bits = 0 THEN
            v_month := v_month + 1; v_day := 1; v_hour := 0; v_minute := 0;
            IF v_month > 12 THEN
                v_year := v_year + 1; v_month := 1;
            END IF;
            CONTINUE;
        END IF;
        v_bits := round(ln((v_bits & -v_bits)::float8) / v_ln2)::bigint;
        IF v_bits > v_day THEN
            v_day := v_bits::integer; v_hour := 0; v_minute := 0;
        END IF;
        v_bits := spec.hours & ~((1::bigint << v_hour) - 1);
        IF v_bits = 0 THEN
            v_day := v_day + 1; v_hour := 0; v_minute := 0;
            CONTINUE;
        END IF;
        v_bits := round(ln((v_bits & -v_bits)::float8) / v_ln2)::bigint;
        IF v_bits > v_hour THEN
            v_hour := v_bits::integer; v_minute := 0;
        END IF;
        v_bits := spec.minutes & ~((1::bigint << v_minute) - 1);
        IF v_bits = 0 THEN
            v_hour := v_hour + 1; v_minute := 0;
            CONTINUE;
        END IF;
        RETURN make_timestamp(v_year, v_month, v_day, v_hour,
                              round(ln((v_bits & -v_bits)::float8) / v_ln2)::integer, 0);
    END LOOP;
    RETURN NULL;
END
$$;

-- The last local time <= latest that matches the cron fields: the mirror of
-- ledger._local_next. The highest set bit of v is floor(log2(v)), which
-- float8 can get one off (it rounds a v above 2^53, and the quotient of
-- logarithms is not exact): the shifts compared with v correct it.
CREATE FUNCTION ledger._local_prev(spec ledger.schedule_spec, latest timestamp)
RETURNS timestamp
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ln2     CONSTANT float8 := ln(2::float8);
    v_start   timestamp := date_trunc('minute', latest);
    v_year    integer;
    v_month   integer;
    v_day     integer;
    v_hour    integer;
    v_minute  integer;
    v_bits    bigint;    -- the field's values up to the current one
    v_highest integer;   -- the highest of them
BEGIN
    v_year := date_part('year', v_start)::integer;
    v_month := date_part('month', v_start)::integer;
    v_day := date_part('day', v_start)::integer;
    v_hour := date_part('hour', v_start)::integer;
    v_minute := date_part('minute', v_start)::integer;
    FOR turn IN 1 .. 10000 LOOP
        v_bits := spec.months & ((2::bigint << v_month) - 1);
        IF v_bits = 0 THEN
            v_year := v_year - 1; v_month := 12; v_day := 31; v_hour := 23; v_minute := 59;
            CONTINUE;
        END IF;
        v_highest := floor(ln(v_bits::float8) / v_ln2)::integer;
        v_highest := v_highest - (((1::bigint << v_highest) > v_bits)::integer)
                               + (((2::bigint << v_highest) <= v_bits)::integer);
        IF v_highest < v_month THEN
            v_month := v_highest; v_day := 31; v_hour := 23; v_minute := 59;
        END IF;
        v_bits := CASE WHEN v_day < 1 THEN 0
                       ELSE ledger._day_mask(spec, v_year, v_month) & ((2::bigint << v_day) - 1) END;
        IF v_bits = 0 THEN
            v_month := v_month - 1; v_day := 31; v_hour := 23; v_minute := 59;
            IF v_month < 1 THEN
                v_year := v_year - 1; v_month := 12;
            END IF;
            CONTINUE;
        END IF;
        v_highest := floor(ln(v_bits::float8) / v_ln2)::integer;
        v_highest := v_highest - (((1::bigint << v_highest) > v_bits)::integer)
                               + (((2::bigint << v_highest) <= v_bits)::integer);
        IF v_highest < v_day THEN
            v_day := v_highest; v_hour := 23; v_minute := 59;
        END IF;
        v_bits := CASE WHEN v_hour < 0 THEN 0 ELSE spec.hours & ((2::bigint << v_hour) - 1) END;
        IF v_bits = 0 THEN
            v_day := v_day - 1; v_hour := 23; v_minute := 59;
            CONTINUE;
        END IF;
        v_highest := floor(ln(v_bits::float8) / v_ln2)::integer;
        v_highest := v_highest - (((1::bigint << v_highest) > v_bits)::integer)
                               + (((2::bigint << v_highest) <= v_bits)::integer);
        IF v_highest < v_hour THEN
            v_hour := v_highest; v_minute := 59;
        END IF;
        v_bits := CASE WHEN v_minute < 0 THEN 0 ELSE spec.minutes & ((2::bigint << v_minute) - 1) END;
        IF v_bits = 0 THEN
            v_hour := v_hour - 1; v_minute := 59;
            CONTINUE;
        END IF;
        v_highest := floor(ln(v_bits::float8) / v_ln2)::integer;
        v_highest := v_highest - (((1::bigint << v_highest) > v_bits)::integer)
                               + (((2::bigint << v_highest) <= v_bits)::integer);
        RETURN make_timestamp(v_year, v_month, v_day, v_hour, v_highest, 0);
    END LOOP;
    RETURN NULL;
END
$$;

-- The number of matching days in [first_day, last_day], so that counting a
-- long downtime never walks its days: O(1) when the month and day-of-month
-- fields are unrestricted (whole weeks and a remainder), else one step per
-- month.
CREATE FUNCTION ledger._match_days(spec ledger.schedule_spec, first_day date, last_day date)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_all_months        CONSTANT integer := (2 << 12) - 2;          -- bits 1 to 12
    v_all_days_of_month CONSTANT bigint := (2::bigint << 31) - 2;   -- bits 1 to 31
    v_all_weekdays      CONSTANT integer := (1 << 7) - 1;           -- bits 0 to 6
    v_days              bigint;
    v_first_weekday     integer;
    v_week              bigint;   -- the weekday field, bit 0 = the weekday of first_day
    v_year              integer;
    v_month             integer;
    v_month_start       date;
    v_month_length      integer;
    v_from              integer;  -- the month's days in range: v_from to v_to
    v_to                integer;
    v_total             bigint := 0::bigint;
BEGIN
    IF last_day < first_day THEN
        RETURN 0::bigint;
    END IF;
    v_days := (last_day - first_day + 1)::bigint;
    IF spec.months = v_all_months AND spec.doms = v_all_days_of_month THEN
        IF spec.dows = v_all_weekdays OR (spec.dom_restricted AND spec.dow_restricted) THEN
            RETURN v_days;
        END IF;
        v_first_weekday := (((first_day - date '2000-01-02') % 7) + 7) % 7;  -- 2000-01-02 was a Sunday
        v_week := (((spec.dows >> v_first_weekday) | (spec.dows << (7 - v_first_weekday))) & v_all_weekdays)::bigint;
        RETURN (v_days / 7) * ledger._popcount(spec.dows)::integer
             + ledger._popcount((v_week & ((1::bigint << (v_days % 7)::integer) - 1)))::integer;
    END IF;
    v_year := date_part('year', first_day::timestamp)::integer;
    v_month := date_part('month', first_day::timestamp)::integer;
    LOOP
        v_month_start := make_date(v_year, v_month, 1);
        EXIT WHEN v_month_start > last_day;
        IF (spec.months >> v_month) & 1 = 1 THEN
            v_month_length := (v_month_start + interval '1 month')::date - v_month_start;
            v_from := CASE WHEN first_day > v_month_start THEN first_day - v_month_start + 1 ELSE 1 END;
            v_to := CASE WHEN last_day < v_month_start + v_month_length - 1 THEN last_day - v_month_start + 1
                         ELSE v_month_length END;
            v_total := v_total + ledger._popcount((ledger._day_mask(spec, v_year, v_month)
                                            & ((2::bigint << v_to) - (1::bigint << v_from))))::integer;
        END IF;
        v_month := v_month + 1;
        IF v_month > 12 THEN
            v_month := 1; v_year := v_year + 1;
        END IF;
    END LOOP;
    RETURN v_total;
END
$$;

-- The number of matching local times in (after_local, upto_local], from
-- counts per day: the matching days between the two ends times the matches
-- in a day, plus the partial first and last days.
CREATE FUNCTION ledger._local_count(spec ledger.schedule_spec, after_local timestamp, upto_local timestamp)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_after        timestamp := date_trunc('minute', after_local);
    v_upto         timestamp := date_trunc('minute', upto_local);
    v_after_day    date;
    v_upto_day     date;
    v_per_hour     integer;   -- matching minutes in a matching hour
    v_per_day      bigint;
    v_through_after bigint;   -- matches in v_after's day up to and including its minute
    v_through_upto bigint;    -- the same for v_upto
    v_hour         integer;
    v_minute       integer;
BEGIN
    IF v_upto <= v_after THEN
        RETURN 0::bigint;
    END IF;
    v_after_day := v_after::date;
    v_upto_day := v_upto::date;
    v_per_hour := ledger._popcount(spec.minutes)::integer;
    v_per_day := (ledger._popcount(spec.hours) * v_per_hour)::bigint;
    v_hour := date_part('hour', v_after)::integer;
    v_minute := date_part('minute', v_after)::integer;
    v_through_after := ledger._popcount((spec.hours & ((1::bigint << v_hour) - 1))) * v_per_hour
                     + ((spec.hours >> v_hour) & 1)
                       * ledger._popcount((spec.minutes & ((2::bigint << v_minute) - 1)));
    v_hour := date_part('hour', v_upto)::integer;
    v_minute := date_part('minute', v_upto)::integer;
    v_through_upto := ledger._popcount((spec.hours & ((1::bigint << v_hour) - 1))) * v_per_hour
                    + ((spec.hours >> v_hour) & 1)
                      * ledger._popcount((spec.minutes & ((2::bigint << v_minute) - 1)));
    IF v_after_day = v_upto_day THEN
        RETURN ledger._match_days(spec, v_after_day, v_after_day) * (v_through_upto - v_through_after);
    END IF;
    RETURN ledger._match_days(spec, v_after_day, v_after_day) * (v_per_day - v_through_after)
         + ledger._match_days(spec, v_after_day + 1, v_upto_day - 1) * v_per_day
         + ledger._match_days(spec, v_upto_day, v_upto_day) * v_through_upto;
END
$$;

-- ---------------------------------------------------------------- time zones

-- The instant in (after, upto] where the UTC offset changes; the caller knows
-- that the offsets at after and upto differ, and that there is one change
-- between them. A binary search on whole seconds, since tzdata transitions
-- fall on whole seconds: about 20 steps across a probe's 144 hours.
CREATE FUNCTION ledger._transition(time_zone text, after timestamptz, upto timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_offset_before interval := (after AT TIME ZONE time_zone) - (after AT TIME ZONE 'UTC');
    v_low           bigint := floor(extract(epoch FROM after))::bigint;   -- epoch seconds, before the change
    v_high          bigint := ceil(extract(epoch FROM upto))::bigint;     -- epoch seconds, after it
    v_middle        bigint;
    v_probe         timestamptz;
BEGIN
    WHILE v_high - v_low > 1 LOOP
        v_middle := v_low + (v_high - v_low) / 2;
        v_probe := to_timestamp(v_middle);
        IF (v_probe AT TIME ZONE time_zone) - (v_probe AT TIME ZONE 'UTC') = v_offset_before THEN
            v_low := v_middle;
        ELSE
            v_high := v_middle;
        END IF;
    END LOOP;
    RETURN to_timestamp(v_high);
END
$$;

-- The instants whose wall clock in time_zone reads local_time: first_at and
-- last_at (equal unless a fall-back repeats local_time), or, when local_time
-- falls in a spring-forward gap, both NULL and gap_end = the transition
-- instant. AT TIME ZONE alone picks one reading and hides the others, and
-- the DST rules of the cron slots need all of them. Only the offsets a day
-- before and after can apply (one transition at most in between).
CREATE FUNCTION ledger._local_instants(time_zone text, local_time timestamp,
    OUT first_at timestamptz, OUT last_at timestamptz, OUT gap_end timestamptz)
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_as_utc         timestamptz := local_time AT TIME ZONE 'UTC';
    v_offset_before  interval := ((v_as_utc - interval '24 hours') AT TIME ZONE time_zone)
                               - ((v_as_utc - interval '24 hours') AT TIME ZONE 'UTC');
    v_offset_after   interval := ((v_as_utc + interval '24 hours') AT TIME ZONE time_zone)
                               - ((v_as_utc + interval '24 hours') AT TIME ZONE 'UTC');
    v_with_before    timestamptz := v_as_utc - v_offset_before;   -- local_time read with the offset before
    v_with_after     timestamptz;                                -- and with the offset after
    v_before_matches boolean;
    v_after_matches  boolean;
BEGIN
    IF v_offset_before = v_offset_after THEN
        first_at := v_with_before;
        last_at := v_with_before;
        RETURN;
    END IF;
    v_with_after := v_as_utc - v_offset_after;
    v_before_matches := (v_with_before AT TIME ZONE time_zone) = local_time;
    v_after_matches := (v_with_after AT TIME ZONE time_zone) = local_time;
    IF v_before_matches AND v_after_matches THEN
        first_at := least(v_with_before, v_with_after);
        last_at := greatest(v_with_before, v_with_after);
    ELSIF v_before_matches THEN
        first_at := v_with_before;
        last_at := v_with_before;
    ELSIF v_after_matches THEN
        first_at := v_with_after;
        last_at := v_with_after;
    ELSE
        gap_end := ledger._transition(time_zone, least(v_with_before, v_with_after),
                                      greatest(v_with_before, v_with_after));
    END IF;
END
$$;

-- M(at): the highest wall-clock time reached up to `at`, which decides the
-- fixed cron expressions' slots (see the top of this file). It is the wall
-- clock of `at`, except during the hour (or so) after a fall-back, when the
-- clock reads times it already passed.
CREATE FUNCTION ledger._local_high(time_zone text, at timestamptz)
RETURNS timestamp
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_local     timestamp := at AT TIME ZONE time_zone;
    v_fall_back timestamptz;
BEGIN
    IF ((at - interval '24 hours') AT TIME ZONE time_zone) - ((at - interval '24 hours') AT TIME ZONE 'UTC')
       <= v_local - (at AT TIME ZONE 'UTC') THEN
        RETURN v_local;
    END IF;
    v_fall_back := ledger._transition(time_zone, at - interval '24 hours', at);
    RETURN greatest(v_local, (v_fall_back - interval '1 microsecond') AT TIME ZONE time_zone);
END
$$;

-- Zones whose offset never changes, so that the cron evaluators can skip the
-- search for transitions and work on UTC wall clocks directly.
CREATE FUNCTION ledger._is_utc(time_zone text)
RETURNS boolean
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN lower(time_zone) IN ('utc', 'etc/utc', 'gmt', 'etc/gmt', 'zulu', 'etc/zulu',
                                'uct', 'etc/uct', 'universal', 'etc/universal', 'greenwich', 'etc/greenwich');
END
$$;

-- ---------------------------------------------------------------- cron slots

-- The oldest cron slot > after, by the DST rules at the top of this file. A
-- fixed expression maps to one local time through M(after); a wildcard one
-- walks the matching local times and takes the first of their instants past
-- `after`, skipping gaps whole (bounded for safety).
CREATE FUNCTION ledger._cron_after(spec ledger.schedule_spec, time_zone text, after timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_after      timestamptz := after;   -- a slot must be later than this
    v_offset     interval;
    v_local_slot timestamp;
    v_fall_back  timestamptz;
    v_from       timestamp;              -- the local times still to try: v_from and later
    v_instants   record;
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN ledger._local_next(spec, (after AT TIME ZONE 'UTC') + interval '1 microsecond') AT TIME ZONE 'UTC';
    END IF;
    IF NOT spec.wildcard THEN
        v_local_slot := ledger._local_next(spec, ledger._local_high(time_zone, after) + interval '1 microsecond');
        v_instants := ledger._local_instants(time_zone, v_local_slot);
        RETURN coalesce(v_instants.first_at, v_instants.gap_end);
    END IF;
    v_offset := (after AT TIME ZONE time_zone) - (after AT TIME ZONE 'UTC');
    v_from := (after AT TIME ZONE time_zone) + interval '1 microsecond';
    IF ((after + interval '24 hours') AT TIME ZONE time_zone) - ((after + interval '24 hours') AT TIME ZONE 'UTC')
       < v_offset THEN
        -- A fall-back within a day: first the slots before it, then the
        -- repeated wall-clock times after it.
        v_fall_back := ledger._transition(time_zone, after, after + interval '24 hours');
        v_local_slot := ledger._local_next(spec, v_from);
        IF v_local_slot <= (v_fall_back - interval '1 microsecond') AT TIME ZONE time_zone THEN
            RETURN (v_local_slot AT TIME ZONE 'UTC') - v_offset;
        END IF;
        v_from := v_fall_back AT TIME ZONE time_zone;
        v_after := v_fall_back - interval '1 microsecond';
    END IF;
    FOR turn IN 1 .. 1000 LOOP
        v_local_slot := ledger._local_next(spec, v_from);
        IF v_local_slot IS NULL THEN
            RETURN NULL;
        END IF;
        v_instants := ledger._local_instants(time_zone, v_local_slot);
        IF v_instants.first_at > v_after THEN
            RETURN v_instants.first_at;
        ELSIF v_instants.last_at > v_after THEN
            RETURN v_instants.last_at;
        ELSIF v_instants.gap_end IS NOT NULL THEN
            v_from := v_instants.gap_end AT TIME ZONE time_zone;   -- skip the whole gap
        ELSE
            v_from := v_local_slot + interval '1 minute';
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- The newest cron slot <= at: the mirror of ledger._cron_after.
CREATE FUNCTION ledger._cron_at_or_before(spec ledger.schedule_spec, time_zone text, at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_at         timestamptz := at;      -- a slot must be no later than this
    v_offset     interval;
    v_local_slot timestamp;
    v_fall_back  timestamptz;
    v_upto       timestamp;              -- the local times still to try: v_upto and earlier
    v_instants   record;
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN ledger._local_prev(spec, at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    END IF;
    IF NOT spec.wildcard THEN
        v_local_slot := ledger._local_prev(spec, ledger._local_high(time_zone, at));
        v_instants := ledger._local_instants(time_zone, v_local_slot);
        RETURN coalesce(v_instants.first_at, v_instants.gap_end);
    END IF;
    v_offset := (at AT TIME ZONE time_zone) - (at AT TIME ZONE 'UTC');
    v_upto := at AT TIME ZONE time_zone;
    IF ((at - interval '24 hours') AT TIME ZONE time_zone) - ((at - interval '24 hours') AT TIME ZONE 'UTC')
       > v_offset THEN
        -- A fall-back within the last day: first the slots since it, then
        -- the ones before it.
        v_fall_back := ledger._transition(time_zone, at - interval '24 hours', at);
        v_local_slot := ledger._local_prev(spec, v_upto);
        IF v_local_slot >= v_fall_back AT TIME ZONE time_zone THEN
            RETURN (v_local_slot AT TIME ZONE 'UTC') - v_offset;
        END IF;
        v_upto := (v_fall_back - interval '1 microsecond') AT TIME ZONE time_zone;
        v_at := v_fall_back - interval '1 microsecond';
    END IF;
    FOR turn IN 1 .. 1000 LOOP
        v_local_slot := ledger._local_prev(spec, v_upto);
        IF v_local_slot IS NULL THEN
            RETURN NULL;
        END IF;
        v_instants := ledger._local_instants(time_zone, v_local_slot);
        IF v_instants.last_at <= v_at THEN
            RETURN v_instants.last_at;
        ELSIF v_instants.first_at <= v_at THEN
            RETURN v_instants.first_at;
        ELSIF v_instants.gap_end IS NOT NULL THEN
            v_upto := (v_instants.gap_end - interval '1 microsecond') AT TIME ZONE time_zone;   -- skip the whole gap
        ELSE
            v_upto := v_local_slot - interval '1 minute';
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- The number of cron slots in (after, upto], from local counts: a wildcard
-- expression sums them over the stretches of constant offset; a fixed one
-- counts every wall-clock time once and takes off the merges in
-- spring-forward gaps. Transitions are found by probing every 144 hours,
-- so a year costs about 60 probes.
CREATE FUNCTION ledger._cron_count(spec ledger.schedule_spec, time_zone text, after timestamptz, upto timestamptz)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_total         bigint := 0::bigint;
    v_probe_from    timestamptz := after;
    v_probe_to      timestamptz;
    v_offset_from   interval;
    v_offset_to     interval;
    v_transition    timestamptz;
    v_stretch_start timestamp;   -- wildcard: the local start of the stretch not yet counted
    v_merged        bigint;      -- fixed: the local times one gap maps to one slot
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN ledger._local_count(spec, after AT TIME ZONE 'UTC', upto AT TIME ZONE 'UTC');
    END IF;
    IF spec.wildcard THEN
        v_stretch_start := after AT TIME ZONE time_zone;
    ELSE
        v_total := ledger._local_count(spec, ledger._local_high(time_zone, after),
                                       ledger._local_high(time_zone, upto));
    END IF;
    v_offset_from := (after AT TIME ZONE time_zone) - (after AT TIME ZONE 'UTC');
    WHILE v_probe_from < upto LOOP
        v_probe_to := least(v_probe_from + interval '144 hours', upto);
        v_offset_to := (v_probe_to AT TIME ZONE time_zone) - (v_probe_to AT TIME ZONE 'UTC');
        IF v_offset_to <> v_offset_from THEN
            v_transition := ledger._transition(time_zone, v_probe_from, v_probe_to);
            IF spec.wildcard THEN
                v_total := v_total
                         + ledger._local_count(spec, v_stretch_start,
                                               (v_transition - interval '1 microsecond') AT TIME ZONE time_zone);
                v_stretch_start := (v_transition AT TIME ZONE time_zone) - interval '1 microsecond';
            ELSIF v_offset_to > v_offset_from THEN
                v_merged := ledger._local_count(spec, (v_transition - interval '1 microsecond') AT TIME ZONE time_zone,
                                                v_transition AT TIME ZONE time_zone);
                IF v_merged > 1 THEN
                    v_total := v_total - (v_merged - 1);
                END IF;
            END IF;
        END IF;
        v_probe_from := v_probe_to;
        v_offset_from := v_offset_to;
    END LOOP;
    IF spec.wildcard THEN
        v_total := v_total + ledger._local_count(spec, v_stretch_start, upto AT TIME ZONE time_zone);
    END IF;
    RETURN v_total;
END
$$;

-- ---------------------------------------------------------------- interval slots

-- base + micros microseconds, exactly: a float8 times interval '1
-- microsecond' is exact only below 2^53, so whole hours go through
-- make_interval and only the rest through float8.
CREATE FUNCTION ledger._add_micros(base timestamptz, micros numeric)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_micros_per_hour CONSTANT numeric := numeric '3600000000';
    v_hours           numeric := div(micros, v_micros_per_hour);
BEGIN
    RETURN base + make_interval(hours => v_hours::integer)
                + (micros - v_hours * v_micros_per_hour)::float8 * interval '1 microsecond';
END
$$;

-- Interval slot number slot_number, by the formula at the top of this file:
-- the calendar part on the local calendar, the time part in absolute time.
CREATE FUNCTION ledger._interval_slot(spec ledger.schedule_spec, time_zone text, slot_number bigint)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_origin CONSTANT timestamp := timestamp '2000-01-01 00:00';   -- slot 0, local
BEGIN
    RETURN ledger._add_micros(
        (v_origin + make_interval(months => (slot_number * spec.every_months)::integer,
                                  days => (slot_number * spec.every_days)::integer))
            AT TIME ZONE time_zone,
        slot_number::numeric * spec.every_micros);
END
$$;

-- The largest slot number whose slot is <= at: computed, not searched, for a
-- pure time interval; estimated and corrected by a step or two when months
-- and days make the slots uneven.
CREATE FUNCTION ledger._interval_index(spec ledger.schedule_spec, time_zone text, at timestamptz)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_origin  CONSTANT timestamp := timestamp '2000-01-01 00:00';   -- slot 0, local
    v_since   numeric := extract(epoch FROM at) - extract(epoch FROM v_origin AT TIME ZONE time_zone);  -- seconds
    v_index   bigint;
BEGIN
    IF spec.every_months = 0 AND spec.every_days = 0 THEN
        RETURN floor(v_since * 1000000 / spec.every_micros)::bigint;
    END IF;
    -- Estimate with an average month (30.436875 days, 2629746 seconds), then
    -- correct: the calendar drifts from it by a few days at most, and a step
    -- is >= 1 day.
    v_index := floor(v_since / (spec.every_months * 2629746.0 + spec.every_days * 86400.0
                                + spec.every_micros / 1000000.0))::bigint;
    WHILE ledger._interval_slot(spec, time_zone, v_index) > at LOOP
        v_index := v_index - 1;
    END LOOP;
    WHILE ledger._interval_slot(spec, time_zone, v_index + 1) <= at LOOP
        v_index := v_index + 1;
    END LOOP;
    RETURN v_index;
END
$$;

-- ---------------------------------------------------------------- the interface

-- The newest slot <= at: where the due slots and the slot checks start. The
-- arguments are checked first, so that a bad one gets an error naming it
-- instead of a NULL answer or an out-of-range error from deep inside.
CREATE FUNCTION ledger._slot_at_or_before(spec ledger.schedule_spec, time_zone text, at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF spec.kind IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument spec must not be null';
    ELSIF time_zone IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument time_zone must not be null';
    ELSIF at IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument at must not be null';
    ELSIF NOT isfinite(at) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument at must be a finite timestamp',
            DETAIL = jsonb_build_object('argument', 'at', 'value', at::text)::text;
    END IF;
    IF spec.kind = 'interval' THEN
        RETURN ledger._interval_slot(spec, time_zone, ledger._interval_index(spec, time_zone, at));
    END IF;
    RETURN ledger._cron_at_or_before(spec, time_zone, at);
END
$$;

-- The oldest slot > after: the next slot to come.
CREATE FUNCTION ledger._slot_after(spec ledger.schedule_spec, time_zone text, after timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF spec.kind IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument spec must not be null';
    ELSIF time_zone IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument time_zone must not be null';
    ELSIF after IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument after must not be null';
    ELSIF NOT isfinite(after) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument after must be a finite timestamp',
            DETAIL = jsonb_build_object('argument', 'after', 'value', after::text)::text;
    END IF;
    IF spec.kind = 'interval' THEN
        RETURN ledger._interval_slot(spec, time_zone, ledger._interval_index(spec, time_zone, after) + 1);
    END IF;
    RETURN ledger._cron_after(spec, time_zone, after);
END
$$;

-- The number of slots s with after < s <= upto, without enumerating them:
-- the slots a downtime missed, which the catch-up bound is checked against.
CREATE FUNCTION ledger._slot_count(spec ledger.schedule_spec, time_zone text, after timestamptz, upto timestamptz)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF spec.kind IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument spec must not be null';
    ELSIF time_zone IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument time_zone must not be null';
    ELSIF after IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument after must not be null';
    ELSIF NOT isfinite(after) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument after must be a finite timestamp',
            DETAIL = jsonb_build_object('argument', 'after', 'value', after::text)::text;
    ELSIF upto IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument upto must not be null';
    ELSIF NOT isfinite(upto) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument upto must be a finite timestamp',
            DETAIL = jsonb_build_object('argument', 'upto', 'value', upto::text)::text;
    END IF;
    IF upto <= after THEN
        RETURN 0::bigint;
    END IF;
    IF spec.kind = 'interval' THEN
        RETURN ledger._interval_index(spec, time_zone, upto) - ledger._interval_index(spec, time_zone, after);
    END IF;
    RETURN ledger._cron_count(spec, time_zone, after, upto);
END
$$;
-- The ledger's tables and their invariants: constraints and unique partial
-- indexes hold them whatever the writer, not only the functions.

CREATE TABLE ledger.jobs (
    job           ledger.label PRIMARY KEY,
    schedule      text,
    time_zone     text        NOT NULL DEFAULT 'UTC',
    ttl           interval,
    max_backfill  integer     NOT NULL DEFAULT 1,
    paused        boolean     NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The schedule parsed once, at registration (see 15_schedule_eval.sql).
    schedule_spec ledger.schedule_spec,
    -- Health bounds (ledger.job_health), all optional: the grace before a
    -- due slot not started is late; no success for longer than down_after
    -- is down; a success shorter than min_runtime is too fast; a run longer
    -- than max_runtime overruns (and `jobledger run` stops it there); the
    -- end of the Nth failure in a row pauses the job.
    late_after           interval,
    down_after           interval,
    min_runtime          interval,
    max_runtime          interval,
    pause_after_failures integer,
    -- When and why the job was paused: 'operator' (pause_job) or 'failures'
    -- (pause_after_failures); NULL while it runs free.
    paused_at     timestamptz,
    pause_reason  text,
    CONSTRAINT jobs_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT jobs_bounds_positive CHECK (late_after > interval '0' AND down_after > interval '0'
                                           AND min_runtime > interval '0' AND max_runtime > interval '0'
                                           AND pause_after_failures >= 1),
    CONSTRAINT jobs_pause_reason_valid CHECK (pause_reason IS NULL
                                              OR (pause_reason IN ('operator', 'failures') AND paused)),
    CONSTRAINT jobs_max_backfill_positive CHECK (max_backfill >= 1),
    CONSTRAINT jobs_schedule_parsed CHECK ((schedule IS NULL) = (schedule_spec IS NULL))
);
COMMENT ON TABLE ledger.jobs IS 'Registered jobs: schedule, time zone, default ttl, catch-up bound, paused';

-- Slots the catch-up bound dropped: one row per drop, a range of slots, so a
-- year of downtime costs one row, not half a million.
CREATE TABLE ledger.skipped_slots (
    job         ledger.label NOT NULL REFERENCES ledger.jobs (job) ON DELETE CASCADE,
    first_slot  timestamptz NOT NULL,
    last_slot   timestamptz NOT NULL,
    slot_count  bigint      NOT NULL,
    reason      text        NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT skipped_slots_pkey PRIMARY KEY (job, first_slot),
    CONSTRAINT skipped_slots_range CHECK (first_slot <= last_slot),
    CONSTRAINT skipped_slots_count CHECK (slot_count >= 1 AND (slot_count = 1) = (first_slot = last_slot)),
    CONSTRAINT skipped_slots_reason_valid CHECK (reason IN ('backfill_limit'))
);
COMMENT ON TABLE ledger.skipped_slots IS 'Ranges of schedule slots the catch-up bound dropped';

-- One row per job that ever held a lease. The row is never deleted: its
-- token is the job's high-water mark, and a token is never issued twice.
CREATE TABLE ledger.leases (
    job         ledger.label PRIMARY KEY,
    owner       ledger.label NOT NULL,
    token       bigint      NOT NULL,
    ttl         interval    NOT NULL,
    acquired_at timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    released_at timestamptz,
    -- WAL timeline that issued `token`: a change means a standby was
    -- promoted, and the next token jumps past anything the old primary issued.
    timeline    integer     NOT NULL,
    CONSTRAINT leases_token_positive CHECK (token > 0),
    CONSTRAINT leases_ttl_positive CHECK (ttl > interval '0'),
    CONSTRAINT leases_timeline_positive CHECK (timeline > 0),
    CONSTRAINT leases_released_ends_lease CHECK (released_at IS NULL OR expires_at <= released_at)
);
COMMENT ON TABLE ledger.leases IS 'Per-job lease: holder, fencing token, expiry';

-- A fence belongs to the job that first wrote through it: tokens are counted
-- per job, so only that job's tokens can be compared with the one recorded.
CREATE TABLE ledger.fences (
    resource    ledger.label PRIMARY KEY,
    job         ledger.label NOT NULL REFERENCES ledger.leases (job),
    token       bigint      NOT NULL,
    advanced_at timestamptz NOT NULL,
    CONSTRAINT fences_token_positive CHECK (token > 0)
);
COMMENT ON TABLE ledger.fences IS 'Per-resource highest accepted fencing token, and the job it belongs to';

CREATE TABLE ledger.job_execution_log (
    run_id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job             ledger.label NOT NULL REFERENCES ledger.leases (job),
    owner           ledger.label NOT NULL,
    token           bigint      NOT NULL,
    slot            timestamptz,
    idempotency_key ledger.label,
    status          text        NOT NULL,
    started_at      timestamptz NOT NULL,
    heartbeat_at    timestamptz,
    completed_at    timestamptz,
    failure_reason  text,
    error           text,
    detail          jsonb,
    -- An operator asked the run to stop (ledger.request_cancel): the
    -- holder's next heartbeat ends it as cancelled and answers NULL.
    cancel_requested_at timestamptz,
    CONSTRAINT log_status_valid CHECK (status IN ('running', 'success', 'failure')),
    CONSTRAINT log_failure_reason_valid
        CHECK (failure_reason IN ('error', 'lease_expired', 'superseded', 'cancelled')),
    CONSTRAINT log_reason_iff_failure CHECK ((status = 'failure') = (failure_reason IS NOT NULL)),
    CONSTRAINT log_completed_iff_ended CHECK ((status = 'running') = (completed_at IS NULL)),
    CONSTRAINT log_completed_after_start CHECK (completed_at >= started_at),
    CONSTRAINT log_slot_finite CHECK (isfinite(slot)),
    CONSTRAINT log_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT log_token_positive CHECK (token > 0),
    -- a token is issued once, so it names at most one run
    CONSTRAINT log_one_run_per_token UNIQUE (job, token)
);
COMMENT ON TABLE ledger.job_execution_log IS 'One row per run: running, success or failure';

-- At most one running run per job.
CREATE UNIQUE INDEX job_execution_log_one_running
    ON ledger.job_execution_log (job) WHERE status = 'running';
-- At most one running-or-successful run per (job, slot) and per (job, key);
-- a failed slot may be retried. The first also finds a job's newest done slot.
CREATE UNIQUE INDEX job_execution_log_one_per_slot
    ON ledger.job_execution_log (job, slot)
    WHERE status IN ('running', 'success') AND slot IS NOT NULL;
CREATE UNIQUE INDEX job_execution_log_one_per_key
    ON ledger.job_execution_log (job, idempotency_key)
    WHERE status IN ('running', 'success') AND idempotency_key IS NOT NULL;
-- Reports, the overlap audit and purge read runs by job in time order.
CREATE INDEX job_execution_log_job_started
    ON ledger.job_execution_log (job, started_at);

-- Monotonic per-job counters. Skips leave no run row, and purge_log removes
-- old rows, so counting the log would undercount and go backwards.
CREATE TABLE ledger.counters (
    job              ledger.label PRIMARY KEY,
    runs_started     bigint NOT NULL DEFAULT 0,
    successes        bigint NOT NULL DEFAULT 0,
    failures         bigint NOT NULL DEFAULT 0,
    skipped_overlap  bigint NOT NULL DEFAULT 0,
    skipped_backfill bigint NOT NULL DEFAULT 0,
    leases_lost      bigint NOT NULL DEFAULT 0,
    -- The job's state as the whole-ledger reads (job_status, alerts,
    -- ttl_advice) need it, kept up to date by the functions that write the
    -- log (start, end, reap, purge) in the same statement as the counters,
    -- so that those reads cost per job, not per log row. Each is what the
    -- log says (ledger._refresh_state recomputes them from it):
    --   last_*          the run that started last (started_at, run_id);
    --   last_success_*  the success that started last;
    --   running_*       the running run;
    --   done_slot       the newest slot that succeeded;
    --   longest_success the longest successful run;
    --   consecutive_failures  failures started after the last success started;
    --   next_due        the job's first slot after done_slot (by its
    --                   schedule; NULL without either): while it is
    --                   still ahead of now, the next slot is it and no
    --                   slot is overdue or missed, which the views then
    --                   read without evaluating the schedule;
    --   latest_end      the latest end of any of its runs;
    --   overlap_run_id  the newest run that started before an earlier run
    --                   ended (none: NULL), the alerts' overlap audit in
    --                   O(1) per job. The writers start a run only once the
    --                   previous one ended, so only a write past the
    --                   functions or a clock stepped back sets it.
    last_run_id             bigint,
    last_status             text,
    last_started_at         timestamptz,
    last_completed_at       timestamptz,
    last_success_started_at timestamptz,
    last_success_at         timestamptz,
    running_run_id          bigint,
    running_token           bigint,
    running_started_at      timestamptz,
    done_slot               timestamptz,
    longest_success         interval,
    consecutive_failures    bigint NOT NULL DEFAULT 0,
    next_due                timestamptz,
    latest_end              timestamptz,
    overlap_run_id          bigint,
    CONSTRAINT counters_non_negative CHECK (
        runs_started >= 0 AND successes >= 0 AND failures >= 0
        AND skipped_overlap >= 0 AND skipped_backfill >= 0 AND leases_lost >= 0
        AND consecutive_failures >= 0)
);
COMMENT ON TABLE ledger.counters IS 'Monotonic per-job counters behind ledger.job_counters, and each job''s state from the log';

-- Skips counted without a WAL flush: a skip (another owner's live lease)
-- writes only this UNLOGGED table, so its commit waits for no disk, and it
-- issues no token. One row per job and backend shard (pg_backend_pid() % 16),
-- so concurrent skippers of one hot job rarely wait for each other. The
-- ending of a run folds the job's pending skips into ledger.counters (rows it
-- can lock without waiting); a crash loses at most the skips not folded yet
-- (harmless: no decision depends on a skip count). ledger.job_counters adds
-- both.
CREATE UNLOGGED TABLE ledger.skip_counts (
    job             ledger.label NOT NULL,
    shard           smallint    NOT NULL,
    skipped_overlap bigint      NOT NULL DEFAULT 0,
    CONSTRAINT skip_counts_pkey PRIMARY KEY (job, shard),
    CONSTRAINT skip_counts_non_negative CHECK (skipped_overlap >= 0)
);
COMMENT ON TABLE ledger.skip_counts IS 'Skips not yet folded into ledger.counters (unlogged: a skip costs no WAL flush)';

-- What purge_log must not forget: a slot or an idempotency key that
-- succeeded answers already_done for ever, even once its run row is gone.
-- Slots: per job, the newest slot whose success was purged (slots at or
-- before it count as done: one row per job). Keys: each purged successful
-- key, kept for ever (about 40 bytes plus the key and the job name).
CREATE TABLE ledger.purged_slots (
    job         ledger.label PRIMARY KEY,
    done_through timestamptz NOT NULL
);
COMMENT ON TABLE ledger.purged_slots IS 'Per job: slots at or before done_through succeeded, though purge_log removed their runs';

CREATE TABLE ledger.purged_keys (
    job             ledger.label NOT NULL,
    idempotency_key ledger.label NOT NULL,
    run_id          bigint      NOT NULL,
    completed_at    timestamptz NOT NULL,
    CONSTRAINT purged_keys_pkey PRIMARY KEY (job, idempotency_key)
);
COMMENT ON TABLE ledger.purged_keys IS 'Idempotency keys that succeeded, kept after purge_log removed their runs';
-- Internal helpers shared by the public functions. Not granted to clients.
-- PL/pgSQL throughout: a non-inlined LANGUAGE sql function is re-planned on
-- every call, and these sit on the hot path.

-- Raise a ledger error: SQLSTATE class LD, DETAIL a JSON object of facts.
CREATE FUNCTION ledger._raise(code text, message text, facts jsonb)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, DETAIL = facts::text;
END
$$;

-- A label (job, owner, resource, idempotency key): 22004 when NULL and
-- required, 22023 when empty, over 200 characters, or holding a character
-- that is invisible or changes how the text around it reads: control (Cc),
-- format (Cf: bidirectional overrides, zero-width joiners, BOM) and separator
-- characters (Zl, Zp, and Zs other than the ASCII space). Look-alike job and
-- owner names would make the audit lie. The class is generated from the
-- Unicode tables (Python's unicodedata) and is the same as ledger.label's.
CREATE FUNCTION ledger._check_label(value text, arg text, required boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL THEN
        IF required THEN
            RAISE EXCEPTION USING ERRCODE = '22004',
                MESSAGE = format('argument %s must not be null', arg);
        END IF;
        RETURN;
    END IF;
    IF value = '' OR char_length(value) > 200 OR NOT ledger._is_visible_text(value) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be 1 to 200 characters without control, format or separator characters', arg),
            DETAIL = jsonb_build_object('argument', arg, 'length', char_length(value))::text;
    END IF;
END
$$;

-- A fencing token: required and positive.
CREATE FUNCTION ledger._check_token(value bigint, arg text DEFAULT 'token')
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = format('argument %s must not be null', arg);
    END IF;
    IF value <= 0 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be positive', arg),
            DETAIL = jsonb_build_object('argument', arg, 'value', value)::text;
    END IF;
END
$$;

-- An optional detail: a JSON object or NULL, at most
-- ledger._max_detail_bytes() as text.
CREATE FUNCTION ledger._check_detail(value jsonb)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NOT NULL AND jsonb_typeof(value) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument detail must be a JSON object',
            DETAIL = jsonb_build_object('argument', 'detail', 'type', jsonb_typeof(value))::text;
    END IF;
    IF octet_length(value::text) > ledger._max_detail_bytes() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument detail must be at most %s bytes as JSON text', ledger._max_detail_bytes()),
            DETAIL = jsonb_build_object('argument', 'detail', 'bytes', octet_length(value::text),
                                        'max', ledger._max_detail_bytes())::text;
    END IF;
END
$$;

-- A duration argument (ttl, older_than): NULL passes (the caller decides
-- whether it is required). A duration is an exact length of time, so:
--   no month part ('1 month', '1 year'): a month has no fixed length, and
--   interval comparison would count it as 30 days, so '1 month' would slip
--   past a '30 days' bound as 31 days of calendar;
--   every other part non-negative, so that adding it to an instant moves
--   forward ('1 day -1 hour' is positive by interval comparison, yet its
--   parts pull apart across a DST change);
--   the whole in (0, upper]: the views add and multiply these values, and a
--   bound keeps every result in timestamptz's range.
-- A day counts as 24 hours: the callers fold it so (ledger._exact) before
-- any arithmetic, which therefore never depends on the session's TimeZone.
CREATE FUNCTION ledger._check_duration(value interval, arg text, upper interval)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL THEN
        RETURN;
    END IF;
    IF date_trunc('month', value) <> interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be an exact duration: no month or year part (give days or hours, '
                             'at most %s)', arg, upper),
            DETAIL = jsonb_build_object('argument', arg, 'value', value::text, 'max', upper::text,
                                        'months', extract(year FROM value) * 12 + extract(month FROM value))::text;
    END IF;
    IF value <= interval '0' OR value > upper
       OR date_trunc('day', value) < interval '0'
       OR value - date_trunc('day', value) < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be positive, with no negative part, and at most %s', arg, upper),
            DETAIL = jsonb_build_object('argument', arg, 'value', value::text, 'max', upper::text)::text;
    END IF;
END
$$;

-- A checked duration as exact time: its day part folded into hours, a day
-- being 24 hours ('1 day 02:00' becomes '26:00:00'). Adding an interval with
-- a day part to a timestamptz follows the session's TimeZone ('1 day' across
-- a DST change is 23 or 25 hours there); adding this one does not. Every
-- ttl and older_than is used, and stored, in this form.
CREATE FUNCTION ledger._exact(value interval)
RETURNS interval
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_days integer := extract(day FROM value)::integer;
BEGIN
    RETURN value - make_interval(days => v_days) + make_interval(hours => 24 * v_days);
END
$$;

-- A ttl, when given: positive, at most ledger._max_ttl().
CREATE FUNCTION ledger._check_ttl(value interval)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_duration(value, 'ttl', ledger._max_ttl());
END
$$;

-- An instant argument (slot, at), when given: inside the ledger's time range.
CREATE FUNCTION ledger._check_instant(value timestamptz, arg text)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value < ledger._min_instant() OR value >= ledger._max_instant() OR NOT isfinite(value) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be a finite timestamp from %s to before %s',
                             arg, ledger._min_instant(), ledger._max_instant()),
            DETAIL = jsonb_build_object('argument', arg, 'value', value::text,
                                        'min', ledger._min_instant(), 'max', ledger._max_instant())::text;
    END IF;
END
$$;

-- A failure's error text, bounded: a longer one is cut and marked, so a
-- runaway stack trace cannot bloat the log (the run still ends).
CREATE FUNCTION ledger._bounded_error(value text)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF char_length(value) <= ledger._max_error_length() THEN
        RETURN value;
    END IF;
    RETURN left(value, ledger._max_error_length())
        || format(' [truncated: %s characters in all]', char_length(value));
END
$$;

-- The ttl to use, exact (ledger._exact): the argument, else the job's
-- registered ttl; 22023 when neither is there or the value is out of bounds.
CREATE FUNCTION ledger._resolve_ttl(job text, ttl interval)
RETURNS interval
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ttl interval := ttl;
BEGIN
    IF v_ttl IS NULL THEN
        SELECT j.ttl INTO v_ttl FROM ledger.jobs j WHERE j.job = _resolve_ttl.job;
        IF v_ttl IS NULL THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument ttl is required: job %s has no registered ttl', job),
                DETAIL = jsonb_build_object('argument', 'ttl', 'job', job)::text;
        END IF;
    END IF;
    PERFORM ledger._check_ttl(v_ttl);
    RETURN ledger._exact(v_ttl);
END
$$;

-- The WAL timeline this server writes on. It grows by one at every standby
-- promotion (and point-in-time recovery), which is what the token jump keys on.
CREATE FUNCTION ledger._timeline()
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
END
$$;

-- The token after `previous` (NULL: the job has none yet), issued on
-- `timeline`. On one timeline tokens count up by one. After a promotion an
-- asynchronous standby may lack the newest tokens of the old primary, so the
-- next token jumps by 2^32 (and never starts below (timeline - 1) * 2^32 + 1):
-- above anything the old primary could have issued on that timeline, as long
-- as a job takes fewer than 2^32 leases per timeline.
CREATE FUNCTION ledger._next_token(previous bigint, previous_timeline integer, timeline integer)
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_floor bigint := ((timeline - 1)::bigint << 32) + 1;
BEGIN
    IF previous IS NULL THEN
        RETURN v_floor;
    ELSIF previous_timeline = timeline THEN
        RETURN previous + 1;
    END IF;
    RETURN greatest(previous + (1::bigint << 32), v_floor);
END
$$;

-- A token must survive a crash whatever the caller does after the call
-- (SET LOCAL synchronous_commit = off right before COMMIT, say). A setting
-- made inside the function would not do: the caller can lower it again
-- before COMMIT reads it. So the lease row carries a deferred constraint
-- trigger (20_tables.sql): it fires inside COMMIT, after the caller's last
-- statement, and raises synchronous_commit to `local` for the commit record
-- of every transaction that issued a token. What stays outside: a caller
-- that runs SET CONSTRAINTS ALL IMMEDIATE (the trigger fires at once) and
-- then lowers the setting (docs/design.md).
CREATE FUNCTION ledger._durable_token()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
    RETURN NULL;
END
$$;

-- How long a caller of acquire, start_run or start_due_run waits for a job's
-- lease row that another transaction holds (a careless client inside BEGIN).
-- Past it, the call answers as if another owner held the lease.
CREATE FUNCTION ledger._lock_wait() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $x$ SELECT '1s'::text $x$;

-- The lease row of a job for a caller that wants to take it: the callers'
-- first statement takes it locked when nobody holds it and no other
-- transaction has it (FOR UPDATE SKIP LOCKED, free, expired, released or
-- already the caller's); their second reads it without a lock, and another
-- owner's live lease there is a skip that locks nothing. This is the rest:
-- the row is missing, or another transaction has it. Answers one of
--   'held'    another owner's live lease, as committed now: the caller
--             skips; it took no row lock (the wait below locks only a row
--             that is still free once its holder let go);
--   'locked'  the row, locked FOR UPDATE, free, expired or the caller's;
--   'created' no row existed: a new one, locked, leased to `owner` with the
--             job's first token;
--   'busy'    another transaction held the row past ledger._lock_wait():
--             `lease` is the last committed row (or NULL), and the caller
--             answers as for 'held'.
-- Every writer takes the lease row first, then run rows, then counters.
CREATE FUNCTION ledger._lock_lease(
    job text, owner text, ttl interval, timeline integer,
    OUT lease ledger.leases, OUT state text)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wait text := current_setting('lock_timeout');
BEGIN
    -- Wait for the other transaction, within the bound. The block is a
    -- subtransaction, paid only here.
    BEGIN
        PERFORM set_config('lock_timeout', ledger._lock_wait(), true);
        FOR attempt IN 1 .. 3 LOOP
            -- Re-checked once the holder let go (READ COMMITTED): a row that
            -- another owner now holds live is not locked, and is a skip.
            SELECT * INTO lease FROM ledger.leases l
             WHERE l.job = _lock_lease.job
               AND (l.released_at IS NOT NULL OR l.expires_at <= clock_timestamp() OR l.owner = _lock_lease.owner)
               FOR UPDATE;
            IF FOUND THEN
                state := 'locked';
                EXIT;
            END IF;
            SELECT * INTO lease FROM ledger.leases l WHERE l.job = _lock_lease.job;
            IF FOUND THEN
                IF lease.released_at IS NULL AND lease.expires_at > clock_timestamp()
                   AND lease.owner <> _lock_lease.owner THEN
                    state := 'held';
                    EXIT;
                END IF;
                CONTINUE;  -- changed in between: look again
            END IF;
            INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, timeline)
            SELECT _lock_lease.job, _lock_lease.owner, ledger._next_token(NULL, NULL, timeline),
                   ttl, now_.at, now_.at + ttl, timeline
              FROM (SELECT clock_timestamp() AS at) now_
            ON CONFLICT ON CONSTRAINT leases_pkey DO NOTHING
            RETURNING * INTO lease;
            IF FOUND THEN
                state := 'created';
                EXIT;
            END IF;
        END LOOP;
        PERFORM set_config('lock_timeout', v_wait, true);
    EXCEPTION WHEN lock_not_available THEN
        -- The subtransaction's rollback restored lock_timeout.
        SELECT * INTO lease FROM ledger.leases l WHERE l.job = _lock_lease.job;
        state := 'busy';
    END;
    IF state IS NULL THEN
        state := 'busy';  -- three races lost in a row: answer as busy
    END IF;
END
$$;

-- Count a skip without a WAL flush and without waiting past `wait` for the
-- job's skip row, which another open transaction may hold (the skip path
-- holds no lease row lock): ledger._lock_wait(), or a few milliseconds when
-- the caller already waited that long for the lease row. The callers try
-- the plain UPDATE of their shard's row first; this is the rest (the row is
-- missing, or locked). A skip count lost that way is harmless; a hang is not.
CREATE FUNCTION ledger._count_skip(job text, wait text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wait text := current_setting('lock_timeout');
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait, true);
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (_count_skip.job, (pg_backend_pid() % 16)::smallint, 1)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + 1;
        PERFORM set_config('lock_timeout', v_wait, true);
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
END
$$;

-- Close a running run as failed because its lease was lost: true when it
-- was running. The caller holds the job's lease row lock and does the
-- counting (ledger._close_lost).
CREATE FUNCTION ledger._close_run(run_id bigint, reason text, at timestamptz)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE ledger.job_execution_log r
       SET status = 'failure',
           failure_reason = reason,
           completed_at = greatest(at, r.started_at),
           error = CASE reason
                       WHEN 'superseded' THEN 'lease superseded by a newer token'
                       ELSE 'lease expired before the run ended'
                   END
     WHERE r.run_id = _close_run.run_id AND r.status = 'running';
    RETURN FOUND;
END
$$;

-- A running run closed as failed because its lease was lost (lease_expired,
-- superseded): the run row, and the job's counters and state. The caller
-- holds the job's lease row lock.
CREATE FUNCTION ledger._close_lost(run ledger.job_execution_log, reason text, at timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_end    timestamptz := greatest(at, run.started_at);
    v_streak bigint;
BEGIN
    IF NOT ledger._close_run(run.run_id, reason, v_end) THEN
        RETURN;
    END IF;
    INSERT INTO ledger.counters AS c (job, failures, leases_lost, consecutive_failures,
                                      last_run_id, last_status, last_started_at, last_completed_at, latest_end)
    VALUES (run.job, 1, 1, 1, run.run_id, 'failure', run.started_at, v_end, v_end)
    ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
        latest_end           = greatest(c.latest_end, v_end),
        failures             = c.failures + 1,
        leases_lost          = c.leases_lost + 1,
        consecutive_failures = c.consecutive_failures
                               + CASE WHEN run.started_at > coalesce(c.last_success_started_at, '-infinity')
                                      THEN 1 ELSE 0 END,
        last_status          = CASE WHEN c.last_run_id = run.run_id THEN 'failure' ELSE c.last_status END,
        last_completed_at    = CASE WHEN c.last_run_id = run.run_id THEN v_end ELSE c.last_completed_at END,
        running_run_id       = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_run_id END,
        running_token        = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_token END,
        running_started_at   = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_started_at END
    RETURNING c.consecutive_failures INTO v_streak;
    PERFORM ledger._auto_pause(run.job, v_streak, v_end);
END
$$;

-- The end of a failure that made `streak` failures in a row pauses the job
-- when its pause_after_failures is at most that (in the transaction of the
-- end); a job paused already stays as it is.
CREATE FUNCTION ledger._auto_pause(job text, streak bigint, at timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE ledger.jobs j SET paused = true, paused_at = at, pause_reason = 'failures', updated_at = at
     WHERE j.job = _auto_pause.job AND NOT j.paused AND j.pause_after_failures <= streak;
END
$$;

-- The jobs' state in ledger.counters recomputed from the log, exactly as
-- the state columns define it: after purge_log removed runs, and after a
-- write to the log that did not come through the ledger's functions (a
-- superuser's UPDATE, a bulk load: see ledger._foreign_log_write). A job
-- with runs but no counters row gets one (zero counters).
--
-- Set-based: the jobs' rows of the log are read once, by one index scan
-- per job, and every column is an aggregate over them (a purge refreshes
-- thousands of jobs per batch, whose rows lie far apart in the table: one
-- read of them each, not one per column). after_purge: the caller removed
-- only ended runs, and never a job's newest success by slot, so done_slot,
-- and the next_due that follows from it, stay as they are where done_slot
-- did not change (no schedule is evaluated); every other column is
-- recomputed. A custom plan for every call: the generic plan PL/pgSQL
-- switches to after five calls does not know how many jobs the array holds,
-- and at thousands it is more than ten times slower.
CREATE FUNCTION ledger._refresh_state(jobs text[], after_purge boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    INSERT INTO ledger.counters (job)
    SELECT DISTINCT r.job FROM ledger.job_execution_log r WHERE r.job = ANY (jobs)
    ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
    WITH r AS MATERIALIZED (
        SELECT l.job, l.run_id, l.status, l.slot, l.token, l.started_at, l.completed_at,
               -- as ledger.overlaps defines an overlap: a run that started
               -- before a run started earlier had ended
               max(coalesce(l.completed_at, 'infinity')) OVER (
                   PARTITION BY l.job ORDER BY l.started_at, l.run_id
                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
          FROM ledger.job_execution_log l WHERE l.job = ANY (jobs)
    ), last_run AS (
        SELECT DISTINCT ON (r.job) r.job, r.run_id, r.status, r.started_at, r.completed_at
          FROM r ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), last_success AS (
        SELECT DISTINCT ON (r.job) r.job, r.started_at, r.completed_at
          FROM r WHERE r.status = 'success' ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), running AS (
        SELECT r.job, r.run_id, r.token, r.started_at FROM r WHERE r.status = 'running'
    ), totals AS (
        SELECT r.job,
               max(r.slot) FILTER (WHERE r.status = 'success') AS done_slot,
               max(r.completed_at - r.started_at) FILTER (WHERE r.status = 'success') AS longest_success,
               max(r.completed_at) AS latest_end
          FROM r GROUP BY r.job
    ), failures AS (
        SELECT r.job, count(*) AS streak
          FROM r LEFT JOIN last_success s ON s.job = r.job
         WHERE r.status = 'failure' AND r.started_at > coalesce(s.started_at, '-infinity')
         GROUP BY r.job
    ), overlap AS (
        SELECT DISTINCT ON (r.job) r.job, r.run_id
          FROM r WHERE r.earlier_end > r.started_at ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), state AS (
        SELECT t.job, lr.run_id AS last_run_id, lr.status AS last_status, lr.started_at AS last_started_at,
               lr.completed_at AS last_completed_at, ls.started_at AS last_success_started_at,
               ls.completed_at AS last_success_at, rn.run_id AS running_run_id, rn.token AS running_token,
               rn.started_at AS running_started_at, tt.done_slot, tt.longest_success,
               coalesce(f.streak, 0) AS consecutive_failures, tt.latest_end, o.run_id AS overlap_run_id
          FROM (SELECT DISTINCT u.job FROM unnest(jobs) AS u(job)) t
          LEFT JOIN last_run lr ON lr.job = t.job
          LEFT JOIN last_success ls ON ls.job = t.job
          LEFT JOIN running rn ON rn.job = t.job
          LEFT JOIN totals tt ON tt.job = t.job
          LEFT JOIN failures f ON f.job = t.job
          LEFT JOIN overlap o ON o.job = t.job
    )
    UPDATE ledger.counters c SET
        last_run_id = st.last_run_id, last_status = st.last_status, last_started_at = st.last_started_at,
        last_completed_at = st.last_completed_at, last_success_started_at = st.last_success_started_at,
        last_success_at = st.last_success_at, running_run_id = st.running_run_id,
        running_token = st.running_token, running_started_at = st.running_started_at,
        done_slot = st.done_slot, longest_success = st.longest_success,
        consecutive_failures = st.consecutive_failures, latest_end = st.latest_end,
        overlap_run_id = st.overlap_run_id,
        next_due = CASE
            WHEN after_purge AND c.done_slot IS NOT DISTINCT FROM st.done_slot THEN c.next_due
            ELSE (SELECT ledger._slot_after(j.schedule_spec, j.time_zone, st.done_slot)
                    FROM ledger.jobs j
                   WHERE j.job = c.job AND j.schedule IS NOT NULL AND st.done_slot IS NOT NULL)
        END
      FROM state st
     WHERE c.job = st.job;
END
$$;

-- A row of the log written by anyone but the ledger's own functions (which
-- run as ledger_owner and keep the state themselves): recompute that job's
-- state, so the views never disagree with the log. The trigger's WHEN keeps
-- it off the functions' path.
CREATE FUNCTION ledger._foreign_log_write()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        PERFORM ledger._refresh_state(ARRAY[OLD.job]::text[]);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM ledger._refresh_state(ARRAY[NEW.job]::text[]);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER job_execution_log_foreign_write
    AFTER INSERT OR UPDATE OR DELETE ON ledger.job_execution_log
    FOR EACH ROW WHEN (current_user <> 'ledger_owner')
    EXECUTE FUNCTION ledger._foreign_log_write();

-- Add to a job's counters (one upsert, whatever moved).
CREATE FUNCTION ledger._count(
    job text,
    runs_started bigint DEFAULT 0,
    successes bigint DEFAULT 0,
    failures bigint DEFAULT 0,
    skipped_overlap bigint DEFAULT 0,
    skipped_backfill bigint DEFAULT 0,
    leases_lost bigint DEFAULT 0)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    INSERT INTO ledger.counters AS c
        (job, runs_started, successes, failures, skipped_overlap, skipped_backfill, leases_lost)
    VALUES (_count.job, _count.runs_started, _count.successes, _count.failures,
            _count.skipped_overlap, _count.skipped_backfill, _count.leases_lost)
    ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
        runs_started     = c.runs_started     + excluded.runs_started,
        successes        = c.successes        + excluded.successes,
        failures         = c.failures         + excluded.failures,
        skipped_overlap  = c.skipped_overlap  + excluded.skipped_overlap,
        skipped_backfill = c.skipped_backfill + excluded.skipped_backfill,
        leases_lost      = c.leases_lost      + excluded.leases_lost;
END
$$;
-- Leases: a per-job, time-limited lock with a fencing token, taken by
-- compare-and-set on the job's row in ledger.leases.

-- Every transaction that issues a token commits durably (see
-- ledger._durable_token): deferred, so it runs inside COMMIT itself.
CREATE CONSTRAINT TRIGGER leases_durable_token
    AFTER INSERT OR UPDATE OF token ON ledger.leases
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION ledger._durable_token();

-- The hot path: each argument checked once, in one expression (the helpers
-- only run to raise the documented error), the lease row read once in the
-- usual cases, no helper call on the way.
CREATE FUNCTION ledger.acquire(job text, owner text, ttl interval DEFAULT NULL)
RETURNS SETOF ledger.lease
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ttl      interval := ttl;
    v_timeline integer;
    v_lease    ledger.leases;
    v_state    text;
    v_took     record;
    v_now      timestamptz;
BEGIN
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
    END IF;
    IF v_ttl IS NULL THEN
        SELECT j.ttl INTO v_ttl FROM ledger.jobs j WHERE j.job = acquire.job;
    END IF;
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;

    -- Free, expired, released or already ours, and nobody else writing it:
    -- locked at once. Another owner's live lease is not locked (the WHERE
    -- fails first), and is read below without a lock.
    SELECT * INTO v_lease FROM ledger.leases l
     WHERE l.job = acquire.job
       AND (l.released_at IS NOT NULL OR l.expires_at <= clock_timestamp() OR l.owner = acquire.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = acquire.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > clock_timestamp()
           AND v_lease.owner <> owner THEN
            RETURN;  -- held: no row, no lock, nothing written
        END IF;
        v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
        v_took := ledger._lock_lease(job, owner, v_ttl, v_timeline);
        v_lease := v_took.lease;
        v_state := v_took.state;
        IF v_state = 'created' THEN
            RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
            RETURN;
        ELSIF v_state <> 'locked' THEN
            RETURN;
        END IF;
    END IF;

    -- Locked, and free, expired or ours: take it with a new token. The
    -- clock is read once the row is locked: a caller that waited for the
    -- previous holder must not date its lease before that holder let go.
    v_now := clock_timestamp();
    v_timeline := coalesce(v_timeline,
        ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer);
    UPDATE ledger.leases l SET
        owner       = acquire.owner,
        -- ledger._next_token, inline
        token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                           ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
        ttl         = v_ttl,
        acquired_at = v_now,
        expires_at  = v_now + v_ttl,
        released_at = NULL,
        timeline    = v_timeline
     WHERE l.job = acquire.job
    RETURNING * INTO v_lease;
    RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
END
$$;
COMMENT ON FUNCTION ledger.acquire(text, text, interval) IS
    'Take the job''s lease with a new fencing token; no row when another owner holds it';

CREATE FUNCTION ledger.renew(job text, owner text, token bigint, ttl interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_expires timestamptz;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_token(token);
    PERFORM ledger._check_ttl(ttl);

    -- Owner and token must both match: a stale holder can never extend the
    -- lease of whoever took over. An expired lease nobody took may be renewed.
    -- The ttl exact (ledger._exact): the expiry is not the session's TimeZone's.
    UPDATE ledger.leases l
       SET expires_at = clock_timestamp() + ledger._exact(coalesce(renew.ttl, l.ttl)),
           ttl        = ledger._exact(coalesce(renew.ttl, l.ttl))
     WHERE l.job = renew.job
       AND l.owner = renew.owner
       AND l.token = renew.token
       AND l.released_at IS NULL
    RETURNING l.expires_at INTO v_expires;
    RETURN v_expires;
END
$$;
COMMENT ON FUNCTION ledger.renew(text, text, bigint, interval) IS
    'Extend the lease (by its own ttl when ttl is NULL); NULL when the lease is lost';

CREATE FUNCTION ledger.release(job text, owner text, token bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_token(token);

    -- The token stays in the row: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at  = least(l.expires_at, v_now),
           released_at = v_now
     WHERE l.job = release.job
       AND l.owner = release.owner
       AND l.token = release.token
       AND l.released_at IS NULL;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION ledger.release(text, text, bigint) IS
    'End the lease now; false when that owner and token do not hold it';

CREATE FUNCTION ledger.is_current(job text, token bigint)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_token(token);
    RETURN EXISTS (
        SELECT FROM ledger.leases l
         WHERE l.job = is_current.job
           AND l.token = is_current.token
           AND l.released_at IS NULL
           AND l.expires_at > clock_timestamp());
END
$$;
COMMENT ON FUNCTION ledger.is_current(text, bigint) IS
    'True when the token is the job''s current token and its lease has not expired';

-- LD001 unless `token` is the job's current token and its lease is live:
-- the body of assert_current, and the first check of both fences.
CREATE FUNCTION ledger._assert_live(job text, token bigint)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease ledger.leases;
BEGIN
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _assert_live.job;
    IF v_lease.token = token AND v_lease.released_at IS NULL AND v_lease.expires_at > clock_timestamp() THEN
        RETURN;
    END IF;
    PERFORM ledger._raise('LD001',
        format('lease superseded: token %s is not the current lease of job %s', token, job),
        jsonb_build_object(
            'job', job,
            'token', token,
            'current_token', v_lease.token,
            'holder', v_lease.owner,
            'expires_at', v_lease.expires_at,
            'released', v_lease.released_at IS NOT NULL));
END
$$;

CREATE FUNCTION ledger.assert_current(job text, token bigint)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_token(token);
    PERFORM ledger._assert_live(job, token);
END
$$;
COMMENT ON FUNCTION ledger.assert_current(text, bigint) IS
    'Raise LD001 unless is_current: the runner''s last check before a side effect';
-- Fences: the resource side of fencing. A fence remembers, per resource, the
-- highest token it accepted and the job it belongs to. Call it in the same
-- transaction as the write it guards, so the fence moves and the write
-- commits together, or neither does.
--
-- Only the job's current live token is accepted, so a token the job was never
-- issued (or a stale one) can never be recorded: nobody can poison a
-- resource by fencing it with a huge number. A resource belongs to the job
-- that first wrote through it; another job's token is refused (LD006),
-- because tokens of two jobs are numbers that mean nothing to each other.

-- The checks both fences share: arguments, the lease (LD001 unless `token`
-- is the job's current live token), the owner job of the resource (LD006),
-- and a newer token that already wrote (LD002). Returns the token the fence
-- had recorded (its row now locked), or NULL when this call created the
-- fence with `token`.
CREATE FUNCTION ledger._checked_fence(job text, resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_fence ledger.fences;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(resource, 'resource');
    PERFORM ledger._check_token(token);
    PERFORM ledger._assert_live(job, token);
    LOOP
        SELECT * INTO v_fence FROM ledger.fences f WHERE f.resource = _checked_fence.resource FOR UPDATE;
        EXIT WHEN FOUND;
        INSERT INTO ledger.fences (resource, job, token, advanced_at)
        VALUES (_checked_fence.resource, _checked_fence.job, _checked_fence.token, clock_timestamp())
        ON CONFLICT ON CONSTRAINT fences_pkey DO NOTHING;
        IF FOUND THEN
            RETURN NULL;  -- the first fenced write: the resource is the job's now
        END IF;
        -- A concurrent first write won: read its row.
    END LOOP;
    IF v_fence.job <> job THEN
        PERFORM ledger._raise('LD006',
            format('fence of another job: resource %s belongs to job %s, not %s', resource, v_fence.job, job),
            jsonb_build_object('resource', resource, 'job', job, 'bound_job', v_fence.job,
                               'token', token));
    END IF;
    IF v_fence.token > token THEN
        -- Current when checked, yet a newer token already wrote: a takeover
        -- committed in between.
        PERFORM ledger._raise('LD002',
            format('stale fence token: resource %s accepted token %s, got %s', resource, v_fence.token, token),
            jsonb_build_object('resource', resource, 'job', job, 'token', token,
                               'highest_token', v_fence.token));
    END IF;
    RETURN v_fence.token;
END
$$;

CREATE FUNCTION ledger.advance_fence(job text, resource text, token bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_recorded bigint := ledger._checked_fence(job, resource, token);
BEGIN
    -- Strict: at most one fenced write per token.
    IF v_recorded IS NULL THEN
        RETURN true;
    ELSIF v_recorded = token THEN
        RETURN false;  -- this token already wrote
    END IF;
    UPDATE ledger.fences f SET token = advance_fence.token, advanced_at = clock_timestamp()
     WHERE f.resource = advance_fence.resource;
    RETURN true;
END
$$;
COMMENT ON FUNCTION ledger.advance_fence(text, text, bigint) IS
    'Strict fence: record the job''s current token if greater than the highest accepted; false when it already wrote';

-- The hot path of the lenient fence: the arguments checked in one
-- expression, and one statement that locks the fence and reads the lease
-- (both by primary key); ledger._checked_fence only for the rest (a first
-- write, an error to raise).
CREATE FUNCTION ledger.fence(job text, resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_recorded bigint;
    v_bound    ledger.label;
    v_live     boolean;
BEGIN
    IF job IS NULL OR resource IS NULL OR token IS NULL OR token <= 0
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(resource) BETWEEN 1 AND 200 AND ledger._is_visible_text(resource)) THEN
        v_recorded := ledger._checked_fence(job, resource, token);  -- raises the documented error
    END IF;
    SELECT f.token, f.job,
           coalesce(l.token = fence.token AND l.released_at IS NULL AND l.expires_at > clock_timestamp(), false)
      INTO v_recorded, v_bound, v_live
      FROM ledger.fences f
      LEFT JOIN ledger.leases l ON l.job = fence.job
     WHERE f.resource = fence.resource
       FOR UPDATE OF f;
    IF NOT FOUND OR NOT v_live THEN
        -- A first write, or LD001: the long way, in the documented order.
        v_recorded := ledger._checked_fence(job, resource, token);
    ELSIF v_bound <> job THEN
        PERFORM ledger._raise('LD006',
            format('fence of another job: resource %s belongs to job %s, not %s', resource, v_bound, job),
            jsonb_build_object('resource', resource, 'job', job, 'bound_job', v_bound, 'token', token));
    ELSIF v_recorded > token THEN
        -- Current when checked, yet a newer token already wrote: a takeover
        -- committed in between.
        PERFORM ledger._raise('LD002',
            format('stale fence token: resource %s accepted token %s, got %s', resource, v_recorded, token),
            jsonb_build_object('resource', resource, 'job', job, 'token', token, 'highest_token', v_recorded));
    END IF;
    -- Lenient: the current holder may write many times with one token.
    IF v_recorded < token THEN
        UPDATE ledger.fences f SET token = fence.token, advanced_at = clock_timestamp()
         WHERE f.resource = fence.resource;
    END IF;
    RETURN token;
END
$$;
COMMENT ON FUNCTION ledger.fence(text, text, bigint) IS
    'Lenient fence: accept the job''s current token if >= the highest accepted and return it; LD002 when lower';
-- Runs: the execution log. Every function that changes a job's runs first
-- locks the job's lease row, so all of them serialize per job in one order
-- (lease row, then run rows, then counters) and cannot deadlock each other.

CREATE FUNCTION ledger.start_run(
    job text,
    owner text,
    ttl interval DEFAULT NULL,
    slot timestamptz DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    detail jsonb DEFAULT NULL)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ttl    interval;
    v_job    ledger.jobs;
    v_result ledger.run_start;
BEGIN
    -- Every argument checked once, in one expression; the helpers run only
    -- to raise the documented error, in the documented order.
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)
               AND (idempotency_key IS NULL
                    OR (char_length(idempotency_key) BETWEEN 1 AND 200
                        AND ledger._is_visible_text(idempotency_key))))
       OR (detail IS NOT NULL
           AND (jsonb_typeof(detail) <> 'object' OR octet_length(detail::text) > ledger._max_detail_bytes()))
       OR slot < ledger._min_instant() OR slot >= ledger._max_instant() OR NOT isfinite(slot) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
        PERFORM ledger._check_label(idempotency_key, 'idempotency_key', false);
        PERFORM ledger._check_detail(detail);
        PERFORM ledger._check_instant(slot, 'slot');
    END IF;
    -- One read of the job's registration serves the ttl default, the slot
    -- check and the pause.
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_run.job;
    v_ttl := coalesce(ttl, v_job.ttl);
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;
    IF slot IS NOT NULL AND v_job.schedule IS NOT NULL THEN
        PERFORM ledger._check_slot(v_job, slot);
    END IF;
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        v_result.slot := slot;
        RETURN v_result;
    END IF;
    RETURN ledger._start(job, owner, v_ttl, slot, idempotency_key, detail);
END
$$;
COMMENT ON FUNCTION ledger.start_run(text, text, interval, timestamptz, text, jsonb) IS
    'Check the previous run, take the lease and log a running run, in one transaction';

-- The one start path of start_run and start_due_run, for checked arguments
-- (`ttl` resolved and exact) of a job that is not paused. In the usual
-- cases it reads the lease row once: locked at once when it is free,
-- expired, released or already the caller's and nobody else writes it;
-- read without a lock when another owner holds it live, and then the skip
-- locks nothing and writes only ledger.skip_counts (UNLOGGED: its commit
-- waits for no WAL flush), issuing no token. Order of locks: the lease row,
-- then run rows, then counters.
CREATE FUNCTION ledger._start(
    job text, owner text, ttl interval, slot timestamptz, idempotency_key text, detail jsonb)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now      timestamptz;
    v_timeline integer;
    v_lease    ledger.leases;
    v_state    text := 'locked';
    v_took     record;
    v_running  ledger.job_execution_log;
    v_result   ledger.run_start;
BEGIN
    v_result.slot := slot;
    SELECT * INTO v_lease FROM ledger.leases l
     WHERE l.job = _start.job
       AND (l.released_at IS NOT NULL OR l.expires_at <= clock_timestamp() OR l.owner = _start.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _start.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > clock_timestamp()
           AND v_lease.owner <> owner THEN
            v_state := 'held';
        ELSE
            v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
            v_took := ledger._lock_lease(job, owner, ttl, v_timeline);
            v_lease := v_took.lease;
            v_state := v_took.state;
        END IF;
    END IF;

    IF v_state IN ('held', 'busy') THEN
        -- That slot or key already succeeded or is running (wins over overlap).
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- Another owner's live lease (or a row another transaction holds
        -- past the lock bound): a normal skip, counted apart from failures,
        -- without a WAL flush.
        UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + 1
          FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                 WHERE t.job = _start.job AND t.shard = pg_backend_pid() % 16
                   FOR UPDATE SKIP LOCKED) free_
         WHERE s.job = free_.job AND s.shard = free_.shard;
        IF NOT FOUND THEN
            PERFORM ledger._count_skip(job, wait => CASE v_state WHEN 'held' THEN ledger._lock_wait() ELSE '10ms' END);
        END IF;
        v_result.outcome := 'skipped_overlap';
        v_result.holder := v_lease.owner;
        v_result.holder_expires_at := v_lease.expires_at;
        RETURN v_result;
    END IF;

    IF v_state = 'locked' THEN
        -- Read the clock once locked: a start that waited for the previous
        -- run to end must not date itself before that end.
        v_now := clock_timestamp();
        -- The previous run, still running while its lease expired, ended
        -- or went to another token? Its runner is gone or a zombie: close
        -- it (counted once, in ledger._close_lost).
        SELECT * INTO v_running FROM ledger.job_execution_log r
         WHERE r.job = _start.job AND r.status = 'running';
        IF FOUND AND (v_lease.token <> v_running.token
                      OR v_lease.released_at IS NOT NULL
                      OR v_lease.expires_at <= v_now) THEN
            PERFORM ledger._close_lost(v_running,
                CASE WHEN v_lease.token <> v_running.token THEN 'superseded' ELSE 'lease_expired' END, v_now);
            v_running := NULL;
        END IF;
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- The same owner still holds it: the new token wins.
        IF v_running.run_id IS NOT NULL THEN
            PERFORM ledger._close_lost(v_running, 'superseded', v_now);
        END IF;
        v_timeline := coalesce(v_timeline,
            ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer);
        UPDATE ledger.leases l SET
            owner       = _start.owner,
            -- ledger._next_token, inline
            token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                               ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
            ttl         = _start.ttl,
            acquired_at = v_now,
            expires_at  = v_now + _start.ttl,
            released_at = NULL,
            timeline    = v_timeline
         WHERE l.job = _start.job
        RETURNING * INTO v_lease;
    END IF;
    -- 'created' (a job with no lease row has no runs: nothing to check) or
    -- taken just now: log the running run, count it, note it as the job's
    -- last and running run.
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail)
    VALUES (v_lease.job, v_lease.owner, v_lease.token, _start.slot, _start.idempotency_key,
            'running', v_lease.acquired_at, v_lease.acquired_at, _start.detail)
    RETURNING run_id INTO v_result.run_id;
    INSERT INTO ledger.counters AS c (job, runs_started, last_run_id, last_status, last_started_at,
                                      running_run_id, running_token, running_started_at)
    VALUES (v_lease.job, 1, v_result.run_id, 'running', v_lease.acquired_at,
            v_result.run_id, v_lease.token, v_lease.acquired_at)
    ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
        runs_started       = c.runs_started + 1,
        last_run_id        = CASE WHEN c.last_run_id IS NULL
                                    OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                  THEN excluded.last_run_id ELSE c.last_run_id END,
        last_status        = CASE WHEN c.last_run_id IS NULL
                                    OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                  THEN 'running' ELSE c.last_status END,
        last_completed_at  = CASE WHEN c.last_run_id IS NULL
                                    OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                  THEN NULL ELSE c.last_completed_at END,
        last_started_at    = CASE WHEN c.last_run_id IS NULL
                                    OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                  THEN excluded.last_started_at ELSE c.last_started_at END,
        running_run_id     = excluded.running_run_id,
        running_token      = excluded.running_token,
        running_started_at = excluded.running_started_at,
        -- started before an earlier run ended: only a clock stepped back can
        -- do that here (the previous run was closed above, at v_now)
        overlap_run_id     = CASE WHEN excluded.last_started_at < c.latest_end THEN excluded.running_run_id
                                  ELSE c.overlap_run_id END;
    v_result.outcome := 'started';
    v_result.token := v_lease.token;
    v_result.expires_at := v_lease.expires_at;
    RETURN v_result;
END
$$;

-- A slot or an idempotency key that succeeded or is running, including
-- those whose runs purge_log removed (it leaves ledger.purged_slots and
-- ledger.purged_keys behind, so a purge never revives them).
CREATE FUNCTION ledger._already_done(job text, slot timestamptz, idempotency_key text)
RETURNS boolean
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (slot IS NOT NULL AND (
               EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = _already_done.job AND r.slot = _already_done.slot
                          AND r.status IN ('running', 'success'))
               OR EXISTS (SELECT FROM ledger.purged_slots p
                           WHERE p.job = _already_done.job AND p.done_through >= _already_done.slot)))
        OR (idempotency_key IS NOT NULL AND (
               EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = _already_done.job
                          AND r.idempotency_key = _already_done.idempotency_key
                          AND r.status IN ('running', 'success'))
               OR EXISTS (SELECT FROM ledger.purged_keys k
                           WHERE k.job = _already_done.job
                             AND k.idempotency_key = _already_done.idempotency_key)));
END
$$;

CREATE FUNCTION ledger.heartbeat(run_id bigint, token bigint, ttl interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run   ledger.job_execution_log;
    v_lease ledger.leases;
    v_now   timestamptz;
BEGIN
    PERFORM ledger._check_ttl(ttl);
    v_run := ledger._lock_run(run_id, token);
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_run.job;

    IF v_run.status <> 'running' THEN
        -- Closed by a takeover, the reaper or an operator's cancel request:
        -- that is a lost lease, not a misuse.
        IF v_run.failure_reason IN ('lease_expired', 'superseded')
           OR (v_run.failure_reason = 'cancelled' AND v_run.cancel_requested_at IS NOT NULL) THEN
            RETURN NULL;
        END IF;
        PERFORM ledger._raise_not_running(v_run);
    END IF;
    IF v_lease.token <> v_run.token OR v_lease.released_at IS NOT NULL THEN
        RETURN NULL;
    END IF;
    -- An operator asked the run to stop (ledger.request_cancel): end it as
    -- cancelled, release the lease, and tell the holder it lost the lease.
    IF v_run.cancel_requested_at IS NOT NULL THEN
        PERFORM ledger._end_run(v_run.run_id, v_run.token, 'failure', 'cancelled',
                                format('cancelled by an operator (ledger.request_cancel at %s)',
                                       v_run.cancel_requested_at), NULL);
        RETURN NULL;
    END IF;

    v_now := clock_timestamp();
    UPDATE ledger.leases l
       SET expires_at = v_now + ledger._exact(coalesce(heartbeat.ttl, l.ttl)),
           ttl        = ledger._exact(coalesce(heartbeat.ttl, l.ttl))
     WHERE l.job = v_run.job
    RETURNING l.expires_at INTO v_lease.expires_at;
    UPDATE ledger.job_execution_log r SET heartbeat_at = v_now WHERE r.run_id = v_run.run_id;
    RETURN v_lease.expires_at;
END
$$;
COMMENT ON FUNCTION ledger.heartbeat(bigint, bigint, interval) IS
    'Renew the run''s lease and stamp heartbeat_at; NULL when the lease is lost';

-- Check run_id and token, find the run, lock its job's lease row (the per-job
-- order every writer follows), then read the run again as it is under that
-- lock. LD004 when unknown, LD001 when `token` is not the run's token.
CREATE FUNCTION ledger._lock_run(run_id bigint, token bigint)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job text;
    v_run ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_token(run_id, 'run_id');
    PERFORM ledger._check_token(token);
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _lock_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    PERFORM FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;
    SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _lock_run.run_id;
    IF v_run.token <> token THEN
        PERFORM ledger._raise('LD001',
            format('lease superseded: run %s holds token %s, not %s', run_id, v_run.token, token),
            jsonb_build_object('run_id', run_id, 'job', v_run.job, 'token', token,
                               'run_token', v_run.token));
    END IF;
    RETURN v_run;
END
$$;

CREATE FUNCTION ledger._raise_not_running(run ledger.job_execution_log)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._raise('LD003',
        format('run not running: run %s of job %s already ended as %s', run.run_id, run.job, run.status),
        jsonb_build_object('run_id', run.run_id, 'job', run.job, 'status', run.status,
                           'failure_reason', run.failure_reason, 'completed_at', run.completed_at));
END
$$;

-- End a run and release its lease in one transaction: the body of
-- complete_run, fail_run and cancel_run. The usual case (the run's own live
-- token, no detail) is one locked read of the lease row and three writes:
-- the run, the lease, and the job's counters and state (with the job's
-- pending skips folded in); anything else goes the long way, which raises
-- the documented error in the documented order.
CREATE FUNCTION ledger._end_run(
    run_id bigint, token bigint, status text, failure_reason text, error text, detail jsonb)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job    ledger.label;
    v_run    ledger.job_execution_log;
    v_lease  ledger.leases;
    v_detail jsonb;
    v_streak bigint;
    v_error  text := CASE WHEN error IS NULL OR char_length(error) <= ledger._max_error_length() THEN error
                          ELSE ledger._bounded_error(error) END;
BEGIN
    IF detail IS NOT NULL THEN
        PERFORM ledger._check_detail(detail);
    END IF;
    IF run_id IS NULL OR token IS NULL OR run_id <= 0 OR token <= 0 THEN
        PERFORM ledger._check_token(run_id, 'run_id');
        PERFORM ledger._check_token(token);
    END IF;
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    -- The per-job order every writer follows: the lease row first.
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;

    IF detail IS NULL THEN
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(clock_timestamp(), r.started_at)
         WHERE r.run_id = _end_run.run_id AND r.token = _end_run.token
           AND r.token = v_lease.token AND r.status = 'running'
        RETURNING * INTO v_run;
    END IF;
    IF v_run.run_id IS NULL THEN
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
        IF v_run.token <> token THEN
            PERFORM ledger._raise('LD001',
                format('lease superseded: run %s holds token %s, not %s', run_id, v_run.token, token),
                jsonb_build_object('run_id', run_id, 'job', v_run.job, 'token', token,
                                   'run_token', v_run.token));
        END IF;
        -- A newer token took the job over: the zombie learns it lost, and the
        -- row keeps the takeover's verdict.
        IF v_lease.token <> v_run.token THEN
            PERFORM ledger._raise('LD001',
                format('lease superseded: job %s is now held with token %s, run %s had token %s',
                       v_run.job, v_lease.token, v_run.run_id, v_run.token),
                jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                   'current_token', v_lease.token, 'holder', v_lease.owner,
                                   'verdict', v_run.failure_reason));
        END IF;
        IF v_run.status <> 'running' THEN
            PERFORM ledger._raise_not_running(v_run);
        END IF;
        -- The detail recorded is the start's merged with this one (its keys
        -- win), and the merge is held to the same bound as either part: two
        -- details of 40 kB each would otherwise record 80 kB.
        IF detail IS NOT NULL THEN
            v_detail := coalesce(v_run.detail, '{}'::jsonb) || detail;
            IF octet_length(v_detail::text) > ledger._max_detail_bytes() THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('argument detail, merged with the detail run %s started with, must be at most '
                                     '%s bytes as JSON text', v_run.run_id, ledger._max_detail_bytes()),
                    DETAIL = jsonb_build_object('argument', 'detail', 'run_id', v_run.run_id,
                                                'bytes', octet_length(v_detail::text),
                                                'given_bytes', octet_length(detail::text),
                                                'recorded_bytes', octet_length(v_run.detail::text),
                                                'max', ledger._max_detail_bytes())::text;
            END IF;
        END IF;
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(clock_timestamp(), r.started_at),
            detail         = coalesce(v_detail, r.detail)
         WHERE r.run_id = v_run.run_id
        RETURNING * INTO v_run;
    END IF;

    -- The token stays: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at = least(l.expires_at, v_run.completed_at), released_at = v_run.completed_at
     WHERE l.job = v_run.job AND l.released_at IS NULL;
    -- Count once, note the job's state, and fold in the skips counted since
    -- (those whose rows no skipper holds right now; the rest wait for the
    -- next end).
    WITH folded AS (
        UPDATE ledger.skip_counts s SET skipped_overlap = 0
          FROM (SELECT t.job, t.shard, t.skipped_overlap FROM ledger.skip_counts t
                 WHERE t.job = v_run.job AND t.skipped_overlap > 0
                   FOR UPDATE SKIP LOCKED) pending
         WHERE s.job = pending.job AND s.shard = pending.shard
        RETURNING pending.skipped_overlap
    )
    UPDATE ledger.counters c SET
        successes               = c.successes + CASE WHEN v_run.status = 'success' THEN 1 ELSE 0 END,
        failures                = c.failures + CASE WHEN v_run.status = 'success' THEN 0 ELSE 1 END,
        skipped_overlap         = c.skipped_overlap + coalesce((SELECT sum(f.skipped_overlap) FROM folded f), 0),
        last_status             = CASE WHEN c.last_run_id = v_run.run_id THEN v_run.status ELSE c.last_status END,
        last_completed_at       = CASE WHEN c.last_run_id = v_run.run_id THEN v_run.completed_at
                                       ELSE c.last_completed_at END,
        running_run_id          = CASE WHEN c.running_run_id = v_run.run_id THEN NULL ELSE c.running_run_id END,
        running_token           = CASE WHEN c.running_run_id = v_run.run_id THEN NULL ELSE c.running_token END,
        running_started_at      = CASE WHEN c.running_run_id = v_run.run_id THEN NULL ELSE c.running_started_at END,
        last_success_started_at = CASE WHEN v_run.status = 'success'
                                        AND v_run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                       THEN v_run.started_at ELSE c.last_success_started_at END,
        last_success_at         = CASE WHEN v_run.status = 'success'
                                        AND v_run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                       THEN v_run.completed_at ELSE c.last_success_at END,
        done_slot               = CASE WHEN v_run.status = 'success' AND v_run.slot IS NOT NULL
                                       THEN greatest(c.done_slot, v_run.slot) ELSE c.done_slot END,
        -- a success that moves done_slot on: one schedule evaluation here
        -- saves one per read of job_status and job_health
        next_due                = CASE WHEN v_run.status = 'success' AND v_run.slot IS NOT NULL
                                        AND v_run.slot > coalesce(c.done_slot, '-infinity')
                                       THEN (SELECT ledger._slot_after(j.schedule_spec, j.time_zone, v_run.slot)
                                               FROM ledger.jobs j
                                              WHERE j.job = v_run.job AND j.schedule IS NOT NULL)
                                       ELSE c.next_due END,
        longest_success         = CASE WHEN v_run.status = 'success'
                                       THEN greatest(c.longest_success, v_run.completed_at - v_run.started_at)
                                       ELSE c.longest_success END,
        latest_end              = greatest(c.latest_end, v_run.completed_at),
        -- failures that started after the last success: none after this one
        consecutive_failures    = CASE
                                      WHEN v_run.status <> 'success'
                                      THEN c.consecutive_failures
                                           + CASE WHEN v_run.started_at > coalesce(c.last_success_started_at, '-infinity')
                                                  THEN 1 ELSE 0 END
                                      WHEN v_run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                      THEN 0
                                      ELSE c.consecutive_failures END
     WHERE c.job = v_run.job
    RETURNING c.consecutive_failures INTO v_streak;
    IF NOT FOUND THEN
        -- A run written past the functions, with no counters row yet.
        PERFORM ledger._count(v_run.job, successes => CASE WHEN v_run.status = 'success' THEN 1 ELSE 0 END,
                              failures => CASE WHEN v_run.status = 'success' THEN 0 ELSE 1 END);
        PERFORM ledger._refresh_state(ARRAY[v_run.job]);
        SELECT c.consecutive_failures INTO v_streak FROM ledger.counters c WHERE c.job = v_run.job;
    END IF;
    -- A failure may pause the job (pause_after_failures): one more statement
    -- on the failure path only, none on a success.
    IF v_run.status = 'failure' THEN
        PERFORM ledger._auto_pause(v_run.job, v_streak, v_run.completed_at);
    END IF;
    RETURN v_run;
END
$$;

CREATE FUNCTION ledger.complete_run(run_id bigint, token bigint, detail jsonb DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._end_run(run_id, token, 'success', NULL, NULL, detail);
END
$$;
COMMENT ON FUNCTION ledger.complete_run(bigint, bigint, jsonb) IS
    'End the run as success and release its lease';

CREATE FUNCTION ledger.fail_run(run_id bigint, token bigint, error text, detail jsonb DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF error IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument error must not be null';
    END IF;
    RETURN ledger._end_run(run_id, token, 'failure', 'error', error, detail);
END
$$;
COMMENT ON FUNCTION ledger.fail_run(bigint, bigint, text, jsonb) IS
    'End the run as failure (reason error) and release its lease';

CREATE FUNCTION ledger.cancel_run(run_id bigint, token bigint, error text DEFAULT NULL)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._end_run(run_id, token, 'failure', 'cancelled', error, NULL);
END
$$;
COMMENT ON FUNCTION ledger.cancel_run(bigint, bigint, text) IS
    'End the run as failure (reason cancelled: the runner was told to stop) and release its lease';

CREATE FUNCTION ledger.reap_expired(job text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now    timestamptz := clock_timestamp();
    v_closed bigint;
    v_jobs   text[];
BEGIN
    PERFORM ledger._check_label(job, 'job', false);
    -- SKIP LOCKED: a job whose lease row is locked is being started, renewed
    -- or ended right now, and that writer settles it; concurrent reapers
    -- split the work instead of waiting on each other. FOR UPDATE returns the
    -- row as locked, so the expiry tested below is current, not a snapshot.
    WITH lost AS (
        SELECT l.job, l.token, l.expires_at, l.released_at
          FROM ledger.leases l
         WHERE (reap_expired.job IS NULL OR l.job = reap_expired.job)
           AND EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = l.job AND r.status = 'running')
           FOR UPDATE OF l SKIP LOCKED
    ), closed AS (
        UPDATE ledger.job_execution_log r SET
            status         = 'failure',
            failure_reason = CASE WHEN lost.token <> r.token THEN 'superseded' ELSE 'lease_expired' END,
            completed_at   = greatest(v_now, r.started_at),
            error          = CASE WHEN lost.token <> r.token THEN 'lease superseded by a newer token'
                                  ELSE 'lease expired before the run ended' END
          FROM lost
         WHERE r.job = lost.job AND r.status = 'running'
           AND (lost.token <> r.token OR lost.released_at IS NOT NULL OR lost.expires_at <= v_now)
        RETURNING r.job, r.token, r.failure_reason, r.run_id, r.started_at, r.completed_at
    ), released AS (
        -- A reaped lease is over: its late holder may not renew it.
        UPDATE ledger.leases l SET released_at = v_now, expires_at = least(l.expires_at, v_now)
          FROM closed
         WHERE l.job = closed.job AND l.token = closed.token AND l.released_at IS NULL
    ), counted AS (
        -- One closed run per job at most (one running run per job): count
        -- it and note it in the job's state, as ledger._close_lost does.
        INSERT INTO ledger.counters AS c (job, failures, leases_lost, consecutive_failures,
                                          last_run_id, last_status, last_started_at, last_completed_at, latest_end)
        SELECT closed.job, 1, 1, 1, closed.run_id, 'failure', closed.started_at, closed.completed_at,
               closed.completed_at FROM closed
        ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
            latest_end           = greatest(c.latest_end, excluded.latest_end),
            failures             = c.failures + 1,
            leases_lost          = c.leases_lost + 1,
            consecutive_failures = c.consecutive_failures
                                   + CASE WHEN excluded.last_started_at > coalesce(c.last_success_started_at, '-infinity')
                                          THEN 1 ELSE 0 END,
            last_status          = CASE WHEN c.last_run_id = excluded.last_run_id THEN 'failure' ELSE c.last_status END,
            last_completed_at    = CASE WHEN c.last_run_id = excluded.last_run_id THEN excluded.last_completed_at
                                        ELSE c.last_completed_at END,
            running_run_id       = CASE WHEN c.running_run_id = excluded.last_run_id THEN NULL ELSE c.running_run_id END,
            running_token        = CASE WHEN c.running_run_id = excluded.last_run_id THEN NULL ELSE c.running_token END,
            running_started_at   = CASE WHEN c.running_run_id = excluded.last_run_id THEN NULL
                                        ELSE c.running_started_at END
    )
    SELECT count(*), array_agg(closed.job::text) INTO v_closed, v_jobs FROM closed;
    IF v_jobs IS NOT NULL THEN
        -- The failures just counted may pause their jobs (pause_after_failures).
        UPDATE ledger.jobs j SET paused = true, paused_at = v_now, pause_reason = 'failures', updated_at = v_now
          FROM ledger.counters c
         WHERE c.job = j.job AND j.job = ANY (v_jobs) AND NOT j.paused
           AND c.consecutive_failures >= j.pause_after_failures;
    END IF;
    RETURN v_closed::integer;
END
$$;
COMMENT ON FUNCTION ledger.reap_expired(text) IS
    'Close every running run whose lease expired as failure (lease_expired); safe to call concurrently';
-- Schedules and bounded catch-up. The slot arithmetic (cron, intervals,
-- daylight saving) is in 15_schedule_eval.sql; this file decides which slots
-- are due and records what the catch-up bound drops.

-- The registered job, or LD005.
CREATE FUNCTION ledger._registered_job(job text)
RETURNS ledger.jobs
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs;
BEGIN
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = _registered_job.job;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
            jsonb_build_object('job', job));
    END IF;
    RETURN v_job;
END
$$;

-- The registered job with a schedule, or LD005 / 22023.
CREATE FUNCTION ledger._scheduled_job(job text)
RETURNS ledger.jobs
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs := ledger._registered_job(job);
BEGIN
    IF v_job.schedule IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument job names %s, which has no schedule', job),
            DETAIL = jsonb_build_object('argument', 'job', 'job', job)::text;
    END IF;
    RETURN v_job;
END
$$;

-- An explicit slot for a scheduled job must be one of its schedule's slots
-- and not in the future: a run for '200000-01-01' would otherwise succeed,
-- leave nothing due for ever, and silence the job without an alert.
CREATE FUNCTION ledger._check_slot(job ledger.jobs, slot timestamptz)
RETURNS void
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF slot > clock_timestamp() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument slot %s is in the future: job %s runs a slot once it is due', slot, job.job),
            DETAIL = jsonb_build_object('argument', 'slot', 'job', job.job, 'value', slot)::text;
    END IF;
    IF ledger._slot_at_or_before(job.schedule_spec, job.time_zone, slot) IS DISTINCT FROM slot THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument slot %s is not a slot of job %s (schedule %s in %s)',
                             slot, job.job, job.schedule, job.time_zone),
            DETAIL = jsonb_build_object('argument', 'slot', 'job', job.job, 'value', slot,
                                        'schedule', job.schedule, 'time_zone', job.time_zone,
                                        'previous_slot', ledger._slot_at_or_before(job.schedule_spec, job.time_zone, slot))::text;
    END IF;
END
$$;

-- The newest slot that succeeded or is running: where catch-up starts. A
-- run still marked running whose lease expired (its runner crashed) does not
-- count: its slot stays due, and start_run closes it before retrying.
-- Served by the unique partial indexes on (job, slot) and on running runs.
CREATE FUNCTION ledger._newest_done_slot(job text, except_run_id bigint DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_succeeded timestamptz;
    v_running   timestamptz;
BEGIN
    SELECT r.slot INTO v_succeeded FROM ledger.job_execution_log r
     WHERE r.job = _newest_done_slot.job
       AND r.status = 'success'
       AND r.slot IS NOT NULL
       AND r.run_id IS DISTINCT FROM except_run_id
     ORDER BY r.slot DESC
     LIMIT 1;
    SELECT r.slot INTO v_running FROM ledger.job_execution_log r
      JOIN ledger.leases l ON l.job = r.job AND l.token = r.token
     WHERE r.job = _newest_done_slot.job
       AND r.status = 'running'
       AND r.run_id IS DISTINCT FROM except_run_id
       AND l.released_at IS NULL
       AND l.expires_at > clock_timestamp();
    RETURN greatest(v_succeeded, v_running);
END
$$;

-- The due slots, oldest first: of the slots after `done` up to `at`, the
-- newest max_backfill; only the latest one when the job never ran. Walks
-- back at most max_backfill slots, whatever the length of the downtime.
CREATE FUNCTION ledger._due(job ledger.jobs, at timestamptz, done timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slot  timestamptz := ledger._slot_at_or_before(job.schedule_spec, job.time_zone, at);
    v_slots timestamptz[] := ARRAY[]::timestamptz[];
BEGIN
    IF v_slot IS NULL THEN
        RETURN v_slots;
    ELSIF done IS NULL THEN
        RETURN ARRAY[v_slot];
    END IF;
    FOR i IN 1 .. job.max_backfill LOOP
        EXIT WHEN v_slot IS NULL OR v_slot <= done;
        v_slots := v_slot || v_slots;
        v_slot := ledger._slot_at_or_before(job.schedule_spec, job.time_zone, v_slot - interval '1 microsecond');
    END LOOP;
    RETURN v_slots;
END
$$;

-- A health bound argument (late_after, down_after, min_runtime,
-- max_runtime) when given: 0 (clear it), or an exact positive duration of
-- at most 365 days.
CREATE FUNCTION ledger._check_health_bound(value interval, arg text)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR (date_trunc('month', value) = interval '0' AND extract(day FROM value) = 0
                         AND value - date_trunc('day', value) = interval '0') THEN
        RETURN;
    END IF;
    IF date_trunc('month', value) <> interval '0' OR value <= interval '0' OR value > ledger._max_health_bound()
       OR date_trunc('day', value) < interval '0' OR value - date_trunc('day', value) < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be 0 (none) or an exact duration with no month part and no '
                             'negative part, at most %s', arg, ledger._max_health_bound()),
            DETAIL = jsonb_build_object('argument', arg, 'value', value::text,
                                        'max', ledger._max_health_bound()::text)::text;
    END IF;
END
$$;

-- Register a job, or change the options given of one registered before:
-- an argument left NULL keeps what the job has (on a first registration:
-- no schedule, no ttl, max_backfill 1, UTC, no health bounds). A bound of
-- 0 clears it. Re-registering resets nothing else: not the pause, not the
-- history, not the counters.
CREATE FUNCTION ledger.register_job(
    job text,
    schedule text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    max_backfill integer DEFAULT NULL,
    time_zone text DEFAULT NULL,
    late_after interval DEFAULT NULL,
    down_after interval DEFAULT NULL,
    min_runtime interval DEFAULT NULL,
    max_runtime interval DEFAULT NULL,
    pause_after_failures integer DEFAULT NULL)
RETURNS ledger.jobs
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_spec  ledger.schedule_spec;
    v_old   ledger.jobs;
    v_job   ledger.jobs;
    v_ahead timestamptz;  -- the newest slot done
    v_new   boolean;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF max_backfill < 1 OR max_backfill > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_backfill must be from 1 to %s', ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'max_backfill', 'value', max_backfill,
                                        'max', ledger._max_backfill())::text;
    END IF;
    PERFORM ledger._check_ttl(ttl);
    IF time_zone IS NOT NULL THEN
        PERFORM ledger._check_time_zone(time_zone);
    END IF;
    PERFORM ledger._check_health_bound(late_after, 'late_after');
    PERFORM ledger._check_health_bound(down_after, 'down_after');
    PERFORM ledger._check_health_bound(min_runtime, 'min_runtime');
    PERFORM ledger._check_health_bound(max_runtime, 'max_runtime');
    IF pause_after_failures < 0 OR pause_after_failures > ledger._max_pause_after_failures() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument pause_after_failures must be from 0 (never) to %s',
                             ledger._max_pause_after_failures()),
            DETAIL = jsonb_build_object('argument', 'pause_after_failures', 'value', pause_after_failures,
                                        'max', ledger._max_pause_after_failures())::text;
    END IF;

    -- The registration as it is, locked (a first one: created, then locked).
    SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = register_job.job FOR UPDATE;
    v_new := NOT FOUND;
    IF v_new THEN
        INSERT INTO ledger.jobs AS j (job) VALUES (register_job.job)
        ON CONFLICT ON CONSTRAINT jobs_pkey DO NOTHING;
        SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = register_job.job FOR UPDATE;
    END IF;
    v_job := v_old;
    v_job.schedule := coalesce(register_job.schedule, v_old.schedule);
    v_job.time_zone := coalesce(register_job.time_zone, v_old.time_zone);
    v_job.ttl := coalesce(ledger._exact(register_job.ttl), v_old.ttl);
    v_job.max_backfill := coalesce(register_job.max_backfill, v_old.max_backfill);
    v_job.late_after := CASE WHEN register_job.late_after IS NULL THEN v_old.late_after
                             ELSE nullif(ledger._exact(register_job.late_after), interval '0') END;
    v_job.down_after := CASE WHEN register_job.down_after IS NULL THEN v_old.down_after
                             ELSE nullif(ledger._exact(register_job.down_after), interval '0') END;
    v_job.min_runtime := CASE WHEN register_job.min_runtime IS NULL THEN v_old.min_runtime
                              ELSE nullif(ledger._exact(register_job.min_runtime), interval '0') END;
    v_job.max_runtime := CASE WHEN register_job.max_runtime IS NULL THEN v_old.max_runtime
                              ELSE nullif(ledger._exact(register_job.max_runtime), interval '0') END;
    v_job.pause_after_failures := CASE WHEN register_job.pause_after_failures IS NULL THEN v_old.pause_after_failures
                                       ELSE nullif(register_job.pause_after_failures, 0) END;
    IF v_job.schedule IS NOT NULL THEN
        -- parsed once, here: the spec depends on the schedule and the zone
        v_spec := ledger._parse_schedule(v_job.schedule, v_job.time_zone);
    END IF;
    IF register_job.schedule IS NOT NULL THEN
        -- An unscheduled job takes any slot, also one years ahead. Catch-up
        -- starts after the newest slot done (ledger._newest_done_slot, and
        -- ledger.purged_slots answers already_done up to its mark), so a
        -- schedule given now would have nothing due until that slot passed:
        -- the job would fall silent without an alert. Refuse it instead.
        v_ahead := greatest(
            (SELECT max(r.slot) FROM ledger.job_execution_log r
              WHERE r.job = register_job.job AND r.status IN ('running', 'success')),
            (SELECT p.done_through FROM ledger.purged_slots p WHERE p.job = register_job.job));
        IF v_ahead > clock_timestamp() THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument schedule cannot be given to job %s: its slot %s succeeded or is running, '
                                 'and is in the future, so no slot would be due before it; register the schedule '
                                 'once that slot has passed, or under another job name', job, v_ahead),
                DETAIL = jsonb_build_object('argument', 'schedule', 'job', job, 'value', schedule,
                                            'slot', v_ahead, 'now', clock_timestamp())::text;
        END IF;
    END IF;

    UPDATE ledger.jobs j SET
        schedule             = v_job.schedule,
        time_zone            = v_job.time_zone,
        ttl                  = v_job.ttl,
        max_backfill         = v_job.max_backfill,
        schedule_spec        = v_spec,
        late_after           = v_job.late_after,
        down_after           = v_job.down_after,
        min_runtime          = v_job.min_runtime,
        max_runtime          = v_job.max_runtime,
        pause_after_failures = v_job.pause_after_failures,
        updated_at           = CASE WHEN v_new THEN j.updated_at ELSE clock_timestamp() END
     WHERE j.job = register_job.job
    RETURNING * INTO v_job;
    -- The job's first slot after its newest done one, by the schedule as it
    -- is now (a composite IS NOT NULL asks for every field: test schedule).
    UPDATE ledger.counters c
       SET next_due = CASE WHEN v_job.schedule IS NOT NULL AND c.done_slot IS NOT NULL
                           THEN ledger._slot_after(v_spec, v_job.time_zone, c.done_slot) END
     WHERE c.job = register_job.job;
    RETURN v_job;
END
$$;
COMMENT ON FUNCTION ledger.register_job(text, text, interval, integer, text, interval, interval, interval,
                                        interval, integer) IS
    'Register a job or change the options given: schedule, default ttl, catch-up bound, time zone, health bounds';

-- Set a registered job's pause flag: true when that changed it (LD005 when
-- the job was never registered). The body of pause_job and resume_job.
CREATE FUNCTION ledger._set_paused(job text, paused boolean)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._registered_job(job);
    UPDATE ledger.jobs j SET paused       = _set_paused.paused,
                             paused_at    = CASE WHEN _set_paused.paused THEN clock_timestamp() END,
                             pause_reason = CASE WHEN _set_paused.paused THEN 'operator' END,
                             updated_at   = clock_timestamp()
     WHERE j.job = _set_paused.job AND j.paused <> _set_paused.paused;
    RETURN FOUND;
END
$$;

CREATE FUNCTION ledger.pause_job(job text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._set_paused(job, true);
END
$$;
COMMENT ON FUNCTION ledger.pause_job(text) IS 'Pause a job: its runs return paused; true when it was running free';

CREATE FUNCTION ledger.resume_job(job text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._set_paused(job, false);
END
$$;
COMMENT ON FUNCTION ledger.resume_job(text) IS 'Resume a paused job; true when it was paused';

CREATE FUNCTION ledger.due_slots(job text, at timestamptz DEFAULT NULL)
RETURNS SETOF timestamptz
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_instant(at, 'at');
    v_job := ledger._scheduled_job(job);
    IF v_job.paused THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT unnest(ledger._due(v_job, coalesce(at, clock_timestamp()),
                                          ledger._newest_done_slot(job)));
END
$$;
COMMENT ON FUNCTION ledger.due_slots(text, timestamptz) IS
    'The slots a runner should execute at `at` (default now), oldest first; no side effects';

CREATE FUNCTION ledger.start_due_run(job text, owner text, ttl interval DEFAULT NULL)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job    ledger.jobs;
    v_ttl    interval;
    v_due    timestamptz[];
    v_result ledger.run_start;
    v_lower  timestamptz;
    v_last   timestamptz;
    v_count  bigint;
BEGIN
    -- Checked once, read once: the start path (ledger._start) is shared with
    -- start_run, and a due slot is a slot of the schedule by construction.
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
    END IF;
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_due_run.job;
    IF v_job.schedule IS NULL THEN
        v_job := ledger._scheduled_job(job);  -- raises LD005 or 22023
    END IF;
    v_ttl := coalesce(ttl, v_job.ttl);
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    v_due := ledger._due(v_job, clock_timestamp(), ledger._newest_done_slot(job));
    IF cardinality(v_due) = 0 THEN
        v_result.outcome := 'nothing_due';
        RETURN v_result;
    END IF;
    v_result := ledger._start(job, owner, v_ttl, v_due[1], NULL, NULL);
    IF v_result.outcome <> 'started' THEN
        RETURN v_result;
    END IF;

    -- Started: this transaction holds the job's lease row, so the slots the
    -- bound drops are accounted once, by the winner, from a stable view.
    -- They lie after the newest done slot (or the last recorded drop) and
    -- before the slot just started.
    v_lower := ledger._newest_done_slot(job, except_run_id => v_result.run_id);
    IF v_lower IS NULL THEN
        RETURN v_result;  -- never ran before: nothing was missed
    END IF;
    v_lower := greatest(v_lower, (SELECT max(s.last_slot) FROM ledger.skipped_slots s
                                   WHERE s.job = start_due_run.job));
    v_last := ledger._slot_at_or_before(v_job.schedule_spec, v_job.time_zone,
                                        v_result.slot - interval '1 microsecond');
    IF v_last IS NOT NULL AND v_last > v_lower THEN
        v_count := ledger._slot_count(v_job.schedule_spec, v_job.time_zone, v_lower, v_last);
        INSERT INTO ledger.skipped_slots (job, first_slot, last_slot, slot_count, reason)
        VALUES (job, ledger._slot_after(v_job.schedule_spec, v_job.time_zone, v_lower), v_last,
                v_count, 'backfill_limit');
        UPDATE ledger.counters c SET skipped_backfill = c.skipped_backfill + v_count
         WHERE c.job = start_due_run.job;
    END IF;
    RETURN v_result;
END
$$;
COMMENT ON FUNCTION ledger.start_due_run(text, text, interval) IS
    'Start a run for the oldest due slot, recording the slots the catch-up bound drops; nothing_due when none';

-- One batch of a purge: the ended runs older than cutoff among the run ids
-- from from_run_id to from_run_id + 9,999, in one DELETE, so that no
-- statement holds more than a batch of row locks or scans more than a batch
-- of rows; and the state of the jobs the batch touched, recomputed from
-- what is left (ledger._refresh_state). next_run_id: the first run id of
-- the next batch (gaps in the ids skipped), NULL after the last.
CREATE FUNCTION ledger._purge_batch(cutoff timestamptz, from_run_id bigint,
                                    OUT deleted bigint, OUT next_run_id bigint)
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_jobs text[];
    batch  constant integer := 10000;  -- run ids per DELETE
BEGIN
    -- Keep each job's newest success, by slot (catch-up starts from it)
    -- and by time (job_status shows it): for the jobs of this range only.
    WITH candidates AS (
        SELECT r.run_id, r.job FROM ledger.job_execution_log r
         WHERE r.run_id >= from_run_id AND r.run_id < from_run_id + batch
           AND r.status <> 'running' AND r.completed_at < cutoff
    ), keep AS (
        SELECT newest.run_id
          FROM (SELECT DISTINCT candidates.job FROM candidates) jobs_,
               LATERAL (
                   (SELECT r.run_id FROM ledger.job_execution_log r
                     WHERE r.job = jobs_.job AND r.status = 'success' AND r.slot IS NOT NULL
                     ORDER BY r.slot DESC LIMIT 1)
                   UNION ALL
                   (SELECT r.run_id FROM ledger.job_execution_log r
                     WHERE r.job = jobs_.job AND r.status = 'success'
                     ORDER BY r.completed_at DESC LIMIT 1)) newest
    ), doomed AS (
        -- An anti-join of the batch, so the DELETE finds its rows by
        -- primary key: a NOT IN on the DELETE itself made it a scan of
        -- the whole log for every batch.
        SELECT candidates.run_id FROM candidates
         WHERE NOT EXISTS (SELECT FROM keep WHERE keep.run_id = candidates.run_id)
    ), purged AS (
        DELETE FROM ledger.job_execution_log r
         USING doomed
         WHERE r.run_id = doomed.run_id
        RETURNING r.run_id, r.job, r.slot, r.idempotency_key, r.status, r.started_at, r.completed_at
    ), slots_done AS (
        -- What a purge must not forget: the slots and keys that succeeded.
        INSERT INTO ledger.purged_slots AS p (job, done_through)
        SELECT purged.job, max(purged.slot) FROM purged
         WHERE purged.status = 'success' AND purged.slot IS NOT NULL
         GROUP BY purged.job
        ON CONFLICT ON CONSTRAINT purged_slots_pkey DO UPDATE SET
            done_through = greatest(p.done_through, excluded.done_through)
    ), keys_done AS (
        INSERT INTO ledger.purged_keys (job, idempotency_key, run_id, completed_at)
        SELECT purged.job, purged.idempotency_key, purged.run_id, purged.completed_at FROM purged
         WHERE purged.status = 'success' AND purged.idempotency_key IS NOT NULL
        ON CONFLICT ON CONSTRAINT purged_keys_pkey DO NOTHING
    )
    -- The jobs whose state the removed rows were part of: their last
    -- run, their longest success, a failure since their last success
    -- (the newest successes stay, and so do running runs), their latest
    -- end, or their overlap.
    SELECT count(*),
           array_agg(DISTINCT purged.job::text)
               FILTER (WHERE c.job IS NULL OR purged.run_id = c.last_run_id
                          OR (purged.status = 'success'
                              AND (purged.completed_at - purged.started_at >= c.longest_success
                                   OR purged.started_at >= c.last_success_started_at))
                          OR (purged.status = 'failure'
                              AND purged.started_at > coalesce(c.last_success_started_at, '-infinity'))
                          OR purged.completed_at >= c.latest_end
                          OR purged.run_id = c.overlap_run_id)
      INTO deleted, v_jobs
      FROM purged LEFT JOIN ledger.counters c ON c.job = purged.job;
    IF v_jobs IS NOT NULL THEN
        PERFORM ledger._refresh_state(v_jobs, after_purge => true);
    END IF;
    SELECT min(r.run_id) INTO next_run_id FROM ledger.job_execution_log r
     WHERE r.run_id >= from_run_id + batch;
END
$$;

-- Old drop records too, except each job's newest (catch-up starts after it).
CREATE FUNCTION ledger._purge_skipped(cutoff timestamptz)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM ledger.skipped_slots s
     WHERE s.recorded_at < cutoff
       AND s.last_slot < (SELECT max(t.last_slot) FROM ledger.skipped_slots t WHERE t.job = s.job);
END
$$;

-- The purge horizon: older_than checked, subtracted exactly (not in the
-- session's TimeZone).
CREATE FUNCTION ledger._purge_cutoff(older_than interval)
RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF older_than IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument older_than must not be null';
    END IF;
    PERFORM ledger._check_duration(older_than, 'older_than', ledger._max_older_than());
    RETURN clock_timestamp() - ledger._exact(older_than);
END
$$;

-- All batches in the caller's transaction: what it removed is gone, or
-- nothing is. The counters rows of the jobs it refreshed stay locked until
-- that transaction ends, so an end of a run of such a job waits for it:
-- a purge of millions of rows belongs to ledger.purge_log_in_batches.
CREATE FUNCTION ledger.purge_log(older_than interval)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cutoff  timestamptz := ledger._purge_cutoff(older_than);
    v_deleted bigint := 0::bigint;
    v_from    bigint;
    v_count   bigint;
BEGIN
    SELECT min(r.run_id) INTO v_from FROM ledger.job_execution_log r;
    WHILE v_from IS NOT NULL LOOP
        SELECT b.deleted, b.next_run_id INTO v_count, v_from FROM ledger._purge_batch(v_cutoff, v_from) b;
        v_deleted := v_deleted + v_count;
    END LOOP;
    PERFORM ledger._purge_skipped(v_cutoff);
    RETURN v_deleted;
END
$$;
COMMENT ON FUNCTION ledger.purge_log(interval) IS
    'Delete ended runs older than that, never a job''s newest success, in batches of run ids, in one transaction; returns how many';

-- What one batch of a purge did, and where the next one starts.
CREATE TYPE ledger.purge_batch AS (
    deleted     bigint,   -- runs this batch deleted
    next_run_id bigint    -- from_run_id of the next batch; NULL: this was the last
);

-- One batch, for a caller that commits between batches
-- (ledger.purge_log_in_batches, jobledger purge): from from_run_id (NULL:
-- the oldest run), the next 10,000 run ids. After the last batch
-- (next_run_id NULL) the old drop records go too.
CREATE FUNCTION ledger.purge_log_batch(older_than interval, from_run_id bigint DEFAULT NULL)
RETURNS ledger.purge_batch
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cutoff timestamptz := ledger._purge_cutoff(older_than);
    v_from   bigint;
    v_batch  ledger.purge_batch := ROW(0::bigint, NULL::bigint);
BEGIN
    IF from_run_id < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument from_run_id must be positive (or null: from the oldest run), not %s', from_run_id),
            DETAIL = jsonb_build_object('argument', 'from_run_id', 'value', from_run_id)::text;
    END IF;
    SELECT min(r.run_id) INTO v_from FROM ledger.job_execution_log r
     WHERE r.run_id >= coalesce(from_run_id, 1);
    IF v_from IS NOT NULL THEN
        SELECT b.deleted, b.next_run_id INTO v_batch.deleted, v_batch.next_run_id
          FROM ledger._purge_batch(v_cutoff, v_from) b;
    END IF;
    IF v_batch.next_run_id IS NULL THEN
        PERFORM ledger._purge_skipped(v_cutoff);
    END IF;
    RETURN v_batch;
END
$$;
COMMENT ON FUNCTION ledger.purge_log_batch(interval, bigint) IS
    'One batch of purge_log (10,000 run ids from from_run_id): how many it deleted and where the next batch starts, NULL after the last';

-- A purge that commits after every batch: no lock is held longer than one
-- batch (a fraction of a second), and a purge stopped half-way keeps the
-- batches it committed, each of them whole. Deliberately neither SECURITY
-- DEFINER nor SET (either forbids COMMIT): it calls only the public
-- ledger.purge_log_batch, so the caller needs ledger_client. Inside a
-- transaction block the first COMMIT fails (2D000) and nothing is removed.
CREATE PROCEDURE ledger.purge_log_in_batches(older_than interval, INOUT deleted bigint DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_next  bigint;
    v_count bigint;
BEGIN
    deleted := 0;
    LOOP
        SELECT b.deleted, b.next_run_id INTO v_count, v_next
          FROM ledger.purge_log_batch(older_than => older_than, from_run_id => v_next) b;
        deleted := deleted + v_count;
        COMMIT;
        EXIT WHEN v_next IS NULL;
    END LOOP;
END
$$;
COMMENT ON PROCEDURE ledger.purge_log_in_batches(interval, bigint) IS
    'purge_log, committing after every batch of 10,000 run ids; returns how many it deleted';
-- Schedule preview: the next slots of a registered job (next_slots) or of a
-- schedule not registered yet (preview_slots), each with its wall clock, its
-- UTC offset and a note on the daylight-saving change near it. The slots are
-- the evaluator's own (ledger._slot_after, 15_schedule_eval.sql), so a
-- preview shows what the ledger will do, gap rule included; nothing is
-- enumerated but the slots shown. Read-only: granted to ledger_reader too
-- (90_privileges.sql).
--
-- The note (dst_change) is NULL unless the UTC offset changes on the slot's
-- local day, or differs from the previous slot's (for the first slot: the
-- offset at `after`). Then it names the change, with its date when that is
-- not the slot's day:
--   'spring forward: 02:00-03:00 skipped'   the wall clock jumps: those
--                                           local times do not exist;
--   'fall back: 02:00-03:00 twice'          it goes back: they come twice;
-- and, for a fixed cron expression (15_schedule_eval.sql), what the change
-- does to this slot: '02:30 runs at 03:00' (a time in the gap fires at its
-- end; several merge into that one slot), '02:30 runs once, the first time'
-- (a repeated time fires at its first occurrence). A wildcard expression's
-- times in the gap are skipped, and in the repeated hour it fires twice: the
-- two rows differ by their utc_offset.

CREATE TYPE ledger.schedule_slot AS (
    slot        timestamptz,   -- the slot, as start_due_run would start it
    local_time  timestamp,     -- its wall clock in the schedule's time zone
    utc_offset  interval,      -- local_time - UTC at the slot
    dst_change  text           -- NULL, or the daylight-saving note above
);

-- The count argument of the previews: 1 to ledger._max_preview_slots().
CREATE FUNCTION ledger._check_preview_count(count integer)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF count IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument count must not be null';
    ELSIF count < 1 OR count > ledger._max_preview_slots() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument count must be from 1 to %s', ledger._max_preview_slots()),
            DETAIL = jsonb_build_object('argument', 'count', 'value', count,
                                        'max', ledger._max_preview_slots())::text;
    END IF;
END
$$;

-- The UTC offset of time_zone at an instant (positive east of Greenwich).
CREATE FUNCTION ledger._utc_offset(time_zone text, at timestamptz)
RETURNS interval
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN (at AT TIME ZONE time_zone) - (at AT TIME ZONE 'UTC');
END
$$;

-- A wall clock as the notes write it: '02:00', '02:00:30' off the minute,
-- and with its date ('2011-12-31 00:00') when that is not `day`, the day
-- the note is about (a jump of a whole day, as Pacific/Apia's in 2011).
CREATE FUNCTION ledger._clock_text(local_time timestamp, day date)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN to_char(local_time, CASE WHEN local_time::date <> day THEN 'YYYY-MM-DD ' ELSE '' END
                               || CASE WHEN date_trunc('minute', local_time) = local_time THEN 'HH24:MI'
                                       ELSE 'HH24:MI:SS' END);
END
$$;

-- A stretch of wall clock: '02:00-03:00', or '00:00 to 2011-12-31 00:00'
-- when the end is on another day.
CREATE FUNCTION ledger._clock_range(from_time timestamp, to_time timestamp, day date)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RETURN ledger._clock_text(from_time, day)
        || CASE WHEN from_time::date = to_time::date THEN '-' ELSE ' to ' END
        || ledger._clock_text(to_time, day);
END
$$;

-- The note of a slot (see the top of this file): the UTC offset change on the
-- slot's local day, else the newest one since the previous slot, else NULL.
-- A local day holds at most one change and a 144-hour stretch too (the tz
-- data assumptions of 15_schedule_eval.sql), so each is found by comparing
-- the offsets at the two ends and a binary search (ledger._transition).
CREATE FUNCTION ledger._dst_note(spec ledger.schedule_spec, time_zone text, previous timestamptz, slot timestamptz)
RETURNS text
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_probe       CONSTANT interval := interval '144 hours';   -- at most one change in a stretch this long
    v_just_before CONSTANT interval := interval '1 microsecond';
    v_most_merged CONSTANT integer := 2;                       -- merged times named one by one, up to this
    v_local       timestamp := slot AT TIME ZONE time_zone;
    v_instants    record;
    v_day_from    timestamptz;   -- just before the slot's local day starts
    v_day_to      timestamptz;   -- just before the next one starts
    v_low         timestamptz;
    v_high        timestamptz;
    v_transition  timestamptz;
    v_before      interval;      -- the offsets either side of the change
    v_after       interval;
    v_from_clock  timestamp;     -- the wall clock jumps from this...
    v_to_clock    timestamp;     -- ...to this
    v_note        text;
    v_first       timestamp;     -- fixed cron: the first and last matching times merged into the slot
    v_last        timestamp;
    v_merged      bigint;
    v_day         date;          -- the day the note is about: the slot's, or the change's when another
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN NULL;
    END IF;
    v_instants := ledger._local_instants(time_zone, v_local::date::timestamp);
    v_day_from := coalesce(v_instants.first_at, v_instants.gap_end) - v_just_before;
    v_instants := ledger._local_instants(time_zone, (v_local::date + 1)::timestamp);
    v_day_to := coalesce(v_instants.first_at, v_instants.gap_end) - v_just_before;
    IF ledger._utc_offset(time_zone, v_day_from) <> ledger._utc_offset(time_zone, v_day_to) THEN
        v_transition := ledger._transition(time_zone, v_day_from, v_day_to);
    ELSIF ledger._utc_offset(time_zone, previous) <> ledger._utc_offset(time_zone, slot) THEN
        -- the newest change in (previous, slot], stretch by stretch backwards
        v_high := slot;
        FOR turn IN 1 .. 100000 LOOP
            v_low := greatest(previous, v_high - v_probe);
            EXIT WHEN ledger._utc_offset(time_zone, v_low) <> ledger._utc_offset(time_zone, v_high);
            v_high := v_low;
        END LOOP;
        v_transition := ledger._transition(time_zone, v_low, v_high);
    ELSE
        RETURN NULL;
    END IF;

    v_before := ledger._utc_offset(time_zone, v_transition - v_just_before);
    v_after := ledger._utc_offset(time_zone, v_transition);
    v_from_clock := (v_transition AT TIME ZONE 'UTC') + v_before;
    v_to_clock := (v_transition AT TIME ZONE 'UTC') + v_after;
    v_day := CASE WHEN v_after > v_before THEN v_from_clock::date ELSE v_to_clock::date END;
    IF v_after > v_before THEN
        v_note := format('spring forward%s: %s skipped',
                         CASE WHEN v_day <> v_local::date THEN ' on ' || v_day END,
                         ledger._clock_range(v_from_clock, v_to_clock, v_day));
    ELSE
        v_note := format('fall back%s: %s twice',
                         CASE WHEN v_day <> v_local::date THEN ' on ' || v_day END,
                         ledger._clock_range(v_to_clock, v_from_clock, v_day));
    END IF;
    IF spec.kind <> 'cron' OR spec.wildcard THEN
        RETURN v_note;
    END IF;

    -- A fixed expression: what the change did to this slot.
    IF v_after > v_before AND v_local = v_to_clock THEN
        v_first := ledger._local_next(spec, v_from_clock);
        IF v_first < v_to_clock THEN
            v_last := ledger._local_prev(spec, v_to_clock);
            v_merged := ledger._local_count(spec, v_from_clock - v_just_before, v_to_clock);
            v_note := v_note || CASE
                WHEN v_merged = 1 THEN format('; %s runs at %s', ledger._clock_text(v_first, v_day),
                                              ledger._clock_text(v_to_clock, v_day))
                WHEN v_merged <= v_most_merged THEN
                    format('; %s and %s run once, at %s', ledger._clock_text(v_first, v_day),
                           ledger._clock_text(v_last, v_day), ledger._clock_text(v_to_clock, v_day))
                ELSE format('; %s times from %s to %s run once, at %s', v_merged, ledger._clock_text(v_first, v_day),
                            ledger._clock_text(v_last, v_day), ledger._clock_text(v_to_clock, v_day)) END;
        END IF;
    ELSIF v_after < v_before AND v_local >= v_to_clock AND v_local < v_from_clock THEN
        v_note := v_note || format('; %s runs once, the first time', ledger._clock_text(v_local, v_day));
    END IF;
    RETURN v_note;
END
$$;

-- The first `count` slots after `after`, before the ledger's end of time
-- (ledger._max_instant(): a preview of a rare schedule may list fewer), with
-- their wall clock, offset and note. The arguments are checked by the callers.
CREATE FUNCTION ledger._preview(spec ledger.schedule_spec, time_zone text, count integer, after timestamptz)
RETURNS SETOF ledger.schedule_slot
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_row      ledger.schedule_slot;
    v_previous timestamptz := after;   -- the first slot's note compares with the offset at `after`
    v_slot     timestamptz := after;
BEGIN
    FOR listed IN 1 .. count LOOP
        v_slot := ledger._slot_after(spec, time_zone, v_slot);
        EXIT WHEN v_slot IS NULL OR v_slot >= ledger._max_instant();
        v_row.slot := v_slot;
        v_row.local_time := v_slot AT TIME ZONE time_zone;
        v_row.utc_offset := ledger._utc_offset(time_zone, v_slot);
        v_row.dst_change := ledger._dst_note(spec, time_zone, v_previous, v_slot);
        RETURN NEXT v_row;
        v_previous := v_slot;
    END LOOP;
END
$$;

CREATE FUNCTION ledger.next_slots(job text, count integer DEFAULT 10, after timestamptz DEFAULT NULL)
RETURNS SETOF ledger.schedule_slot
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_preview_count(count);
    PERFORM ledger._check_instant(after, 'after');
    v_job := ledger._scheduled_job(job);   -- LD005, or 22023 without a schedule
    RETURN QUERY
        SELECT p.slot, p.local_time, p.utc_offset, p.dst_change
          FROM ledger._preview(v_job.schedule_spec, v_job.time_zone, count,
                               coalesce(after, clock_timestamp())) AS p;
END
$$;
COMMENT ON FUNCTION ledger.next_slots(text, integer, timestamptz) IS
    'The next `count` slots of a registered job after `after` (default now), with wall clock, UTC offset '
    'and daylight-saving notes; read-only';

CREATE FUNCTION ledger.preview_slots(schedule text, time_zone text DEFAULT 'UTC', count integer DEFAULT 10,
                                     after timestamptz DEFAULT NULL)
RETURNS SETOF ledger.schedule_slot
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_spec ledger.schedule_spec;
BEGIN
    v_spec := ledger._parse_schedule(schedule, time_zone);   -- checks schedule and time_zone, as register_job
    PERFORM ledger._check_preview_count(count);
    PERFORM ledger._check_instant(after, 'after');
    RETURN QUERY
        SELECT p.slot, p.local_time, p.utc_offset, p.dst_change
          FROM ledger._preview(v_spec, time_zone, count, coalesce(after, clock_timestamp())) AS p;
END
$$;
COMMENT ON FUNCTION ledger.preview_slots(text, text, integer, timestamptz) IS
    'The next `count` slots of a schedule not registered yet (as register_job would read it), with wall clock, '
    'UTC offset and daylight-saving notes; read-only';
-- Operator commands: what an operator reaches for by hand (jobledger
-- unregister, release, cancel). Each follows the per-job lock order (the
-- lease row first) and records in the log what it does to a run.

-- Remove a job's registration (its schedule, bounds, pause, skipped
-- ranges). With with_history also its runs, counters and purge marks, so
-- that its slots and keys may run again; the lease row (the job's token
-- high-water mark) and its fences stay, so no token is ever issued twice.
-- Refused (22023 naming job) while a run of the job is live: cancel it or
-- force-release the lease first. LD005 when the ledger knows nothing of it.
CREATE FUNCTION ledger.unregister_job(job text, with_history boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease   ledger.leases;
    v_running ledger.job_execution_log;
    v_found   boolean;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF with_history IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument with_history must not be null';
    END IF;
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = unregister_job.job FOR UPDATE;
    IF NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = unregister_job.job)
       AND (NOT with_history OR v_lease.job IS NULL) THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
            jsonb_build_object('job', job));
    END IF;
    SELECT * INTO v_running FROM ledger.job_execution_log r
     WHERE r.job = unregister_job.job AND r.status = 'running';
    IF FOUND AND v_lease.token = v_running.token AND v_lease.released_at IS NULL
       AND v_lease.expires_at > clock_timestamp() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument job names %s, whose run %s is live: cancel it (ledger.request_cancel) or '
                             'force-release its lease (ledger.force_release) first', job, v_running.run_id),
            DETAIL = jsonb_build_object('argument', 'job', 'job', job, 'run_id', v_running.run_id,
                                        'owner', v_running.owner)::text;
    END IF;
    DELETE FROM ledger.jobs j WHERE j.job = unregister_job.job;  -- skipped_slots cascade
    v_found := FOUND;
    IF with_history THEN
        -- The state in ledger.counters goes with the log it was kept from.
        DELETE FROM ledger.job_execution_log r WHERE r.job = unregister_job.job;
        DELETE FROM ledger.counters c WHERE c.job = unregister_job.job;
        DELETE FROM ledger.skip_counts s WHERE s.job = unregister_job.job;
        DELETE FROM ledger.purged_slots p WHERE p.job = unregister_job.job;
        DELETE FROM ledger.purged_keys k WHERE k.job = unregister_job.job;
        v_found := true;
    END IF;
    RETURN v_found;
END
$$;
COMMENT ON FUNCTION ledger.unregister_job(text, boolean) IS
    'Remove a job''s registration, and with with_history its runs and counters; its token mark stays';

-- Force-release a job's lease, whoever holds it: a new token is issued on
-- a lease that is released at once, so the old holder's token is
-- superseded (its heartbeat answers NULL, its fence and its end are
-- refused with LD001) and its running run is closed as failure
-- (superseded). Returns the new token; NULL when the job has no lease row
-- (LD005 when the ledger knows nothing of the job).
CREATE FUNCTION ledger.force_release(job text)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now      timestamptz;
    v_lease    ledger.leases;
    v_running  ledger.job_execution_log;
    v_timeline integer;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = force_release.job FOR UPDATE;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = force_release.job) THEN
            PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
                jsonb_build_object('job', job));
        END IF;
        RETURN NULL;
    END IF;
    v_now := clock_timestamp();
    v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
    UPDATE ledger.leases l SET
        token       = ledger._next_token(l.token, l.timeline, v_timeline),
        timeline    = v_timeline,
        acquired_at = v_now,
        expires_at  = v_now,
        released_at = v_now
     WHERE l.job = force_release.job
    RETURNING * INTO v_lease;
    SELECT * INTO v_running FROM ledger.job_execution_log r
     WHERE r.job = force_release.job AND r.status = 'running';
    IF FOUND THEN
        PERFORM ledger._close_lost(v_running, 'superseded', v_now);
    END IF;
    RETURN v_lease.token;
END
$$;
COMMENT ON FUNCTION ledger.force_release(text) IS
    'Release a job''s lease whoever holds it: a new token supersedes the holder''s, its running run is closed';

-- An operator asks a running run to stop: the request is recorded on the
-- run (cancel_requested_at), and the holder's next heartbeat ends the run
-- as cancelled and answers NULL (the lease is lost to it). True when this
-- call made the request; false when it was made already. LD004 unknown,
-- LD003 when the run has ended.
CREATE FUNCTION ledger.request_cancel(run_id bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job ledger.label;
    v_run ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_token(run_id, 'run_id');
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = request_cancel.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    PERFORM FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;
    SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = request_cancel.run_id;
    IF v_run.status <> 'running' THEN
        PERFORM ledger._raise_not_running(v_run);
    END IF;
    UPDATE ledger.job_execution_log r SET cancel_requested_at = clock_timestamp()
     WHERE r.run_id = request_cancel.run_id AND r.cancel_requested_at IS NULL;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION ledger.request_cancel(bigint) IS
    'Ask a running run to stop: its holder''s next heartbeat ends it as cancelled and learns it lost the lease';

-- Run a scheduled job's slots in [from_slot, to_slot] (for example those
-- ledger.skipped_slots recorded), oldest first: a run for the oldest slot
-- of the range that is due (not in the future), has not succeeded and is
-- not running, taken under the lease as start_run takes it; 'nothing_due'
-- when none is left. A runner loops on it as on start_due_run. The range
-- holds at most 1000 slots (ledger._max_backfill), so a call walks at most
-- that many.
CREATE FUNCTION ledger.backfill(job text, owner text, from_slot timestamptz, to_slot timestamptz,
                                ttl interval DEFAULT NULL)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_job    ledger.jobs;
    v_ttl    interval;
    v_slot   timestamptz;
    v_upto   timestamptz;
    v_count  bigint;
    v_result ledger.run_start;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    IF from_slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument from_slot must not be null';
    ELSIF to_slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument to_slot must not be null';
    END IF;
    PERFORM ledger._check_instant(from_slot, 'from_slot');
    PERFORM ledger._check_instant(to_slot, 'to_slot');
    PERFORM ledger._check_ttl(ttl);
    IF to_slot < from_slot THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument to_slot %s is before from_slot %s', to_slot, from_slot),
            DETAIL = jsonb_build_object('argument', 'to_slot', 'value', to_slot, 'from_slot', from_slot)::text;
    END IF;
    v_job := ledger._scheduled_job(job);  -- LD005, or 22023 without a schedule
    v_count := ledger._slot_count(v_job.schedule_spec, v_job.time_zone, from_slot - interval '1 microsecond',
                                  to_slot);
    IF v_count > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument to_slot: the range from %s to %s holds %s slots of job %s, more than %s; '
                             'backfill it in parts', from_slot, to_slot, v_count, job, ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'to_slot', 'job', job, 'from_slot', from_slot,
                                        'value', to_slot, 'slots', v_count, 'max', ledger._max_backfill())::text;
    END IF;
    v_ttl := ledger._resolve_ttl(job, ttl);
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;
    v_upto := least(to_slot, clock_timestamp());
    v_slot := ledger._slot_after(v_job.schedule_spec, v_job.time_zone, from_slot - interval '1 microsecond');
    WHILE v_slot IS NOT NULL AND v_slot <= v_upto LOOP
        IF NOT ledger._already_done(job, v_slot, NULL) THEN
            RETURN ledger._start(job, owner, v_ttl, v_slot, NULL, NULL);
        END IF;
        v_slot := ledger._slot_after(v_job.schedule_spec, v_job.time_zone, v_slot);
    END LOOP;
    v_result.outcome := 'nothing_due';
    RETURN v_result;
END
$$;
COMMENT ON FUNCTION ledger.backfill(text, text, timestamptz, timestamptz, interval) IS
    'Start a run for the oldest slot in the range that has not succeeded and is not running; nothing_due when none';
-- Events: the ledger's state changes as a table a live consumer can tail
-- (jobledger watch, jobledger notify, LISTEN ledger_events). Triggers write
-- them, so every writer of a run or a pause (the functions, pg_cron's
-- run_guarded, a superuser's UPDATE) produces the same events; alert
-- changes, which time makes without any write, come from ledger.sync_alerts.
--
-- The cost on the hot path is one row per run start and one per run end
-- (BENCHMARKS.md measures it). Both can be switched off
-- (configure_events(run_events => false)); the pg_notify is off until
-- asked for (notify => true), since every notifying commit queues behind
-- PostgreSQL's one notification queue lock.

CREATE TABLE ledger.event_settings (
    singleton  boolean     PRIMARY KEY DEFAULT true,
    -- run_started and run_ended events (the two per run); the rarer events
    -- (lost, cancelled, paused, alerts) are always recorded.
    run_events boolean     NOT NULL DEFAULT true,
    -- a pg_notify on channel ledger_events for every event
    notify     boolean     NOT NULL DEFAULT false,
    -- events older than retention, or more than max_events behind the
    -- newest, are deleted (in small batches, by the inserts themselves)
    retention  interval    NOT NULL DEFAULT interval '168:00:00',
    max_events bigint      NOT NULL DEFAULT 1000000,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT event_settings_one_row CHECK (singleton),
    CONSTRAINT event_settings_retention_positive CHECK (retention > interval '0'),
    CONSTRAINT event_settings_max_events_bounds CHECK (max_events BETWEEN 1000 AND 1000000000)
);
COMMENT ON TABLE ledger.event_settings IS 'One row: which events are recorded, notified, and kept how long';
INSERT INTO ledger.event_settings DEFAULT VALUES;

CREATE TABLE ledger.events (
    event_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    kind     text         NOT NULL,
    -- no foreign key: an event outlives the job's registration and runs
    job      ledger.label NOT NULL,
    run_id   bigint,
    detail   jsonb        NOT NULL,
    CONSTRAINT events_kind_valid CHECK (kind IN (
        'run_started', 'run_ended', 'run_lost', 'run_cancelled', 'cancel_requested',
        'job_paused', 'job_resumed', 'alert_raised', 'alert_cleared')),
    CONSTRAINT events_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT events_run_has_run_id CHECK (run_id IS NOT NULL
                                            OR kind IN ('job_paused', 'job_resumed', 'alert_raised', 'alert_cleared'))
);
COMMENT ON TABLE ledger.events IS
    'State changes in order (event_id): runs started, ended, lost, cancelled; jobs paused, resumed; alerts raised, cleared';

-- The alerts sync_alerts last saw, so that it records only what changed.
-- An alert about one run (overlap, long_running, overrun) is keyed by it;
-- the others by job and alert alone, so that a message that moves on ("4
-- failures in a row", then 5) is the same alert.
CREATE TABLE ledger.alert_state (
    job          ledger.label NOT NULL,
    alert        text         NOT NULL,
    run_key      bigint       NOT NULL,
    run_id       bigint,
    message      text         NOT NULL,
    since        timestamptz  NOT NULL,
    raised_event bigint       NOT NULL,
    CONSTRAINT alert_state_pkey PRIMARY KEY (job, alert, run_key)
);
COMMENT ON TABLE ledger.alert_state IS 'The open alerts as ledger.sync_alerts last recorded them';

-- A run's row changed: its event. The triggers' WHEN clauses pick the
-- rows, so a row no event is about costs no call.
CREATE FUNCTION ledger._log_event()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_kind text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO ledger.events (at, kind, job, run_id, detail)
        VALUES (NEW.started_at, 'run_started', NEW.job, NEW.run_id,
                jsonb_strip_nulls(jsonb_build_object('owner', NEW.owner, 'token', NEW.token,
                                                     'slot', NEW.slot, 'idempotency_key', NEW.idempotency_key)));
        RETURN NULL;
    END IF;
    IF OLD.status = 'running' AND NEW.status <> 'running' THEN
        v_kind := CASE NEW.failure_reason WHEN 'lease_expired' THEN 'run_lost' WHEN 'superseded' THEN 'run_lost'
                                          WHEN 'cancelled' THEN 'run_cancelled' ELSE 'run_ended' END;
        INSERT INTO ledger.events (at, kind, job, run_id, detail)
        VALUES (NEW.completed_at, v_kind, NEW.job, NEW.run_id,
                jsonb_strip_nulls(jsonb_build_object(
                    'status', NEW.status, 'reason', NEW.failure_reason, 'owner', NEW.owner, 'token', NEW.token,
                    'slot', NEW.slot,
                    'seconds', round(extract(epoch FROM NEW.completed_at - NEW.started_at)::numeric, 3),
                    'error', left(NEW.error, 200))));
    ELSIF OLD.cancel_requested_at IS NULL AND NEW.cancel_requested_at IS NOT NULL THEN
        INSERT INTO ledger.events (at, kind, job, run_id, detail)
        VALUES (NEW.cancel_requested_at, 'cancel_requested', NEW.job, NEW.run_id,
                jsonb_build_object('owner', NEW.owner, 'token', NEW.token));
    END IF;
    RETURN NULL;
END
$$;

-- run_started and run_ended: switched by event_settings.run_events
-- (ledger.configure_events enables and disables these two triggers).
CREATE TRIGGER job_execution_log_started_event
    AFTER INSERT ON ledger.job_execution_log
    FOR EACH ROW WHEN (NEW.status = 'running') EXECUTE FUNCTION ledger._log_event();
CREATE TRIGGER job_execution_log_ended_event
    AFTER UPDATE OF status ON ledger.job_execution_log
    FOR EACH ROW WHEN (OLD.status = 'running' AND (NEW.status = 'success' OR NEW.failure_reason = 'error'))
    EXECUTE FUNCTION ledger._log_event();
-- Lost, cancelled, a cancel asked for: always.
CREATE TRIGGER job_execution_log_lost_event
    AFTER UPDATE OF status, cancel_requested_at ON ledger.job_execution_log
    FOR EACH ROW WHEN ((OLD.status = 'running' AND NEW.failure_reason IN ('lease_expired', 'superseded', 'cancelled'))
                       OR (OLD.cancel_requested_at IS NULL AND NEW.cancel_requested_at IS NOT NULL))
    EXECUTE FUNCTION ledger._log_event();

CREATE FUNCTION ledger._pause_event()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- paused: why (operator, failures); resumed: why it had been paused
    INSERT INTO ledger.events (at, kind, job, detail)
    VALUES (coalesce(NEW.paused_at, NEW.updated_at), CASE WHEN NEW.paused THEN 'job_paused' ELSE 'job_resumed' END,
            NEW.job,
            CASE WHEN NEW.paused THEN jsonb_strip_nulls(jsonb_build_object('reason', NEW.pause_reason))
                 ELSE jsonb_strip_nulls(jsonb_build_object('pause_reason', OLD.pause_reason)) END);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_pause_event
    AFTER UPDATE OF paused ON ledger.jobs
    FOR EACH ROW WHEN (OLD.paused IS DISTINCT FROM NEW.paused)
    EXECUTE FUNCTION ledger._pause_event();

-- The live feed: a small payload (the row has the rest; a NOTIFY payload
-- is at most 8000 bytes). Delivered at commit, so a listener never sees an
-- event of a transaction that rolled back. Enabled by configure_events(notify => true).
CREATE FUNCTION ledger._notify_event()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_notify('ledger_events', jsonb_build_object(
        'event_id', NEW.event_id, 'kind', NEW.kind, 'job', NEW.job, 'run_id', NEW.run_id)::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER events_notify
    AFTER INSERT ON ledger.events
    FOR EACH ROW EXECUTE FUNCTION ledger._notify_event();
ALTER TABLE ledger.events DISABLE TRIGGER events_notify;

-- Delete what is past the bounds among the `batch` oldest events (event_id
-- order, which is nearly `at` order); the number deleted. The oldest are
-- read without a lock, and only the rows to delete are locked, skipping
-- those another purge holds: a purge never waits, and when nothing is old
-- it writes nothing.
CREATE FUNCTION ledger._purge_events(batch integer)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_settings ledger.event_settings;
    v_newest   bigint;
    v_deleted  bigint;
BEGIN
    SELECT * INTO v_settings FROM ledger.event_settings;
    SELECT max(e.event_id) INTO v_newest FROM ledger.events e;
    DELETE FROM ledger.events e
     WHERE e.event_id IN (
           SELECT l.event_id FROM ledger.events l
            WHERE l.event_id IN (
                  SELECT o.event_id
                    FROM (SELECT x.event_id, x.at FROM ledger.events x ORDER BY x.event_id LIMIT batch) o
                   WHERE o.at < clock_timestamp() - v_settings.retention
                      OR o.event_id <= v_newest - v_settings.max_events)
              FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

-- Retention without a scheduler: every 500th event deletes up to 1000 old
-- ones, so the table shrinks twice as fast as it can grow past its bounds,
-- and the cost is a WHEN test on the other 499.
CREATE FUNCTION ledger._retain_events()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._purge_events(1000);
    RETURN NULL;
END
$$;

CREATE TRIGGER events_retention
    AFTER INSERT ON ledger.events
    FOR EACH ROW WHEN (NEW.event_id % 500 = 0)
    EXECUTE FUNCTION ledger._retain_events();

-- Change the options given (NULL keeps one) and return the settings. The
-- two run triggers and the notify trigger follow the flags in the same
-- transaction, so a switched-off feature costs nothing on the hot path; a
-- call with no arguments only makes them agree with the table again (after
-- a restore of the table from a dump, say). ALTER TABLE waits for the
-- transactions writing those tables, a moment on a busy ledger.
CREATE FUNCTION ledger.configure_events(
    run_events boolean DEFAULT NULL,
    notify boolean DEFAULT NULL,
    retention interval DEFAULT NULL,
    max_events bigint DEFAULT NULL)
RETURNS ledger.event_settings
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_settings ledger.event_settings;
    v_trigger  record;
BEGIN
    PERFORM ledger._check_duration(retention, 'retention', ledger._max_older_than());
    IF max_events < 1000 OR max_events > 1000000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument max_events must be between 1000 and 1000000000',
            DETAIL = jsonb_build_object('argument', 'max_events', 'value', max_events,
                                        'min', 1000, 'max', 1000000000)::text;
    END IF;
    IF num_nonnulls(run_events, notify, retention, max_events) > 0 THEN
        UPDATE ledger.event_settings s SET
            run_events = coalesce(configure_events.run_events, s.run_events),
            notify     = coalesce(configure_events.notify, s.notify),
            retention  = coalesce(ledger._exact(configure_events.retention), s.retention),
            max_events = coalesce(configure_events.max_events, s.max_events),
            updated_at = clock_timestamp();
    END IF;
    SELECT * INTO v_settings FROM ledger.event_settings;
    FOR v_trigger IN
        SELECT t.tgrelid::regclass AS tab, t.tgname,
               CASE WHEN t.tgname = 'events_notify' THEN v_settings.notify ELSE v_settings.run_events END AS wanted
          FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid IN ('ledger.job_execution_log'::regclass, 'ledger.events'::regclass)
           AND t.tgname IN ('job_execution_log_started_event', 'job_execution_log_ended_event', 'events_notify')
           AND (t.tgenabled <> 'D') IS DISTINCT FROM
               (CASE WHEN t.tgname = 'events_notify' THEN v_settings.notify ELSE v_settings.run_events END)
    LOOP
        EXECUTE format('ALTER TABLE %s %s TRIGGER %I', v_trigger.tab,
                       CASE WHEN v_trigger.wanted THEN 'ENABLE' ELSE 'DISABLE' END, v_trigger.tgname);
    END LOOP;
    RETURN v_settings;
END
$$;
COMMENT ON FUNCTION ledger.configure_events(boolean, boolean, interval, bigint) IS
    'Switch run events and pg_notify on or off, and set the events'' retention; the options given only';

-- Delete the events past the retention now, oldest first, until the oldest
-- 10,000 left hold none (the inserts do it a batch at a time anyway); the
-- number deleted. Rows a concurrent purge holds are left to it.
CREATE FUNCTION ledger.purge_events()
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_total   bigint := 0::bigint;
    v_deleted bigint;
BEGIN
    LOOP
        v_deleted := ledger._purge_events(10000);
        v_total := v_total + v_deleted;
        EXIT WHEN v_deleted = 0;
    END LOOP;
    RETURN v_total;
END
$$;
COMMENT ON FUNCTION ledger.purge_events() IS 'Delete the events past the retention now; the number deleted';

-- Record the alerts that appeared (alert_raised) and went (alert_cleared)
-- since the last call, and return those events. Alerts come from the clock
-- as much as from writes (a slot not started turns late with no write at
-- all), so something calls this: jobledger notify and jobledger watch do on
-- every poll, pg_cron may every minute. One call at a time does the work (a
-- table lock, taken NOWAIT): a call that finds another at it returns no
-- rows at once instead of queueing behind it (what that one records is in
-- ledger.events), so a change is recorded once and many pollers cost one.
CREATE FUNCTION ledger.sync_alerts()
RETURNS SETOF ledger.events
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off  -- compiling the alerts' plan costs more than running it (BENCHMARKS.md)
AS $$
BEGIN
    BEGIN
        LOCK TABLE ledger.alert_state IN EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        RETURN;
    END;
    RETURN QUERY
    WITH now_open AS MATERIALIZED (
        SELECT DISTINCT ON (a.job, a.alert, k.run_key)
               a.job, a.alert, k.run_key, a.run_id, a.message, coalesce(a.since, now()) AS since
          FROM ledger.alerts a
         CROSS JOIN LATERAL (SELECT CASE WHEN a.alert IN ('overlap', 'long_running', 'overrun')
                                         THEN coalesce(a.run_id, 0) ELSE 0 END AS run_key) k
         ORDER BY a.job, a.alert, k.run_key, a.since
    ), cleared AS (
        DELETE FROM ledger.alert_state s
         WHERE NOT EXISTS (SELECT FROM now_open o
                            WHERE o.job = s.job AND o.alert = s.alert AND o.run_key = s.run_key)
        RETURNING s.*
    ), raised AS (
        SELECT o.* FROM now_open o
         WHERE NOT EXISTS (SELECT FROM ledger.alert_state s
                            WHERE s.job = o.job AND s.alert = o.alert AND s.run_key = o.run_key)
    ), written AS (
        INSERT INTO ledger.events (kind, job, run_id, detail)
        SELECT e.kind, e.job, e.run_id, e.detail
          FROM (SELECT 'alert_cleared' AS kind, c.job, c.run_id,
                       jsonb_build_object('alert', c.alert, 'message', c.message, 'since', c.since,
                                          'raised_event', c.raised_event) AS detail, 0 AS part, c.since
                  FROM cleared c
                UNION ALL
                SELECT 'alert_raised', r.job, r.run_id,
                       jsonb_build_object('alert', r.alert, 'message', r.message, 'since', r.since), 1, r.since
                  FROM raised r) e
         ORDER BY e.part, e.since, e.job
        RETURNING *
    ), kept AS (
        INSERT INTO ledger.alert_state (job, alert, run_key, run_id, message, since, raised_event)
        SELECT r.job, r.alert, r.run_key, r.run_id, r.message, r.since, w.event_id
          FROM raised r
          JOIN written w ON w.kind = 'alert_raised' AND w.job = r.job AND w.detail ->> 'alert' = r.alert
                        AND w.run_id IS NOT DISTINCT FROM r.run_id
    )
    -- (a data-modifying WITH runs whether or not it is read)
    SELECT w.* FROM written w ORDER BY w.event_id;
END
$$;
COMMENT ON FUNCTION ledger.sync_alerts() IS
    'Record the alerts raised and cleared since the last call as events, and return them';
-- Read-only views over the ledger: counters and the overlap audit.

CREATE VIEW ledger.job_counters AS
SELECT k.job,
       coalesce(c.runs_started, 0)     AS runs_started,
       coalesce(c.successes, 0)        AS successes,
       coalesce(c.failures, 0)         AS failures,
       -- skips not yet folded into ledger.counters are in ledger.skip_counts
       coalesce(c.skipped_overlap, 0)
           + coalesce((SELECT sum(s.skipped_overlap) FROM ledger.skip_counts s WHERE s.job = k.job), 0)::bigint
                                       AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill,
       coalesce(c.leases_lost, 0)      AS leases_lost
  FROM (SELECT t.job FROM ledger.counters t
        UNION SELECT t.job FROM ledger.jobs t
        UNION SELECT t.job FROM ledger.skip_counts t) k
  LEFT JOIN ledger.counters c ON c.job = k.job;
COMMENT ON VIEW ledger.job_counters IS
    'Per job: runs started, successes, failures, skips by overlap and by backfill limit, leases lost';

-- Pairs of runs of one job whose time spans overlap. Should always be empty:
-- it is the audit that proves it. A window over start order finds the runs
-- that start before an earlier one ended, so the cost stays O(n log n) and
-- the pair join only touches offenders.
CREATE VIEW ledger.overlaps AS
WITH ordered AS (
    SELECT r.run_id, r.job, r.started_at,
           max(coalesce(r.completed_at, 'infinity')) OVER (
               PARTITION BY r.job ORDER BY r.started_at, r.run_id
               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
      FROM ledger.job_execution_log r
)
SELECT a.job,
       a.run_id          AS run_id,
       a.owner           AS owner,
       a.token           AS token,
       a.started_at      AS started_at,
       a.completed_at    AS completed_at,
       b.run_id          AS other_run_id,
       b.owner           AS other_owner,
       b.token           AS other_token,
       b.started_at      AS other_started_at,
       b.completed_at    AS other_completed_at
  FROM ordered o
  JOIN ledger.job_execution_log b ON b.run_id = o.run_id
  JOIN ledger.job_execution_log a
    ON a.job = o.job
   AND (a.started_at, a.run_id) < (o.started_at, o.run_id)
   AND coalesce(a.completed_at, 'infinity') > o.started_at
 WHERE o.earlier_end > o.started_at;
COMMENT ON VIEW ledger.overlaps IS
    'Pairs of runs of the same job whose time spans overlap; always empty when the ledger holds';

-- Two successes of one job for one slot or one idempotency key. Should
-- always be empty (the unique partial indexes forbid it): the audit that
-- proves no slot or key succeeded twice.
CREATE VIEW ledger.duplicates AS
SELECT r.job, 'slot'::text AS kind, r.slot::text AS value,
       array_agg(r.run_id ORDER BY r.run_id) AS run_ids
  FROM ledger.job_execution_log r
 WHERE r.status = 'success' AND r.slot IS NOT NULL
 GROUP BY r.job, r.slot
HAVING count(*) > 1
UNION ALL
SELECT r.job, 'idempotency_key', r.idempotency_key::text,
       array_agg(r.run_id ORDER BY r.run_id)
  FROM ledger.job_execution_log r
 WHERE r.status = 'success' AND r.idempotency_key IS NOT NULL
 GROUP BY r.job, r.idempotency_key
HAVING count(*) > 1;
COMMENT ON VIEW ledger.duplicates IS
    'Slots and idempotency keys of a job that succeeded more than once; always empty when the ledger holds';
-- Reporting views: read-only, granted to ledger_reader. They read the log and
-- the counters; none of them writes.

-- Per job: the counts and percentiles over each job's newest 1,000 runs (an
-- index scan per job, so a metrics scrape does not grow with the log's
-- length); the longest successful run over the whole log, from the job's
-- state (ledger.counters.longest_success).
CREATE VIEW ledger.run_stats AS
SELECT c.job,
       count(*)                                             AS runs,
       count(*) FILTER (WHERE r.status = 'success')         AS successes,
       count(*) FILTER (WHERE r.status = 'failure')         AS failures,
       round(count(*) FILTER (WHERE r.status = 'failure')::numeric
             / nullif(count(*) FILTER (WHERE r.status <> 'running'), 0), 4) AS failure_rate,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p50_duration,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p95_duration,
       c.longest_success                                    AS max_duration
  FROM ledger.counters c
 CROSS JOIN LATERAL (
       SELECT r.status, r.started_at, r.completed_at FROM ledger.job_execution_log r
        WHERE r.job = c.job ORDER BY r.started_at DESC LIMIT 1000) r
 WHERE c.last_run_id IS NOT NULL
 GROUP BY c.job, c.longest_success;
COMMENT ON VIEW ledger.run_stats IS
    'Per job, over its newest 1,000 runs: runs, failure rate, p50/p95 duration of successful runs; the longest over the log';

-- The ttl should be 1.5 to 2 times the longest normal run, renewed every
-- ttl/3; never under 1 second (ledger._advice_min_ttl: a 19 ms run is no
-- reason for a 28 ms lease), and no advice before 5 successes
-- (ledger._advice_min_runs): one run is no sample.
CREATE VIEW ledger.ttl_advice AS
WITH known AS (
    SELECT job, coalesce(j.ttl, l.ttl) AS ttl
      FROM ledger.jobs j FULL JOIN ledger.leases l USING (job)
), sampled AS (
    SELECT k.job, k.ttl,
           CASE WHEN c.successes >= ledger._advice_min_runs() THEN c.longest_success END AS longest,
           coalesce(c.successes, 0) AS successes
      FROM known k
      LEFT JOIN ledger.counters c ON c.job = k.job
)
SELECT s.job,
       s.ttl,
       s.longest                                                    AS longest_run,
       -- greatest() ignores NULLs: no sample, no recommendation
       CASE WHEN s.longest IS NOT NULL
            THEN greatest(s.longest * 1.5, ledger._advice_min_ttl()) END AS recommended_min,
       CASE WHEN s.longest IS NOT NULL
            THEN greatest(s.longest * 2, ledger._advice_min_ttl()) END   AS recommended_max,
       s.ttl / 3                                                    AS renew_every,
       CASE
           WHEN s.ttl IS NULL OR s.longest IS NULL THEN 'no_data'
           WHEN s.ttl < greatest(s.longest * 1.5, ledger._advice_min_ttl()) THEN 'too_short'
           WHEN s.ttl > greatest(s.longest * 2, ledger._advice_min_ttl()) THEN 'too_long'
           ELSE 'ok'
       END                                                          AS verdict,
       s.successes                                                  AS successes
  FROM sampled s;
COMMENT ON VIEW ledger.ttl_advice IS
    'Per job: ttl, longest successful run, recommended ttl range (1.5-2x, at least 1 s, after 5 successes), renew interval, verdict';

-- Per job, from the job's row in each of jobs, leases and counters (its
-- state, kept by the writing functions): the cost is per job, whatever the
-- length of the log.
CREATE VIEW ledger.job_status AS
WITH known AS (
    SELECT job FROM ledger.jobs
    UNION
    SELECT job FROM ledger.leases
)
SELECT k.job,
       j.schedule,
       j.time_zone,
       coalesce(j.ttl, l.ttl)                               AS ttl,
       j.max_backfill,
       coalesce(j.paused, false)                            AS paused,
       CASE WHEN l.released_at IS NULL AND l.expires_at > now() THEN l.owner END AS holder,
       l.token,
       l.expires_at                                         AS lease_expires_at,
       c.last_run_id                                        AS last_run_id,
       c.last_status                                        AS last_status,
       c.last_started_at                                    AS last_started_at,
       c.last_completed_at                                  AS last_completed_at,
       c.last_success_at                                    AS last_success_at,
       c.running_run_id                                     AS running_run_id,
       now() - c.running_started_at                         AS running_for,
       -- next_due still ahead: no slot since done_slot, so it is the next
       -- (no schedule evaluation for a job that keeps up)
       CASE WHEN j.schedule IS NOT NULL AND NOT j.paused
            THEN CASE WHEN c.next_due > now() THEN c.next_due
                      ELSE ledger._slot_after(j.schedule_spec, j.time_zone, now()) END END AS next_slot,
       -- Overdue: a slot at least one ttl old (5 minutes without a ttl) has
       -- not succeeded and no live run is on it (a run whose lease expired
       -- is a crash, not progress). A job that never ran counts from its
       -- registration.
       coalesce(j.schedule IS NOT NULL AND NOT j.paused
                AND NOT (c.running_run_id IS NOT NULL AND l.token = c.running_token
                         AND l.released_at IS NULL AND l.expires_at > now())
                AND NOT coalesce(c.next_due > now() - coalesce(j.ttl, l.ttl, interval '5 minutes'), false)
                AND ledger._slot_at_or_before(j.schedule_spec, j.time_zone,
                                              now() - coalesce(j.ttl, l.ttl, interval '5 minutes'))
                    > coalesce(c.done_slot, j.created_at), false) AS overdue,
       coalesce(c.consecutive_failures, 0)                  AS consecutive_failures,
       -- A job known only by its lease has no counters row: zeros, not NULLs.
       coalesce(c.runs_started, 0) AS runs_started, coalesce(c.successes, 0) AS successes,
       coalesce(c.failures, 0) AS failures,
       coalesce(c.skipped_overlap, 0)
           + coalesce((SELECT sum(s.skipped_overlap) FROM ledger.skip_counts s WHERE s.job = k.job), 0)::bigint
                                   AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill, coalesce(c.leases_lost, 0) AS leases_lost
  FROM known k
  LEFT JOIN ledger.jobs j ON j.job = k.job
  LEFT JOIN ledger.leases l ON l.job = k.job
  LEFT JOIN ledger.counters c ON c.job = k.job;
COMMENT ON VIEW ledger.job_status IS
    'One row per known job: lease, last run, last success, current run, next slot, overdue, failures, counters';

-- One health state per known job, from its rows in jobs, leases and
-- counters (never the log): O(jobs). The first state that holds wins:
--   paused    the job is paused (pause_reason: 'operator' or 'failures');
--   overrun   a live run has been running longer than max_runtime;
--   running   a live run (its lease held and not expired);
--   down      at least 3 slots missed (ledger._down_after_slots), or no
--             success for longer than down_after (since registration when
--             none ever succeeded);
--   late      a slot missed: due, not started within the grace;
--   failing   the last ended run failed (consecutive_failures >= 1);
--   never_run no run yet;
--   ok        otherwise.
-- A slot is missed when it lies after the newest slot that succeeded (or
-- the registration) and is older than the grace: late_after, or by
-- default the ttl but at least 1 minute. missed_slots counts them from the
-- schedule, without listing them: arithmetic for an interval, per day for
-- cron, over at most 366 days back (beyond that the count is a lower bound:
-- missed_slots_capped). `since` is when the state began (for failing: the
-- end of the last success, or the registration; for ok: the last success).
CREATE VIEW ledger.job_health AS
WITH known AS (
    SELECT job FROM ledger.jobs
    UNION
    SELECT job FROM ledger.leases
), base AS (
    SELECT k.job, j.schedule, j.schedule_spec, j.time_zone, j.created_at, coalesce(j.paused, false) AS paused,
           j.paused_at, j.pause_reason, j.down_after, j.min_runtime, j.max_runtime, j.pause_after_failures,
           coalesce(j.late_after, greatest(coalesce(j.ttl, l.ttl, interval '1 minute'), interval '1 minute')) AS grace,
           c.last_success_at, c.last_success_started_at, c.consecutive_failures, c.running_run_id,
           c.running_started_at, coalesce(c.runs_started, 0) AS runs_started, c.last_completed_at,
           c.next_due,
           (c.running_run_id IS NOT NULL AND l.token = c.running_token
            AND l.released_at IS NULL AND l.expires_at > now()) AS live,
           -- missed slots lie in (done, upto]
           coalesce(c.done_slot, j.created_at) AS done
      FROM known k
      LEFT JOIN ledger.jobs j ON j.job = k.job
      LEFT JOIN ledger.leases l ON l.job = k.job
      LEFT JOIN ledger.counters c ON c.job = k.job
), counted AS (
    SELECT b.*,
           CASE WHEN b.schedule IS NULL THEN NULL
                WHEN now() - b.grace <= b.done OR b.next_due > now() - b.grace THEN 0::bigint
                WHEN (b.schedule_spec).kind = 'interval'
                THEN ledger._slot_count(b.schedule_spec, b.time_zone, b.done, now() - b.grace)
                ELSE ledger._slot_count(b.schedule_spec, b.time_zone,
                                        greatest(b.done, now() - b.grace - ledger._missed_horizon()),
                                        now() - b.grace) END AS missed_slots,
           b.schedule IS NOT NULL AND (b.schedule_spec).kind <> 'interval'
               AND b.done < now() - b.grace - ledger._missed_horizon() AS missed_slots_capped
      FROM base b
), judged AS (
    SELECT c.*,
           CASE
               WHEN c.paused THEN 'paused'
               WHEN c.live AND c.max_runtime IS NOT NULL AND now() - c.running_started_at > c.max_runtime
               THEN 'overrun'
               WHEN c.live THEN 'running'
               WHEN c.missed_slots >= ledger._down_after_slots()
                    OR (c.down_after IS NOT NULL
                        AND now() - coalesce(c.last_success_at, c.created_at) > c.down_after) THEN 'down'
               WHEN c.missed_slots >= 1 THEN 'late'
               WHEN c.consecutive_failures >= 1 THEN 'failing'
               WHEN c.runs_started = 0 THEN 'never_run'
               ELSE 'ok'
           END AS state
      FROM counted c
), dated AS (
    -- The first slot missed, for late and down: the first after done,
    -- which the job's state keeps (next_due) when a success moved done on.
    SELECT j.*,
           CASE WHEN j.state IN ('late', 'down')
                THEN coalesce(j.next_due, ledger._slot_after(j.schedule_spec, j.time_zone, j.done)) END AS first_missed
      FROM judged j
)
SELECT j.job,
       j.state,
       CASE j.state
           WHEN 'paused' THEN j.paused_at
           WHEN 'overrun' THEN j.running_started_at + j.max_runtime
           WHEN 'running' THEN j.running_started_at
           WHEN 'down' THEN least(
               CASE WHEN j.missed_slots >= ledger._down_after_slots()
                    THEN ledger._slot_after(j.schedule_spec, j.time_zone,
                             ledger._slot_after(j.schedule_spec, j.time_zone,
                                 j.first_missed)) + j.grace END,
               CASE WHEN now() - coalesce(j.last_success_at, j.created_at) > j.down_after
                    THEN coalesce(j.last_success_at, j.created_at) + j.down_after END)
           WHEN 'late' THEN j.first_missed + j.grace
           WHEN 'failing' THEN coalesce(j.last_success_at, j.created_at)
           WHEN 'never_run' THEN j.created_at
           ELSE coalesce(j.last_success_at, j.last_completed_at)
       END                                                   AS since,
       CASE j.state
           WHEN 'paused' THEN CASE j.pause_reason
                                  WHEN 'failures' THEN format('paused after %s failure%s in a row',
                                                              j.consecutive_failures,
                                                              CASE WHEN j.consecutive_failures = 1 THEN ''
                                                                   ELSE 's' END)
                                  ELSE 'paused by an operator' END
           WHEN 'overrun' THEN format('running for %s, over its max_runtime %s',
                                      date_trunc('second', now() - j.running_started_at), j.max_runtime)
           WHEN 'running' THEN format('run %s running', j.running_run_id)
           WHEN 'down' THEN CASE WHEN j.missed_slots >= ledger._down_after_slots()
                                 THEN format('%s%s slots missed since the last success',
                                             CASE WHEN j.missed_slots_capped THEN 'at least ' ELSE '' END,
                                             j.missed_slots)
                                 ELSE format('no success for over %s', j.down_after) END
           WHEN 'late' THEN format('a slot due %s ago was not started within %s',
                                   date_trunc('second', now() - j.first_missed),
                                   j.grace)
           WHEN 'failing' THEN format('%s failure%s in a row', j.consecutive_failures,
                                      CASE WHEN j.consecutive_failures = 1 THEN '' ELSE 's' END)
           WHEN 'never_run' THEN 'no run yet'
           ELSE 'ok'
       END                                                   AS reason,
       j.pause_reason,
       j.last_success_at,
       now() - j.last_success_at                             AS last_success_age,
       j.last_success_at - j.last_success_started_at         AS last_success_duration,
       j.missed_slots,
       j.missed_slots_capped,
       j.grace                                               AS late_after,
       j.down_after,
       j.min_runtime,
       j.max_runtime,
       j.pause_after_failures,
       coalesce(j.consecutive_failures, 0)                   AS consecutive_failures,
       CASE WHEN j.live THEN j.running_run_id END            AS running_run_id,
       CASE WHEN j.live THEN now() - j.running_started_at END AS running_for
  FROM dated j;
COMMENT ON VIEW ledger.job_health IS
    'One health state per known job (paused, overrun, running, down, late, failing, never_run, ok), since when, why';

-- One row per live problem. Every part reads per job (the jobs' state,
-- ledger.counters: ledger.overlaps is the audit of the whole log), so
-- alerts do not grow with the log's length.
-- Read it with jit off (ledger.report.read_only_transaction and
-- ledger.sync_alerts do): JIT-compiling this plan costs more than running it.
CREATE VIEW ledger.alerts AS
WITH s AS MATERIALIZED (
    -- job_status once for the three parts that read it (its overdue test
    -- evaluates the schedule: paid once per job, not three times)
    SELECT s.job, s.running_run_id, s.running_for, s.overdue, s.consecutive_failures, s.last_run_id
      FROM ledger.job_status s
), t AS MATERIALIZED (
    SELECT t.job, t.ttl, t.longest_run, t.verdict FROM ledger.ttl_advice t
), h AS MATERIALIZED (
    SELECT h.job, h.state, h.since, h.reason, h.pause_reason, h.running_run_id FROM ledger.job_health h
)
SELECT 'long_running'::text AS alert, s.job, s.running_run_id AS run_id,
       format('running for %s, over twice its longest successful run (%s)',
              date_trunc('second', s.running_for), date_trunc('second', c.longest_success)) AS message,
       now() - s.running_for AS since
  FROM s JOIN ledger.counters c USING (job)
 WHERE s.running_run_id IS NOT NULL AND s.running_for > c.longest_success * 2
UNION ALL
-- From ledger.job_health: its late, down, overrun and failing states, and a
-- pause that pause_after_failures made.
SELECT h.state, h.job, h.running_run_id, h.reason, h.since
  FROM h
 WHERE h.state IN ('late', 'down', 'overrun', 'failing')
UNION ALL
SELECT 'paused', h.job, NULL, h.reason, h.since
  FROM h
 WHERE h.state = 'paused' AND h.pause_reason = 'failures'
UNION ALL
-- The newest success was shorter than min_runtime (from the job's state).
SELECT 'too_fast', c.job, NULL,
       format('the last success took %s, under its min_runtime %s',
              c.last_success_at - c.last_success_started_at, j.min_runtime),
       c.last_success_at
  FROM ledger.counters c JOIN ledger.jobs j ON j.job = c.job
 WHERE j.min_runtime IS NOT NULL AND c.last_success_at - c.last_success_started_at < j.min_runtime
UNION ALL
SELECT 'overdue', s.job, NULL,
       format('a slot is more than one ttl old and has not succeeded, with no live run on it; next slot %s',
              ledger._slot_after(j.schedule_spec, j.time_zone, now())),
       NULL
  FROM s JOIN ledger.jobs j ON j.job = s.job
 WHERE s.overdue
UNION ALL
SELECT 'consecutive_failures', s.job, s.last_run_id,
       format('%s failures in a row', s.consecutive_failures), NULL
  FROM s
 WHERE s.consecutive_failures >= 3
UNION ALL
-- A run that started before an earlier run of its job ended (the job's
-- state keeps the newest: ledger.counters.overlap_run_id): O(1) per job.
-- ledger.overlaps lists every pair, over the whole log.
SELECT 'overlap', c.job, c.overlap_run_id,
       format('run %s started before an earlier run of the job ended (ledger.overlaps lists the pairs)',
              c.overlap_run_id),
       r.started_at
  FROM ledger.counters c
  LEFT JOIN ledger.job_execution_log r ON r.run_id = c.overlap_run_id
 WHERE c.overlap_run_id IS NOT NULL
UNION ALL
SELECT 'ttl_too_short', t.job, NULL,
       format('ttl %s is under 1.5 times the longest successful run (%s)', t.ttl, t.longest_run), NULL
  FROM t
 WHERE t.verdict = 'too_short';
COMMENT ON VIEW ledger.alerts IS
    'One row per live problem: long_running, late, down, overrun, failing, paused, too_fast, overdue, '
    'consecutive_failures, overlap, ttl_too_short';
-- Guarding a SQL job, from pg_cron or any SQL client:
--   CALL ledger.run_guarded(job => 'nightly', command => $$ ... $$);
-- A DO block or a function is one transaction: the run it starts stays
-- invisible until the end (no job_status, no reaper, no trace after a
-- crash), and an overlapping caller waits on the uncommitted lease row. A
-- procedure can COMMIT right after the start, which makes the run visible (a
-- concurrent caller is skipped at once) and its token durable before the
-- command runs.
--
-- Deliberately neither SECURITY DEFINER nor SET search_path: PostgreSQL
-- refuses COMMIT in a procedure that has either, and the command is the
-- caller's own SQL, so it must run with the caller's privileges and
-- search_path, never the ledger owner's. The procedure only calls the public
-- (SECURITY DEFINER) API, so the caller needs ledger_client; every function
-- it calls is schema-qualified, whatever the caller's search_path.
CREATE PROCEDURE ledger.run_guarded(
    job text,
    command text,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_owner     text;
    v_scheduled boolean := false;
    v_limit     integer;
    v_start     ledger.run_start;
    v_failed    boolean;
    v_state     text;
    v_message   text;
    v_detail    text;
    v_hint      text;
    v_context   text;
    v_lost      text;
    v_facts     jsonb;
BEGIN
    -- CALL inside BEGIN ... cannot commit. Detected here when the statement
    -- came on the simple protocol (psql, pg_cron, a driver's unparameterised
    -- statement): there, and only there, a transaction that began before
    -- this statement is a transaction block. Parameterised or prepared
    -- statements have a portal (pg_cursors) and start their transaction at
    -- Parse or Bind: for those, and for a call from a function, the COMMIT
    -- below fails with 2D000 before anything was done.
    IF pg_catalog.transaction_timestamp() < pg_catalog.statement_timestamp()
       AND NOT EXISTS (SELECT FROM pg_catalog.pg_cursors) THEN
        RAISE EXCEPTION USING ERRCODE = '25001',
            MESSAGE = 'ledger.run_guarded must be called outside a transaction block: it commits as soon as the run has started',
            DETAIL = pg_catalog.jsonb_build_object(
                'job', job,
                'transaction_started_at', pg_catalog.transaction_timestamp(),
                'statement_started_at', pg_catalog.statement_timestamp())::text,
            HINT = 'CALL it as a statement of its own in autocommit mode, as pg_cron does; not after BEGIN, not from a function.';
    END IF;
    IF command IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument command must not be null';
    ELSIF command !~ E'\\S' THEN  -- E'': whatever standard_conforming_strings says
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument command must be a SQL statement, not empty',
            DETAIL = pg_catalog.jsonb_build_object('argument', 'command',
                                                   'length', pg_catalog.char_length(command))::text;
    END IF;
    -- The default owner is unique among live backends, so two callers never
    -- count as one owner (a start by the same owner supersedes its previous
    -- run): '<application>:<database>:<backend pid>'. pg_cron connects as
    -- application 'pg_cron' (its background workers have backend type
    -- 'pg_cron'): 'pg_cron:postgres:4242'; a client without a name is 'sql'.
    v_owner := coalesce(owner, pg_catalog.format('%s:%s:%s',
        coalesce(nullif(pg_catalog.current_setting('application_name'), ''),
                 nullif((SELECT a.backend_type FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a),
                        'client backend'),
                 'sql'),
        pg_catalog.current_database(), pg_catalog.pg_backend_pid()));

    -- Where COMMIT is impossible (a transaction block, a function, one
    -- statement of several in a query string), PostgreSQL raises 2D000 here.
    COMMIT;

    SELECT j.schedule IS NOT NULL, j.max_backfill INTO v_scheduled, v_limit
      FROM ledger.jobs j WHERE j.job = run_guarded.job;
    -- A scheduled job: one run per due slot, oldest first, at most
    -- max_backfill of them; any other job: one run.
    FOR i IN 1 .. coalesce(v_limit, 1) LOOP
        IF v_scheduled THEN
            v_start := ledger.start_due_run(job => job, owner => v_owner, ttl => ttl);
        ELSE
            v_start := ledger.start_run(job => job, owner => v_owner, ttl => ttl);
        END IF;
        v_facts := pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
            'job', job, 'owner', v_owner, 'outcome', v_start.outcome, 'run_id', v_start.run_id,
            'token', v_start.token, 'slot', v_start.slot, 'expires_at', v_start.expires_at,
            'holder', v_start.holder, 'holder_expires_at', v_start.holder_expires_at));
        -- The run is visible (a concurrent caller is skipped) and its token
        -- durable; a skip's count is kept.
        COMMIT;

        IF v_start.outcome <> 'started' THEN
            -- Not an error: pg_cron logs the CALL as succeeded.
            IF v_start.outcome = 'skipped_overlap' THEN
                RAISE NOTICE USING
                    MESSAGE = pg_catalog.format('ledger.run_guarded: job %s skipped (skipped_overlap): held by %s until %s',
                                                job, coalesce(v_start.holder, 'another transaction'),
                                                coalesce(v_start.holder_expires_at::text, 'unknown')),
                    DETAIL = v_facts::text;
            ELSIF v_start.outcome <> 'nothing_due' OR i = 1 THEN
                RAISE NOTICE USING
                    MESSAGE = pg_catalog.format('ledger.run_guarded: job %s not run (%s)', job, v_start.outcome),
                    DETAIL = v_facts::text;
            END IF;
            RETURN;
        END IF;

        -- The command's transaction: the run's facts as transaction-local
        -- settings, gone at its COMMIT. The command and the run's end commit
        -- together: a run that lost its lease meanwhile (LD001, LD003) rolls
        -- the command's writes back.
        PERFORM pg_catalog.set_config('ledger.job', job, true);
        PERFORM pg_catalog.set_config('ledger.owner', v_owner, true);
        PERFORM pg_catalog.set_config('ledger.run_id', v_start.run_id::text, true);
        PERFORM pg_catalog.set_config('ledger.token', v_start.token::text, true);
        PERFORM pg_catalog.set_config('ledger.slot',
            coalesce(pg_catalog.to_char(v_start.slot AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), ''),
            true);
        v_failed := false;
        BEGIN
            -- The caller's own SQL, run with the caller's privileges (this
            -- procedure is not SECURITY DEFINER): nothing to inject into.
            PERFORM 'PRAGMA:disable:security_warnings';  -- plpgsql_check; a no-op when run
            EXECUTE command;
            PERFORM ledger.complete_run(run_id => v_start.run_id, token => v_start.token);
        EXCEPTION WHEN OTHERS OR query_canceled OR assert_failure THEN
            v_failed := true;
            GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
                                    v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT,
                                    v_context = PG_EXCEPTION_CONTEXT;
        END;

        IF v_failed THEN
            -- The command's writes are rolled back; record why, then end the
            -- CALL with the same error, so pg_cron logs it as failed.
            BEGIN
                IF v_state = '57014' THEN  -- query_canceled: statement_timeout, pg_cancel_backend
                    PERFORM ledger.cancel_run(run_id => v_start.run_id, token => v_start.token,
                                               error => pg_catalog.format('%s: %s', v_state, v_message));
                ELSE
                    PERFORM ledger.fail_run(run_id => v_start.run_id, token => v_start.token,
                        error => pg_catalog.format('%s: %s', v_state, v_message),
                        detail => pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
                            'sqlstate', v_state,
                            'error_detail', pg_catalog.left(nullif(v_detail, ''), 2000),
                            'error_hint', pg_catalog.left(nullif(v_hint, ''), 2000),
                            'error_context', pg_catalog.left(nullif(v_context, ''), 2000))));
                END IF;
            EXCEPTION WHEN SQLSTATE 'LD001' OR SQLSTATE 'LD003' THEN
                -- A takeover or the reaper closed the run meanwhile: the ttl
                -- did not cover the command. The row keeps their verdict.
                GET STACKED DIAGNOSTICS v_lost = MESSAGE_TEXT;
                RAISE NOTICE USING
                    MESSAGE = pg_catalog.format('ledger.run_guarded: job %s run %s lost its lease while the command ran: %s',
                                                job, v_start.run_id, v_lost),
                    DETAIL = v_facts::text,
                    HINT = 'The ttl must cover the whole command: heartbeats are impossible during one statement.';
            END;
            COMMIT;
            RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_message,
                DETAIL = coalesce(nullif(v_detail, ''), v_facts::text),
                HINT = coalesce(nullif(v_hint, ''),
                                pg_catalog.format('ledger.job_execution_log run %s records this failure.', v_start.run_id));
        END IF;
        COMMIT;
        RAISE NOTICE USING
            MESSAGE = pg_catalog.format('ledger.run_guarded: job %s run %s (token %s%s) succeeded',
                                        job, v_start.run_id, v_start.token,
                                        coalesce(', slot ' || v_start.slot::text, '')),
            DETAIL = v_facts::text;
    END LOOP;
END
$$;
COMMENT ON PROCEDURE ledger.run_guarded(text, text, text, interval) IS
    'Run a SQL command as a run of the job (CALL outside a transaction block, e.g. from pg_cron): start, commit, execute, complete or fail';
-- Privileges: clients write only through the SECURITY DEFINER functions, so
-- no client can forge or rewind a token. Runs last, over everything above.

REVOKE ALL ON SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL ROUTINES IN SCHEMA ledger FROM PUBLIC;  -- functions and procedures

GRANT USAGE ON SCHEMA ledger TO ledger_client, ledger_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA ledger TO ledger_client, ledger_reader;

-- The public API: every function whose name does not start with '_'.
DO $grants$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
           AND p.proname NOT LIKE E'\\_%'
         ORDER BY p.oid::regprocedure::text
    LOOP
        EXECUTE format('GRANT EXECUTE ON ROUTINE %s TO ledger_client', f);  -- ROUTINE: procedures too
    END LOOP;
END
$grants$;

-- The schedule previews read nothing a reader may not SELECT (a job's
-- schedule) and write nothing: dashboards may call them too.
GRANT EXECUTE ON FUNCTION ledger.next_slots(text, integer, timestamptz),
                          ledger.preview_slots(text, text, integer, timestamptz) TO ledger_reader;

-- The views compute next and overdue slots, and a view's functions are
-- checked against whoever reads it. IMMUTABLE helpers are pure arithmetic
-- (slots, tokens, argument checks) that read and write nothing: both roles
-- may run them. Helpers that touch tables stay with the owner.
DO $pure$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
           AND p.proname LIKE E'\\_%'
           AND p.provolatile = 'i'
         ORDER BY p.oid::regprocedure::text
    LOOP
        EXECUTE format('GRANT EXECUTE ON ROUTINE %s TO ledger_client, ledger_reader', f);
    END LOOP;
END
$pure$;

-- Least privilege for the ledger itself: everything in the schema belongs to
-- ledger_owner (NOLOGIN, no other privileges), so a SECURITY DEFINER
-- function runs as that role, never as the superuser who may have installed
-- it. The installer keeps the schema (DROP SCHEMA ledger CASCADE still
-- uninstalls) and alembic's version table. To hand objects to ledger_owner
-- the installer must be a member: a superuser is; a CREATEROLE user that
-- created the role grants it to itself; otherwise an administrator has.
DO $owner$
DECLARE
    v_object record;
BEGIN
    IF NOT pg_catalog.pg_has_role(current_user, 'ledger_owner', 'USAGE') THEN
        BEGIN
            EXECUTE format('GRANT ledger_owner TO %I', current_user);
        EXCEPTION WHEN insufficient_privilege OR invalid_grant_operation THEN
            RAISE EXCEPTION USING ERRCODE = '42501',
                MESSAGE = format('%s must be a member of ledger_owner to install the ledger', current_user),
                HINT = format('An administrator runs once: GRANT ledger_owner TO %I;', current_user);
        END;
    END IF;
    GRANT USAGE, CREATE ON SCHEMA ledger TO ledger_owner;
    FOR v_object IN
        SELECT format('ALTER %s %s OWNER TO ledger_owner',
                      CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END,
                      c.oid::regclass) AS statement
          FROM pg_catalog.pg_class c
         WHERE c.relnamespace = 'ledger'::regnamespace
           AND c.relkind IN ('r', 'v', 'p')
           AND c.relname <> 'alembic_version'
        UNION ALL
        SELECT format('ALTER ROUTINE %s OWNER TO ledger_owner', p.oid::regprocedure)
          FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
        UNION ALL
        SELECT format('ALTER %s %s OWNER TO ledger_owner',
                      CASE t.typtype WHEN 'd' THEN 'DOMAIN' ELSE 'TYPE' END, t.oid::regtype)
          FROM pg_catalog.pg_type t
         WHERE t.typnamespace = 'ledger'::regnamespace
           AND t.typtype IN ('c', 'd')
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_class c
                            WHERE c.oid = t.typrelid AND c.relkind <> 'c')
    LOOP
        EXECUTE v_object.statement;
    END LOOP;
END
$owner$;
