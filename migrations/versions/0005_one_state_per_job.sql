-- 0005: one state per job (drafted by tools/draft_revision.py from sql/; by hand: the audit's
-- type, the locks, the tables, the backfill, the new view ledger._job_state and the triggers)

-- By hand: the audit's declared result type (a function is created after its result type).
CREATE TYPE ledger.state_difference AS (
    job         text,
    state       text,
    differences jsonb
);

ALTER TYPE ledger.state_difference OWNER TO ledger_owner;

CREATE OR REPLACE FUNCTION ledger._failing_after()
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $function$ SELECT 1 $function$;

ALTER FUNCTION ledger._failing_after() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._failing_after() FROM PUBLIC;

COMMENT ON FUNCTION ledger._failing_after() IS NULL;

GRANT EXECUTE ON FUNCTION ledger._failing_after() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._failing_after() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._lock_lease(job text, owner text, ttl interval, timeline integer, OUT lease ledger.leases, OUT state text)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
            INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, timeline)
            SELECT _lock_lease.job, _lock_lease.owner, ledger._next_token(NULL, NULL, timeline),
                   ttl, now_.at, now_.at + ttl, timeline
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
$function$;

CREATE OR REPLACE FUNCTION ledger._lock_lease_to_be(job text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('ledger.leases'), hashtext(job));
END
$function$;

