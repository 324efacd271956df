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

-- purge_log's horizon.
CREATE FUNCTION ledger._max_older_than() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT interval '100 years' $$;

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

-- A schedule's time zone must be an IANA zone name. The server also loads
-- POSIX strings ('UTC+3' is three hours west, 'EST5EDT,M3.2.0,M11.1.0' has its
-- own DST rules), numeric offsets and abbreviations ('PST' never changes to
-- PDT), and leap-second 'right/' zones (off by the leap seconds): each would
-- silently fire at other times than the client meant.
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
    BEGIN
        PERFORM timestamptz '2000-01-01 00:00+00' AT TIME ZONE time_zone;
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: unknown time zone', time_zone),
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END;
    -- A name with a slash that the server loads is a zone file. Without one it
    -- may be an abbreviation ('PST') or a POSIX string ('abc3'), which the
    -- server also accepts: ask the (slow) catalog of zone names.
    IF position('/' in time_zone) = 0 AND upper(time_zone) NOT IN ('UTC', 'GMT')
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_timezone_names
                       WHERE lower(name) = lower(time_zone)) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid time_zone %L: not a time zone name (abbreviations are not accepted)', time_zone),
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
-- '/step'; 'a/step' means 'a-high/step' (Vixie cron).
CREATE FUNCTION ledger._cron_field(schedule text, field text, label text, low integer, high integer, names text[])
RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
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
                IF v_first > v_last THEN
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
    CONSTRAINT jobs_ttl_positive CHECK (ttl > interval '0'),
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
    CONSTRAINT counters_non_negative CHECK (
        runs_started >= 0 AND successes >= 0 AND failures >= 0
        AND skipped_overlap >= 0 AND skipped_backfill >= 0 AND leases_lost >= 0)
);
COMMENT ON TABLE ledger.counters IS 'Monotonic per-job counters behind ledger.job_counters';

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
-- whether it is required). Every part must be non-negative, so that adding it
-- to an instant moves forward whatever the calendar ('-1 year 361 days' is
-- "positive" by interval comparison, yet lands before its start), and the
-- whole must lie in (0, upper]: the views add and multiply these values, and
-- a bound keeps every result in timestamptz's range.
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
    IF value <= interval '0' OR value > upper
       OR date_trunc('month', value) < interval '0'
       OR date_trunc('day', value) - date_trunc('month', value) < interval '0'
       OR value - date_trunc('day', value) < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be positive, with no negative part, and at most %s', arg, upper),
            DETAIL = jsonb_build_object('argument', arg, 'value', value::text, 'max', upper::text)::text;
    END IF;
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

-- The ttl to use: the argument, else the job's registered ttl; 22023 when
-- neither is there or the value is not positive.
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
    RETURN v_ttl;
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

-- The job's lease row for a caller that wants to take it, as one of:
--   'held'    another owner's live lease, read without a lock: the caller
--             skips, and a skip takes no row lock and waits for nobody;
--   'locked'  the row, locked FOR UPDATE, as it is now;
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
    v_wait text;
BEGIN
    SELECT * INTO lease FROM ledger.leases l WHERE l.job = _lock_lease.job;
    IF FOUND THEN
        IF lease.released_at IS NULL AND lease.expires_at > clock_timestamp()
           AND lease.owner <> _lock_lease.owner THEN
            state := 'held';
            RETURN;
        END IF;
        -- The usual case: nobody else is writing this job right now.
        SELECT * INTO lease FROM ledger.leases l WHERE l.job = _lock_lease.job FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            state := 'locked';
            RETURN;
        END IF;
    END IF;

    -- Another transaction holds the row (or is inserting it): wait for it,
    -- within the bound. The block is a subtransaction, paid only here.
    v_wait := current_setting('lock_timeout');
    BEGIN
        PERFORM set_config('lock_timeout', ledger._lock_wait(), true);
        FOR attempt IN 1 .. 3 LOOP
            SELECT * INTO lease FROM ledger.leases l WHERE l.job = _lock_lease.job FOR UPDATE;
            IF FOUND THEN
                state := 'locked';
                EXIT;
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

