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
                               coalesce(after, ledger._now())) AS p;
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
          FROM ledger._preview(v_spec, time_zone, count, coalesce(after, ledger._now())) AS p;
END
$$;
COMMENT ON FUNCTION ledger.preview_slots(text, text, integer, timestamptz) IS
    'The next `count` slots of a schedule not registered yet (as register_job would read it), with wall clock, '
    'UTC offset and daylight-saving notes; read-only';