ALTER FUNCTION ledger._lock_lease_to_be(text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._lock_lease_to_be(text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._lock_lease_to_be(text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._lock_registration(job text)
 RETURNS ledger.leases
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
$function$;

ALTER FUNCTION ledger._lock_registration(text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._lock_registration(text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._lock_registration(text) IS NULL;

CREATE OR REPLACE FUNCTION ledger._close_lost(run ledger.job_execution_log, reason text, at timestamp with time zone)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF NOT ledger._close_run(run.run_id, reason, at) THEN
        RETURN;
    END IF;
    SELECT * INTO run FROM ledger.job_execution_log r WHERE r.run_id = run.run_id;
    PERFORM ledger._set_state(run.job, 'lost', run);
END
$function$;

CREATE OR REPLACE FUNCTION ledger._due_marks(spec ledger.schedule_spec, time_zone text, done timestamp with time zone, OUT next_due timestamp with time zone, OUT down_due timestamp with time zone)
 RETURNS record
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF spec.kind IS NULL OR done IS NULL THEN
        RETURN;
    END IF;
    next_due := ledger._slot_after(spec, time_zone, done);
    down_due := next_due;
    FOR i IN 2 .. ledger._down_after_slots() LOOP
        EXIT WHEN down_due IS NULL;
        down_due := ledger._slot_after(spec, time_zone, down_due);
    END LOOP;
END
$function$;

ALTER FUNCTION ledger._due_marks(ledger.schedule_spec,text,timestamp with time zone) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._due_marks(ledger.schedule_spec,text,timestamp with time zone) FROM PUBLIC;

COMMENT ON FUNCTION ledger._due_marks(ledger.schedule_spec,text,timestamp with time zone) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._due_marks(ledger.schedule_spec,text,timestamp with time zone) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._due_marks(ledger.schedule_spec,text,timestamp with time zone) TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._state_from_log(jobs text[])
 RETURNS TABLE(job text, last_run_id bigint, last_status text, last_started_at timestamp with time zone, last_completed_at timestamp with time zone, last_success_started_at timestamp with time zone, last_success_at timestamp with time zone, running_run_id bigint, running_token bigint, running_started_at timestamp with time zone, done_slot timestamp with time zone, longest_success interval, consecutive_failures bigint, next_due timestamp with time zone, latest_end timestamp with time zone, overlap_run_id bigint, down_due timestamp with time zone)
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET plan_cache_mode TO 'force_custom_plan'
AS $function$
BEGIN
    RETURN QUERY
    WITH r AS MATERIALIZED (
        SELECT l.job, l.run_id, l.status, l.failure_reason, l.slot, l.token, l.started_at, l.completed_at,
               -- as ledger.overlaps defines an overlap: a run that started
               -- before a run started earlier had ended
               max(coalesce(l.completed_at, 'infinity')) OVER (
                   PARTITION BY l.job ORDER BY l.started_at, l.run_id
                   ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS earlier_end
          FROM ledger.job_execution_log l WHERE l.job = ANY (_state_from_log.jobs)
    ), last_run AS (
        SELECT DISTINCT ON (r.job) r.job, r.run_id, r.status, r.started_at, r.completed_at
          FROM r ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), last_success AS (
        SELECT DISTINCT ON (r.job) r.job, r.started_at, r.completed_at
          FROM r WHERE r.status = 'success' ORDER BY r.job, r.started_at DESC, r.run_id DESC
    ), running AS (
        SELECT r.job, r.run_id, r.token, r.started_at FROM r WHERE r.status = 'running'
    ), totals AS (
        SELECT r.job,
               max(r.slot) FILTER (WHERE r.status = 'success') AS done_slot,
               max(r.completed_at - r.started_at) FILTER (WHERE r.status = 'success') AS longest_success,
               max(r.completed_at) AS latest_end
          FROM r GROUP BY r.job
    ), failures AS (
        -- a cancel is no failure of the streak
        SELECT r.job, count(*) AS streak
          FROM r LEFT JOIN last_success s ON s.job = r.job
         WHERE r.status = 'failure' AND r.failure_reason <> 'cancelled'
           AND r.started_at > coalesce(s.started_at, '-infinity')
         GROUP BY r.job
    ), overlap AS (
        SELECT DISTINCT ON (r.job) r.job, r.run_id
          FROM r WHERE r.earlier_end > r.started_at ORDER BY r.job, r.started_at DESC, r.run_id DESC
    )
    SELECT t.job::text, lr.run_id, lr.status, lr.started_at, lr.completed_at, ls.started_at, ls.completed_at,
           rn.run_id, rn.token, rn.started_at, tt.done_slot,
           greatest(tt.longest_success, p.longest_success),
           coalesce(f.streak, 0)
               + CASE WHEN p.streak_after IS NOT DISTINCT FROM ls.started_at THEN coalesce(p.streak_failures, 0)
                      ELSE 0 END,
           m.next_due, tt.latest_end, o.run_id, m.down_due
      FROM (SELECT DISTINCT u.job FROM unnest(_state_from_log.jobs) AS u(job)) t
      LEFT JOIN last_run lr ON lr.job = t.job
      LEFT JOIN last_success ls ON ls.job = t.job
      LEFT JOIN running rn ON rn.job = t.job
      LEFT JOIN totals tt ON tt.job = t.job
      LEFT JOIN failures f ON f.job = t.job
      LEFT JOIN overlap o ON o.job = t.job
      LEFT JOIN ledger.purged_state p ON p.job = t.job
      LEFT JOIN ledger.jobs j ON j.job = t.job
      LEFT JOIN LATERAL ledger._due_marks(j.schedule_spec, j.time_zone, coalesce(tt.done_slot, j.created_at)) m
             ON true;
END
$function$;

ALTER FUNCTION ledger._state_from_log(text[]) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._state_from_log(text[]) FROM PUBLIC;

COMMENT ON FUNCTION ledger._state_from_log(text[]) IS NULL;

CREATE OR REPLACE FUNCTION ledger._set_state(job text, event text, run ledger.job_execution_log DEFAULT NULL::ledger.job_execution_log, slots bigint DEFAULT NULL::bigint)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job    ledger.jobs;
    v_streak bigint;
    v_counts boolean;  -- the run's end is a failure of the streak
    v_next   timestamptz;  -- the due marks after the run's slot
    v_down   timestamptz;
BEGIN
    PERFORM FROM ledger.leases l WHERE l.job = _set_state.job FOR UPDATE;
    CASE event
    WHEN 'leased' THEN
        INSERT INTO ledger.counters AS c (job) VALUES (_set_state.job)
        ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
    WHEN 'registration' THEN
        SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = _set_state.job;
        INSERT INTO ledger.counters AS c (job) VALUES (_set_state.job)
        ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
        UPDATE ledger.counters c SET (next_due, down_due) =
               (SELECT m.next_due, m.down_due
                  FROM ledger._due_marks(v_job.schedule_spec, v_job.time_zone,
                                         coalesce(c.done_slot, v_job.created_at)) m)
         WHERE c.job = _set_state.job;
    WHEN 'started' THEN
        INSERT INTO ledger.counters AS c (job, runs_started, last_run_id, last_status, last_started_at,
                                          running_run_id, running_token, running_started_at)
        VALUES (run.job, 1, run.run_id, 'running', run.started_at, run.run_id, run.token, run.started_at)
        ON CONFLICT ON CONSTRAINT counters_pkey DO UPDATE SET
            runs_started       = c.runs_started + 1,
            last_run_id        = CASE WHEN c.last_run_id IS NULL
                                        OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                      THEN excluded.last_run_id ELSE c.last_run_id END,
            last_status        = CASE WHEN c.last_run_id IS NULL
                                        OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                      THEN 'running' ELSE c.last_status END,
            last_completed_at  = CASE WHEN c.last_run_id IS NULL
                                        OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                      THEN NULL ELSE c.last_completed_at END,
            last_started_at    = CASE WHEN c.last_run_id IS NULL
                                        OR (excluded.last_started_at, excluded.last_run_id) > (c.last_started_at, c.last_run_id)
                                      THEN excluded.last_started_at ELSE c.last_started_at END,
            running_run_id     = excluded.running_run_id,
            running_token      = excluded.running_token,
            running_started_at = excluded.running_started_at,
            -- started before an earlier run ended: only a clock stepped back
            -- can do that here (the start closed the previous run first)
            overlap_run_id     = CASE WHEN excluded.last_started_at < c.latest_end THEN excluded.running_run_id
                                      ELSE c.overlap_run_id END;
    WHEN 'ended', 'lost' THEN
        v_counts := run.status = 'failure' AND run.failure_reason <> 'cancelled';
        -- A success of a slot: the due marks after it, the schedule evaluated
        -- here, once, and never by a read (applied below if the slot is newer
        -- than the newest done).
        IF run.status = 'success' AND run.slot IS NOT NULL THEN
            SELECT m.next_due, m.down_due INTO v_next, v_down
              FROM ledger.jobs j, ledger._due_marks(j.schedule_spec, j.time_zone, run.slot) m
             WHERE j.job = run.job AND j.schedule IS NOT NULL;
        END IF;
        -- Count once, note the run's end, and fold in the skips counted
        -- since (those whose rows no skipper holds right now; the rest wait
        -- for the next end).
        WITH folded AS (
            UPDATE ledger.skip_counts s SET skipped_overlap = 0
              FROM (SELECT t.job, t.shard, t.skipped_overlap FROM ledger.skip_counts t
                     WHERE t.job = run.job AND t.skipped_overlap > 0
                       FOR UPDATE SKIP LOCKED) pending
             WHERE s.job = pending.job AND s.shard = pending.shard
            RETURNING pending.skipped_overlap
        )
        UPDATE ledger.counters c SET
            successes               = c.successes + CASE WHEN run.status = 'success' THEN 1 ELSE 0 END,
            failures                = c.failures + CASE WHEN run.status = 'success' THEN 0 ELSE 1 END,
            leases_lost             = c.leases_lost + CASE WHEN event = 'lost' THEN 1 ELSE 0 END,
            skipped_overlap         = c.skipped_overlap + coalesce((SELECT sum(f.skipped_overlap) FROM folded f), 0),
            last_status             = CASE WHEN c.last_run_id = run.run_id THEN run.status ELSE c.last_status END,
            last_completed_at       = CASE WHEN c.last_run_id = run.run_id THEN run.completed_at
                                           ELSE c.last_completed_at END,
            running_run_id          = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_run_id END,
            running_token           = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_token END,
            running_started_at      = CASE WHEN c.running_run_id = run.run_id THEN NULL ELSE c.running_started_at END,
            last_success_started_at = CASE WHEN run.status = 'success'
                                            AND run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                           THEN run.started_at ELSE c.last_success_started_at END,
            last_success_at         = CASE WHEN run.status = 'success'
                                            AND run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                           THEN run.completed_at ELSE c.last_success_at END,
            done_slot               = CASE WHEN run.status = 'success' AND run.slot IS NOT NULL
                                           THEN greatest(c.done_slot, run.slot) ELSE c.done_slot END,
            -- a success that moves done_slot on moves the due marks on
            next_due                = CASE WHEN v_next IS NOT NULL AND run.slot > coalesce(c.done_slot, '-infinity')
                                           THEN v_next ELSE c.next_due END,
            down_due                = CASE WHEN v_next IS NOT NULL AND run.slot > coalesce(c.done_slot, '-infinity')
                                           THEN v_down ELSE c.down_due END,
            longest_success         = CASE WHEN run.status = 'success'
                                           THEN greatest(c.longest_success, run.completed_at - run.started_at)
                                           ELSE c.longest_success END,
            latest_end              = greatest(c.latest_end, run.completed_at),
            -- failures that started after the last success: none after this
            -- one; a cancel neither adds nor resets
            consecutive_failures    = CASE
                                          WHEN v_counts
                                          THEN c.consecutive_failures
                                               + CASE WHEN run.started_at > coalesce(c.last_success_started_at, '-infinity')
                                                      THEN 1 ELSE 0 END
                                          WHEN run.status = 'success'
                                           AND run.started_at >= coalesce(c.last_success_started_at, '-infinity')
                                          THEN 0
                                          ELSE c.consecutive_failures END
         WHERE c.job = run.job
        RETURNING c.consecutive_failures INTO v_streak;
        IF NOT FOUND THEN
            -- A run written past the functions, with no state row yet: one
            -- from the log, which has this end already.
            INSERT INTO ledger.counters AS c (job, successes, failures, leases_lost)
            VALUES (run.job, CASE WHEN run.status = 'success' THEN 1 ELSE 0 END,
                    CASE WHEN run.status = 'success' THEN 0 ELSE 1 END, CASE WHEN event = 'lost' THEN 1 ELSE 0 END);
            PERFORM ledger._set_state(run.job, 'recomputed');
            SELECT c.consecutive_failures INTO v_streak FROM ledger.counters c WHERE c.job = run.job;
        END IF;
        -- A failure may pause the job (pause_after_failures): one more
        -- statement on the failure path only, none on a success or a cancel.
        IF v_counts THEN
            PERFORM ledger._auto_pause(run.job, v_streak, run.completed_at);
        END IF;
    WHEN 'skipped_backfill' THEN
        UPDATE ledger.counters c SET skipped_backfill = c.skipped_backfill + slots WHERE c.job = _set_state.job;
    WHEN 'forgotten' THEN
        DELETE FROM ledger.counters c WHERE c.job = _set_state.job;
        DELETE FROM ledger.purged_state p WHERE p.job = _set_state.job;
    WHEN 'recomputed' THEN
        INSERT INTO ledger.counters AS c (job) VALUES (_set_state.job)
        ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;
        UPDATE ledger.counters c SET
            last_run_id = s.last_run_id, last_status = s.last_status, last_started_at = s.last_started_at,
            last_completed_at = s.last_completed_at, last_success_started_at = s.last_success_started_at,
            last_success_at = s.last_success_at, running_run_id = s.running_run_id,
            running_token = s.running_token, running_started_at = s.running_started_at,
            done_slot = s.done_slot, longest_success = s.longest_success,
            consecutive_failures = s.consecutive_failures, next_due = s.next_due, down_due = s.down_due,
            latest_end = s.latest_end, overlap_run_id = s.overlap_run_id
          FROM ledger._state_from_log(ARRAY[_set_state.job]) s
         WHERE c.job = _set_state.job;
    ELSE
        RAISE EXCEPTION 'ledger._set_state: unknown event %', event;
    END CASE;
END
$function$;

ALTER FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint) FROM PUBLIC;

COMMENT ON FUNCTION ledger._set_state(text,text,ledger.job_execution_log,bigint) IS NULL;

CREATE OR REPLACE FUNCTION ledger._refresh_state(jobs text[], after_purge boolean DEFAULT false)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job text;
BEGIN
    FOR v_job IN SELECT DISTINCT u.job FROM unnest(jobs) AS u(job) ORDER BY 1 LOOP
        PERFORM ledger._set_state(v_job, 'recomputed');
    END LOOP;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._foreign_job_write()
 RETURNS trigger
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    IF TG_TABLE_NAME = 'leases' THEN
        PERFORM ledger._set_state(NEW.job, 'leased');
    ELSIF TG_OP = 'DELETE' THEN
        -- as unregister_job without history: known still by a lease, else gone
        PERFORM ledger._set_state(OLD.job, CASE WHEN EXISTS (SELECT FROM ledger.leases l WHERE l.job = OLD.job)
                                                 THEN 'registration' ELSE 'forgotten' END);
    ELSE
        PERFORM ledger._set_state(NEW.job, 'registration');
    END IF;
    RETURN NULL;
END
$function$;

ALTER FUNCTION ledger._foreign_job_write() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._foreign_job_write() FROM PUBLIC;

COMMENT ON FUNCTION ledger._foreign_job_write() IS NULL;

CREATE OR REPLACE FUNCTION ledger.verify_state()
 RETURNS SETOF ledger.state_difference
 LANGUAGE plpgsql
 STABLE SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    RETURN QUERY
    WITH known AS (
        SELECT c.job::text AS job FROM ledger.counters c
        UNION SELECT j.job::text FROM ledger.jobs j
        UNION SELECT DISTINCT r.job::text FROM ledger.job_execution_log r
    ), expected AS (
        SELECT to_jsonb(e) - 'job' AS doc, e.job FROM ledger._state_from_log(ARRAY(SELECT k.job FROM known k)) e
    ), compared AS (
        SELECT x.job,
               CASE WHEN c.job IS NULL THEN jsonb_build_object('row', jsonb_build_object('stored', NULL,
                                                                                          'expected', 'present'))
                    ELSE (SELECT jsonb_object_agg(e.key, jsonb_build_object('stored', to_jsonb(c) -> e.key,
                                                                           'expected', e.value))
                            FROM jsonb_each(x.doc) e
                           WHERE (to_jsonb(c) -> e.key) IS DISTINCT FROM e.value) END AS differences
          FROM expected x LEFT JOIN ledger.counters c ON c.job = x.job
    )
    SELECT d.job, s.state, d.differences
      FROM compared d LEFT JOIN ledger._job_state s ON s.job = d.job
     WHERE d.differences IS NOT NULL
     ORDER BY d.job;
END
$function$;

ALTER FUNCTION ledger.verify_state() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.verify_state() FROM PUBLIC;

COMMENT ON FUNCTION ledger.verify_state() IS 'Jobs whose stored state differs from its recomputation from the log and the schedule; always empty when the ledger holds';

GRANT EXECUTE ON FUNCTION ledger.verify_state() TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger.verify_state() TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger.acquire(job text, owner text, ttl interval DEFAULT NULL::interval)
 RETURNS SETOF ledger.lease
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
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
            RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
            RETURN;
        ELSIF v_state <> 'locked' THEN
            RETURN;
        END IF;
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
    -- exists, or exists from now on (after unregister_job with history).
    PERFORM ledger._set_state(job, 'leased');
    RETURN NEXT (v_lease.job, v_lease.owner, v_lease.token, v_lease.acquired_at, v_lease.expires_at)::ledger.lease;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._start(job text, owner text, ttl interval, slot timestamp with time zone, idempotency_key text, detail jsonb)
 RETURNS ledger.run_start
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now      timestamptz;
    v_timeline integer;
    v_lease    ledger.leases;
    v_state    text := 'locked';
    v_took     record;
    v_running  ledger.job_execution_log;
    v_result   ledger.run_start;
BEGIN
    v_result.slot := slot;
    SELECT * INTO v_lease FROM ledger.leases l
     WHERE l.job = _start.job
       AND (l.released_at IS NOT NULL OR l.expires_at <= ledger._now() OR l.owner = _start.owner)
       FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = _start.job;
        IF FOUND AND v_lease.released_at IS NULL AND v_lease.expires_at > ledger._now()
           AND v_lease.owner <> owner THEN
            v_state := 'held';
        ELSE
            v_timeline := ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer;
            v_took := ledger._lock_lease(job, owner, ttl, v_timeline);
            v_lease := v_took.lease;
            v_state := v_took.state;
        END IF;
    END IF;

    IF v_state IN ('held', 'busy') THEN
        -- That slot or key already succeeded or is running (wins over overlap).
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- Another owner's live lease (or a row another transaction holds
        -- past the lock bound): a normal skip, counted apart from failures,
        -- without a WAL flush.
        UPDATE ledger.skip_counts s SET skipped_overlap = s.skipped_overlap + 1
          FROM (SELECT t.job, t.shard FROM ledger.skip_counts t
                 WHERE t.job = _start.job AND t.shard = pg_backend_pid() % 16
                   FOR UPDATE SKIP LOCKED) free_
         WHERE s.job = free_.job AND s.shard = free_.shard;
        IF NOT FOUND THEN
            PERFORM ledger._count_skip(job, wait => CASE v_state WHEN 'held' THEN ledger._lock_wait() ELSE '10ms' END);
        END IF;
        v_result.outcome := 'skipped_overlap';
        v_result.holder := v_lease.owner;
        v_result.holder_expires_at := v_lease.expires_at;
        RETURN v_result;
    END IF;

    IF v_state = 'locked' THEN
        -- Read the clock once locked: a start that waited for the previous
        -- run to end must not date itself before that end.
        v_now := ledger._now();
        -- The previous run, still running while its lease expired, ended
        -- or went to another token? Its runner is gone or a zombie: close
        -- it (counted once, in ledger._close_lost).
        SELECT * INTO v_running FROM ledger.job_execution_log r
         WHERE r.job = _start.job AND r.status = 'running';
        IF FOUND AND (v_lease.token <> v_running.token
                      OR v_lease.released_at IS NOT NULL
                      OR v_lease.expires_at <= v_now) THEN
            PERFORM ledger._close_lost(v_running,
                CASE WHEN v_lease.token <> v_running.token THEN 'superseded' ELSE 'lease_expired' END, v_now);
            v_running := NULL;
        END IF;
        IF (slot IS NOT NULL OR idempotency_key IS NOT NULL)
           AND ledger._already_done(job, slot, idempotency_key) THEN
            v_result.outcome := 'already_done';
            RETURN v_result;
        END IF;
        -- The same owner still holds it: the new token wins.
        IF v_running.run_id IS NOT NULL THEN
            PERFORM ledger._close_lost(v_running, 'superseded', v_now);
        END IF;
        v_timeline := coalesce(v_timeline,
            ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::integer);
        UPDATE ledger.leases l SET
            owner       = _start.owner,
            -- ledger._next_token, inline
            token       = CASE WHEN l.timeline = v_timeline THEN l.token + 1
                               ELSE greatest(l.token + (1::bigint << 32), ((v_timeline - 1)::bigint << 32) + 1) END,
            ttl         = _start.ttl,
            acquired_at = v_now,
            expires_at  = v_now + _start.ttl,
            released_at = NULL,
            timeline    = v_timeline
         WHERE l.job = _start.job
        RETURNING * INTO v_lease;
    END IF;
    -- 'created' (a job with no lease row has no runs: nothing to check) or
    -- taken just now: log the running run, and the job's 'started'
    -- transition counts it and notes it as the job's last and running run.
    INSERT INTO ledger.job_execution_log
        (job, owner, token, slot, idempotency_key, status, started_at, heartbeat_at, detail)
    VALUES (v_lease.job, v_lease.owner, v_lease.token, _start.slot, _start.idempotency_key,
            'running', v_lease.acquired_at, v_lease.acquired_at, _start.detail)
    RETURNING * INTO v_running;
    PERFORM ledger._set_state(v_lease.job, 'started', v_running);
    v_result.run_id := v_running.run_id;
    v_result.outcome := 'started';
    v_result.token := v_lease.token;
    v_result.expires_at := v_lease.expires_at;
    RETURN v_result;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._end_run(run_id bigint, token bigint, status text, failure_reason text, error text, detail jsonb)
 RETURNS ledger.job_execution_log
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job    ledger.label;
    v_run    ledger.job_execution_log;
    v_lease  ledger.leases;
    v_detail jsonb;
    v_error  text := CASE WHEN error IS NULL OR char_length(error) <= ledger._max_error_length() THEN error
                          ELSE ledger._bounded_error(error) END;
BEGIN
    IF detail IS NOT NULL THEN
        PERFORM ledger._check_detail(detail);
    END IF;
    IF run_id IS NULL OR token IS NULL OR run_id <= 0 OR token <= 0 THEN
        PERFORM ledger._check_token(run_id, 'run_id');
        PERFORM ledger._check_token(token);
    END IF;
    SELECT r.job INTO v_job FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
            jsonb_build_object('run_id', run_id));
    END IF;
    -- The per-job order every writer follows: the lease row first.
    SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_job FOR UPDATE;

    IF detail IS NULL THEN
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(ledger._now(), r.started_at)
         WHERE r.run_id = _end_run.run_id AND r.token = _end_run.token
           AND r.token = v_lease.token AND r.status = 'running'
        RETURNING * INTO v_run;
    END IF;
    IF v_run.run_id IS NULL THEN
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.run_id = _end_run.run_id;
        IF NOT FOUND THEN  -- purged or unregistered while this call waited for the lease row
            PERFORM ledger._raise('LD004', format('run not found: %s', run_id),
                jsonb_build_object('run_id', run_id));
        END IF;
        IF v_run.token <> token THEN
            PERFORM ledger._raise('LD001',
                format('lease superseded: run %s holds token %s, not %s', run_id, v_run.token, token),
                jsonb_build_object('run_id', run_id, 'job', v_run.job, 'token', token,
                                   'run_token', v_run.token));
        END IF;
        -- A newer token took the job over: the zombie learns it lost, and the
        -- row keeps the takeover's verdict.
        IF v_lease.token <> v_run.token THEN
            PERFORM ledger._raise('LD001',
                format('lease superseded: job %s is now held with token %s, run %s had token %s',
                       v_run.job, v_lease.token, v_run.run_id, v_run.token),
                jsonb_build_object('run_id', v_run.run_id, 'job', v_run.job, 'token', v_run.token,
                                   'current_token', v_lease.token, 'holder', v_lease.owner,
                                   'verdict', v_run.failure_reason));
        END IF;
        IF v_run.status <> 'running' THEN
            PERFORM ledger._raise_not_running(v_run);
        END IF;
        -- The detail recorded is the start's merged with this one (its keys
        -- win), and the merge is held to the same bound as either part: two
        -- details of 40 kB each would otherwise record 80 kB.
        IF detail IS NOT NULL THEN
            v_detail := coalesce(v_run.detail, '{}'::jsonb) || detail;
            IF octet_length(v_detail::text) > ledger._max_detail_bytes() THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('argument detail, merged with the detail run %s started with, must be at most '
                                     '%s bytes as JSON text', v_run.run_id, ledger._max_detail_bytes()),
                    DETAIL = jsonb_build_object('argument', 'detail', 'run_id', v_run.run_id,
                                                'bytes', octet_length(v_detail::text),
                                                'given_bytes', octet_length(detail::text),
                                                'recorded_bytes', octet_length(v_run.detail::text),
                                                'max', ledger._max_detail_bytes())::text;
            END IF;
        END IF;
        UPDATE ledger.job_execution_log r SET
            status         = _end_run.status,
            failure_reason = _end_run.failure_reason,
            error          = v_error,
            completed_at   = greatest(ledger._now(), r.started_at),
            detail         = coalesce(v_detail, r.detail)
         WHERE r.run_id = v_run.run_id
        RETURNING * INTO v_run;
    END IF;

    -- The token stays: it is the job's high-water mark.
    UPDATE ledger.leases l
       SET expires_at = least(l.expires_at, v_run.completed_at), released_at = v_run.completed_at
     WHERE l.job = v_run.job AND l.released_at IS NULL;
    -- Counted, noted as the job's state, and the pending skips folded in,
    -- by the job's one writer.
    PERFORM ledger._set_state(v_run.job, 'ended', v_run);
    RETURN v_run;
END
$function$;

COMMENT ON FUNCTION ledger.cancel_run(bigint,bigint,text) IS 'End the run as cancelled (status failure, reason cancelled: the runner was told to stop; no failure of the job) and release its lease';

CREATE OR REPLACE FUNCTION ledger.reap_expired(job text DEFAULT NULL::text)
 RETURNS integer
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_now    timestamptz := ledger._now();
    v_closed integer := 0;
    v_lease  ledger.leases;
    v_run    ledger.job_execution_log;
BEGIN
    PERFORM ledger._check_label(job, 'job', false);
    -- SKIP LOCKED: a job whose lease row is locked is being started, renewed
    -- or ended right now, and that writer settles it; concurrent reapers
    -- split the work instead of waiting on each other. FOR UPDATE returns the
    -- row as locked, so the expiry tested below is current, not a snapshot.
    FOR v_lease IN
        SELECT l.* FROM ledger.leases l
         WHERE (reap_expired.job IS NULL OR l.job = reap_expired.job)
           AND EXISTS (SELECT FROM ledger.job_execution_log r
                        WHERE r.job = l.job AND r.status = 'running')
           FOR UPDATE OF l SKIP LOCKED
    LOOP
        SELECT * INTO v_run FROM ledger.job_execution_log r WHERE r.job = v_lease.job AND r.status = 'running';
        CONTINUE WHEN NOT FOUND
                   OR (v_lease.token = v_run.token AND v_lease.released_at IS NULL AND v_lease.expires_at > v_now);
        -- closed, counted and noted (a failure that may pause the job), by
        -- the job's 'lost' transition
        PERFORM ledger._close_lost(v_run, CASE WHEN v_lease.token <> v_run.token THEN 'superseded'
                                               ELSE 'lease_expired' END, v_now);
        -- A reaped lease is over: its late holder may not renew it.
        UPDATE ledger.leases l SET released_at = v_now, expires_at = least(l.expires_at, v_now)
         WHERE l.job = v_lease.job AND l.token = v_run.token AND l.released_at IS NULL;
        v_closed := v_closed + 1;
    END LOOP;
    RETURN v_closed;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.register_job(job text, schedule text DEFAULT NULL::text, ttl interval DEFAULT NULL::interval, max_backfill integer DEFAULT NULL::integer, time_zone text DEFAULT NULL::text, late_after interval DEFAULT NULL::interval, down_after interval DEFAULT NULL::interval, min_runtime interval DEFAULT NULL::interval, max_runtime interval DEFAULT NULL::interval, pause_after_failures integer DEFAULT NULL::integer)
 RETURNS ledger.jobs
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_spec  ledger.schedule_spec;
    v_old   ledger.jobs;
    v_job   ledger.jobs;
    v_ahead timestamptz;  -- the newest slot done
    v_new   boolean;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF max_backfill < 1 OR max_backfill > ledger._max_backfill() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument max_backfill must be from 1 to %s', ledger._max_backfill()),
            DETAIL = jsonb_build_object('argument', 'max_backfill', 'value', max_backfill,
                                        'max', ledger._max_backfill())::text;
    END IF;
    PERFORM ledger._check_ttl(ttl);
    IF time_zone IS NOT NULL THEN
        PERFORM ledger._check_time_zone(time_zone);
    END IF;
    PERFORM ledger._check_health_bound(late_after, 'late_after');
    PERFORM ledger._check_health_bound(down_after, 'down_after');
    PERFORM ledger._check_health_bound(min_runtime, 'min_runtime');
    PERFORM ledger._check_health_bound(max_runtime, 'max_runtime');
    IF pause_after_failures < 0 OR pause_after_failures > ledger._max_pause_after_failures() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument pause_after_failures must be from 0 (never) to %s',
                             ledger._max_pause_after_failures()),
            DETAIL = jsonb_build_object('argument', 'pause_after_failures', 'value', pause_after_failures,
                                        'max', ledger._max_pause_after_failures())::text;
    END IF;

    -- The per-job order every writer follows: the lease row first (when the
    -- job has none: the registration, ledger._lock_registration), then the
    -- registration as it is, locked (a first one: created, then locked). FOR NO KEY UPDATE, as the UPDATE below would: a
    -- start's foreign key checks (FOR KEY SHARE) on this row must never wait
    -- on a registration.
    PERFORM ledger._lock_registration(register_job.job);
    SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = register_job.job FOR NO KEY UPDATE;
    v_new := NOT FOUND;
    IF v_new THEN
        INSERT INTO ledger.jobs AS j (job) VALUES (register_job.job)
        ON CONFLICT ON CONSTRAINT jobs_pkey DO NOTHING;
        SELECT * INTO v_old FROM ledger.jobs j WHERE j.job = register_job.job FOR NO KEY UPDATE;
    END IF;
    v_job := v_old;
    v_job.schedule := coalesce(register_job.schedule, v_old.schedule);
    v_job.time_zone := coalesce(register_job.time_zone, v_old.time_zone);
    v_job.ttl := coalesce(ledger._exact(register_job.ttl), v_old.ttl);
    v_job.max_backfill := coalesce(register_job.max_backfill, v_old.max_backfill);
    v_job.late_after := CASE WHEN register_job.late_after IS NULL THEN v_old.late_after
                             ELSE nullif(ledger._exact(register_job.late_after), interval '0') END;
    v_job.down_after := CASE WHEN register_job.down_after IS NULL THEN v_old.down_after
                             ELSE nullif(ledger._exact(register_job.down_after), interval '0') END;
    v_job.min_runtime := CASE WHEN register_job.min_runtime IS NULL THEN v_old.min_runtime
                              ELSE nullif(ledger._exact(register_job.min_runtime), interval '0') END;
    v_job.max_runtime := CASE WHEN register_job.max_runtime IS NULL THEN v_old.max_runtime
                              ELSE nullif(ledger._exact(register_job.max_runtime), interval '0') END;
    v_job.pause_after_failures := CASE WHEN register_job.pause_after_failures IS NULL THEN v_old.pause_after_failures
                                       ELSE nullif(register_job.pause_after_failures, 0) END;
    IF v_job.schedule IS NOT NULL THEN
        -- parsed once, here: the spec depends on the schedule and the zone
        v_spec := ledger._parse_schedule(v_job.schedule, v_job.time_zone);
    END IF;
    IF register_job.schedule IS NOT NULL THEN
        -- An unscheduled job takes any slot, also one years ahead. Catch-up
        -- starts after the newest slot done (ledger._newest_done_slot, and
        -- ledger.purged_slots answers already_done up to its mark), so a
        -- schedule given now would have nothing due until that slot passed:
        -- the job would fall silent without an alert. Refuse it instead.
        v_ahead := greatest(
            (SELECT max(r.slot) FROM ledger.job_execution_log r
              WHERE r.job = register_job.job AND r.status IN ('running', 'success')),
            (SELECT p.done_through FROM ledger.purged_slots p WHERE p.job = register_job.job));
        IF v_ahead > ledger._now() THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('argument schedule cannot be given to job %s: its slot %s succeeded or is running, '
                                 'and is in the future, so no slot would be due before it; register the schedule '
                                 'once that slot has passed, or under another job name', job, v_ahead),
                DETAIL = jsonb_build_object('argument', 'schedule', 'job', job, 'value', schedule,
                                            'slot', v_ahead, 'now', ledger._now())::text;
        END IF;
    END IF;

    UPDATE ledger.jobs j SET
        schedule             = v_job.schedule,
        time_zone            = v_job.time_zone,
        ttl                  = v_job.ttl,
        max_backfill         = v_job.max_backfill,
        schedule_spec        = v_spec,
        late_after           = v_job.late_after,
        down_after           = v_job.down_after,
        min_runtime          = v_job.min_runtime,
        max_runtime          = v_job.max_runtime,
        pause_after_failures = v_job.pause_after_failures,
        updated_at           = CASE WHEN v_new THEN j.updated_at ELSE ledger._now() END
     WHERE j.job = register_job.job
    RETURNING * INTO v_job;
    -- The job's state row: its due marks follow the schedule as it is now.
    PERFORM ledger._set_state(register_job.job, 'registration');
    RETURN v_job;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._set_paused(job text, paused boolean)
 RETURNS boolean
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
BEGIN
    PERFORM ledger._check_label(job, 'job');
    PERFORM ledger._lock_registration(_set_paused.job);  -- the per-job order: the lease row first
    PERFORM ledger._registered_job(job);
    UPDATE ledger.jobs j SET paused       = _set_paused.paused,
                             paused_at    = CASE WHEN _set_paused.paused THEN ledger._now() END,
                             pause_reason = CASE WHEN _set_paused.paused THEN 'operator' END,
                             updated_at   = ledger._now()
     WHERE j.job = _set_paused.job AND j.paused <> _set_paused.paused;
    RETURN FOUND;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.start_due_run(job text, owner text, ttl interval DEFAULT NULL::interval)
 RETURNS ledger.run_start
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job    ledger.jobs;
    v_ttl    interval;
    v_due    timestamptz[];
    v_result ledger.run_start;
    v_lower  timestamptz;
    v_last   timestamptz;
    v_count  bigint;
BEGIN
    -- Checked once, read once: the start path (ledger._start) is shared with
    -- start_run, and a due slot is a slot of the schedule by construction.
    IF job IS NULL OR owner IS NULL
       OR NOT (char_length(job) BETWEEN 1 AND 200 AND ledger._is_visible_text(job)
               AND char_length(owner) BETWEEN 1 AND 200 AND ledger._is_visible_text(owner)) THEN
        PERFORM ledger._check_label(job, 'job');
        PERFORM ledger._check_label(owner, 'owner');
    END IF;
    SELECT * INTO v_job FROM ledger.jobs j WHERE j.job = start_due_run.job;
    IF v_job.schedule IS NULL THEN
        v_job := ledger._scheduled_job(job);  -- raises LD005 or 22023
    END IF;
    v_ttl := coalesce(ttl, v_job.ttl);
    IF v_ttl IS NULL OR v_ttl <= interval '0' OR v_ttl > ledger._max_ttl()
       OR date_trunc('month', v_ttl) <> interval '0' OR date_trunc('day', v_ttl) < interval '0'
       OR v_ttl - date_trunc('day', v_ttl) < interval '0' THEN
        v_ttl := ledger._resolve_ttl(job, v_ttl);  -- raises the documented 22023
    ELSIF extract(day FROM v_ttl) <> 0 THEN
        v_ttl := ledger._exact(v_ttl);
    END IF;
    IF v_job.paused THEN
        v_result.outcome := 'paused';
        RETURN v_result;
    END IF;

    v_due := ledger._due(v_job, ledger._now(), ledger._newest_done_slot(job));
    IF cardinality(v_due) = 0 THEN
        v_result.outcome := 'nothing_due';
        RETURN v_result;
    END IF;
    v_result := ledger._start(job, owner, v_ttl, v_due[1], NULL, NULL);
    IF v_result.outcome <> 'started' THEN
        RETURN v_result;
    END IF;
    -- The lease row is ours: an unregister_job that held it has committed.
    -- Its job is gone, and so is this start (the raise undoes it).
    PERFORM FROM ledger.jobs j WHERE j.job = start_due_run.job;
    IF NOT FOUND THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was unregistered while this start waited', job),
            jsonb_build_object('job', job));
    END IF;

    -- Started: this transaction holds the job's lease row, so the slots the
    -- bound drops are accounted once, by the winner, from a stable view.
    -- They lie after the newest done slot (or the last recorded drop) and
    -- before the slot just started.
    v_lower := ledger._newest_done_slot(job, except_run_id => v_result.run_id);
    IF v_lower IS NULL THEN
        RETURN v_result;  -- never ran before: nothing was missed
    END IF;
    v_lower := greatest(v_lower, (SELECT max(s.last_slot) FROM ledger.skipped_slots s
                                   WHERE s.job = start_due_run.job));
    v_last := ledger._slot_at_or_before(v_job.schedule_spec, v_job.time_zone,
                                        v_result.slot - interval '1 microsecond');
    IF v_last IS NOT NULL AND v_last > v_lower THEN
        v_count := ledger._slot_count(v_job.schedule_spec, v_job.time_zone, v_lower, v_last);
        INSERT INTO ledger.skipped_slots (job, first_slot, last_slot, slot_count, reason)
        VALUES (job, ledger._slot_after(v_job.schedule_spec, v_job.time_zone, v_lower), v_last,
                v_count, 'backfill_limit');
        PERFORM ledger._set_state(job, 'skipped_backfill', slots => v_count);
    END IF;
    RETURN v_result;