-- Count a skip without waiting past `wait` for the job's counters row, which
-- another open transaction may hold (the skip path holds no lease row lock):
-- ledger._lock_wait(), or a few milliseconds when the caller already waited
-- that long for the lease row. A skip count lost that way is harmless; a
-- hang is not.
CREATE FUNCTION ledger._count_skip(job text, wait text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wait text;
BEGIN
    UPDATE ledger.counters c SET skipped_overlap = c.skipped_overlap + 1
      FROM (SELECT t.job FROM ledger.counters t WHERE t.job = _count_skip.job
               FOR UPDATE SKIP LOCKED) free_
     WHERE c.job = free_.job;
    IF FOUND THEN
        RETURN;
    END IF;
    v_wait := current_setting('lock_timeout');
    BEGIN
        PERFORM set_config('lock_timeout', wait, true);
        PERFORM ledger._count(job, skipped_overlap => 1);
        PERFORM set_config('lock_timeout', v_wait, true);
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
END
$$;

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

CREATE FUNCTION ledger.acquire(job text, owner text, ttl interval DEFAULT NULL)
RETURNS SETOF ledger.lease
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_ttl      interval;
    v_timeline integer;
    v_took     record;
    v_lease    ledger.leases;
    v_now      timestamptz;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    v_ttl := ledger._resolve_ttl(job, ttl);
    v_timeline := ledger._timeline();

    v_took := ledger._lock_lease(job, owner, v_ttl, v_timeline);
    v_lease := v_took.lease;
    IF v_took.state = 'created' THEN
        RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
        RETURN;
    ELSIF v_took.state IN ('held', 'busy') THEN
        RETURN;
    END IF;

    -- Locked: free, expired, or already ours? Then take it with a new token.
    -- The clock is read once the row is locked: a caller that waited for the
    -- previous holder must not date its lease before that holder let go.
    v_now := clock_timestamp();
    IF v_lease.expires_at <= v_now OR v_lease.released_at IS NOT NULL OR v_lease.owner = owner THEN
        UPDATE ledger.leases l SET
            owner       = acquire.owner,
            token       = ledger._next_token(l.token, l.timeline, v_timeline),
            ttl         = v_ttl,
            acquired_at = v_now,
            expires_at  = v_now + v_ttl,
            released_at = NULL,
            timeline    = v_timeline
         WHERE l.job = acquire.job
        RETURNING * INTO v_lease;
        RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
    END IF;
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
    UPDATE ledger.leases l
       SET expires_at = clock_timestamp() + coalesce(renew.ttl, l.ttl),
           ttl        = coalesce(renew.ttl, l.ttl)
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

CREATE FUNCTION ledger.fence(job text, resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_recorded bigint := ledger._checked_fence(job, resource, token);
BEGIN
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
    v_now      timestamptz;
    v_ttl      interval;
    v_timeline integer;
    v_took     record;
    v_lease    ledger.leases;
    v_running  ledger.job_execution_log;
    v_lost     bigint := 0::bigint;
    v_result   ledger.run_start;
    v_job      ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    PERFORM ledger._check_label(idempotency_key, 'idempotency_key', false);
    PERFORM ledger._check_detail(detail);
    PERFORM ledger._check_instant(slot, 'slot');
    -- One read of the job's registration serves the ttl default, the slot
    -- check and the pause.
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_run.job;
    v_ttl := ledger._resolve_ttl(job, coalesce(ttl, v_job.ttl));
    IF slot IS NOT NULL AND v_job.schedule IS NOT NULL THEN
        PERFORM ledger._check_slot(v_job, slot);
    END IF;
    v_result.slot := slot;

    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    v_timeline := ledger._timeline();
    v_took := ledger._lock_lease(job, owner, v_ttl, v_timeline);
    v_lease := v_took.lease;
    IF v_took.state = 'created' THEN
        -- A job with no lease row has no runs: nothing to check.
        RETURN ledger._insert_run(v_lease, slot, idempotency_key, detail, 0);
    END IF;
    -- Read the clock once locked: a start that waited for the previous run
    -- to end must not date itself before that end.
    v_now := clock_timestamp();

    IF v_took.state = 'locked' THEN
        -- The previous run: still running while its lease expired, ended or
        -- went to another token? Its runner is gone or a zombie: close it.
        SELECT * INTO v_running FROM ledger.job_execution_log r
         WHERE r.job = start_run.job AND r.status = 'running';
        IF FOUND AND (v_lease.token <> v_running.token
                      OR v_lease.released_at IS NOT NULL
                      OR v_lease.expires_at <= v_now) THEN
            PERFORM ledger._close_run(v_running.run_id,
                CASE WHEN v_lease.token <> v_running.token THEN 'superseded' ELSE 'lease_expired' END,
                v_now);
            v_lost := v_lost + 1;
            v_running := NULL;
        END IF;
    END IF;

    -- That slot or key already succeeded or is running (wins over overlap).
    IF ledger._already_done(job, slot, idempotency_key) THEN
        IF v_lost > 0 THEN
            PERFORM ledger._count(job, failures => v_lost, leases_lost => v_lost);
        END IF;
        v_result.outcome := 'already_done';
        RETURN v_result;
    END IF;

    -- Another owner's live lease (or a row another transaction holds past
    -- the lock bound): a normal skip, counted apart from failures.
    IF v_took.state IN ('held', 'busy')
       OR (v_lease.released_at IS NULL AND v_lease.expires_at > v_now AND v_lease.owner <> owner) THEN
        IF v_took.state = 'locked' THEN
            PERFORM ledger._count(job, skipped_overlap => 1, failures => v_lost, leases_lost => v_lost);
        ELSE
            PERFORM ledger._count_skip(job, wait => CASE v_took.state WHEN 'held' THEN ledger._lock_wait()
                                                                      ELSE '10ms' END);
        END IF;
        v_result.outcome := 'skipped_overlap';
        v_result.holder := v_lease.owner;
        v_result.holder_expires_at := v_lease.expires_at;
        RETURN v_result;
    END IF;

    -- The same owner still holds it: the new token wins.
    IF v_running.run_id IS NOT NULL THEN
        PERFORM ledger._close_run(v_running.run_id, 'superseded', v_now);
        v_lost := v_lost + 1;
    END IF;

    UPDATE ledger.leases l SET
        owner       = start_run.owner,
        token       = ledger._next_token(l.token, l.timeline, v_timeline),
        ttl         = v_ttl,
        acquired_at = v_now,
        expires_at  = v_now + v_ttl,
        released_at = NULL,
        timeline    = v_timeline
     WHERE l.job = start_run.job
    RETURNING * INTO v_lease;
    RETURN ledger._insert_run(v_lease, slot, idempotency_key, detail, v_lost);
END
$$;
COMMENT ON FUNCTION ledger.start_run(text, text, interval, timestamptz, text, jsonb) IS
    'Check the previous run, take the lease and log a running run, in one transaction';

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

-- Log a running run under a lease the caller has just taken (and holds
-- locked); count it, with `lost` earlier runs closed on the way.
CREATE FUNCTION ledger._insert_run(
    lease ledger.leases, slot timestamptz, idempotency_key text, detail jsonb, lost bigint)
RETURNS ledger.run_start
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_result ledger.run_start;
BEGIN
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail)
    VALUES (lease.job, lease.owner, lease.token, _insert_run.slot, _insert_run.idempotency_key,
            'running', lease.acquired_at, lease.acquired_at, _insert_run.detail)
    RETURNING run_id INTO v_result.run_id;
    PERFORM ledger._count(lease.job, runs_started => 1, failures => lost, leases_lost => lost);
    v_result.outcome := 'started';
    v_result.token := lease.token;
    v_result.expires_at := lease.expires_at;
    v_result.slot := slot;
    RETURN v_result;
