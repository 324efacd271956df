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
-- fixed search_path (tests/sql/test_schedule_eval.py), and a constant local costs
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
