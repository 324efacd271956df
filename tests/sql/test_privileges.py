"""Clients write only through the functions: no role can forge or rewind a token."""

from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from sqlhelp import one, value

TABLES = ["jobs", "leases", "fences", "job_execution_log", "counters", "skipped_slots", "purged_slots",
          "purged_keys", "events", "event_settings", "alert_state", "triggers", "schedulers", "scheduler_jobs", "wakeups",
          "upkeep_leader"]
WRITES = {
    "INSERT": "INSERT INTO ledger.{t} DEFAULT VALUES",
    "UPDATE": "UPDATE ledger.{t} SET {c} = {c}",
    "DELETE": "DELETE FROM ledger.{t}",
    "TRUNCATE": "TRUNCATE ledger.{t}",
}
KEY = {"jobs": "job", "leases": "token", "fences": "token", "job_execution_log": "status", "counters": "failures",
       "skipped_slots": "slot_count", "purged_slots": "done_through", "purged_keys": "run_id", "events": "kind",
       "event_settings": "notify", "alert_state": "message", "triggers": "status", "schedulers": "version",
       "scheduler_jobs": "job", "wakeups": "at",
       "upkeep_leader": "term"}


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_client_role_cannot_write_ledger_tables(db, app_role, table, write):
    db.execute("SELECT ledger.start_run('nightly', 'host-1', '1 hour')")
    db.execute(f"SET ROLE {app_role}")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute(WRITES[write].format(t=table, c=KEY[table]))