END
$$;

-- Close a running run as failed because its lease was lost. The caller
-- holds the job's lease row lock and does the counting.
CREATE FUNCTION ledger._close_run(run_id bigint, reason text, at timestamptz)
RETURNS void
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
        -- Closed by a takeover or the reaper: that is a lost lease, not a misuse.
        IF v_run.failure_reason IN ('lease_expired', 'superseded') THEN
            RETURN NULL;
        END IF;
        PERFORM ledger._raise_not_running(v_run);
    END IF;
    IF v_lease.token <> v_run.token OR v_lease.released_at IS NOT NULL THEN
        RETURN NULL;
    END IF;

    v_now := clock_timestamp();
    UPDATE ledger.leases l
       SET expires_at = v_now + coalesce(heartbeat.ttl, l.ttl),
           ttl        = coalesce(heartbeat.ttl, l.ttl)
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
-- complete_run, fail_run and cancel_run.
CREATE FUNCTION ledger._end_run(
    run_id bigint, token bigint, status text, failure_reason text, error text, detail jsonb)
RETURNS ledger.job_execution_log
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_run   ledger.job_execution_log;
    v_lease ledger.leases;
    v_now   timestamptz;
BEGIN
    PERFORM ledger._check_detail(detail);
    v_run := ledger._lock_run(run_id, token);
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_run.job;

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

    v_now := greatest(clock_timestamp(), v_run.started_at);
    UPDATE ledger.job_execution_log r SET
        status         = _end_run.status,
        failure_reason = _end_run.failure_reason,
        error          = ledger._bounded_error(_end_run.error),
        completed_at   = v_now,
        detail         = CASE WHEN _end_run.detail IS NULL THEN r.detail
                              ELSE coalesce(r.detail, '{}'::jsonb) || _end_run.detail END
     WHERE r.run_id = v_run.run_id
    RETURNING * INTO v_run;
    -- The token stays: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at = least(l.expires_at, v_now), released_at = v_now
     WHERE l.job = v_run.job AND l.released_at IS NULL;
    IF status = 'success' THEN
        PERFORM ledger._count(v_run.job, successes => 1);
    ELSE
        PERFORM ledger._count(v_run.job, failures => 1);
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
        RETURNING r.job, r.token, r.failure_reason
    ), released AS (
        -- A reaped lease is over: its late holder may not renew it.
        UPDATE ledger.leases l SET released_at = v_now, expires_at = least(l.expires_at, v_now)
          FROM closed
         WHERE l.job = closed.job AND l.token = closed.token AND l.released_at IS NULL
    ), counted AS (
        INSERT INTO ledger.counters AS c (job, failures, leases_lost)
        SELECT closed.job, count(*), count(*) FROM closed GROUP BY closed.job
        ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
            failures    = c.failures + excluded.failures,
            leases_lost = c.leases_lost + excluded.leases_lost
    )
    SELECT count(*) INTO v_closed FROM closed;
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

