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
-- Schedule evaluation: parse a schedule once into ledger.schedule_spec, then
-- answer "newest slot <= at", "oldest slot > after" and "how many slots in
-- (after, upto]" without enumerating slots.
--
-- Pure functions only (no tables). The evaluators are IMMUTABLE, like
-- PostgreSQL's own AT TIME ZONE; the parser is STABLE (it reads
-- pg_timezone_names).
-- None depends on the session's TimeZone: instants are only moved by
-- intervals without day or month parts, and calendars are walked on local
-- timestamps (timestamp without time zone).
--
-- Cron slots. L is the set of local wall-clock minutes that match the five
-- fields (Vixie rules). local(u) is the wall clock of instant u in time_zone.
--   wildcard expressions: the slots are all instants u with local(u) in L
--     (a local time in a spring-forward gap has no instant: skipped; a local
--     time in a fall-back overlap has two: both fire);
--   fixed expressions: the slots are f(t) for t in L, f(t) = the first
--     instant u with local(u) >= t (a local time in a gap fires at the end of
--     the gap and several merge into that one slot; a repeated local time
--     fires once, at its first occurrence). This is cronie's behaviour.
-- Since f is monotone, f(t) > after <=> t > M(after), where M(after) is the
-- highest wall-clock time reached up to `after` (ledger._local_high).
--
-- Interval slots: slot k = ((2000-01-01 00:00 local + k * the interval's
-- month and day parts, on the local calendar) AT TIME ZONE time_zone)
-- + k * its time part (absolute time). This is exactly what
-- `SET TimeZone = time_zone; SELECT '2000-01-01'::timestamptz + k * every`
-- gives: '1 day' stays at 00:00 local across DST, '24 hours' does not,
-- '90 minutes' keeps its rhythm in absolute time. A local time that falls in a
-- gap resolves like PostgreSQL (offset before the transition: 02:30 -> 03:30),
-- a repeated one to its later occurrence.
--
-- Time zone data assumptions (checked against the tzdata shipped with the
-- server, 1970 onwards): two UTC offset changes of a zone are at least 6.9
-- days apart (Asia/Gaza and three Brazilian zones come closest), and a jump is
-- at most 24 hours. Transitions are located by probing every 144 hours and a
-- binary search to the second.

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

CREATE FUNCTION ledger._check_time_zone(time_zone text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF time_zone IS NULL THEN
        RAISE EXCEPTION 'time_zone must not be NULL' USING ERRCODE = '22004';
    END IF;
    -- IANA names only: no POSIX strings ('UTC+3', 'EST5EDT,M3.2.0,M11.1.0'),
    -- no numeric offsets, no leap-second 'right/' zones.
    IF time_zone !~ '^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+)*$'
       OR lower(time_zone) LIKE 'right/%' THEN
        RAISE EXCEPTION 'invalid time_zone %: not an IANA time zone name', quote_literal(time_zone)
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END IF;
    BEGIN
        PERFORM timestamptz '2000-01-01 00:00+00' AT TIME ZONE time_zone;
    EXCEPTION WHEN OTHERS THEN
        RAISE EXCEPTION 'invalid time_zone %: unknown time zone', quote_literal(time_zone)
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END;
    -- A name with a slash that the server loads is a zone file. Without one it
    -- may be an abbreviation ('PST') or a POSIX string ('abc3'), which the
    -- server also accepts: ask the (slow) catalog of zone names.
    IF position('/' in time_zone) = 0 AND upper(time_zone) NOT IN ('UTC', 'GMT')
       AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_timezone_names
                       WHERE lower(name) = lower(time_zone)) THEN
        RAISE EXCEPTION 'invalid time_zone %: not a time zone name (abbreviations are not accepted)',
            quote_literal(time_zone) USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'time_zone', 'value', time_zone)::text;
    END IF;
END
$fn$;

-- One value of a cron field: a number or, where the field has them, a name.
CREATE FUNCTION ledger._cron_value(schedule text, value text, label text, lo integer, hi integer, names text[])
RETURNS integer
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n integer;
BEGIN
    IF value ~ '^[0-9]{1,6}$' THEN
        n := value::integer;
    ELSIF names IS NOT NULL AND array_position(names, value) IS NOT NULL THEN
        n := array_position(names, value) - 1 + lo;
    ELSE
        RAISE EXCEPTION 'invalid schedule %: invalid % value %', quote_literal(schedule), label, quote_literal(value)
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    IF n < lo OR n > hi THEN
        RAISE EXCEPTION 'invalid schedule %: % value % is out of range %-%', quote_literal(schedule), label, n, lo, hi
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    RETURN n;
END
$fn$;

-- One cron field as a bitmask: comma-separated items, each '*', 'a' or 'a-b',
-- optionally followed by '/step'; 'a/step' means 'a-hi/step' (Vixie cron).
CREATE FUNCTION ledger._cron_field(schedule text, field text, label text, lo integer, hi integer, names text[])
RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    mask   bigint := 0::bigint;
    item   text;
    base   text;
    part   text;
    bounds text[];
    step   integer;
    a      integer;
    b      integer;
