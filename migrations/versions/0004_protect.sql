-- 0004: protect (drafted by tools/draft_revision.py from sql/)

-- By hand: the table the strict mode writes, before the functions that use it.
CREATE TABLE ledger.protected_writes (
    resource ledger.label PRIMARY KEY,
    token    bigint NOT NULL,
    xact     xid8   NOT NULL,
    CONSTRAINT protected_writes_token_positive CHECK (token > 0)
);
COMMENT ON TABLE ledger.protected_writes IS
    'Per strictly protected table: the transaction whose token advanced its fence last';
ALTER TABLE ledger.protected_writes OWNER TO ledger_owner;
REVOKE ALL ON TABLE ledger.protected_writes FROM PUBLIC;
GRANT SELECT ON TABLE ledger.protected_writes TO ledger_client, ledger_reader;

CREATE OR REPLACE FUNCTION ledger._protect()
 RETURNS trigger
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_job      text := TG_ARGV[0];
    v_resource text := TG_ARGV[1];
    v_carried  text := nullif(current_setting('ledger.token', true), '');
    v_for_job  text := nullif(current_setting('ledger.job', true), '');
    v_token    bigint;
    v_lease    ledger.leases;
BEGIN
    IF TG_LEVEL <> 'STATEMENT' OR TG_WHEN <> 'BEFORE' OR TG_NARGS <> 3
       OR TG_ARGV[2] NOT IN ('strict', 'lenient') THEN
        RAISE EXCEPTION USING ERRCODE = '55000',
            MESSAGE = format('trigger %s on %I.%I is not one that ledger.protect creates', TG_NAME,
                             TG_TABLE_SCHEMA, TG_TABLE_NAME),
            HINT = 'Drop it and call ledger.protect(table_name, job).';
    END IF;
    IF v_carried IS NULL THEN
        -- The fence's DETAIL, with no token: a write that carries none is a zombie's as much as a stale one.
        SELECT * INTO v_lease FROM ledger.leases l WHERE l.job = v_job;
        RAISE EXCEPTION USING ERRCODE = 'LD001',
            MESSAGE = format('no fencing token: table %I.%I is protected for job %s, and this transaction '
                             'carries no ledger.token', TG_TABLE_SCHEMA, TG_TABLE_NAME, v_job),
            DETAIL = jsonb_build_object(
                'job', v_job, 'token', NULL, 'current_token', v_lease.token, 'holder', v_lease.owner,
                'expires_at', v_lease.expires_at, 'released', v_lease.released_at IS NOT NULL,
                'resource', v_resource, 'setting', 'ledger.token')::text,
            HINT = 'SET LOCAL ledger.token (and ledger.job) to the job''s live token in the writing transaction; '
                   'ledger.run_guarded, the Python client''s run.transaction(conn) and jobledger run --pgoptions do.';
    END IF;
    IF NOT (CASE WHEN v_carried ~ '^[0-9]{1,19}$' THEN v_carried::numeric BETWEEN 1 AND 9223372036854775807
                 ELSE false END) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'setting ledger.token must be a fencing token: a positive integer',
            DETAIL = jsonb_build_object('argument', 'ledger.token', 'value', left(v_carried, 100))::text;
    END IF;
    v_token := v_carried::bigint;
    IF v_for_job <> v_job THEN
        -- Another job's token is a number that means nothing to this table's job.
        PERFORM ledger._raise('LD006',
            format('fence of another job: table %I.%I is protected for job %s, and this transaction carries '
                   'a token of job %s', TG_TABLE_SCHEMA, TG_TABLE_NAME, v_job, v_for_job),
            jsonb_build_object('resource', v_resource, 'job', v_for_job, 'bound_job', v_job, 'token', v_token));
    END IF;
    IF TG_ARGV[2] = 'lenient' THEN
        PERFORM ledger.fence(v_job, v_resource, v_token);  -- the fence itself: LD001, LD002, LD006
    ELSIF ledger.advance_fence(v_job, v_resource, v_token) THEN
        INSERT INTO ledger.protected_writes AS w (resource, token, xact)
        VALUES (v_resource, v_token, pg_current_xact_id())
        ON CONFLICT (resource) DO UPDATE SET token = excluded.token, xact = excluded.xact;
    ELSIF NOT EXISTS (SELECT FROM ledger.protected_writes w
                       WHERE w.resource = v_resource AND w.token = v_token AND w.xact = pg_current_xact_id()) THEN
        -- Strict: this token advanced the fence in another transaction already.
        PERFORM ledger._raise('LD002',
            format('stale fence token: table %I.%I is protected strictly and token %s wrote it in an earlier '
                   'transaction', TG_TABLE_SCHEMA, TG_TABLE_NAME, v_token),
            jsonb_build_object('resource', v_resource, 'job', v_job, 'token', v_token,
                               'highest_token', v_token, 'strict', true));
    END IF;
    RETURN NULL;  -- a statement trigger's result is ignored
