-- Leases: a per-job, time-limited lock with a fencing token, taken by
-- compare-and-set on the job's row in ledger.leases.

CREATE FUNCTION ledger.acquire(job text, owner text, ttl interval DEFAULT NULL)
RETURNS SETOF ledger.lease
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_now      timestamptz;
    v_ttl      interval;
    v_timeline integer;
    v_lease    ledger.lease;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_label(owner, 'owner');
    v_ttl := ledger._resolve_ttl(job, ttl);
    v_now := clock_timestamp();
    v_timeline := ledger._timeline();

    -- One statement: the row lock taken by ON CONFLICT makes the check and
    -- the take atomic, so two callers can never both win. The clock is read
    -- again once the row is locked: a caller that waited for the previous
    -- holder must not date its lease before that holder let go.
    INSERT INTO ledger.leases AS l
        (job, owner, token, ttl, acquired_at, expires_at, released_at, timeline)
    VALUES (acquire.job, acquire.owner, ledger._next_token(NULL, NULL, v_timeline),
            v_ttl, v_now, v_now + v_ttl, NULL, v_timeline)
    ON CONFLICT ON CONSTRAINT leases_pkey DO UPDATE SET
        owner       = excluded.owner,
        token       = ledger._next_token(l.token, l.timeline, excluded.timeline),
        ttl         = excluded.ttl,
        (acquired_at, expires_at) = (SELECT now_.at, now_.at + excluded.ttl
                                       FROM (SELECT clock_timestamp() AS at) now_),
        released_at = NULL,
        timeline    = excluded.timeline
    WHERE l.expires_at <= clock_timestamp()
       OR l.released_at IS NOT NULL
       OR l.owner = excluded.owner
    RETURNING l.job, l.owner, l.token, l.acquired_at, l.expires_at
    INTO v_lease;

    IF FOUND THEN
        PERFORM ledger._make_durable();
        RETURN NEXT v_lease;
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

CREATE FUNCTION ledger.assert_current(job text, token bigint)
RETURNS void
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lease ledger.leases;
    v_now   timestamptz := clock_timestamp();
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._check_token(token);
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = assert_current.job;
    IF v_lease.token = token AND v_lease.released_at IS NULL AND v_lease.expires_at > v_now THEN
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
COMMENT ON FUNCTION ledger.assert_current(text, bigint) IS
    'Raise LD001 unless is_current: the runner''s last check before a side effect';
