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