END
$function$;

ALTER FUNCTION ledger._protect() OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._protect() FROM PUBLIC;

COMMENT ON FUNCTION ledger._protect() IS 'Trigger of a protected table: the job''s fence with the transaction''s ledger.token, once per statement';

GRANT EXECUTE ON FUNCTION ledger._protect() TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._trigger_args(args bytea)
 RETURNS text[]
 LANGUAGE plpgsql
 IMMUTABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_rest bytea := args;
    v_at   integer;
    v_args text[] := '{}'::text[];
    v_end  bytea := decode('00', 'hex');  -- not '\x00': whatever standard_conforming_strings says
BEGIN
    LOOP
        v_at := position(v_end IN v_rest);
        EXIT WHEN v_at = 0;
        v_args := array_append(v_args, convert_from(substring(v_rest FROM 1 FOR v_at - 1),
                                                    current_setting('server_encoding')));
        v_rest := substring(v_rest FROM v_at + 1);
    END LOOP;
    RETURN v_args;
END
$function$;

ALTER FUNCTION ledger._trigger_args(bytea) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._trigger_args(bytea) FROM PUBLIC;

COMMENT ON FUNCTION ledger._trigger_args(bytea) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._trigger_args(bytea) TO ledger_client;

GRANT EXECUTE ON FUNCTION ledger._trigger_args(bytea) TO ledger_reader;

CREATE OR REPLACE FUNCTION ledger._owned_table(table_name regclass, verb text)
 RETURNS pg_class
 LANGUAGE plpgsql
 STABLE
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_class pg_catalog.pg_class;
BEGIN
    IF table_name IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument table_name must not be null';
    END IF;
    SELECT * INTO v_class FROM pg_catalog.pg_class c WHERE c.oid = table_name;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42P01',
            MESSAGE = format('argument table_name names no table: relation %s does not exist', table_name::oid),
            DETAIL = jsonb_build_object('argument', 'table_name', 'oid', table_name::oid)::text;
    END IF;
    IF NOT pg_has_role(current_user, v_class.relowner, 'USAGE') THEN
        RAISE EXCEPTION USING ERRCODE = '42501',
            MESSAGE = format('argument table_name names %s, which %s does not own: only its owner may %s it',
                             table_name, current_user, verb),
            DETAIL = jsonb_build_object('argument', 'table_name', 'table', table_name::text,
                                        'owner', pg_get_userbyid(v_class.relowner), 'caller', current_user)::text;
    END IF;
    RETURN v_class;
END
$function$;

