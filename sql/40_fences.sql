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
        VALUES (_checked_fence.resource, _checked_fence.job, _checked_fence.token, ledger._now())
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
    UPDATE ledger.fences f SET token = advance_fence.token, advanced_at = ledger._now()
     WHERE f.resource = advance_fence.resource;
    RETURN true;
END
$$;
COMMENT ON FUNCTION ledger.advance_fence(text, text, bigint) IS
    'Strict fence: record the job''s current token if greater than the highest accepted; false when it already wrote';

-- The hot path of the lenient fence: the arguments checked in one
-- expression, and one statement that locks the fence and reads the lease
-- (both by primary key); ledger._checked_fence only for the rest (a first
-- write, an error to raise).
CREATE FUNCTION ledger.fence(job text, resource text, token bigint)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_recorded bigint;
    v_bound    ledger.label;
    v_live     boolean;
BEGIN
    IF job IS NULL OR resource IS NULL OR token IS NULL OR token <= 0
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(resource) BETWEEN 1 AND 200 AND ledger._is_visible_text(resource)) THEN
        v_recorded := ledger._checked_fence(job, resource, token);  -- raises the documented error
    END IF;
    SELECT f.token, f.job,
           coalesce(l.token = fence.token AND l.released_at IS NULL AND l.expires_at > ledger._now(), false)
      INTO v_recorded, v_bound, v_live
      FROM ledger.fences f
      LEFT JOIN ledger.leases l ON l.job = fence.job
     WHERE f.resource = fence.resource
       FOR UPDATE OF f;
    IF NOT FOUND OR NOT v_live THEN
        -- A first write, or LD001: the long way, in the documented order.
        v_recorded := ledger._checked_fence(job, resource, token);
    ELSIF v_bound <> job THEN
        PERFORM ledger._raise('LD006',
            format('fence of another job: resource %s belongs to job %s, not %s', resource, v_bound, job),
            jsonb_build_object('resource', resource, 'job', job, 'bound_job', v_bound, 'token', token));
    ELSIF v_recorded > token THEN
        -- Current when checked, yet a newer token already wrote: a takeover
        -- committed in between.
        PERFORM ledger._raise('LD002',
            format('stale fence token: resource %s accepted token %s, got %s', resource, v_recorded, token),
            jsonb_build_object('resource', resource, 'job', job, 'token', token, 'highest_token', v_recorded));
    END IF;
    -- Lenient: the current holder may write many times with one token.
    IF v_recorded < token THEN
        UPDATE ledger.fences f SET token = fence.token, advanced_at = ledger._now()
         WHERE f.resource = fence.resource;
    END IF;
    RETURN token;
END
$$;
COMMENT ON FUNCTION ledger.fence(text, text, bigint) IS
    'Lenient fence: accept the job''s current token if >= the highest accepted and return it; LD002 when lower';