BEGIN
    FOREACH item IN ARRAY string_to_array(field, ',') LOOP
        IF item = '' THEN
            RAISE EXCEPTION 'invalid schedule %: empty list element in the % field', quote_literal(schedule), label
                USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
        END IF;
        step := NULL;
        base := item;
        IF position('/' in item) > 0 THEN
            base := split_part(item, '/', 1);
            part := substr(item, length(base) + 2);
            IF part !~ '^[0-9]{1,6}$' THEN
                RAISE EXCEPTION 'invalid schedule %: invalid step % in the % field', quote_literal(schedule), quote_literal(part), label
                    USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
            step := part::integer;
            IF step = 0 THEN
                RAISE EXCEPTION 'invalid schedule %: step 0 in the % field', quote_literal(schedule), label
                    USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
            IF step > hi - lo + 1 THEN
                RAISE EXCEPTION 'invalid schedule %: step % is larger than the % field''s range %-%', quote_literal(schedule), step, label, lo, hi
                    USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
        END IF;
        IF base = '*' THEN
            a := lo;
            b := hi;
        ELSE
            bounds := string_to_array(base, '-');
            IF base = '' OR cardinality(bounds) > 2 THEN
                RAISE EXCEPTION 'invalid schedule %: invalid % element %', quote_literal(schedule), label, quote_literal(item)
                    USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
            END IF;
            a := ledger._cron_value(schedule, bounds[1], label, lo, hi, names);
            IF cardinality(bounds) = 2 THEN
                b := ledger._cron_value(schedule, bounds[2], label, lo, hi, names);
                IF a > b THEN
                    RAISE EXCEPTION 'invalid schedule %: reversed range % in the % field', quote_literal(schedule), quote_literal(base), label
                        USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
                END IF;
            ELSIF step IS NOT NULL THEN
                b := hi;
            ELSE
                b := a;
            END IF;
        END IF;
        FOR v IN a..b BY coalesce(step, 1) LOOP
            mask := mask | (1::bigint << v);
        END LOOP;
    END LOOP;
    RETURN mask;
END
$fn$;

CREATE FUNCTION ledger._parse_schedule(schedule text, time_zone text)
RETURNS ledger.schedule_spec
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    spec       ledger.schedule_spec;
    s          text;
    f          text[];
    iv         interval;
    months     integer;
    days       integer;
    micros     numeric;
    cron_error text;
BEGIN
    IF schedule IS NULL THEN
        RAISE EXCEPTION 'schedule must not be NULL' USING ERRCODE = '22004';
    END IF;
    PERFORM ledger._check_time_zone(time_zone);
    IF char_length(schedule) > ledger._max_schedule_length() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument schedule must be at most %s characters', ledger._max_schedule_length()),
            DETAIL = jsonb_build_object('argument', 'schedule', 'length', char_length(schedule),
                                        'max', ledger._max_schedule_length())::text;
    END IF;
    s := lower(btrim(schedule, E' \t\r\n'));
    IF s = '' THEN
        RAISE EXCEPTION 'invalid schedule: must not be empty' USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    s := CASE s
        WHEN '@hourly'   THEN '0 * * * *'
        WHEN '@daily'    THEN '0 0 * * *'
        WHEN '@midnight' THEN '0 0 * * *'
        WHEN '@weekly'   THEN '0 0 * * 0'
        WHEN '@monthly'  THEN '0 0 1 * *'
        WHEN '@yearly'   THEN '0 0 1 1 *'
        WHEN '@annually' THEN '0 0 1 1 *'
        ELSE s END;
    IF s ~ '^@[a-z]+$' THEN
        RAISE EXCEPTION 'invalid schedule %: unknown macro (use @hourly, @daily, @midnight, @weekly, @monthly, @yearly or @annually)', quote_literal(schedule)
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;

    -- Five fields: a cron expression, unless they do not parse as one and
    -- the text is an interval after all ('1 day 2 hours 3').
    f := regexp_split_to_array(s, '\s+');
    IF cardinality(f) = 5 THEN
        BEGIN
            RETURN ledger._parse_cron(schedule, f);
        EXCEPTION WHEN invalid_parameter_value THEN
            GET STACKED DIAGNOSTICS cron_error = MESSAGE_TEXT;
        END;
    END IF;

    -- An interval? Only interval characters (PostgreSQL reads '*/15 * * * *'
    -- as 15 seconds), and no bare number, which would mean seconds.
    IF s ~ '^[0-9a-z .:+-]+$' AND s !~ '^[0-9. ]+$' THEN
        BEGIN
            iv := btrim(schedule, E' \t\r\n')::interval;  -- ISO 8601 ('PT45M') wants upper case
        EXCEPTION WHEN OTHERS THEN
            iv := NULL;
        END;
    END IF;
    IF iv IS NULL THEN
        IF cron_error IS NOT NULL THEN
            RAISE EXCEPTION '%', cron_error USING ERRCODE = '22023',
                DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
        END IF;
        RAISE EXCEPTION 'invalid schedule %: expected an interval such as ''45 minutes'' or a five-field cron expression (got % fields)', quote_literal(schedule), cardinality(f)
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    months := (extract(year FROM iv) * 12 + extract(month FROM iv))::integer;
    days := extract(day FROM iv)::integer;
    micros := extract(epoch FROM iv - make_interval(months => months, days => days)) * 1000000;
    IF months < 0 OR days < 0 OR micros < 0 OR (months = 0 AND days = 0 AND micros = 0) THEN
        RAISE EXCEPTION 'invalid schedule %: the interval must be positive, with no negative part', quote_literal(schedule)
            USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
    END IF;
    IF iv < ledger._min_every() OR iv > ledger._max_every() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('invalid schedule %s: an interval schedule must be from %s to %s',
                             quote_literal(schedule), ledger._min_every(), ledger._max_every()),
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule,
                                        'min', ledger._min_every()::text, 'max', ledger._max_every()::text)::text;
    END IF;
    spec.kind := 'interval';
    spec.every := iv;
    spec.every_months := months;
    spec.every_days := days;
    spec.every_micros := micros::bigint;
    RETURN spec;