END
$function$;

CREATE OR REPLACE FUNCTION ledger._purge_batch(cutoff timestamp with time zone, from_run_id bigint, OUT deleted bigint, OUT next_run_id bigint)
 RETURNS record
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    batch constant integer := 10000;  -- run ids per DELETE
BEGIN
    WITH doomed AS (
        -- Found by primary key: the DELETE joins the batch, not the log.
        SELECT r.run_id FROM ledger.job_execution_log r
          JOIN ledger.counters c ON c.job = r.job
          LEFT JOIN ledger.job_execution_log o ON o.run_id = c.overlap_run_id
         WHERE r.run_id >= from_run_id AND r.run_id < from_run_id + batch
           AND r.status <> 'running' AND r.completed_at < cutoff
           AND r.run_id IS DISTINCT FROM c.last_run_id
           AND NOT coalesce(r.status = 'success' AND (r.started_at = c.last_success_started_at
                                                      OR r.slot = c.done_slot), false)
           AND r.completed_at < c.latest_end
           AND NOT coalesce(r.run_id = o.run_id
                            OR (r.started_at < o.started_at AND r.completed_at > o.started_at), false)
    ), purged AS (
        DELETE FROM ledger.job_execution_log r
         USING doomed
         WHERE r.run_id = doomed.run_id
        RETURNING r.run_id, r.job, r.slot, r.idempotency_key, r.status, r.failure_reason, r.started_at,
                  r.completed_at
    ), slots_done AS (
        -- What a purge must not forget: the slots and keys that succeeded.
        INSERT INTO ledger.purged_slots AS p (job, done_through)
        SELECT purged.job, max(purged.slot) FROM purged
         WHERE purged.status = 'success' AND purged.slot IS NOT NULL
         GROUP BY purged.job
        ON CONFLICT ON CONSTRAINT purged_slots_pkey DO UPDATE SET
            done_through = greatest(p.done_through, excluded.done_through)
    ), keys_done AS (
        INSERT INTO ledger.purged_keys (job, idempotency_key, run_id, completed_at)
        SELECT purged.job, purged.idempotency_key, purged.run_id, purged.completed_at FROM purged
         WHERE purged.status = 'success' AND purged.idempotency_key IS NOT NULL
        ON CONFLICT ON CONSTRAINT purged_keys_pkey DO NOTHING
    ), state_kept AS (
        -- ...and what the state counts of them: their longest success, and
        -- the failures (not cancels) that started after the job's last
        -- success, which stay in its streak while that is the last success.
        INSERT INTO ledger.purged_state AS p (job, longest_success, streak_failures, streak_after)
        SELECT purged.job,
               max(purged.completed_at - purged.started_at) FILTER (WHERE purged.status = 'success'),
               count(*) FILTER (WHERE purged.status = 'failure' AND purged.failure_reason <> 'cancelled'
                                  AND purged.started_at > coalesce(c.last_success_started_at, '-infinity')),
               c.last_success_started_at
          FROM purged JOIN ledger.counters c ON c.job = purged.job
         GROUP BY purged.job, c.last_success_started_at
        HAVING count(*) FILTER (WHERE purged.status = 'success'
                                   OR (purged.status = 'failure' AND purged.failure_reason <> 'cancelled'
                                       AND purged.started_at > coalesce(c.last_success_started_at, '-infinity'))) > 0
        ON CONFLICT ON CONSTRAINT purged_state_pkey DO UPDATE SET
            longest_success = greatest(p.longest_success, excluded.longest_success),
            streak_failures = CASE WHEN p.streak_after IS NOT DISTINCT FROM excluded.streak_after
                                   THEN p.streak_failures + excluded.streak_failures
                                   ELSE excluded.streak_failures END,
            streak_after    = excluded.streak_after
    )
    SELECT count(*) INTO deleted FROM purged;
    SELECT min(r.run_id) INTO next_run_id FROM ledger.job_execution_log r
     WHERE r.run_id >= from_run_id + batch;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.unregister_job(job text, with_history boolean DEFAULT false)
 RETURNS boolean
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_lease   ledger.leases;
    v_running ledger.job_execution_log;
    v_found   boolean;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF with_history IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument with_history must not be null';
    END IF;
    v_lease := ledger._lock_registration(unregister_job.job);
    IF NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = unregister_job.job)
       AND (NOT with_history OR v_lease.job IS NULL) THEN
        PERFORM ledger._raise('LD005', format('job not found: %s was never registered', job),
            jsonb_build_object('job', job));
    END IF;
    SELECT * INTO v_running FROM ledger.job_execution_log r
     WHERE r.job = unregister_job.job AND r.status = 'running';
    IF FOUND AND v_lease.token = v_running.token AND v_lease.released_at IS NULL
       AND v_lease.expires_at > ledger._now() THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument job names %s, whose run %s is live: cancel it (ledger.request_cancel) or '
                             'force-release its lease (ledger.force_release) first', job, v_running.run_id),
            DETAIL = jsonb_build_object('argument', 'job', 'job', job, 'run_id', v_running.run_id,
                                        'owner', v_running.owner)::text;
    END IF;
    DELETE FROM ledger.jobs j WHERE j.job = unregister_job.job;  -- skipped_slots cascade
    v_found := FOUND;
    IF with_history THEN
        DELETE FROM ledger.job_execution_log r WHERE r.job = unregister_job.job;
        DELETE FROM ledger.skip_counts s WHERE s.job = unregister_job.job;
        DELETE FROM ledger.purged_slots p WHERE p.job = unregister_job.job;
        DELETE FROM ledger.purged_keys k WHERE k.job = unregister_job.job;
        -- The state row goes with the log it was kept from: the job is no
        -- longer known (job_status, job_health and alerts list no ghost),
        -- though its lease row stays.
        PERFORM ledger._set_state(unregister_job.job, 'forgotten');
        v_found := true;
    ELSIF v_lease.job IS NULL THEN
        -- It never took a lease, so it has no runs: nothing is left of it.
        PERFORM ledger._set_state(unregister_job.job, 'forgotten');
    ELSE
        -- Known still, by its lease and runs: no schedule, so no slot is due.
        PERFORM ledger._set_state(unregister_job.job, 'registration');
    END IF;
    RETURN v_found;
