-- Guarding a SQL job, from pg_cron or any SQL client:
--   CALL ledger.run_guarded(job => 'nightly', command => $$ ... $$);
-- A DO block or a function is one transaction: the run it starts stays
-- invisible until the end (no job_status, no reaper, no trace after a
-- crash), and an overlapping caller waits on the uncommitted lease row. A
-- procedure can COMMIT right after the start, which makes the run visible (a
-- concurrent caller is skipped at once) and its token durable before the
-- command runs.
--
-- Deliberately neither SECURITY DEFINER nor SET search_path: PostgreSQL
-- refuses COMMIT in a procedure that has either, and the command is the
-- caller's own SQL, so it must run with the caller's privileges and
-- search_path, never the ledger owner's. The procedure only calls the public
-- (SECURITY DEFINER) API, so the caller needs ledger_client; every function
-- it calls is schema-qualified, whatever the caller's search_path.
CREATE PROCEDURE ledger.run_guarded(
    job text,
    command text,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL)
LANGUAGE plpgsql
AS $$
DECLARE
    v_owner     text;
    v_scheduled boolean := false;
    v_limit     integer;
    v_start     ledger.run_start;
    v_failed    boolean;
    v_state     text;
    v_message   text;
    v_detail    text;
    v_hint      text;
    v_context   text;
    v_lost      text;
    v_facts     jsonb;
