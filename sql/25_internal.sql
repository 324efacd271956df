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

-- How long an operator command waits for a table lock (configure_events'
-- ALTER TABLE): while it waits, every start and end of every job queues
-- behind it, so the wait is short, and past it the command fails (55P03)
-- rather than stall the ledger behind an idle transaction.
CREATE FUNCTION ledger._ddl_lock_wait() RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $x$ SELECT '200ms'::text $x$;

-- The longest a caller may sit idle in the transaction of its
-- ledger.sync_alerts() call (whose lock holds back every other poller's
-- alerts until that transaction ends): past it the server ends the session.
CREATE FUNCTION ledger._alert_sync_idle_limit() RETURNS interval
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $x$ SELECT interval '5 seconds' $x$;

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
-- Every writer takes the lease row first, then run rows, then the state row.
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
               AND (l.released_at IS NOT NULL OR l.expires_at <= ledger._now() OR l.owner = _lock_lease.owner)
               FOR UPDATE;
            IF FOUND THEN
                state := 'locked';
                EXIT;
            END IF;
            SELECT * INTO lease FROM ledger.leases l WHERE l.job = _lock_lease.job;
            IF FOUND THEN
                IF lease.released_at IS NULL AND lease.expires_at > ledger._now()
                   AND lease.owner <> _lock_lease.owner THEN
                    state := 'held';
                    EXIT;
                END IF;
                CONTINUE;  -- changed in between: look again
            END IF;
            PERFORM ledger._lock_lease_to_be(_lock_lease.job);
            -- the job's pool copied onto its first lease row, under the lock
            -- that stands for that row (register_job writes both under it)
            INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, timeline, pool)
            SELECT _lock_lease.job, _lock_lease.owner, ledger._next_token(NULL, NULL, timeline),
                   ttl, now_.at, now_.at + ttl, timeline,
                   (SELECT j.pool FROM ledger.jobs j WHERE j.job = _lock_lease.job)
              FROM (SELECT ledger._now() AS at) now_
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

-- The lock that stands for a job's lease row while it has none: a
-- transaction advisory lock on the job's name. A job's first lease row is
-- inserted under it (ledger._lock_lease), and a writer of a registration
-- that finds no lease row to take first takes it instead
-- (ledger._lock_registration), so no lease row appears while that writer
-- runs, and the per-job order holds for a job without a lease row too. A
-- hash collision of two names only makes them wait for each other.
CREATE FUNCTION ledger._lock_lease_to_be(job text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('ledger.leases'), hashtext(job));
END
$$;

-- The first lock of a writer of a job's registration (register_job,
-- unregister_job, pause_job, resume_job), in the per-job order: the job's
-- lease row, when it has one (returned), or the lock that stands for it
-- (ledger._lock_lease_to_be; then NULL, unless the row appeared meanwhile).
-- The registration row comes after it.
CREATE FUNCTION ledger._lock_registration(job text)
RETURNS ledger.leases
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease ledger.leases;
BEGIN
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _lock_registration.job FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM ledger._lock_lease_to_be(job);
        -- made meanwhile (its maker held the lock above, and has committed)
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _lock_registration.job FOR UPDATE;
    END IF;
    RETURN v_lease;
END
$$;

-- Count a skip without a WAL flush and without waiting past `wait` for a
-- skip row, which another open transaction may hold (the skip path holds no
-- lease row lock; an end folding the job's skips holds the rows it folds
-- until its commit; another skip of the same shard holds its row until its
-- own commit): ledger._lock_wait(), or a few milliseconds when the caller
-- already waited that long for the lease row. Its first step is the plain
-- UPDATE of the caller's shard's row, which the hot path's callers
-- (ledger._start) try inline first, a call less per skip; the rest is for a
-- row that is missing or held. A held row sends the count to a spare row of
-- the same shard (shard + 16, + 32, + 48: rows nobody holds, or new ones).
-- A row that exists is never INSERTed over: ON CONFLICT waits for the
-- transaction that holds the row it conflicts with, and that wait timing
-- out is what lost counts under 64 clients. Only when all four are held
-- does it wait for its own. A count lost at that wait is harmless; a hang
-- is not. Every count of a skip comes here (ledger._start tries this
-- first step inline): a start's skip (ledger._count_skip, below) and the
-- scheduler's overlap skips of slots and triggers, which before wrote the
-- row themselves and waited, unbounded, for whoever held it.
CREATE FUNCTION ledger._count_skips(job text, wait text, skips bigint)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_wait  text := current_setting('lock_timeout');
    v_shard smallint;
BEGIN
    PERFORM set_config('lock_timeout', wait, true);
    FOR v_spare IN 0 .. 3 LOOP
        v_shard := (pg_backend_pid() % 16 + 16 * v_spare)::smallint;
        UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + skips
          FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                 WHERE t.job = _count_skips.job AND t.shard = v_shard
                   FOR UPDATE SKIP LOCKED) free_
         WHERE s.job = free_.job AND s.shard = free_.shard;
        IF FOUND THEN
            PERFORM set_config('lock_timeout', v_wait, true);
            RETURN;
        END IF;
        -- A row that exists is held (by an end folding it, or by another
        -- skip of this shard): try the next. An INSERT there, even with DO
        -- NOTHING, would wait for its holder to commit.
        CONTINUE WHEN EXISTS (SELECT FROM ledger.skip_counts t
                               WHERE t.job = _count_skips.job AND t.shard = v_shard);
        -- A missing row: the INSERT waits only for another transaction
        -- inserting this very row, within the bound; past it, the next.
        BEGIN
            INSERT INTO ledger.skip_counts (job, shard, skipped_overlap)
            VALUES (_count_skips.job, v_shard, skips)
            ON CONFLICT ON CONSTRAINT skip_counts_pkey DO NOTHING;
            IF FOUND THEN
                PERFORM set_config('lock_timeout', v_wait, true);
                RETURN;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            NULL;
        END;
    END LOOP;
    -- All four held: wait for the own row, within the bound.
    BEGIN
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (_count_skips.job, (pg_backend_pid() % 16)::smallint, skips)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + skips;
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
    PERFORM set_config('lock_timeout', v_wait, true);
END
$$;

-- One skip of a start (ledger._start, ledger._start_seat), counted as above.
CREATE FUNCTION ledger._count_skip(job text, wait text)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._count_skips(job, wait, 1);
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
-- superseded): the run row, then the job's 'lost' transition. The caller
-- holds the job's lease row lock.
-- seats: the job is in seats mode (its other running runs stay running).
CREATE FUNCTION ledger._close_lost(run ledger.job_execution_log, reason text, at timestamptz,
                                   seats boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT ledger._close_run(run.run_id, reason, at) THEN
        RETURN;
    END IF;
    SELECT * INTO run FROM ledger.job_execution_log r WHERE r.run_id = run.run_id;
    IF seats THEN
        UPDATE ledger.lease_seats s SET run_id = NULL
         WHERE s.job = run.job AND s.seat = run.seat AND s.run_id = run.run_id;
    END IF;
    PERFORM ledger._set_state(run.job, 'lost', run, seats => seats);
END
$$;