END
$fn$;

-- The five fields of a cron expression (lower case), parsed and checked.
CREATE FUNCTION ledger._parse_cron(schedule text, f text[])
RETURNS ledger.schedule_spec
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    spec ledger.schedule_spec;
    dows bigint;
    ok   boolean := false;
BEGIN
    spec.kind := 'cron';
    spec.minutes := ledger._cron_field(schedule, f[1], 'minute', 0, 59, NULL);
    spec.hours := ledger._cron_field(schedule, f[2], 'hour', 0, 23, NULL)::integer;
    spec.doms := ledger._cron_field(schedule, f[3], 'day-of-month', 1, 31, NULL);
    spec.months := ledger._cron_field(schedule, f[4], 'month', 1, 12,
        ARRAY['jan','feb','mar','apr','may','jun','jul','aug','sep','oct','nov','dec'])::integer;
    dows := ledger._cron_field(schedule, f[5], 'day-of-week', 0, 7,
        ARRAY['sun','mon','tue','wed','thu','fri','sat']);
    spec.dows := ((dows | (dows >> 7)) & 127)::integer;  -- 7 is Sunday too
    spec.dom_restricted := left(f[3], 1) <> '*';
    spec.dow_restricted := left(f[5], 1) <> '*';
    spec.wildcard := left(f[1], 1) = '*' OR left(f[2], 1) = '*';

    -- Can it ever fire? With both day fields restricted either one suffices
    -- and any weekday occurs. Otherwise some allowed month must have an
    -- allowed day (Feb 29 counts); every date falls on every weekday in
    -- some year, so the weekday field cannot make it impossible.
    IF NOT (spec.dom_restricted AND spec.dow_restricted) THEN
        FOR m IN 1..12 LOOP
            IF (spec.months >> m) & 1 = 1
               AND spec.doms & ((2::bigint << (CASE WHEN m = 2 THEN 29 WHEN m IN (4, 6, 9, 11) THEN 30 ELSE 31 END)) - 2) <> 0 THEN
                ok := true;
            END IF;
        END LOOP;
        IF NOT ok THEN
            RAISE EXCEPTION 'invalid schedule %: no allowed month has an allowed day of month, it can never fire', quote_literal(schedule)
                USING ERRCODE = '22023',
            DETAIL = jsonb_build_object('argument', 'schedule', 'value', schedule)::text;
        END IF;
    END IF;
    RETURN spec;
END
$fn$;

-- ---------------------------------------------------------------- local calendar

-- Days of month y-m that match the day-of-month/day-of-week rule (bits 1..31).
CREATE FUNCTION ledger._day_mask(spec ledger.schedule_spec, y integer, m integer) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    nd   integer;
    days bigint;
    w1   integer;
    p    bigint;
    wm   bigint;
BEGIN
    nd := CASE WHEN m = 2 THEN
                   CASE WHEN (y % 4 = 0 AND y % 100 <> 0) OR y % 400 = 0 THEN 29 ELSE 28 END
               WHEN m IN (4, 6, 9, 11) THEN 30
               ELSE 31 END;
    days := (2::bigint << nd) - 2;
    IF spec.dows = 127 AND NOT (spec.dom_restricted AND spec.dow_restricted) THEN
        RETURN spec.doms & days;
    END IF;
    -- weekday of day 1 (2000-01-02 was a Sunday), then the weekday pattern
    -- rotated to start on day 1 and repeated over five weeks
    w1 := (((make_date(y, m, 1) - date '2000-01-02') % 7) + 7) % 7;
    p := (((spec.dows >> w1) | (spec.dows << (7 - w1))) & 127)::bigint;
    wm := (p | (p << 7) | (p << 14) | (p << 21) | (p << 28)) << 1;
    IF spec.dom_restricted AND spec.dow_restricted THEN
        RETURN (spec.doms | wm) & days;
    END IF;
    RETURN spec.doms & wm & days;