END
$function$;

CREATE OR REPLACE FUNCTION ledger.sync_alerts()
 RETURNS SETOF ledger.events
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
 SET jit TO 'off'
AS $function$
BEGIN
    BEGIN
        LOCK TABLE ledger.alert_state IN EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        RETURN;
    END;
    IF current_setting('idle_in_transaction_session_timeout')::interval NOT BETWEEN interval '1 microsecond'
                                                                               AND ledger._alert_sync_idle_limit() THEN
        PERFORM set_config('idle_in_transaction_session_timeout',
                           (extract(epoch FROM ledger._alert_sync_idle_limit()) * 1000)::bigint::text, true);
    END IF;
    RETURN QUERY
    WITH now_open AS MATERIALIZED (
        SELECT DISTINCT ON (a.job, a.alert, k.run_key)
               a.job, a.alert, k.run_key, a.run_id, a.message, coalesce(a.since, ledger._view_now()) AS since
          FROM ledger.alerts a
         CROSS JOIN LATERAL (SELECT CASE WHEN a.alert IN ('overlap', 'long_running', 'overrun', 'crashed')
                                         THEN coalesce(a.run_id, 0) ELSE 0 END AS run_key) k
         ORDER BY a.job, a.alert, k.run_key, a.since
    ), cleared AS (
        DELETE FROM ledger.alert_state s
         WHERE NOT EXISTS (SELECT FROM now_open o
                            WHERE o.job = s.job AND o.alert = s.alert AND o.run_key = s.run_key)
        RETURNING s.*
    ), raised AS (
        SELECT o.* FROM now_open o
         WHERE NOT EXISTS (SELECT FROM ledger.alert_state s
                            WHERE s.job = o.job AND s.alert = o.alert AND s.run_key = o.run_key)
    ), written AS (
        INSERT INTO ledger.events (kind, job, run_id, detail)
        SELECT e.kind, e.job, e.run_id, e.detail
          FROM (SELECT 'alert_cleared' AS kind, c.job, c.run_id,
                       jsonb_build_object('alert', c.alert, 'message', c.message, 'since', c.since,
                                          'raised_event', c.raised_event) AS detail, 0 AS part, c.since
                  FROM cleared c
                UNION ALL
                SELECT 'alert_raised', r.job, r.run_id,
                       jsonb_build_object('alert', r.alert, 'message', r.message, 'since', r.since), 1, r.since
                  FROM raised r) e
         ORDER BY e.part, e.since, e.job
        RETURNING *
    ), kept AS (
        INSERT INTO ledger.alert_state (job, alert, run_key, run_id, message, since, raised_event)
        SELECT r.job, r.alert, r.run_key, r.run_id, r.message, r.since, w.event_id
          FROM raised r
          JOIN written w ON w.kind = 'alert_raised' AND w.job = r.job AND w.detail ->> 'alert' = r.alert
                        AND w.run_id IS NOT DISTINCT FROM r.run_id
    )
    -- (a data-modifying WITH runs whether or not it is read)
    SELECT w.* FROM written w ORDER BY w.event_id;
