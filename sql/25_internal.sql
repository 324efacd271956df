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
-- required, 22023 when empty, over 200 characters, or with control characters.
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
    IF value = '' OR char_length(value) > 200 OR value ~ '[[:cntrl:]]' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument %s must be 1 to 200 characters without control characters', arg),
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

-- An optional detail: a JSON object or NULL.
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
END
$$;

-- A ttl, when given, must be positive.
CREATE FUNCTION ledger._check_ttl(value interval)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF value <= interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument ttl must be positive',
            DETAIL = jsonb_build_object('argument', 'ttl', 'value', value::text)::text;
    END IF;
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

-- A token must survive a crash even when the caller set
-- synchronous_commit = off: raise it to `local` for the rest of this
-- transaction. A function-level SET clause would not do: it is undone when the
-- function returns, before COMMIT reads the setting.
CREATE FUNCTION ledger._make_durable()
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('synchronous_commit') = 'off' THEN
        PERFORM set_config('synchronous_commit', 'local', true);
    END IF;
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