END
$fn$;

-- The first local time >= t that matches the cron fields. Field by field:
-- each turn of the loop either returns or moves to the start of the next
-- candidate month, day or hour (a handful of turns; bounded for safety).
-- Bit scans are inlined (a call to a function with SET costs microseconds):
-- v & -v isolates the lowest set bit, a power of two, exact in float8.
CREATE FUNCTION ledger._local_next(spec ledger.schedule_spec, t timestamp) RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    x  timestamp := date_trunc('minute', t);
    y  integer;
    mo integer;
    d  integer;
    h  integer;
    mi integer;
    v  bigint;
BEGIN
    IF x < t THEN
        x := x + interval '1 minute';
    END IF;
    y := date_part('year', x)::integer;
    mo := date_part('month', x)::integer;
    d := date_part('day', x)::integer;
    h := date_part('hour', x)::integer;
    mi := date_part('minute', x)::integer;
    FOR i IN 1..10000 LOOP
        v := spec.months & ~((1::bigint << mo) - 1);
        IF v = 0 THEN
            y := y + 1; mo := 1; d := 1; h := 0; mi := 0;
            CONTINUE;
        END IF;
        v := round(ln((v & -v)::float8) / 0.6931471805599453)::bigint;
        IF v > mo THEN
            mo := v::integer; d := 1; h := 0; mi := 0;
        END IF;
        v := ledger._day_mask(spec, y, mo) & ~((1::bigint << d) - 1);
        IF v = 0 THEN
            mo := mo + 1; d := 1; h := 0; mi := 0;
            IF mo > 12 THEN
                y := y + 1; mo := 1;
            END IF;
            CONTINUE;
        END IF;
        v := round(ln((v & -v)::float8) / 0.6931471805599453)::bigint;
        IF v > d THEN
            d := v::integer; h := 0; mi := 0;
        END IF;
        v := spec.hours & ~((1::bigint << h) - 1);
        IF v = 0 THEN
            d := d + 1; h := 0; mi := 0;
            CONTINUE;
        END IF;
        v := round(ln((v & -v)::float8) / 0.6931471805599453)::bigint;
        IF v > h THEN
            h := v::integer; mi := 0;
        END IF;
        v := spec.minutes & ~((1::bigint << mi) - 1);
        IF v = 0 THEN
            h := h + 1; mi := 0;
            CONTINUE;
        END IF;
        RETURN make_timestamp(y, mo, d, h, round(ln((v & -v)::float8) / 0.6931471805599453)::integer, 0);
    END LOOP;
    RETURN NULL;
END
$fn$;

-- The last local time <= t that matches the cron fields. The highest set bit
-- of v is floor(log2(v)), corrected by one where float8 rounds v.
CREATE FUNCTION ledger._local_prev(spec ledger.schedule_spec, t timestamp) RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    x  timestamp := date_trunc('minute', t);
    y  integer;
    mo integer;
    d  integer;
    h  integer;
    mi integer;
    v  bigint;
    k  integer;
BEGIN
    y := date_part('year', x)::integer;
    mo := date_part('month', x)::integer;
    d := date_part('day', x)::integer;
    h := date_part('hour', x)::integer;
    mi := date_part('minute', x)::integer;
    FOR i IN 1..10000 LOOP
        v := spec.months & ((2::bigint << mo) - 1);
        IF v = 0 THEN
            y := y - 1; mo := 12; d := 31; h := 23; mi := 59;
            CONTINUE;
        END IF;
        k := floor(ln(v::float8) / 0.6931471805599453)::integer;
        k := k - (((1::bigint << k) > v)::integer) + (((2::bigint << k) <= v)::integer);
        IF k < mo THEN
            mo := k; d := 31; h := 23; mi := 59;
        END IF;
        v := CASE WHEN d < 1 THEN 0 ELSE ledger._day_mask(spec, y, mo) & ((2::bigint << d) - 1) END;
        IF v = 0 THEN
            mo := mo - 1; d := 31; h := 23; mi := 59;
            IF mo < 1 THEN
                y := y - 1; mo := 12;
            END IF;
            CONTINUE;
        END IF;
        k := floor(ln(v::float8) / 0.6931471805599453)::integer;
        k := k - (((1::bigint << k) > v)::integer) + (((2::bigint << k) <= v)::integer);
        IF k < d THEN
            d := k; h := 23; mi := 59;
        END IF;
        v := CASE WHEN h < 0 THEN 0 ELSE spec.hours & ((2::bigint << h) - 1) END;
        IF v = 0 THEN
            d := d - 1; h := 23; mi := 59;
            CONTINUE;
        END IF;
        k := floor(ln(v::float8) / 0.6931471805599453)::integer;
        k := k - (((1::bigint << k) > v)::integer) + (((2::bigint << k) <= v)::integer);
        IF k < h THEN
            h := k; mi := 59;
        END IF;
        v := CASE WHEN mi < 0 THEN 0 ELSE spec.minutes & ((2::bigint << mi) - 1) END;
        IF v = 0 THEN
            h := h - 1; mi := 59;
            CONTINUE;
        END IF;
        k := floor(ln(v::float8) / 0.6931471805599453)::integer;
        k := k - (((1::bigint << k) > v)::integer) + (((2::bigint << k) <= v)::integer);
        RETURN make_timestamp(y, mo, d, h, k, 0);
    END LOOP;
    RETURN NULL;