END
$function$;

-- By hand: the due marks of every scheduled job, and the jobs whose failure streak holds a cancel, read before
-- any table lock below is taken (these reads wait for no writer, and no writer for them): under the
-- lock, the backfill is a join, not a schedule evaluation per job.
CREATE TEMPORARY TABLE ledger_0005_marks ON COMMIT DROP AS
SELECT j.job::text AS job, c.done_slot, m.next_due, m.down_due
  FROM ledger.jobs j
  LEFT JOIN ledger.counters c ON c.job = j.job
 CROSS JOIN LATERAL ledger._due_marks(j.schedule_spec, j.time_zone, coalesce(c.done_slot, j.created_at)) m
 WHERE j.schedule IS NOT NULL;

CREATE TEMPORARY TABLE ledger_0005_cancels ON COMMIT DROP AS
SELECT DISTINCT c.job::text AS job
  FROM ledger.counters c
  JOIN ledger.job_execution_log r
    ON r.job = c.job AND r.failure_reason = 'cancelled' AND r.started_at > coalesce(c.last_success_started_at, '-infinity');

-- The locks, each waited for (at most the 2 s of the migration's lock_timeout) in an order that no
-- reader or writer waits against: first the views this revision replaces (a no-op ALTER takes each;
-- a reader takes a view before its tables, so it never holds a table this waits for), then the
-- tables as the writers take them, the lease rows first. Held until the commit, a few statements
-- on: the backfill under them is a join. ACCESS EXCLUSIVE, and with them every table a later
-- revision alters (0007, 0010, 0012): an upgrade from 0.1.0 runs them all in this transaction, and
-- a lock held weaker here and strengthened there deadlocked with the writers (a heartbeat that read
-- the lease rows waits to write them behind this SHARE ROW EXCLUSIVE, while 0010 waits for it),
-- every try, under load. Taken at once here, the rest of the chain waits for nobody.
ALTER VIEW ledger.alerts OWNER TO ledger_owner;

ALTER VIEW ledger.job_status OWNER TO ledger_owner;

ALTER VIEW ledger.job_health OWNER TO ledger_owner;

ALTER VIEW ledger.ttl_advice OWNER TO ledger_owner;

LOCK TABLE ledger.leases IN ACCESS EXCLUSIVE MODE;

LOCK TABLE ledger.jobs IN ACCESS EXCLUSIVE MODE;

LOCK TABLE ledger.counters, ledger.job_execution_log, ledger.events, ledger.skipped_slots IN ACCESS EXCLUSIVE MODE;

-- Tables: a column added with no default (no rewrite) and a new table.
ALTER TABLE ledger.counters ADD COLUMN down_due timestamptz;

COMMENT ON TABLE ledger.counters IS 'Each known job''s state row: its counters and its state from the log (one writer: ledger._set_state)';

CREATE TABLE ledger.purged_state (
    job             ledger.label PRIMARY KEY,
    longest_success interval,
    streak_failures bigint      NOT NULL DEFAULT 0,
    streak_after    timestamptz,
    CONSTRAINT purged_state_streak_non_negative CHECK (streak_failures >= 0)
);

COMMENT ON TABLE ledger.purged_state IS
    'Per job: the longest success and the failures of its streak that purge_log removed, still counted in its state';

ALTER TABLE ledger.purged_state OWNER TO ledger_owner;

GRANT SELECT ON TABLE ledger.purged_state TO ledger_client, ledger_reader;

-- Every known job has a state row: the registered ones, and those that hold a lease (a lease row
-- released, of a job neither registered nor run, is the mark a past unregister_job(with_history)
-- left: no job any more; such a job is known again at its next lease).
INSERT INTO ledger.counters (job) SELECT j.job FROM ledger.jobs j
ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;

INSERT INTO ledger.counters (job) SELECT l.job FROM ledger.leases l WHERE l.released_at IS NULL
ON CONFLICT ON CONSTRAINT counters_pkey DO NOTHING;

-- The due marks: as read above where the newest done slot has not moved since, else now.
UPDATE ledger.counters c SET next_due = m.next_due, down_due = m.down_due
  FROM ledger_0005_marks m
 WHERE m.job = c.job AND m.done_slot IS NOT DISTINCT FROM c.done_slot;

UPDATE ledger.counters c SET (next_due, down_due) =
       (SELECT m.next_due, m.down_due
          FROM ledger._due_marks(j.schedule_spec, j.time_zone, coalesce(c.done_slot, j.created_at)) m)
  FROM ledger.jobs j
 WHERE j.job = c.job AND j.schedule IS NOT NULL
   AND NOT EXISTS (SELECT FROM ledger_0005_marks m WHERE m.job = c.job AND m.done_slot IS NOT DISTINCT FROM c.done_slot);

UPDATE ledger.counters c SET next_due = NULL, down_due = NULL
 WHERE c.next_due IS NOT NULL
   AND NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = c.job AND j.schedule IS NOT NULL);