def test_a_client_role_uses_the_api_and_reads_the_tables(db, app_role):
    db.execute(f"SET ROLE {app_role}")
    started = one(db, "SELECT * FROM ledger.start_run('nightly', 'host-1', '1 hour')")
    assert started["outcome"] == "started"
    assert value(db, "SELECT ledger.fence('nightly', 'reports', %s)", (started["token"],)) == started["token"]
    assert value(db, "SELECT count(*) FROM ledger.job_execution_log") == 1
    assert value(db, "SELECT count(*) FROM ledger.job_counters") == 1
    one(db, "SELECT * FROM ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))


def test_a_client_role_cannot_call_internal_helpers_that_touch_tables(db, app_role):
    db.execute(f"SET ROLE {app_role}")
    for call in ("ledger._set_state('nightly', 'recomputed')", "ledger._close_run(1, 'superseded', now())",
                 "ledger._newest_done_slot('nightly')", "ledger._lock_lease('nightly', 'o', '1 hour', 1)",
                 "ledger._count_skip('nightly', '1s')", "ledger._count_skips('nightly', '1s', 5)",
                 "ledger._already_done('nightly', now(), NULL)"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute(f"SELECT {call}")


# The clock (12_clock.sql): read by the views as whoever reads them, so
# granted though not IMMUTABLE; inlined LANGUAGE sql, so no SET clause (their
# bodies are qualified down to the operator). Redefining them is the owner's.
CLOCK = [("_clock_offset", "sql", "s", False), ("_now", "sql", "v", False), ("_view_now", "sql", "s", False)]


def test_only_pure_immutable_helpers_and_the_clock_are_granted_to_the_roles(db):
    granted = db.execute("""
        SELECT p.proname::text FROM pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace AND p.proname LIKE E'\\\\_%'
           AND has_function_privilege('ledger_reader', p.oid, 'EXECUTE')
           AND p.provolatile <> 'i' ORDER BY 1""").fetchall()
    assert granted == [(name,) for name, *_ in CLOCK]


def test_the_reader_role_reads_but_cannot_call_the_api(db):
    db.execute("SELECT ledger.acquire('nightly', 'host-1', '1 hour')")
    db.execute("SET ROLE ledger_reader")
    assert value(db, "SELECT count(*) FROM ledger.leases") == 1
    assert value(db, "SELECT count(*) FROM ledger.overlaps") == 0
    assert value(db, "SELECT count(*) FROM ledger.db_risks WHERE kind = 'xmin_horizon'") == 1
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SELECT ledger.acquire('nightly', 'host-2', '1 hour')")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SELECT ledger.fence('nightly', 'reports', 1)")


def test_public_has_no_access_to_the_schema(db):
    assert value(db, "SELECT has_schema_privilege('public', 'ledger', 'USAGE')") is False
    assert value(db, "SELECT has_function_privilege('public', 'ledger.acquire(text,text,interval)', 'EXECUTE')") is False


# The procedures that COMMIT: neither SECURITY DEFINER nor SET (see below).
COMMITTING_PROCEDURES = ("run_guarded", "purge_log_in_batches")
# Functions that run as their caller (with a fixed search_path): protect and unprotect
# (45_protect.sql) create or drop a trigger on the caller's own table, which only its owner may.
INVOKER_FUNCTIONS = ("protect", "unprotect")


def test_every_public_function_is_security_definer_with_a_fixed_search_path(db):
    # The exceptions: the bounds (11_bounds.sql), IMMUTABLE LANGUAGE sql
    # helpers with no SET clause, so that the planner inlines them into the
    # callers, whose search_path is fixed; and the procedure run_guarded
    # (80_pg_cron.sql), which runs the caller's own SQL, and the procedure
    # purge_log_in_batches (55_schedules.sql), which commits between batches:
    # PostgreSQL refuses COMMIT in a SECURITY DEFINER procedure or one with a
    # SET clause (and the caller's SQL must run with the caller's rights).
    # Both call only the API.
    bad = db.execute("""
        SELECT p.proname FROM pg_proc p
         WHERE p.pronamespace = 'ledger'::regnamespace
           AND NOT (p.proname LIKE E'\\\\_%%' AND p.provolatile = 'i' AND NOT p.prosecdef AND p.proconfig IS NULL
                    AND p.prolang = (SELECT l.oid FROM pg_language l WHERE l.lanname = 'sql'))
           AND NOT (p.proname = ANY (%(procedures)s) AND p.prokind = 'p'
                    AND NOT p.prosecdef AND p.proconfig IS NULL)
           AND NOT (p.proname = ANY (%(invokers)s) AND p.prokind = 'f' AND NOT p.prosecdef
                    AND 'search_path=pg_catalog, pg_temp' = ANY (p.proconfig))
           AND NOT (p.proname = ANY (%(clock)s) AND NOT p.prosecdef AND p.proconfig IS NULL
                    AND p.prolang = (SELECT l.oid FROM pg_language l WHERE l.lanname = 'sql'))
           AND (NOT p.prosecdef AND p.proname NOT LIKE E'\\\\_%%'
                OR p.proconfig IS NULL
                OR NOT 'search_path=pg_catalog, pg_temp' = ANY (p.proconfig))""",
        {"procedures": list(COMMITTING_PROCEDURES), "invokers": list(INVOKER_FUNCTIONS),
         "clock": [name for name, *_ in CLOCK]}).fetchall()
    assert bad == []


INLINED = ["_advice_min_runs", "_advice_min_ttl", "_alert_sync_idle_limit", "_ddl_lock_wait", "_down_after_slots",
           "_failing_after", "_is_visible_text", "_lock_wait", "_max_backfill", "_max_concurrent", "_max_detail_bytes", "_max_error_length",
           "_max_every", "_max_health_bound", "_max_instant", "_max_older_than", "_max_pause_after_failures",
           "_max_preview_slots", "_max_schedule_length", "_max_pool_size",
           "_max_ttl", "_min_every",
           "_max_fenced", "_min_instant", "_popcount",
           # the thresholds of ledger.db_risks (76_risks.sql)
           "_risk_dead_per_live_critical", "_risk_dead_per_live_warn", "_risk_dead_rows_critical",
           "_risk_dead_rows_warn", "_risk_horizon_critical_age", "_risk_horizon_critical_xids",
           "_risk_horizon_warn_age", "_risk_horizon_warn_xids", "_risk_vacuum_critical_lag", "_risk_vacuum_warn_lag"]


def test_only_the_pure_inlined_bounds_go_without_a_fixed_search_path(db):
    inlined = db.execute("""
        SELECT p.proname::text, l.lanname::text, p.provolatile::text, p.prosecdef FROM pg_proc p
          JOIN pg_language l ON l.oid = p.prolang
         WHERE p.pronamespace = 'ledger'::regnamespace AND p.proconfig IS NULL
           AND NOT (p.proname = ANY (%(procedures)s) AND p.prokind = 'p') ORDER BY 1""",
        {"procedures": list(COMMITTING_PROCEDURES)}).fetchall()
    assert inlined == sorted([(name, "sql", "i", False) for name in INLINED] + CLOCK)


def test_everything_in_the_schema_belongs_to_the_nologin_ledger_owner_not_the_installer(db):
    """A SECURITY DEFINER function runs as its owner: ledger_owner, never the superuser who installed."""
    owners = db.execute("""
        SELECT DISTINCT r.rolname::text FROM (
            SELECT proowner AS owner FROM pg_proc WHERE pronamespace = 'ledger'::regnamespace
            UNION ALL
            SELECT relowner FROM pg_class WHERE relnamespace = 'ledger'::regnamespace
                                            AND relname NOT LIKE 'alembic_version%'
            UNION ALL
            SELECT typowner FROM pg_type WHERE typnamespace = 'ledger'::regnamespace
                                           AND typname NOT IN ('alembic_version', '_alembic_version')) o
          JOIN pg_roles r ON r.oid = o.owner""").fetchall()
    assert owners == [("ledger_owner",)]
    owner = one(db, "SELECT rolsuper, rolcanlogin, rolcreaterole, rolcreatedb, rolbypassrls FROM pg_roles "
                    "WHERE rolname = 'ledger_owner'")
    assert owner == {"rolsuper": False, "rolcanlogin": False, "rolcreaterole": False, "rolcreatedb": False,
                     "rolbypassrls": False}
    assert value(db, "SELECT count(*) FROM pg_proc WHERE pronamespace = 'ledger'::regnamespace "
                     "AND prosecdef AND proowner <> 'ledger_owner'::regrole") == 0


def test_a_client_cannot_become_the_ledger_owner(db, app_role):
    # SET ROLE is checked against the session user: become the client for real.
    db.execute(f"SET SESSION AUTHORIZATION {app_role}")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SET ROLE ledger_owner")
    db.execute("RESET SESSION AUTHORIZATION")


def test_a_schema_earlier_in_search_path_defining_now_and_clock_timestamp_changes_nothing(db, app_role):
    db.execute("CREATE SCHEMA evil")
    for fn in ("now", "clock_timestamp", "statement_timestamp", "transaction_timestamp"):
        db.execute(f"CREATE FUNCTION evil.{fn}() RETURNS timestamptz LANGUAGE sql AS $$ SELECT '2000-01-01'::timestamptz $$")
    db.execute("CREATE FUNCTION evil.char_length(text) RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$")
    db.execute("GRANT USAGE ON SCHEMA evil TO PUBLIC")
    db.execute(f"SET ROLE {app_role}")
    db.execute("SET search_path = evil, pg_catalog, public")
    assert value(db, "SELECT clock_timestamp()").year == 2000  # the trap is armed
    lease = one(db, "SELECT * FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    real_now = datetime.now(timezone.utc)
    assert abs(lease["acquired_at"] - real_now) < timedelta(minutes=5)
    assert value(db, "SELECT ledger.is_current('nightly', %s)", (lease["token"],)) is True
    started = one(db, "SELECT * FROM ledger.start_run('other', 'host-1', '1 hour')")
    assert abs(started["expires_at"] - real_now - timedelta(hours=1)) < timedelta(minutes=5)
