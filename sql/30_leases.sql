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
       AND (l.released_at IS NOT NULL OR l.expires_at <= ledger._now() OR l.owner = acquire.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = acquire.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now()
           AND v_lease.owner <> owner THEN
            RETURN;  -- held: no row, no lock, nothing written
        END IF;
        v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
        v_took := ledger._lock_lease(job, owner, v_ttl, v_timeline);
        v_lease := v_took.lease;
        v_state := v_took.state;
        IF v_state = 'created' THEN
            PERFORM ledger._set_state(job, 'leased');
            -- a first lease row of a job in a full pool: removed again (its
            -- token was never handed out, and no one else has seen the row)
            IF v_lease.pool IS NOT NULL AND NOT ledger._pool_admits(job, v_lease.pool) THEN
                DELETE FROM ledger.leases l WHERE l.job = acquire.job;
                PERFORM ledger._set_state(job, 'skipped_pool_full');
                RETURN;
            END IF;
            RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
            RETURN;
        ELSIF v_state <> 'locked' THEN
            RETURN;
        END IF;
    END IF;

    -- Seats mode: the row locked is the token counter; a seat is the lease.
    IF v_lease.multi THEN
        RETURN QUERY SELECT * FROM ledger._acquire_seat(job, owner, v_ttl, v_lease.pool);
        RETURN;
    END IF;

    -- POOL CHECK: before a token is issued (the lease row carries the
    -- job's pool; a job in none pays one test). Not admitted: no row.
    IF v_lease.pool IS NOT NULL AND NOT ledger._pool_admits(job, v_lease.pool) THEN
        PERFORM ledger._set_state(job, 'skipped_pool_full');
        RETURN;
    END IF;
    -- Locked, and free, expired or ours: take it with a new token. The
    -- clock is read once the row is locked: a caller that waited for the
    -- previous holder must not date its lease before that holder let go.
    v_now := ledger._now();
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
    -- A job that holds a lease is known (job_status lists it): its state row
    -- exists, or exists from now on (after unregister_job with history). The
    -- 'leased' transition only makes the row; a read under the lease row's
    -- lock (no other writer of this job's row can run) saves the call when
    -- the row is there, as it is for every job but a first or forgotten one.
    IF NOT EXISTS (SELECT FROM ledger.counters c WHERE c.job = acquire.job) THEN
        PERFORM ledger._set_state(job, 'leased');
    END IF;
    RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
END
$$;

-- The free seat of a job in seats mode whose lease row the caller holds
-- locked (FOR UPDATE), the seats locked with it in seat order: NULL when
-- max_concurrent seats are live already. A free seat is the lowest of 1 ..
-- max_concurrent whose row is missing, released or expired; seats above
-- max_concurrent (it was lowered) still count while they are live. The
-- owner does not matter: one owner may hold several seats, and a second
-- start of the same owner takes another seat (it does not supersede its
-- first, as it does for a single holder).
CREATE FUNCTION ledger._free_seat(job text, at timestamptz)
RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_max  integer;
    v_live integer;
BEGIN
    SELECT j.max_concurrent INTO v_max FROM ledger.jobs j WHERE j.job = _free_seat.job;
    v_max := coalesce(v_max, 1);  -- unregistered: one seat
    -- the seats, locked in seat order (after the lease row, as every writer)
    PERFORM FROM ledger.lease_seats s WHERE s.job = _free_seat.job ORDER BY s.seat FOR UPDATE;
    SELECT count(*) INTO v_live FROM ledger.lease_seats s
     WHERE s.job = _free_seat.job AND s.released_at IS NULL AND s.expires_at > at;
    IF v_live >= v_max THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT g.n FROM generate_series(1, v_max) AS g(n)
             WHERE NOT EXISTS (SELECT FROM ledger.lease_seats s
                                WHERE s.job = _free_seat.job AND s.seat = g.n
                                  AND s.released_at IS NULL AND s.expires_at > at)
             ORDER BY g.n LIMIT 1);
END
$$;

-- Seat `seat` (free: ledger._free_seat) taken with a new token from the
-- job's lease row, which the caller holds locked. The pool, if the job has
-- one, admitted the start before this (ledger._pool_admits): a token is
-- issued only to a start that may run.
CREATE FUNCTION ledger._take_seat(job text, seat integer, owner text, ttl interval, at timestamptz)
RETURNS ledger.lease_seats
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_timeline integer;
    v_token    bigint;
    v_row      ledger.lease_seats;
BEGIN
    v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
    -- The row stays released: only the counter moves (ledger._next_token, inline).
    UPDATE ledger.leases l SET
        owner       = _take_seat.owner,
        token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                           ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
        ttl         = _take_seat.ttl,
        acquired_at = at,
        expires_at  = at,
        released_at = at,
        timeline    = v_timeline
     WHERE l.job = _take_seat.job
    RETURNING l.token INTO v_token;
    INSERT INTO ledger.lease_seats AS s (job, seat, owner, token, ttl, acquired_at, expires_at, released_at)
    VALUES (_take_seat.job, _take_seat.seat, _take_seat.owner, v_token, _take_seat.ttl, at, at + _take_seat.ttl, NULL)
    ON CONFLICT ON CONSTRAINT lease_seats_pkey DO UPDATE SET
        owner = excluded.owner, token = excluded.token, ttl = excluded.ttl,
        acquired_at = excluded.acquired_at, expires_at = excluded.expires_at, released_at = NULL, run_id = NULL
    RETURNING * INTO v_row;
    RETURN v_row;
END
$$;

-- acquire of a job in seats mode, its lease row locked: a seat, or no row
-- when every seat is live or the job's pool is full. Unlike a single
-- holder's acquire, it closes the runs whose seats were lost first
-- (ledger._close_lost_seats).
CREATE FUNCTION ledger._acquire_seat(job text, owner text, ttl interval, pool text)
RETURNS SETOF ledger.lease
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now  timestamptz := ledger._now();
    v_free integer;
    v_seat ledger.lease_seats;
BEGIN
    -- a seat's lost run is closed before anyone takes the seat (as a start does)
    PERFORM ledger._close_lost_seats(job, v_now);
    v_free := ledger._free_seat(job, v_now);
    IF v_free IS NULL THEN
        RETURN;
    END IF;
    IF pool IS NOT NULL THEN
        IF NOT ledger._pool_admits(job, pool) THEN
            PERFORM ledger._set_state(job, 'skipped_pool_full');
            RETURN;
        END IF;
        v_now := ledger._now();  -- dated after the admission, as a single holder's
    END IF;
    v_seat := ledger._take_seat(job, v_free, owner, ttl, v_now);
    IF NOT EXISTS (SELECT FROM ledger.counters c WHERE c.job = _acquire_seat.job) THEN
        PERFORM ledger._set_state(job, 'leased');
    END IF;
    RETURN NEXT (v_seat.job, v_seat.owner, v_seat.token, v_seat.acquired_at, v_seat.expires_at)::ledger.lease;
END
$$;

-- The live seat of a job that holds `token` (NULL: none), read without a
-- lock: the failure path of the checks of a live token on the lease row.
CREATE FUNCTION ledger._live_seat(job text, token bigint)
RETURNS ledger.lease_seats
LANGUAGE plpgsql
STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_seat ledger.lease_seats;
BEGIN
    SELECT * INTO v_seat FROM ledger.lease_seats s
     WHERE s.job = _live_seat.job AND s.token = _live_seat.token
       AND s.released_at IS NULL AND s.expires_at > ledger._now();
    RETURN v_seat;
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
       SET expires_at = ledger._now() + ledger._exact(coalesce(renew.ttl, l.ttl)),
           ttl        = ledger._exact(coalesce(renew.ttl, l.ttl))
     WHERE l.job = renew.job
       AND l.owner = renew.owner
       AND l.token = renew.token
       AND l.released_at IS NULL
    RETURNING l.expires_at INTO v_expires;
    IF NOT FOUND THEN
        -- Seats mode (or a lost lease): the seat that holds the token, under
        -- the job's lease row lock.
        PERFORM FROM ledger.leases l WHERE l.job = renew.job AND l.multi FOR UPDATE;
        IF FOUND THEN
            UPDATE ledger.lease_seats s
               SET expires_at = ledger._now() + ledger._exact(coalesce(renew.ttl, s.ttl)),
                   ttl        = ledger._exact(coalesce(renew.ttl, s.ttl))
             WHERE s.job = renew.job AND s.owner = renew.owner AND s.token = renew.token
               AND s.released_at IS NULL
            RETURNING s.expires_at INTO v_expires;
        END IF;
    END IF;
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
    v_now timestamptz := ledger._now();
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
    IF FOUND THEN
        RETURN true;
    END IF;
    -- Seats mode: the seat that holds the token, under the lease row lock.
    PERFORM FROM ledger.leases l WHERE l.job = release.job AND l.multi FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE ledger.lease_seats s
       SET expires_at  = least(s.expires_at, v_now),
           released_at = v_now
     WHERE s.job = release.job AND s.owner = release.owner AND s.token = release.token
       AND s.released_at IS NULL;
    -- a seat freed wakes the job and its pool (trigger lease_seats_wake)
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
           AND l.expires_at > ledger._now())
        -- seats mode: a live seat with the token
        OR EXISTS (
        SELECT FROM ledger.lease_seats s
         WHERE s.job = is_current.job
           AND s.token = is_current.token
           AND s.released_at IS NULL
           AND s.expires_at > ledger._now());
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
    IF v_lease.token = token AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now() THEN
        RETURN;
    END IF;
    -- Seats mode: a live seat with the token (each holder its own token).
    IF v_lease.multi AND (ledger._live_seat(job, token)).job IS NOT NULL THEN
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