-- A cancel is no failure of the streak any more: the streaks that hold one, counted again.
UPDATE ledger.counters c SET consecutive_failures =
       (SELECT count(*) FROM ledger.job_execution_log r
         WHERE r.job = c.job AND r.status = 'failure' AND r.failure_reason <> 'cancelled'
           AND r.started_at > coalesce(c.last_success_started_at, '-infinity'))
  FROM ledger_0005_cancels x
 WHERE x.job = c.job;

-- By hand: the new view, the one state machine, which the views below select from.
CREATE VIEW ledger._job_state AS
SELECT c.job,
       j.schedule, j.time_zone, j.max_backfill, coalesce(j.paused, false) AS paused, j.paused_at, j.pause_reason,
       j.created_at, j.down_after, j.min_runtime, j.max_runtime, j.pause_after_failures,
       coalesce(j.ttl, l.ttl)                                             AS ttl,
       CASE WHEN l.released_at IS NULL AND l.expires_at > n.at THEN l.owner END AS holder,
       l.token,
       l.expires_at                                                       AS lease_expires_at,
       c.last_run_id, c.last_status, c.last_started_at, c.last_completed_at, c.last_success_started_at,
       c.last_success_at, c.running_run_id, c.running_started_at,
       n.at - c.running_started_at                                        AS running_for,
       c.done_slot, c.longest_success, c.consecutive_failures, c.next_due, c.down_due, c.latest_end,
       c.overlap_run_id, c.runs_started, c.successes, c.failures,
       c.skipped_overlap + coalesce(sk.pending, 0)::bigint                AS skipped_overlap,
       c.skipped_backfill, c.leases_lost,
       n.at, s.live, s.grace,
       s.state,
       CASE s.state
           WHEN 'crashed' THEN CASE WHEN l.token = c.running_token THEN l.expires_at ELSE l.acquired_at END
           WHEN 'overrun' THEN c.running_started_at + j.max_runtime
           WHEN 'paused' THEN j.paused_at
           WHEN 'running' THEN c.running_started_at
           WHEN 'down' THEN least(
               CASE WHEN c.down_due <= n.at - s.grace THEN c.down_due + s.grace END,
               CASE WHEN n.at - coalesce(c.last_success_at, j.created_at) > j.down_after
                    THEN coalesce(c.last_success_at, j.created_at) + j.down_after END)
           WHEN 'late' THEN c.next_due + s.grace
           WHEN 'failing' THEN coalesce(c.last_success_at, j.created_at)
           WHEN 'never_run' THEN j.created_at
           ELSE coalesce(c.last_success_at, c.last_completed_at)
       END                                                                AS since,
       CASE s.state
           WHEN 'crashed' THEN format('run %s is still marked running, but its lease %s: its runner is gone '
                                      '(ledger.reap_expired, or the next start, closes it)', c.running_run_id,
                                      CASE WHEN l.token <> c.running_token THEN format('went to token %s', l.token)
                                           WHEN l.released_at IS NOT NULL THEN 'was released'
                                           ELSE format('expired %s ago', date_trunc('second', n.at - l.expires_at))
                                      END)
           WHEN 'overrun' THEN format('running for %s, over its max_runtime %s',
                                      date_trunc('second', n.at - c.running_started_at), j.max_runtime)
           WHEN 'paused' THEN CASE j.pause_reason
                                  WHEN 'failures' THEN format('paused after %s failure%s in a row',
                                                              c.consecutive_failures,
                                                              CASE WHEN c.consecutive_failures = 1 THEN ''
                                                                   ELSE 's' END)
                                  ELSE 'paused by an operator' END
           WHEN 'running' THEN format('run %s running', c.running_run_id)
           WHEN 'down' THEN CASE WHEN c.down_due <= n.at - s.grace
                                 THEN format('%s%s slots missed since the last success',
                                             CASE WHEN m.missed_slots_capped THEN 'at least ' ELSE '' END,
                                             m.missed_slots)
                                 ELSE format('no success for over %s', j.down_after) END
           WHEN 'late' THEN format('a slot due %s ago was not started within %s',
                                   date_trunc('second', n.at - c.next_due), s.grace)
           WHEN 'failing' THEN format('%s failure%s in a row', c.consecutive_failures,
                                      CASE WHEN c.consecutive_failures = 1 THEN '' ELSE 's' END)
           WHEN 'never_run' THEN 'no run yet'
           ELSE 'ok'
       END                                                                AS reason,
       m.missed_slots, m.missed_slots_capped,
       -- ledger.ttl_advice's verdict (the alerts' ttl_too_short): no advice
       -- before ledger._advice_min_runs() successes
       CASE WHEN c.successes >= ledger._advice_min_runs() THEN c.longest_success END AS advice_longest,
       CASE
           WHEN coalesce(j.ttl, l.ttl) IS NULL OR c.successes < ledger._advice_min_runs()
                OR c.longest_success IS NULL THEN 'no_data'
           WHEN coalesce(j.ttl, l.ttl) < greatest(c.longest_success * 1.5, ledger._advice_min_ttl()) THEN 'too_short'
           WHEN coalesce(j.ttl, l.ttl) > greatest(c.longest_success * 2, ledger._advice_min_ttl()) THEN 'too_long'
           ELSE 'ok'
       END                                                                AS ttl_verdict
  FROM ledger.counters c
  LEFT JOIN ledger.jobs j ON j.job = c.job
  LEFT JOIN ledger.leases l ON l.job = c.job
  -- skips not yet folded into the state row (ledger.skip_counts)
  LEFT JOIN (SELECT k.job, sum(k.skipped_overlap) AS pending FROM ledger.skip_counts k GROUP BY k.job) sk
         ON sk.job = c.job
 CROSS JOIN LATERAL (SELECT ledger._view_now() AS at) n
 -- The state, worked out once per row (OFFSET 0 keeps the planner from
 -- copying its expression into every column that reads it; a lateral
 -- subquery still lets a read of one job use the primary keys).
 CROSS JOIN LATERAL (
       SELECT d.live, d.grace,
              CASE
                  WHEN c.running_run_id IS NOT NULL AND NOT d.live THEN 'crashed'
                  WHEN d.live AND n.at - c.running_started_at > j.max_runtime THEN 'overrun'
                  WHEN j.paused THEN 'paused'
                  WHEN d.live THEN 'running'
                  WHEN c.down_due <= n.at - d.grace
                       OR n.at - coalesce(c.last_success_at, j.created_at) > j.down_after THEN 'down'
                  WHEN c.next_due <= n.at - d.grace THEN 'late'
                  WHEN c.consecutive_failures >= ledger._failing_after() THEN 'failing'
                  WHEN c.last_run_id IS NULL THEN 'never_run'
                  ELSE 'ok'
              END AS state
         FROM (SELECT coalesce(l.token = c.running_token AND l.released_at IS NULL AND l.expires_at > n.at, false)
                          AS live,
                      coalesce(j.late_after, greatest(coalesce(j.ttl, l.ttl, interval '1 minute'), interval '1 minute'))
                          AS grace) d
       OFFSET 0) s
 -- The slots missed since the newest done (or the registration): counted
 -- by arithmetic for an interval of fixed length (its slots are whole
 -- multiples of it since 2000-01-01 00:00 local, as ledger._interval_index
 -- counts them); otherwise from the due marks, 1 or
 -- ledger._down_after_slots(), as a lower bound (missed_slots_capped).
 CROSS JOIN LATERAL (
       SELECT CASE
                  WHEN j.schedule IS NULL THEN NULL
                  WHEN c.next_due IS NULL OR c.next_due > n.at - s.grace THEN 0::bigint
                  WHEN (j.schedule_spec).kind = 'interval' AND (j.schedule_spec).every_months = 0
                       AND (j.schedule_spec).every_days = 0
                  THEN floor(((extract(epoch FROM n.at - s.grace))::numeric
                              - (extract(epoch FROM timestamp '2000-01-01 00:00' AT TIME ZONE j.time_zone))::numeric)
                             * 1000000 / (j.schedule_spec).every_micros)::bigint
                       - floor(((extract(epoch FROM coalesce(c.done_slot, j.created_at)))::numeric
                                - (extract(epoch FROM timestamp '2000-01-01 00:00' AT TIME ZONE j.time_zone))::numeric)
                               * 1000000 / (j.schedule_spec).every_micros)::bigint
                  WHEN c.down_due <= n.at - s.grace THEN ledger._down_after_slots()::bigint
                  ELSE 1::bigint
              END AS missed_slots,
              coalesce(j.schedule IS NOT NULL AND c.next_due <= n.at - s.grace
                       AND NOT ((j.schedule_spec).kind = 'interval' AND (j.schedule_spec).every_months = 0
                                AND (j.schedule_spec).every_days = 0), false) AS missed_slots_capped) m;

