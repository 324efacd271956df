-- 0013 undone: back to 0012

CREATE OR REPLACE FUNCTION ledger._count_skip(job text, wait text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_wait  text := current_setting('lock_timeout');
    v_shard smallint;
BEGIN
    BEGIN
        PERFORM set_config('lock_timeout', wait, true);
        FOR v_spare IN 0 .. 3 LOOP
            v_shard := (pg_backend_pid() % 16 + 16 * v_spare)::smallint;
            UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + 1
              FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                     WHERE t.job = _count_skip.job AND t.shard = v_shard
                       FOR UPDATE SKIP LOCKED) free_
             WHERE s.job = free_.job AND s.shard = free_.shard;
            IF NOT FOUND THEN
                -- no row, or a held one: DO NOTHING waits for no row lock
                INSERT INTO ledger.skip_counts (job, shard, skipped_overlap)
                VALUES (_count_skip.job, v_shard, 1)
                ON CONFLICT ON CONSTRAINT skip_counts_pkey DO NOTHING;
            END IF;
            IF FOUND THEN
                PERFORM set_config('lock_timeout', v_wait, true);
                RETURN;
            END IF;
        END LOOP;
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (_count_skip.job, (pg_backend_pid() % 16)::smallint, 1)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + 1;
        PERFORM set_config('lock_timeout', v_wait, true);
    EXCEPTION WHEN lock_not_available THEN
        NULL;
    END;
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
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (_record_skipped.job, (pg_backend_pid() % 16)::smallint, v_count)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + excluded.skipped_overlap;
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
        INSERT INTO ledger.skip_counts AS s (job, shard, skipped_overlap)
        VALUES (v_job, (pg_backend_pid() % 16)::smallint, 1)
        ON CONFLICT ON CONSTRAINT skip_counts_pkey DO UPDATE SET skipped_overlap = s.skipped_overlap + 1;
    END IF;
END
$function$;

-- Left in place for the calls in flight across this change (old bodies call them):
--   ledger._count_skips(text,text,bigint)