CREATE FUNCTION ledger.register_job(
    job text,
    schedule text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    max_backfill integer DEFAULT 1,
    time_zone text DEFAULT 'UTC')
RETURNS ledger.jobs
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_spec ledger.schedule_spec;
    v_job  ledger.jobs;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF max_backfill IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument max_backfill must not be null';
    ELSIF max_backfill < 1 OR max_backfill > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_backfill must be from 1 to %s', ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'max_backfill', 'value', max_backfill,
                                        'max', ledger._max_backfill())::text;
    END IF;
    PERFORM ledger._check_ttl(ttl);
    PERFORM ledger._check_time_zone(time_zone);
    IF schedule IS NOT NULL THEN
        v_spec := ledger._parse_schedule(schedule, time_zone);  -- parsed once, here
    END IF;

    INSERT INTO ledger.jobs AS j
        (job, schedule, time_zone, ttl, max_backfill, schedule_spec)
    VALUES (register_job.job, register_job.schedule, register_job.time_zone, register_job.ttl,
            register_job.max_backfill, v_spec)
    ON CONFLICT ON CONSTRAINT jobs_pkey DO UPDATE SET
        schedule      = excluded.schedule,
        time_zone     = excluded.time_zone,
        ttl           = excluded.ttl,
        max_backfill  = excluded.max_backfill,
        schedule_spec = excluded.schedule_spec,
        updated_at    = clock_timestamp()
    RETURNING * INTO v_job;
    RETURN v_job;
END
$$;
COMMENT ON FUNCTION ledger.register_job(text, text, interval, integer, text) IS
    'Register or update a job: schedule (interval or cron), default ttl, catch-up bound, time zone';

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
    UPDATE ledger.jobs j SET paused = _set_paused.paused, updated_at = clock_timestamp()
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
    v_due    timestamptz[];
    v_result ledger.run_start;
    v_lower  timestamptz;
    v_last   timestamptz;
    v_count  bigint;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    v_job := ledger._scheduled_job(job);
    PERFORM ledger._resolve_ttl(job, ttl);
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    v_due := ledger._due(v_job, clock_timestamp(), ledger._newest_done_slot(job));
    IF cardinality(v_due) = 0 THEN
        v_result.outcome := 'nothing_due';
        RETURN v_result;
    END IF;
    v_result := ledger.start_run(job, owner, ttl, slot => v_due[1]);
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
        PERFORM ledger._count(job, skipped_backfill => v_count);
    END IF;
    RETURN v_result;
END
$$;
COMMENT ON FUNCTION ledger.start_due_run(text, text, interval) IS
    'Start a run for the oldest due slot, recording the slots the catch-up bound drops; nothing_due when none';

CREATE FUNCTION ledger.purge_log(older_than interval)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_cutoff  timestamptz;
    v_deleted bigint;