ALTER VIEW ledger._job_state OWNER TO ledger_owner;

GRANT SELECT ON TABLE ledger._job_state TO ledger_client, ledger_reader;

COMMENT ON VIEW ledger._job_state IS
    'Internal: every known job with its state (the one state machine: ledger.job_status, job_health, alerts, ttl_advice read it)';

CREATE OR REPLACE VIEW ledger.ttl_advice AS
 SELECT s.job,
    s.ttl,
    s.advice_longest AS longest_run,
        CASE
            WHEN (s.advice_longest IS NOT NULL) THEN GREATEST((s.advice_longest * (1.5)::double precision), ledger._advice_min_ttl())
            ELSE NULL::interval
        END AS recommended_min,
        CASE
            WHEN (s.advice_longest IS NOT NULL) THEN GREATEST((s.advice_longest * (2)::double precision), ledger._advice_min_ttl())
            ELSE NULL::interval
        END AS recommended_max,
    (s.ttl / (3)::double precision) AS renew_every,
    s.ttl_verdict AS verdict,
    s.successes
   FROM ledger._job_state s;

CREATE OR REPLACE VIEW ledger.job_status AS
 SELECT s.job,
    s.schedule,
    s.time_zone,
    s.ttl,
    s.max_backfill,
    s.paused,
    s.holder,
    s.token,
    s.lease_expires_at,
    s.last_run_id,
    s.last_status,
    s.last_started_at,
    s.last_completed_at,
    s.last_success_at,
    s.running_run_id,
    s.running_for,
        CASE
            WHEN ((s.schedule IS NOT NULL) AND (NOT s.paused)) THEN s.next_due
            ELSE NULL::timestamp with time zone
        END AS next_slot,
    (s.state = ANY (ARRAY['late'::text, 'down'::text])) AS overdue,
    s.consecutive_failures,
    s.runs_started,
    s.successes,
    s.failures,
    s.skipped_overlap,
    s.skipped_backfill,
    s.leases_lost,
    s.state
   FROM ledger._job_state s;

