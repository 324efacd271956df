-- Events: the ledger's state changes as a table a live consumer can tail
-- (jobledger watch, jobledger notify, LISTEN ledger_events). Triggers write
-- them, so every writer of a run or a pause (the functions, pg_cron's
-- run_guarded, a superuser's UPDATE) produces the same events; alert
-- changes, which time makes without any write, come from ledger.sync_alerts.
--
-- The cost on the hot path is one row per run start and one per run end
-- (BENCHMARKS.md measures it). Both can be switched off
-- (configure_events(run_events => false)); the pg_notify is off until
-- asked for (notify => true), since every notifying commit queues behind
-- PostgreSQL's one notification queue lock.

CREATE TABLE ledger.event_settings (
    singleton  boolean     PRIMARY KEY DEFAULT true,
    -- run_started and run_ended events (the two per run); the rarer events
    -- (lost, cancelled, paused, alerts) are always recorded.
    run_events boolean     NOT NULL DEFAULT true,
    -- a pg_notify on channel ledger_events for every event
    notify     boolean     NOT NULL DEFAULT false,
    -- events older than retention, or more than max_events behind the
    -- newest, are deleted (in small batches, by the inserts themselves)
    retention  interval    NOT NULL DEFAULT interval '168:00:00',
    max_events bigint      NOT NULL DEFAULT 1000000,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT event_settings_one_row CHECK (singleton),
    CONSTRAINT event_settings_retention_positive CHECK (retention > interval '0'),
    CONSTRAINT event_settings_max_events_bounds CHECK (max_events BETWEEN 1000 AND 1000000000)
);
COMMENT ON TABLE ledger.event_settings IS 'One row: which events are recorded, notified, and kept how long';
INSERT INTO ledger.event_settings DEFAULT VALUES;

CREATE TABLE ledger.events (
    event_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz  NOT NULL DEFAULT clock_timestamp(),
    kind     text         NOT NULL,
    -- no foreign key: an event outlives the job's registration and runs
    job      ledger.label NOT NULL,
    run_id   bigint,
    detail   jsonb        NOT NULL,
    CONSTRAINT events_kind_valid CHECK (kind IN (
        'run_started', 'run_ended', 'run_lost', 'run_cancelled', 'cancel_requested',
        'job_paused', 'job_resumed', 'alert_raised', 'alert_cleared', 'job_redefined')),
    CONSTRAINT events_detail_object CHECK (jsonb_typeof(detail) = 'object'),
    CONSTRAINT events_run_has_run_id CHECK (run_id IS NOT NULL
                                            OR kind IN ('job_paused', 'job_resumed', 'alert_raised', 'alert_cleared',
                                                        'job_redefined'))
);
COMMENT ON TABLE ledger.events IS
    'State changes in order (event_id): runs started, ended, lost, cancelled; jobs paused, resumed; alerts raised, cleared';

-- The alerts sync_alerts last saw, so that it records only what changed.
-- An alert about one run (overlap, long_running, overrun, crashed) is keyed by it;
-- the others by job and alert alone, so that a message that moves on ("4
-- failures in a row", then 5) is the same alert.
CREATE TABLE ledger.alert_state (
    job          ledger.label NOT NULL,
    alert        text         NOT NULL,
    run_key      bigint       NOT NULL,
    run_id       bigint,
    message      text         NOT NULL,
    since        timestamptz  NOT NULL,
    raised_event bigint       NOT NULL,
    CONSTRAINT alert_state_pkey PRIMARY KEY (job, alert, run_key)
);
COMMENT ON TABLE ledger.alert_state IS 'The open alerts as ledger.sync_alerts last recorded them';

-- A run's row changed: its event. The triggers' WHEN clauses pick the
-- rows, so a row no event is about costs no call.
CREATE FUNCTION ledger._log_event()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_kind text;
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO ledger.events (at, kind, job, run_id, detail)
        VALUES (NEW.started_at, 'run_started', NEW.job, NEW.run_id,
                jsonb_strip_nulls(jsonb_build_object('owner', NEW.owner, 'token', NEW.token,
                                                     'slot', NEW.slot, 'idempotency_key', NEW.idempotency_key)));
        RETURN NULL;
    END IF;
    IF OLD.status = 'running' AND NEW.status <> 'running' THEN
        v_kind := CASE NEW.failure_reason WHEN 'lease_expired' THEN 'run_lost' WHEN 'superseded' THEN 'run_lost'
                                          WHEN 'cancelled' THEN 'run_cancelled' ELSE 'run_ended' END;
        INSERT INTO ledger.events (at, kind, job, run_id, detail)
        VALUES (NEW.completed_at, v_kind, NEW.job, NEW.run_id,
                jsonb_strip_nulls(jsonb_build_object(
                    'status', NEW.status, 'reason', NEW.failure_reason, 'owner', NEW.owner, 'token', NEW.token,
                    'slot', NEW.slot,
                    'seconds', round(extract(epoch FROM NEW.completed_at - NEW.started_at)::numeric, 3),
                    'error', left(NEW.error, 200))));
    ELSIF OLD.cancel_requested_at IS NULL AND NEW.cancel_requested_at IS NOT NULL THEN
        INSERT INTO ledger.events (at, kind, job, run_id, detail)
        VALUES (NEW.cancel_requested_at, 'cancel_requested', NEW.job, NEW.run_id,
                jsonb_build_object('owner', NEW.owner, 'token', NEW.token));
    END IF;
    RETURN NULL;
END
$$;

-- run_started and run_ended: switched by event_settings.run_events
-- (ledger.configure_events enables and disables these two triggers).
CREATE TRIGGER job_execution_log_started_event
    AFTER INSERT ON ledger.job_execution_log
    FOR EACH ROW WHEN (NEW.status = 'running') EXECUTE FUNCTION ledger._log_event();
CREATE TRIGGER job_execution_log_ended_event
    AFTER UPDATE OF status ON ledger.job_execution_log
    FOR EACH ROW WHEN (OLD.status = 'running' AND (NEW.status = 'success' OR NEW.failure_reason = 'error'))
    EXECUTE FUNCTION ledger._log_event();
-- Lost, cancelled, a cancel asked for: always.
CREATE TRIGGER job_execution_log_lost_event
    AFTER UPDATE OF status, cancel_requested_at ON ledger.job_execution_log
    FOR EACH ROW WHEN ((OLD.status = 'running' AND NEW.failure_reason IN ('lease_expired', 'superseded', 'cancelled'))
                       OR (OLD.cancel_requested_at IS NULL AND NEW.cancel_requested_at IS NOT NULL))
    EXECUTE FUNCTION ledger._log_event();

CREATE FUNCTION ledger._pause_event()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- paused: why (operator, failures); resumed: why it had been paused
    INSERT INTO ledger.events (at, kind, job, detail)
    VALUES (coalesce(NEW.paused_at, NEW.updated_at), CASE WHEN NEW.paused THEN 'job_paused' ELSE 'job_resumed' END,
            NEW.job,
            CASE WHEN NEW.paused THEN jsonb_strip_nulls(jsonb_build_object('reason', NEW.pause_reason))
                 ELSE jsonb_strip_nulls(jsonb_build_object('pause_reason', OLD.pause_reason)) END);
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_pause_event
    AFTER UPDATE OF paused ON ledger.jobs
    FOR EACH ROW WHEN (OLD.paused IS DISTINCT FROM NEW.paused)
    EXECUTE FUNCTION ledger._pause_event();

-- The live feed: a small payload (the row has the rest; a NOTIFY payload
-- is at most 8000 bytes). Delivered at commit, so a listener never sees an
-- event of a transaction that rolled back. Enabled by configure_events(notify => true).
CREATE FUNCTION ledger._notify_event()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_notify('ledger_events', jsonb_build_object(
        'event_id', NEW.event_id, 'kind', NEW.kind, 'job', NEW.job, 'run_id', NEW.run_id)::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER events_notify
    AFTER INSERT ON ledger.events
    FOR EACH ROW EXECUTE FUNCTION ledger._notify_event();
ALTER TABLE ledger.events DISABLE TRIGGER events_notify;

-- Delete what is past the bounds among the `batch` oldest events (event_id
-- order, which is nearly `at` order); the number deleted. The oldest are
-- read without a lock, and only the rows to delete are locked, skipping
-- those another purge holds: a purge never waits, and when nothing is old
-- it writes nothing.
CREATE FUNCTION ledger._purge_events(batch integer)
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_settings ledger.event_settings;
    v_newest   bigint;
    v_deleted  bigint;
BEGIN
    SELECT * INTO v_settings FROM ledger.event_settings;
    SELECT max(e.event_id) INTO v_newest FROM ledger.events e;
    DELETE FROM ledger.events e
     WHERE e.event_id IN (
           SELECT l.event_id FROM ledger.events l
            WHERE l.event_id IN (
                  SELECT o.event_id
                    FROM (SELECT x.event_id, x.at FROM ledger.events x ORDER BY x.event_id LIMIT batch) o
                   WHERE o.at < ledger._now() - v_settings.retention
                      OR o.event_id <= v_newest - v_settings.max_events)
              FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_deleted = ROW_COUNT;
    RETURN v_deleted;
END
$$;

-- Retention without a scheduler: every 500th event deletes up to 1000 old
-- ones, so the table shrinks twice as fast as it can grow past its bounds,
-- and the cost is a WHEN test on the other 499.
CREATE FUNCTION ledger._retain_events()
RETURNS trigger
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM ledger._purge_events(1000);
    RETURN NULL;
END
$$;

CREATE TRIGGER events_retention
    AFTER INSERT ON ledger.events
    FOR EACH ROW WHEN (NEW.event_id % 500 = 0)
    EXECUTE FUNCTION ledger._retain_events();

-- Change the options given (NULL keeps one) and return the settings. The
-- two run triggers and the notify trigger follow the flags in the same
-- transaction, so a switched-off feature costs nothing on the hot path; a
-- call with no arguments only makes them agree with the table again (after
-- a restore of the table from a dump, say). ALTER TABLE waits for the
-- transactions writing those tables, and every start and end queues behind
-- it while it waits: at most ledger._ddl_lock_wait(), then 55P03 naming the
-- transactions in the way, and nothing changed.
CREATE FUNCTION ledger.configure_events(
    run_events boolean DEFAULT NULL,
    notify boolean DEFAULT NULL,
    retention interval DEFAULT NULL,
    max_events bigint DEFAULT NULL)
RETURNS ledger.event_settings
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_settings ledger.event_settings;
    v_trigger  record;
    v_table    regclass;
    v_wait     text := current_setting('lock_timeout');
BEGIN
    PERFORM ledger._check_duration(retention, 'retention', ledger._max_older_than());
    IF max_events < 1000 OR max_events > 1000000000 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument max_events must be between 1000 and 1000000000',
            DETAIL = jsonb_build_object('argument', 'max_events', 'value', max_events,
                                        'min', 1000, 'max', 1000000000)::text;
    END IF;
    IF num_nonnulls(run_events, notify, retention, max_events) > 0 THEN
        UPDATE ledger.event_settings s SET
            run_events = coalesce(configure_events.run_events, s.run_events),
            notify     = coalesce(configure_events.notify, s.notify),
            retention  = coalesce(ledger._exact(configure_events.retention), s.retention),
            max_events = coalesce(configure_events.max_events, s.max_events),
            updated_at = ledger._now();
    END IF;
    SELECT * INTO v_settings FROM ledger.event_settings;
    FOR v_trigger IN
        SELECT t.tgrelid::regclass AS tab, t.tgname,
               CASE WHEN t.tgname = 'events_notify' THEN v_settings.notify ELSE v_settings.run_events END AS wanted
          FROM pg_catalog.pg_trigger t
         WHERE t.tgrelid IN ('ledger.job_execution_log'::regclass, 'ledger.events'::regclass)
           AND t.tgname IN ('job_execution_log_started_event', 'job_execution_log_ended_event', 'events_notify')
           AND (t.tgenabled <> 'D') IS DISTINCT FROM
               (CASE WHEN t.tgname = 'events_notify' THEN v_settings.notify ELSE v_settings.run_events END)
    LOOP
        v_table := v_trigger.tab;
        BEGIN
            PERFORM set_config('lock_timeout', ledger._ddl_lock_wait(), true);
            EXECUTE format('ALTER TABLE %s %s TRIGGER %I', v_trigger.tab,
                           CASE WHEN v_trigger.wanted THEN 'ENABLE' ELSE 'DISABLE' END, v_trigger.tgname);
            PERFORM set_config('lock_timeout', v_wait, true);
        EXCEPTION WHEN lock_not_available THEN
            RAISE EXCEPTION USING ERRCODE = '55P03',
                MESSAGE = format('configure_events could not switch the triggers of %s within %s: another '
                                 'transaction has that table open; nothing changed, retry when it has ended',
                                 v_table, ledger._ddl_lock_wait()),
                DETAIL = jsonb_build_object(
                    'table', v_table::text, 'waited', ledger._ddl_lock_wait(),
                    'blocking_pids', (SELECT coalesce(jsonb_agg(DISTINCT l.pid ORDER BY l.pid), '[]'::jsonb)
                                        FROM pg_catalog.pg_locks l
                                       WHERE l.relation = v_table AND l.granted
                                         AND l.pid <> pg_catalog.pg_backend_pid()))::text,
                HINT = 'pg_stat_activity shows what those backends are doing (an idle transaction holds its locks).';
        END;
    END LOOP;
    RETURN v_settings;
END
$$;
COMMENT ON FUNCTION ledger.configure_events(boolean, boolean, interval, bigint) IS
    'Switch run events and pg_notify on or off, and set the events'' retention; the options given only';

-- Delete the events past the retention now, oldest first, until the oldest
-- 10,000 left hold none (the inserts do it a batch at a time anyway); the
-- number deleted. Rows a concurrent purge holds are left to it.
CREATE FUNCTION ledger.purge_events()
RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_total   bigint := 0::bigint;
    v_deleted bigint;
BEGIN
    LOOP
        v_deleted := ledger._purge_events(10000);
        v_total := v_total + v_deleted;
        EXIT WHEN v_deleted = 0;
    END LOOP;
    RETURN v_total;
END
$$;
COMMENT ON FUNCTION ledger.purge_events() IS 'Delete the events past the retention now; the number deleted';

-- Record the alerts that appeared (alert_raised) and went (alert_cleared)
-- since the last call, and return those events. Alerts come from the clock
-- as much as from writes (a slot not started turns late with no write at
-- all), so something calls this: jobledger notify and jobledger watch do on
-- every poll, pg_cron may every minute. One call at a time does the work (a
-- table lock, taken NOWAIT): a call that finds another at it returns no
-- rows at once instead of queueing behind it (what that one records is in
-- ledger.events), so a change is recorded once and many pollers cost one.
-- The lock lasts until the caller's transaction ends, so a caller that sat
-- idle in it would hold back every alert: for the rest of that transaction,
-- the session's idle_in_transaction_session_timeout is at most
-- ledger._alert_sync_idle_limit(), after which the server ends the session.
CREATE FUNCTION ledger.sync_alerts()
RETURNS SETOF ledger.events
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off  -- compiling the alerts' plan costs more than running it (BENCHMARKS.md)
AS $$
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
$$;
COMMENT ON FUNCTION ledger.sync_alerts() IS
    'Record the alerts raised and cleared since the last call as events, and return them';