BEGIN
    -- CALL inside BEGIN ... cannot commit. Detected here when the statement
    -- came on the simple protocol (psql, pg_cron, a driver's unparameterised
    -- statement): there, and only there, a transaction that began before
    -- this statement is a transaction block. Parameterised or prepared
    -- statements have a portal (pg_cursors) and start their transaction at
    -- Parse or Bind: for those, and for a call from a function, the COMMIT
    -- below fails with 2D000 before anything was done.
    IF pg_catalog.transaction_timestamp() < pg_catalog.statement_timestamp()
       AND NOT EXISTS (SELECT FROM pg_catalog.pg_cursors) THEN
        RAISE EXCEPTION USING ERRCODE = '25001',
            MESSAGE = 'ledger.run_guarded must be called outside a transaction block: it commits as soon as the run has started',
            DETAIL = pg_catalog.jsonb_build_object(
                'job', job,
                'transaction_started_at', pg_catalog.transaction_timestamp(),
                'statement_started_at', pg_catalog.statement_timestamp())::text,
            HINT = 'CALL it as a statement of its own in autocommit mode, as pg_cron does; not after BEGIN, not from a function.';
    END IF;
    IF command IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument command must not be null';
    ELSIF command !~ E'\\S' THEN  -- E'': whatever standard_conforming_strings says
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument command must be a SQL statement, not empty',
            DETAIL = pg_catalog.jsonb_build_object('argument', 'command',
                                                   'length', pg_catalog.char_length(command))::text;
    END IF;
    -- The default owner is unique among live backends, so two callers never
    -- count as one owner (a start by the same owner supersedes its previous
    -- run): '<application>:<database>:<backend pid>'. pg_cron connects as
    -- application 'pg_cron' (its background workers have backend type
    -- 'pg_cron'): 'pg_cron:postgres:4242'; a client without a name is 'sql'.
    v_owner := coalesce(owner, pg_catalog.format('%s:%s:%s',
        coalesce(nullif(pg_catalog.current_setting('application_name'), ''),
                 nullif((SELECT a.backend_type FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) a),
                        'client backend'),
                 'sql'),
        pg_catalog.current_database(), pg_catalog.pg_backend_pid()));

    -- Where COMMIT is impossible (a transaction block, a function, one
    -- statement of several in a query string), PostgreSQL raises 2D000 here.
    COMMIT;

    SELECT j.schedule IS NOT NULL, j.max_backfill INTO v_scheduled, v_limit
      FROM ledger.jobs j WHERE j.job = run_guarded.job;
    -- A scheduled job: one run per due slot, oldest first, at most
    -- max_backfill of them; any other job: one run.
    FOR i IN 1 .. coalesce(v_limit, 1) LOOP
        IF v_scheduled THEN
            v_start := ledger.start_due_run(job => job, owner => v_owner, ttl => ttl);
        ELSE
            v_start := ledger.start_run(job => job, owner => v_owner, ttl => ttl);
        END IF;
        v_facts := pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
            'job', job, 'owner', v_owner, 'outcome', v_start.outcome, 'run_id', v_start.run_id,
            'token', v_start.token, 'slot', v_start.slot, 'expires_at', v_start.expires_at,
            'holder', v_start.holder, 'holder_expires_at', v_start.holder_expires_at));
        -- The run is visible (a concurrent caller is skipped) and its token
        -- durable; a skip's count is kept.
        COMMIT;

        IF v_start.outcome <> 'started' THEN
            -- Not an error: pg_cron logs the CALL as succeeded.
            IF v_start.outcome = 'skipped_overlap' THEN
                RAISE NOTICE USING
                    MESSAGE = pg_catalog.format('ledger.run_guarded: job %s skipped (skipped_overlap): held by %s until %s',
                                                job, coalesce(v_start.holder, 'another transaction'),
                                                coalesce(v_start.holder_expires_at::text, 'unknown')),
                    DETAIL = v_facts::text;
            ELSIF v_start.outcome <> 'nothing_due' OR i = 1 THEN
                RAISE NOTICE USING
                    MESSAGE = pg_catalog.format('ledger.run_guarded: job %s not run (%s)', job, v_start.outcome),
                    DETAIL = v_facts::text;
            END IF;
            RETURN;
        END IF;

        -- The command's transaction: the run's facts as transaction-local
        -- settings, gone at its COMMIT. The command and the run's end commit
        -- together: a run that lost its lease meanwhile (LD001, LD003) rolls
        -- the command's writes back.
        PERFORM pg_catalog.set_config('ledger.job', job, true);
        PERFORM pg_catalog.set_config('ledger.owner', v_owner, true);
        PERFORM pg_catalog.set_config('ledger.run_id', v_start.run_id::text, true);
        PERFORM pg_catalog.set_config('ledger.token', v_start.token::text, true);
        PERFORM pg_catalog.set_config('ledger.slot',
            coalesce(pg_catalog.to_char(v_start.slot AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), ''),
            true);
        v_failed := false;
        BEGIN
            -- The caller's own SQL, run with the caller's privileges (this
            -- procedure is not SECURITY DEFINER): nothing to inject into.
            PERFORM 'PRAGMA:disable:security_warnings';  -- plpgsql_check; a no-op when run
            EXECUTE command;
            PERFORM ledger.complete_run(run_id => v_start.run_id, token => v_start.token);
        EXCEPTION WHEN OTHERS OR query_canceled OR assert_failure THEN
            v_failed := true;
            GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT,
                                    v_detail = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT,
                                    v_context = PG_EXCEPTION_CONTEXT;
        END;

        IF v_failed THEN
            -- The command's writes are rolled back; record why, then end the
            -- CALL with the same error, so pg_cron logs it as failed.
            BEGIN
                IF v_state = '57014' THEN  -- query_canceled: statement_timeout, pg_cancel_backend
                    PERFORM ledger.cancel_run(run_id => v_start.run_id, token => v_start.token,
                                               error => pg_catalog.format('%s: %s', v_state, v_message));
                ELSE
                    PERFORM ledger.fail_run(run_id => v_start.run_id, token => v_start.token,
                        error => pg_catalog.format('%s: %s', v_state, v_message),
                        detail => pg_catalog.jsonb_strip_nulls(pg_catalog.jsonb_build_object(
                            'sqlstate', v_state,
                            'error_detail', pg_catalog.left(nullif(v_detail, ''), 2000),
                            'error_hint', pg_catalog.left(nullif(v_hint, ''), 2000),
                            'error_context', pg_catalog.left(nullif(v_context, ''), 2000))));
                END IF;
            EXCEPTION WHEN SQLSTATE 'LD001' OR SQLSTATE 'LD003' THEN
                -- A takeover or the reaper closed the run meanwhile: the ttl
                -- did not cover the command. The row keeps their verdict.
                GET STACKED DIAGNOSTICS v_lost = MESSAGE_TEXT;
                RAISE NOTICE USING
                    MESSAGE = pg_catalog.format('ledger.run_guarded: job %s run %s lost its lease while the command ran: %s',
                                                job, v_start.run_id, v_lost),
                    DETAIL = v_facts::text,
                    HINT = 'The ttl must cover the whole command: heartbeats are impossible during one statement.';
            END;
            COMMIT;
            RAISE EXCEPTION USING ERRCODE = v_state, MESSAGE = v_message,
                DETAIL = coalesce(nullif(v_detail, ''), v_facts::text),
                HINT = coalesce(nullif(v_hint, ''),
                                pg_catalog.format('ledger.job_execution_log run %s records this failure.', v_start.run_id));
        END IF;
        COMMIT;
        RAISE NOTICE USING
            MESSAGE = pg_catalog.format('ledger.run_guarded: job %s run %s (token %s%s) succeeded',
                                        job, v_start.run_id, v_start.token,
                                        coalesce(', slot ' || v_start.slot::text, '')),
            DETAIL = v_facts::text;
    END LOOP;
END
$$;
COMMENT ON PROCEDURE ledger.run_guarded(text, text, text, interval) IS
    'Run a SQL command as a run of the job (CALL outside a transaction block, e.g. from pg_cron): start, commit, execute, complete or fail';