COMMENT ON VIEW ledger.job_status IS 'One row per known job: lease, last run, last success, current run, next slot, state, failures, counters';

CREATE OR REPLACE VIEW ledger.job_health AS
 SELECT s.job,
    s.state,
    s.since,
    s.reason,
    s.pause_reason,
    s.last_success_at,
    (s.at - s.last_success_at) AS last_success_age,
    (s.last_success_at - s.last_success_started_at) AS last_success_duration,
    s.missed_slots,
    s.missed_slots_capped,
    s.grace AS late_after,
    s.down_after,
    s.min_runtime,
    s.max_runtime,
    s.pause_after_failures,
    s.consecutive_failures,
        CASE
            WHEN s.live THEN s.running_run_id
            ELSE NULL::bigint
        END AS running_run_id,
        CASE
            WHEN s.live THEN s.running_for
            ELSE NULL::interval
        END AS running_for
   FROM ledger._job_state s;

COMMENT ON VIEW ledger.job_health IS 'One state per known job (crashed, overrun, paused, running, down, late, failing, never_run, ok), since when, why';

CREATE OR REPLACE VIEW ledger.alerts AS
 SELECT a.alert,
    s.job,
    a.run_id,
    a.message,
    a.since
   FROM (ledger._job_state s
     CROSS JOIN LATERAL UNNEST(ARRAY[
        CASE
            WHEN ((s.state = ANY (ARRAY['crashed'::text, 'overrun'::text, 'down'::text, 'late'::text, 'failing'::text])) OR ((s.state = 'paused'::text) AND (s.pause_reason = 'failures'::text))) THEN s.state
            ELSE NULL::text
        END,
        CASE
            WHEN (s.live AND (s.state <> 'overrun'::text) AND (s.running_for > (s.longest_success * (2)::double precision))) THEN 'long_running'::text
            ELSE NULL::text
        END,
        CASE
            WHEN ((s.last_success_at - s.last_success_started_at) < s.min_runtime) THEN 'too_fast'::text
            ELSE NULL::text
        END,
        CASE
            WHEN (s.overlap_run_id IS NOT NULL) THEN 'overlap'::text
            ELSE NULL::text
        END,
        CASE
            WHEN (s.ttl_verdict = 'too_short'::text) THEN 'ttl_too_short'::text
            ELSE NULL::text
        END], ARRAY[
        CASE
            WHEN (s.state = ANY (ARRAY['crashed'::text, 'overrun'::text])) THEN s.running_run_id
            ELSE NULL::bigint
        END, s.running_run_id, NULL::bigint, s.overlap_run_id, NULL::bigint], ARRAY[
        CASE
            WHEN (s.state = ANY (ARRAY['crashed'::text, 'overrun'::text, 'down'::text, 'late'::text, 'failing'::text, 'paused'::text])) THEN s.reason
            ELSE NULL::text
        END,
        CASE
            WHEN (s.live AND (s.running_for > (s.longest_success * (2)::double precision))) THEN format('running for %s, over twice its longest successful run (%s)'::text, date_trunc('second'::text, s.running_for), date_trunc('second'::text, s.longest_success))
            ELSE NULL::text
        END,
        CASE
            WHEN ((s.last_success_at - s.last_success_started_at) < s.min_runtime) THEN format('the last success took %s, under its min_runtime %s'::text, (s.last_success_at - s.last_success_started_at), s.min_runtime)
            ELSE NULL::text
        END,
        CASE
            WHEN (s.overlap_run_id IS NOT NULL) THEN format('run %s started before an earlier run of the job ended (ledger.overlaps lists the pairs)'::text, s.overlap_run_id)
            ELSE NULL::text
        END,
        CASE
            WHEN (s.ttl_verdict = 'too_short'::text) THEN format('ttl %s is under 1.5 times the longest successful run (%s)'::text, s.ttl, s.advice_longest)
            ELSE NULL::text
        END], ARRAY[s.since, s.running_started_at, s.last_success_at,
        CASE
            WHEN (s.overlap_run_id IS NOT NULL) THEN ( SELECT r.started_at
               FROM ledger.job_execution_log r
              WHERE (r.run_id = s.overlap_run_id))
            ELSE NULL::timestamp with time zone
        END, NULL::timestamp with time zone]) a(alert, run_id, message, since))
  WHERE (a.alert IS NOT NULL);

COMMENT ON VIEW ledger.alerts IS 'One row per live problem, one per job and cause: crashed, overrun, down, late, failing, paused (by failures), long_running, too_fast, overlap, ttl_too_short';

-- By hand: the triggers that keep a write past the functions in the state rows.
CREATE TRIGGER jobs_foreign_write
    AFTER INSERT OR DELETE OR UPDATE OF schedule, schedule_spec, time_zone, created_at ON ledger.jobs
    FOR EACH ROW WHEN (current_user <> 'ledger_owner')
    EXECUTE FUNCTION ledger._foreign_job_write();

CREATE TRIGGER leases_foreign_write
    AFTER INSERT ON ledger.leases
    FOR EACH ROW WHEN (current_user <> 'ledger_owner')
    EXECUTE FUNCTION ledger._foreign_job_write();

DROP FUNCTION ledger._missed_horizon();
