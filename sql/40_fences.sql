-- Fences: the resource side of fencing. A fence remembers, per resource, the
-- highest token it accepted. Call it in the same transaction as the write it
-- guards, so the fence moves and the write commits together, or neither does.

CREATE FUNCTION ledger.advance_fence(resource text, token bigint)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._check_label(resource, 'resource');
    PERFORM ledger._check_token(token);
    -- Strict: at most one fenced write per token.
    INSERT INTO ledger.fences AS f (resource, token, advanced_at)
    VALUES (advance_fence.resource, advance_fence.token, clock_timestamp())
    ON CONFLICT ON CONSTRAINT fences_pkey DO UPDATE SET
        token = excluded.token,
        advanced_at = excluded.advanced_at
    WHERE f.token < excluded.token;
    RETURN FOUND;
END
$$;
COMMENT ON FUNCTION ledger.advance_fence(text, bigint) IS
    'Strict fence: record the token if greater than the highest accepted; false otherwise';

CREATE FUNCTION ledger.fence(resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_highest bigint;
BEGIN
    PERFORM ledger._check_label(resource, 'resource');
    PERFORM ledger._check_token(token);
    -- Lenient: the current holder may write many times with one token.
    INSERT INTO ledger.fences AS f (resource, token, advanced_at)
    VALUES (fence.resource, fence.token, clock_timestamp())
    ON CONFLICT ON CONSTRAINT fences_pkey DO UPDATE SET
        token = excluded.token,
        advanced_at = excluded.advanced_at
    WHERE f.token <= excluded.token;
    IF FOUND THEN
        RETURN token;
    END IF;
    SELECT f.token INTO v_highest FROM ledger.fences f WHERE f.resource = fence.resource;
    PERFORM ledger._raise('LD002',
        format('stale fence token: resource %s accepted token %s, got %s', resource, v_highest, token),
        jsonb_build_object('resource', resource, 'token', token, 'highest_token', v_highest));
    RETURN NULL;
END
$$;
COMMENT ON FUNCTION ledger.fence(text, bigint) IS
    'Lenient fence: accept a token >= the highest accepted and return it; LD002 when lower';
