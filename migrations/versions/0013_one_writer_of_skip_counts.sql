-- 0013: one writer of skip counts (drafted by tools/draft_revision.py from sql/)

CREATE OR REPLACE FUNCTION ledger._count_skips(job text, wait text, skips bigint)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._count_skips(text,text,bigint) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._count_skips(text,text,bigint) FROM PUBLIC;

COMMENT ON FUNCTION ledger._count_skips(text,text,bigint) IS NULL;

CREATE OR REPLACE FUNCTION ledger._count_skip(job text, wait text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM ledger._count_skips(job, wait, 1);
END
$function$;

CREATE OR REPLACE FUNCTION ledger._record_skipped(job text, due timestamp with time zone[], from_i integer, to_i integer, reason text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_count bigint := to_i - from_i + 1;
BEGIN
    IF v_count < 1 THEN
        RETURN;
    END IF;
    INSERT INTO ledger.skipped_slots (job, first_slot, last_slot, slot_count, reason)
    VALUES (job, due[from_i], due[to_i], v_count, reason);
    IF reason = 'start_deadline' THEN
        PERFORM ledger._set_state(job, 'skipped_deadline', slots => v_count);
    ELSE
        PERFORM ledger._count_skips(job, ledger._lock_wait(), v_count);
    END IF;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._skip_trigger(trigger_id bigint, reason text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job text;
BEGIN
    UPDATE ledger.triggers t SET status = 'skipped', skip_reason = reason, resolved_at = ledger._now()
     WHERE t.trigger_id = _skip_trigger.trigger_id AND t.status = 'pending'
    RETURNING t.job INTO v_job;
    IF FOUND AND reason = 'overlap' THEN
        PERFORM ledger._count_skips(v_job, ledger._lock_wait(), 1);
    END IF;
END
$function$;