BEGIN
    IF older_than IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument older_than must not be null';
    END IF;
    PERFORM ledger._check_duration(older_than, 'older_than', ledger._max_older_than());
    v_cutoff := clock_timestamp() - older_than;

    -- Keep each job's newest success, by slot (catch-up starts from it) and
    -- by time (job_status shows it).
    WITH keep AS (
        SELECT newest.run_id
          FROM (SELECT DISTINCT job FROM ledger.job_execution_log) jobs_,
               LATERAL (
                   (SELECT r.run_id FROM ledger.job_execution_log r
                     WHERE r.job = jobs_.job AND r.status = 'success' AND r.slot IS NOT NULL
                     ORDER BY r.slot DESC LIMIT 1)
                   UNION ALL
                   (SELECT r.run_id FROM ledger.job_execution_log r
                     WHERE r.job = jobs_.job AND r.status = 'success'
                     ORDER BY r.completed_at DESC LIMIT 1)) newest
    ), purged AS (
        DELETE FROM ledger.job_execution_log r
         WHERE r.status <> 'running'
           AND r.completed_at < v_cutoff
           AND r.run_id NOT IN (SELECT keep.run_id FROM keep)
        RETURNING r.run_id, r.job, r.slot, r.idempotency_key, r.status, r.completed_at
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
    SELECT count(*) INTO v_deleted FROM purged;

    -- Old drop records too, except each job's newest (catch-up starts after it).
    DELETE FROM ledger.skipped_slots s
     WHERE s.recorded_at < v_cutoff
       AND s.last_slot < (SELECT max(t.last_slot) FROM ledger.skipped_slots t WHERE t.job = s.job);
    RETURN v_deleted;
END
$$;
COMMENT ON FUNCTION ledger.purge_log(interval) IS
    'Delete ended runs older than that, never a job''s newest success; returns how many';
-- Read-only views over the ledger: counters and the overlap audit.

CREATE VIEW ledger.job_counters AS
SELECT job,
       coalesce(c.runs_started, 0)     AS runs_started,
       coalesce(c.successes, 0)        AS successes,
       coalesce(c.failures, 0)         AS failures,
       coalesce(c.skipped_overlap, 0)  AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill,
       coalesce(c.leases_lost, 0)      AS leases_lost
  FROM ledger.counters c
  FULL JOIN ledger.jobs j USING (job);
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
-- Reporting views: read-only, granted to ledger_reader. They read the log and
-- the counters; none of them writes.

CREATE VIEW ledger.run_stats AS
SELECT r.job,
       count(*)                                             AS runs,
       count(*) FILTER (WHERE r.status = 'success')         AS successes,
       count(*) FILTER (WHERE r.status = 'failure')         AS failures,
       round(count(*) FILTER (WHERE r.status = 'failure')::numeric
             / nullif(count(*) FILTER (WHERE r.status <> 'running'), 0), 4) AS failure_rate,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p50_duration,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY r.completed_at - r.started_at)
           FILTER (WHERE r.status = 'success')              AS p95_duration,
       max(r.completed_at - r.started_at) FILTER (WHERE r.status = 'success') AS max_duration
  FROM ledger.job_execution_log r
 GROUP BY r.job;
COMMENT ON VIEW ledger.run_stats IS
    'Per job, over the log: runs, failure rate, p50/p95/max duration of successful runs';

-- The ttl should be 1.5 to 2 times the longest normal run, renewed every ttl/3.
CREATE VIEW ledger.ttl_advice AS
WITH known AS (
    SELECT job, coalesce(j.ttl, l.ttl) AS ttl
      FROM ledger.jobs j FULL JOIN ledger.leases l USING (job)
)
SELECT k.job,
       k.ttl,
       s.max_duration                                      AS longest_run,
       s.max_duration * 1.5                                AS recommended_min,
       s.max_duration * 2                                  AS recommended_max,
       k.ttl / 3                                           AS renew_every,
       CASE
           WHEN k.ttl IS NULL OR s.max_duration IS NULL THEN 'no_data'
           WHEN k.ttl < s.max_duration * 1.5 THEN 'too_short'
           WHEN k.ttl > s.max_duration * 2 THEN 'too_long'
           ELSE 'ok'
       END                                                 AS verdict
  FROM known k
  LEFT JOIN ledger.run_stats s ON s.job = k.job;