ALTER FUNCTION ledger._owned_table(regclass,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._owned_table(regclass,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._owned_table(regclass,text) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._owned_table(regclass,text) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger._lock_for_protect(table_name regclass, exclusive boolean, verb text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_wait text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', ledger._ddl_lock_wait(), true);
    IF exclusive THEN
        EXECUTE format('LOCK TABLE %s IN ACCESS EXCLUSIVE MODE', table_name);
    ELSE
        EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', table_name);
    END IF;
    PERFORM set_config('lock_timeout', v_wait, true);
EXCEPTION WHEN lock_not_available THEN
    RAISE EXCEPTION USING ERRCODE = '55P03',
        MESSAGE = format('%s could not lock %s within %s: another transaction has that table open; nothing '
                         'changed, retry when it has ended', verb, table_name, ledger._ddl_lock_wait()),
        DETAIL = jsonb_build_object(
            'argument', 'table_name', 'table', table_name::text, 'waited', ledger._ddl_lock_wait(),
            'blocking_pids', (SELECT coalesce(jsonb_agg(DISTINCT l.pid ORDER BY l.pid), '[]'::jsonb)
                                FROM pg_catalog.pg_locks l
                               WHERE l.relation = table_name AND l.granted
                                 AND l.pid <> pg_catalog.pg_backend_pid()))::text,
        HINT = 'pg_stat_activity shows what those backends are doing (an idle transaction holds its locks).';
END
$function$;

ALTER FUNCTION ledger._lock_for_protect(regclass,boolean,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger._lock_for_protect(regclass,boolean,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger._lock_for_protect(regclass,boolean,text) IS NULL;

GRANT EXECUTE ON FUNCTION ledger._lock_for_protect(regclass,boolean,text) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger.protect(table_name regclass, job text, mode text DEFAULT 'lenient'::text)
 RETURNS text
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_class    pg_catalog.pg_class;
    v_resource text;
    v_bound    ledger.label;
    v_held_by  text;
    v_held_as  text;
BEGIN
    PERFORM ledger._check_label(job, 'job');
    IF mode IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004', MESSAGE = 'argument mode must not be null';
    ELSIF mode NOT IN ('lenient', 'strict') THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument mode must be ''lenient'' (the token may write in many transactions, as '
                      'ledger.fence) or ''strict'' (in one transaction, as ledger.advance_fence)',
            DETAIL = jsonb_build_object('argument', 'mode', 'value', left(mode, 100))::text;
    END IF;
    v_class := ledger._owned_table(table_name, 'protect');
    IF v_class.relnamespace IN ('ledger'::regnamespace, 'pg_catalog'::regnamespace,
                                'information_schema'::regnamespace) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument table_name names %s, a table of the ledger itself or a system catalog',
                             table_name),
            DETAIL = jsonb_build_object('argument', 'table_name', 'table', table_name::text)::text;
    END IF;
    IF v_class.relkind <> 'r' THEN
        -- A view is written through its tables; a partitioned table's
        -- statement triggers do not fire for a write to a partition.
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument table_name names %s, which is not an ordinary table (%s)', table_name,
                             CASE v_class.relkind WHEN 'p' THEN 'a partitioned table'
                                 WHEN 'v' THEN 'a view: protect the tables it writes'
                                 WHEN 'm' THEN 'a materialized view' WHEN 'f' THEN 'a foreign table'
                                 ELSE 'relkind ' || v_class.relkind::text END),
            DETAIL = jsonb_build_object('argument', 'table_name', 'table', table_name::text,
                                        'relkind', v_class.relkind::text)::text;
    END IF;
    IF v_class.relispartition OR EXISTS (SELECT FROM pg_catalog.pg_inherits i
                                          WHERE i.inhrelid = table_name OR i.inhparent = table_name) THEN
        -- A statement on a parent fires the parent's statement triggers only.
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('argument table_name names %s, a partition or a table of an inheritance tree: '
                             'a write through a parent would not fire its trigger', table_name),
            DETAIL = jsonb_build_object('argument', 'table_name', 'table', table_name::text)::text;
    END IF;
    -- The fence's resource: the table's qualified name when it was protected (a rename keeps it).
    v_resource := format('%I.%I', (SELECT n.nspname FROM pg_catalog.pg_namespace n WHERE n.oid = v_class.relnamespace),
                         v_class.relname);
    IF char_length(v_resource) > 200 OR NOT ledger._is_visible_text(v_resource) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'argument table_name must name a table whose qualified name is a valid resource: '
                      '1 to 200 characters without control, format or separator characters',
            DETAIL = jsonb_build_object('argument', 'table_name', 'length', char_length(v_resource))::text;
    END IF;
    IF NOT EXISTS (SELECT FROM ledger.jobs j WHERE j.job = protect.job)
       AND NOT EXISTS (SELECT FROM ledger.leases l WHERE l.job = protect.job) THEN
        -- A misspelt job would refuse every write: the ledger must know it.
        RAISE EXCEPTION USING ERRCODE = 'LD005',
            MESSAGE = format('job not found: %s was never registered and never held a lease', job),
            DETAIL = jsonb_build_object('job', job)::text;
    END IF;
    PERFORM ledger._lock_for_protect(table_name, false, 'protect');
    SELECT p.job, p.mode INTO v_held_by, v_held_as
      FROM ledger.protected_tables p WHERE p.table_name = protect.table_name LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING ERRCODE = '42710',
            MESSAGE = format('argument table_name names %s, which is protected already (for job %s): '
                             'unprotect it first', table_name, v_held_by),
            DETAIL = jsonb_build_object('argument', 'table_name', 'table', table_name::text,
                                        'job', v_held_by, 'mode', v_held_as)::text;
    END IF;
    SELECT f.job INTO v_bound FROM ledger.fences f WHERE f.resource = v_resource;
    IF v_bound <> job THEN
        RAISE EXCEPTION USING ERRCODE = 'LD006',
            MESSAGE = format('fence of another job: resource %s belongs to job %s, not %s', v_resource, v_bound, job),
            DETAIL = jsonb_build_object('resource', v_resource, 'job', job, 'bound_job', v_bound,
                                        'token', NULL)::text;
    END IF;
    EXECUTE format('CREATE TRIGGER ledger_protect BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %s '
                   'FOR EACH STATEMENT EXECUTE FUNCTION ledger._protect(%L, %L, %L)',
                   table_name, job, v_resource, mode);
    RETURN v_resource;
END
$function$;

ALTER FUNCTION ledger.protect(regclass,text,text) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.protect(regclass,text,text) FROM PUBLIC;

COMMENT ON FUNCTION ledger.protect(regclass,text,text) IS 'Refuse every write to the caller''s table from a transaction that does not carry the job''s live token';

GRANT EXECUTE ON FUNCTION ledger.protect(regclass,text,text) TO ledger_client;

CREATE OR REPLACE FUNCTION ledger.unprotect(table_name regclass)
 RETURNS boolean
 LANGUAGE plpgsql
 SET search_path TO 'pg_catalog', 'pg_temp'
AS $function$
DECLARE
    v_trigger name;
    v_found   boolean := false;
BEGIN
    PERFORM ledger._owned_table(table_name, 'unprotect');
    PERFORM ledger._lock_for_protect(table_name, true, 'unprotect');  -- DROP TRIGGER's lock
    FOR v_trigger IN
        SELECT p.trigger_name FROM ledger.protected_tables p WHERE p.table_name = unprotect.table_name
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', v_trigger, table_name);
        v_found := true;
    END LOOP;
    RETURN v_found;  -- the fence stays, as every fence does
END
$function$;

ALTER FUNCTION ledger.unprotect(regclass) OWNER TO ledger_owner;

REVOKE ALL ON FUNCTION ledger.unprotect(regclass) FROM PUBLIC;

COMMENT ON FUNCTION ledger.unprotect(regclass) IS 'Remove ledger.protect''s trigger from the caller''s table; false when it was not protected';

GRANT EXECUTE ON FUNCTION ledger.unprotect(regclass) TO ledger_client;

-- By hand: the view of the protected tables, after the functions it calls.
CREATE VIEW ledger.protected_tables AS
SELECT t.tgrelid::regclass                AS table_name,
       a.args[1]                          AS job,
       a.args[2]                          AS resource,
       a.args[3]                          AS mode,
       t.tgenabled IN ('O', 'A')          AS enabled,
       t.tgname                           AS trigger_name
  FROM pg_catalog.pg_trigger t
 CROSS JOIN LATERAL (SELECT ledger._trigger_args(t.tgargs) AS args) a
 WHERE t.tgfoid = 'ledger._protect()'::regprocedure;
COMMENT ON VIEW ledger.protected_tables IS 'Tables that ledger.protect guards: the job, the fence''s resource, the mode';
ALTER VIEW ledger.protected_tables OWNER TO ledger_owner;
REVOKE ALL ON TABLE ledger.protected_tables FROM PUBLIC;
GRANT SELECT ON TABLE ledger.protected_tables TO ledger_client, ledger_reader;
