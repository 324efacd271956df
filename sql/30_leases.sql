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
           AND l.expires_at > ledger._now());
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