COMMENT ON VIEW ledger.ttl_advice IS
    'Per job: ttl, longest successful run, recommended ttl range (1.5-2x), renew interval, verdict';

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
       last_run.run_id                                      AS last_run_id,
       last_run.status                                      AS last_status,
       last_run.started_at                                  AS last_started_at,
       last_run.completed_at                                AS last_completed_at,
       last_success.completed_at                            AS last_success_at,
       running.run_id                                       AS running_run_id,
       now() - running.started_at                           AS running_for,
       CASE WHEN j.schedule IS NOT NULL AND NOT j.paused
            THEN ledger._slot_after(j.schedule_spec, j.time_zone, now()) END AS next_slot,
       -- Overdue: a slot at least one ttl old (5 minutes without a ttl) has
       -- not succeeded and no live run is on it (a run whose lease expired
       -- is a crash, not progress). A job that never ran counts from its
       -- registration.
       coalesce(j.schedule IS NOT NULL AND NOT j.paused
                AND NOT (running.run_id IS NOT NULL AND l.token = running.token
                         AND l.released_at IS NULL AND l.expires_at > now())
                AND ledger._slot_at_or_before(j.schedule_spec, j.time_zone,
                                              now() - coalesce(j.ttl, l.ttl, interval '5 minutes'))
                    > coalesce(done.slot, j.created_at), false) AS overdue,
       (SELECT count(*) FROM ledger.job_execution_log f
         WHERE f.job = k.job AND f.status = 'failure'
           AND f.started_at > coalesce(last_success.started_at, '-infinity')) AS consecutive_failures,
       -- A job known only by its lease has no counters row: zeros, not NULLs.
       coalesce(c.runs_started, 0) AS runs_started, coalesce(c.successes, 0) AS successes,
       coalesce(c.failures, 0) AS failures, coalesce(c.skipped_overlap, 0) AS skipped_overlap,
       coalesce(c.skipped_backfill, 0) AS skipped_backfill, coalesce(c.leases_lost, 0) AS leases_lost
  FROM known k
  LEFT JOIN ledger.jobs j ON j.job = k.job
  LEFT JOIN ledger.leases l ON l.job = k.job
  LEFT JOIN ledger.job_counters c ON c.job = k.job
  LEFT JOIN LATERAL (
      SELECT r.run_id, r.status, r.started_at, r.completed_at FROM ledger.job_execution_log r
       WHERE r.job = k.job ORDER BY r.started_at DESC, r.run_id DESC LIMIT 1) last_run ON true
  LEFT JOIN LATERAL (
      SELECT r.started_at, r.completed_at FROM ledger.job_execution_log r
       WHERE r.job = k.job AND r.status = 'success' ORDER BY r.started_at DESC LIMIT 1) last_success ON true
  LEFT JOIN LATERAL (
      SELECT r.run_id, r.token, r.started_at FROM ledger.job_execution_log r
       WHERE r.job = k.job AND r.status = 'running') running ON true
  LEFT JOIN LATERAL (
      SELECT r.slot FROM ledger.job_execution_log r
       WHERE r.job = k.job AND r.status = 'success' AND r.slot IS NOT NULL
       ORDER BY r.slot DESC LIMIT 1) done ON true;
COMMENT ON VIEW ledger.job_status IS
    'One row per known job: lease, last run, last success, current run, next slot, overdue, failures, counters';

-- One row per live problem.
CREATE VIEW ledger.alerts AS
SELECT 'long_running'::text AS alert, s.job, s.running_run_id AS run_id,
       format('running for %s, over twice its longest successful run (%s)',
              date_trunc('second', s.running_for), date_trunc('second', t.longest_run)) AS message,
       now() - s.running_for AS since
  FROM ledger.job_status s JOIN ledger.ttl_advice t USING (job)
 WHERE s.running_run_id IS NOT NULL AND s.running_for > t.longest_run * 2
UNION ALL
SELECT 'overdue', s.job, NULL,
       format('a slot is more than one ttl old and has not succeeded, with no live run on it; next slot %s', s.next_slot),
       NULL
  FROM ledger.job_status s
 WHERE s.overdue
UNION ALL
SELECT 'consecutive_failures', s.job, s.last_run_id,
       format('%s failures in a row', s.consecutive_failures), NULL
  FROM ledger.job_status s
 WHERE s.consecutive_failures >= 3
UNION ALL
SELECT 'overlap', o.job, o.other_run_id,
       format('runs %s and %s overlap', o.run_id, o.other_run_id), o.other_started_at
  FROM ledger.overlaps o
UNION ALL
SELECT 'ttl_too_short', t.job, NULL,
       format('ttl %s is under 1.5 times the longest successful run (%s)', t.ttl, t.longest_run), NULL
  FROM ledger.ttl_advice t
 WHERE t.verdict = 'too_short';
COMMENT ON VIEW ledger.alerts IS
    'One row per live problem: long_running, overdue, consecutive_failures, overlap, ttl_too_short';
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