END
$fn$;

-- Number of matching days in [d1, d2]: O(1) when month and day of month are
-- unrestricted (whole weeks), else one step per month.
CREATE FUNCTION ledger._match_days(spec ledger.schedule_spec, d1 date, d2 date) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    n     bigint;
    w1    integer;
    p     bigint;
    y     integer;
    m     integer;
    first date;
    nd    integer;
    lo    integer;
    hi    integer;
    total bigint := 0::bigint;
BEGIN
    IF d2 < d1 THEN
        RETURN 0::bigint;
    END IF;
    n := (d2 - d1 + 1)::bigint;
    IF spec.months = 8190 AND spec.doms = 4294967294 THEN
        IF spec.dows = 127 OR (spec.dom_restricted AND spec.dow_restricted) THEN
            RETURN n;
        END IF;
        w1 := (((d1 - date '2000-01-02') % 7) + 7) % 7;
        p := (((spec.dows >> w1) | (spec.dows << (7 - w1))) & 127)::bigint;
        RETURN (n / 7) * bit_count(spec.dows::bit(64))::integer
             + bit_count((p & ((1::bigint << (n % 7)::integer) - 1))::bit(64))::integer;
    END IF;
    y := date_part('year', d1::timestamp)::integer;
    m := date_part('month', d1::timestamp)::integer;
    LOOP
        first := make_date(y, m, 1);
        EXIT WHEN first > d2;
        IF (spec.months >> m) & 1 = 1 THEN
            nd := (first + interval '1 month')::date - first;
            lo := CASE WHEN d1 > first THEN d1 - first + 1 ELSE 1 END;
            hi := CASE WHEN d2 < first + nd - 1 THEN d2 - first + 1 ELSE nd END;
            total := total + bit_count((ledger._day_mask(spec, y, m) & ((2::bigint << hi) - (1::bigint << lo)))::bit(64))::integer;
        END IF;
        m := m + 1;
        IF m > 12 THEN
            m := 1; y := y + 1;
        END IF;
    END LOOP;
    RETURN total;
END
$fn$;

-- Number of matching local times in (lo, hi].
CREATE FUNCTION ledger._local_count(spec ledger.schedule_spec, lo timestamp, hi timestamp) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    a       timestamp := date_trunc('minute', lo);
    b       timestamp := date_trunc('minute', hi);
    da      date;
    db      date;
    per_min integer;
    per_day bigint;
    upto_a  bigint;
    upto_b  bigint;
    h       integer;
    mi      integer;
BEGIN
    IF b <= a THEN
        RETURN 0::bigint;
    END IF;
    da := a::date;
    db := b::date;
    per_min := bit_count(spec.minutes::bit(64))::integer;
    per_day := (bit_count(spec.hours::bit(64)) * per_min)::bigint;
    -- matches in a day up to and including a's and b's minute
    h := date_part('hour', a)::integer;
    mi := date_part('minute', a)::integer;
    upto_a := bit_count((spec.hours & ((1::bigint << h) - 1))::bit(64)) * per_min
            + ((spec.hours >> h) & 1) * bit_count((spec.minutes & ((2::bigint << mi) - 1))::bit(64));
    h := date_part('hour', b)::integer;
    mi := date_part('minute', b)::integer;
    upto_b := bit_count((spec.hours & ((1::bigint << h) - 1))::bit(64)) * per_min
            + ((spec.hours >> h) & 1) * bit_count((spec.minutes & ((2::bigint << mi) - 1))::bit(64));
    IF da = db THEN
        RETURN ledger._match_days(spec, da, da) * (upto_b - upto_a);
    END IF;
    RETURN ledger._match_days(spec, da, da) * (per_day - upto_a)
         + ledger._match_days(spec, da + 1, db - 1) * per_day
         + ledger._match_days(spec, db, db) * upto_b;
END
$fn$;

-- ---------------------------------------------------------------- time zones

-- The instant in (lo, hi] where the UTC offset changes; the caller knows the
-- offsets at lo and hi differ (and that there is one change between them).
-- tzdata transitions fall on whole seconds.
CREATE FUNCTION ledger._transition(time_zone text, lo timestamptz, hi timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    before interval := (lo AT TIME ZONE time_zone) - (lo AT TIME ZONE 'UTC');
    a      bigint := floor(extract(epoch FROM lo))::bigint;
    b      bigint := ceil(extract(epoch FROM hi))::bigint;
    m      bigint;
    u      timestamptz;
BEGIN
    WHILE b - a > 1 LOOP
        m := a + (b - a) / 2;
        u := to_timestamp(m);
        IF (u AT TIME ZONE time_zone) - (u AT TIME ZONE 'UTC') = before THEN
            a := m;
        ELSE
            b := m;
        END IF;
    END LOOP;
    RETURN to_timestamp(b);
END
$fn$;

-- The instants whose wall clock in time_zone reads t: first_at and last_at
-- (equal unless t is repeated by a fall-back), or, when t falls in a
-- spring-forward gap, both NULL and gap_end = the transition instant.
CREATE FUNCTION ledger._local_instants(time_zone text, t timestamp,
    OUT first_at timestamptz, OUT last_at timestamptz, OUT gap_end timestamptz)
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    c   timestamptz := t AT TIME ZONE 'UTC';
    pb  interval := ((c - interval '24 hours') AT TIME ZONE time_zone) - ((c - interval '24 hours') AT TIME ZONE 'UTC');
    pa  interval := ((c + interval '24 hours') AT TIME ZONE time_zone) - ((c + interval '24 hours') AT TIME ZONE 'UTC');
    c1  timestamptz := c - pb;
    c2  timestamptz;
    ok1 boolean;
    ok2 boolean;
BEGIN
    IF pb = pa THEN
        first_at := c1;
        last_at := c1;
        RETURN;
    END IF;
    c2 := c - pa;
    ok1 := (c1 AT TIME ZONE time_zone) = t;
    ok2 := (c2 AT TIME ZONE time_zone) = t;
    IF ok1 AND ok2 THEN
        first_at := least(c1, c2);
        last_at := greatest(c1, c2);
    ELSIF ok1 THEN
        first_at := c1;
        last_at := c1;
    ELSIF ok2 THEN
        first_at := c2;
        last_at := c2;
    ELSE
        gap_end := ledger._transition(time_zone, least(c1, c2), greatest(c1, c2));
    END IF;
END
$fn$;

-- M(at): the highest wall-clock time reached up to `at`. Equal to the wall
-- clock of `at`, except during the hour (or so) after a fall-back.
CREATE FUNCTION ledger._local_high(time_zone text, at timestamptz) RETURNS timestamp
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    l timestamp := at AT TIME ZONE time_zone;
    t timestamptz;
BEGIN
    IF ((at - interval '24 hours') AT TIME ZONE time_zone) - ((at - interval '24 hours') AT TIME ZONE 'UTC') <= (at AT TIME ZONE time_zone) - (at AT TIME ZONE 'UTC') THEN
        RETURN l;
    END IF;
    t := ledger._transition(time_zone, at - interval '24 hours', at);
    RETURN greatest(l, (t - interval '1 microsecond') AT TIME ZONE time_zone);
END
$fn$;

-- Zones whose offset never changes: no transitions to look for.
CREATE FUNCTION ledger._is_utc(time_zone text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN lower(time_zone) IN ('utc', 'etc/utc', 'gmt', 'etc/gmt', 'zulu', 'etc/zulu',
                                'uct', 'etc/uct', 'universal', 'etc/universal', 'greenwich', 'etc/greenwich');
END
$fn$;

-- ---------------------------------------------------------------- cron slots

CREATE FUNCTION ledger._cron_after(spec ledger.schedule_spec, time_zone text, after timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    cur timestamptz := after;
    o   interval;
    t   timestamp;
    tr  timestamptz;
    lb  timestamp;
    r   record;
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN ledger._local_next(spec, (after AT TIME ZONE 'UTC') + interval '1 microsecond') AT TIME ZONE 'UTC';
    END IF;
    IF NOT spec.wildcard THEN
        t := ledger._local_next(spec, ledger._local_high(time_zone, after) + interval '1 microsecond');
        r := ledger._local_instants(time_zone, t);
        RETURN coalesce(r.first_at, r.gap_end);
    END IF;
    o := (after AT TIME ZONE time_zone) - (after AT TIME ZONE 'UTC');
    lb := (after AT TIME ZONE time_zone) + interval '1 microsecond';
    IF ((after + interval '24 hours') AT TIME ZONE time_zone) - ((after + interval '24 hours') AT TIME ZONE 'UTC') < o THEN
        -- A fall-back within a day: first the slots before it, then the
        -- repeated wall-clock times after it.
        tr := ledger._transition(time_zone, after, after + interval '24 hours');
        t := ledger._local_next(spec, lb);
        IF t <= (tr - interval '1 microsecond') AT TIME ZONE time_zone THEN
            RETURN (t AT TIME ZONE 'UTC') - o;
        END IF;
        lb := tr AT TIME ZONE time_zone;
        cur := tr - interval '1 microsecond';
    END IF;
    FOR i IN 1..1000 LOOP
        t := ledger._local_next(spec, lb);
        IF t IS NULL THEN
            RETURN NULL;
        END IF;
        r := ledger._local_instants(time_zone, t);
        IF r.first_at > cur THEN
            RETURN r.first_at;
        ELSIF r.last_at > cur THEN
            RETURN r.last_at;
        ELSIF r.gap_end IS NOT NULL THEN
            lb := r.gap_end AT TIME ZONE time_zone;   -- skip the whole gap
        ELSE
            lb := t + interval '1 minute';
        END IF;
    END LOOP;
    RETURN NULL;
END
$fn$;

CREATE FUNCTION ledger._cron_at_or_before(spec ledger.schedule_spec, time_zone text, at timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    cur timestamptz := at;
    o   interval;
    t   timestamp;
    tr  timestamptz;
    ub  timestamp;
    r   record;
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN ledger._local_prev(spec, at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
    END IF;
    IF NOT spec.wildcard THEN
        t := ledger._local_prev(spec, ledger._local_high(time_zone, at));
        r := ledger._local_instants(time_zone, t);
        RETURN coalesce(r.first_at, r.gap_end);
    END IF;
    o := (at AT TIME ZONE time_zone) - (at AT TIME ZONE 'UTC');
    ub := at AT TIME ZONE time_zone;
    IF ((at - interval '24 hours') AT TIME ZONE time_zone) - ((at - interval '24 hours') AT TIME ZONE 'UTC') > o THEN
        -- A fall-back within the last day: first the slots since it, then
        -- the ones before it.
        tr := ledger._transition(time_zone, at - interval '24 hours', at);
        t := ledger._local_prev(spec, ub);
        IF t >= tr AT TIME ZONE time_zone THEN
            RETURN (t AT TIME ZONE 'UTC') - o;
        END IF;
        ub := (tr - interval '1 microsecond') AT TIME ZONE time_zone;
        cur := tr - interval '1 microsecond';
    END IF;
    FOR i IN 1..1000 LOOP
        t := ledger._local_prev(spec, ub);
        IF t IS NULL THEN
            RETURN NULL;
        END IF;
        r := ledger._local_instants(time_zone, t);
        IF r.last_at <= cur THEN
            RETURN r.last_at;
        ELSIF r.first_at <= cur THEN
            RETURN r.first_at;
        ELSIF r.gap_end IS NOT NULL THEN
            ub := (r.gap_end - interval '1 microsecond') AT TIME ZONE time_zone;   -- skip the whole gap
        ELSE
            ub := t - interval '1 minute';
        END IF;
    END LOOP;
    RETURN NULL;
END
$fn$;

CREATE FUNCTION ledger._cron_count(spec ledger.schedule_spec, time_zone text, after timestamptz, upto timestamptz) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    total bigint := 0::bigint;
    p     timestamptz := after;
    q     timestamptz;
    op    interval;
    oq    interval;
    tr    timestamptz;
    lo    timestamp;
    n     bigint;
BEGIN
    IF ledger._is_utc(time_zone) THEN
        RETURN ledger._local_count(spec, after AT TIME ZONE 'UTC', upto AT TIME ZONE 'UTC');
    END IF;
    IF spec.wildcard THEN
        -- sum over the stretches of constant offset
        lo := after AT TIME ZONE time_zone;
    ELSE
        -- every wall-clock time once, less the merges in spring-forward gaps
        total := ledger._local_count(spec, ledger._local_high(time_zone, after),
                                     ledger._local_high(time_zone, upto));
    END IF;
    op := (after AT TIME ZONE time_zone) - (after AT TIME ZONE 'UTC');
    WHILE p < upto LOOP
        q := least(p + interval '144 hours', upto);
        oq := (q AT TIME ZONE time_zone) - (q AT TIME ZONE 'UTC');
        IF oq <> op THEN
            tr := ledger._transition(time_zone, p, q);
            IF spec.wildcard THEN
                total := total + ledger._local_count(spec, lo, (tr - interval '1 microsecond') AT TIME ZONE time_zone);
                lo := (tr AT TIME ZONE time_zone) - interval '1 microsecond';
            ELSIF oq > op THEN
                n := ledger._local_count(spec, (tr - interval '1 microsecond') AT TIME ZONE time_zone,
                                         tr AT TIME ZONE time_zone);
                IF n > 1 THEN
                    total := total - (n - 1);
                END IF;
            END IF;
        END IF;
        p := q;
        op := oq;
    END LOOP;
    IF spec.wildcard THEN
        total := total + ledger._local_count(spec, lo, upto AT TIME ZONE time_zone);
    END IF;
    RETURN total;
END
$fn$;

-- ---------------------------------------------------------------- interval slots

-- ts + us microseconds, exactly (float8 factors stay below 2^53).
CREATE FUNCTION ledger._add_micros(ts timestamptz, us numeric) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    h numeric := div(us, 3600000000);
BEGIN
    RETURN ts + make_interval(hours => h::integer)
              + (us - h * 3600000000)::float8 * interval '1 microsecond';
END
$fn$;

CREATE FUNCTION ledger._interval_slot(spec ledger.schedule_spec, time_zone text, k bigint) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN ledger._add_micros(
        (timestamp '2000-01-01 00:00' + make_interval(months => (k * spec.every_months)::integer,
                                                       days => (k * spec.every_days)::integer))
            AT TIME ZONE time_zone,
        k::numeric * spec.every_micros);
END
$fn$;

-- The largest k whose slot is <= at.
CREATE FUNCTION ledger._interval_index(spec ledger.schedule_spec, time_zone text, at timestamptz) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    since numeric := extract(epoch FROM at)
                   - extract(epoch FROM timestamp '2000-01-01 00:00' AT TIME ZONE time_zone);
    k     bigint;
BEGIN
    IF spec.every_months = 0 AND spec.every_days = 0 THEN
        RETURN floor(since * 1000000 / spec.every_micros)::bigint;
    END IF;
    -- Estimate with an average month (30.436875 days), then correct: the
    -- calendar drifts from it by a few days at most, and a step is >= 1 day.
    k := floor(since / (spec.every_months * 2629746.0 + spec.every_days * 86400.0
                        + spec.every_micros / 1000000.0))::bigint;
    WHILE ledger._interval_slot(spec, time_zone, k) > at LOOP
        k := k - 1;
    END LOOP;
    WHILE ledger._interval_slot(spec, time_zone, k + 1) <= at LOOP
        k := k + 1;
    END LOOP;
    RETURN k;
END
$fn$;

-- ---------------------------------------------------------------- the interface

-- The newest slot <= at.
CREATE FUNCTION ledger._slot_at_or_before(spec ledger.schedule_spec, time_zone text, at timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF spec.kind IS NULL THEN
        RAISE EXCEPTION 'spec must not be NULL' USING ERRCODE = '22004';
    ELSIF time_zone IS NULL THEN
        RAISE EXCEPTION 'time_zone must not be NULL' USING ERRCODE = '22004';
    ELSIF at IS NULL THEN
        RAISE EXCEPTION 'at must not be NULL' USING ERRCODE = '22004';
    ELSIF NOT isfinite(at) THEN
        RAISE EXCEPTION 'at must be a finite timestamp' USING ERRCODE = '22023';
    END IF;
    IF spec.kind = 'interval' THEN
        RETURN ledger._interval_slot(spec, time_zone, ledger._interval_index(spec, time_zone, at));
    END IF;
    RETURN ledger._cron_at_or_before(spec, time_zone, at);
END
$fn$;

-- The oldest slot > after.
CREATE FUNCTION ledger._slot_after(spec ledger.schedule_spec, time_zone text, after timestamptz) RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF spec.kind IS NULL THEN
        RAISE EXCEPTION 'spec must not be NULL' USING ERRCODE = '22004';
    ELSIF time_zone IS NULL THEN
        RAISE EXCEPTION 'time_zone must not be NULL' USING ERRCODE = '22004';
    ELSIF after IS NULL THEN
        RAISE EXCEPTION 'after must not be NULL' USING ERRCODE = '22004';
    ELSIF NOT isfinite(after) THEN
        RAISE EXCEPTION 'after must be a finite timestamp' USING ERRCODE = '22023';
    END IF;
    IF spec.kind = 'interval' THEN
        RETURN ledger._interval_slot(spec, time_zone, ledger._interval_index(spec, time_zone, after) + 1);
    END IF;
    RETURN ledger._cron_after(spec, time_zone, after);
END
$fn$;

-- The number of slots s with after < s <= upto, without enumerating them.
CREATE FUNCTION ledger._slot_count(spec ledger.schedule_spec, time_zone text, after timestamptz, upto timestamptz) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF spec.kind IS NULL THEN
        RAISE EXCEPTION 'spec must not be NULL' USING ERRCODE = '22004';
    ELSIF time_zone IS NULL THEN
        RAISE EXCEPTION 'time_zone must not be NULL' USING ERRCODE = '22004';
    ELSIF after IS NULL THEN
        RAISE EXCEPTION 'after must not be NULL' USING ERRCODE = '22004';
    ELSIF NOT isfinite(after) THEN
        RAISE EXCEPTION 'after must be a finite timestamp' USING ERRCODE = '22023';
    ELSIF upto IS NULL THEN
        RAISE EXCEPTION 'upto must not be NULL' USING ERRCODE = '22004';
    ELSIF NOT isfinite(upto) THEN
        RAISE EXCEPTION 'upto must be a finite timestamp' USING ERRCODE = '22023';
    END IF;
    IF upto <= after THEN
        RETURN 0::bigint;
    END IF;
    IF spec.kind = 'interval' THEN
        RETURN ledger._interval_index(spec, time_zone, upto) - ledger._interval_index(spec, time_zone, after);
    END IF;
    RETURN ledger._cron_count(spec, time_zone, after, upto);
END
$fn$;
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
       c.runs_started, c.successes, c.failures, c.skipped_overlap, c.skipped_backfill, c.leases_lost
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
-- Privileges: clients write only through the SECURITY DEFINER functions, so
-- no client can forge or rewind a token. Runs last, over everything above.

REVOKE ALL ON SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA ledger FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA ledger FROM PUBLIC;

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
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO ledger_client', f);
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
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO ledger_client, ledger_reader', f);
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
