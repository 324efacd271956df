"""Protected tables (sql/45_protect.sql): a write to a table that ledger.protect guards must carry
the job's live token in the setting ledger.token, or it is refused with the fence's own errors, so
a zombie that wakes after a takeover cannot write one row without a line of its SQL changed.

Leases expire through the clock seam (ledger_clock), never by sleeping.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta

import psycopg
import pytest

from sqlhelp import one, rows, state, value

WRITES = {
    "INSERT": "INSERT INTO orders (id, note) VALUES (100, 'zombie')",
    "UPDATE": "UPDATE orders SET note = 'zombie'",
    "DELETE": "DELETE FROM orders",
    "TRUNCATE": "TRUNCATE orders",
    "INSERT ON CONFLICT": "INSERT INTO orders (id, note) VALUES (1, 'zombie') "
                          "ON CONFLICT (id) DO UPDATE SET note = excluded.note",
    "MERGE": "MERGE INTO orders o USING (SELECT 1 AS id) s ON o.id = s.id WHEN MATCHED THEN UPDATE SET note = 'zombie'",
}


@pytest.fixture
def orders(db):
    """Table orders (one row), protected for job nightly, whose lease host-1 holds: its token."""
    db.execute("CREATE TABLE orders (id integer PRIMARY KEY, note text)")
    db.execute("INSERT INTO orders VALUES (1, 'first')")
    token = value(db, "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    assert value(db, "SELECT ledger.protect('orders', 'nightly')") == "public.orders"
    return token


def carrying(conn, token, job="nightly"):
    """Open a transaction on ``conn`` that carries ``token`` (as a client does: SET LOCAL)."""
    conn.execute("BEGIN")
    conn.execute("SELECT set_config('ledger.token', %s, true)", (str(token),))
    if job is not None:
        conn.execute("SELECT set_config('ledger.job', %s, true)", (job,))


def table_rows(db):
    return db.execute("SELECT id, note FROM orders ORDER BY id").fetchall()


def refused(conn, sql, params=None):
    """The error of ``sql`` (which must fail), its transaction rolled back."""
    with pytest.raises(psycopg.DatabaseError) as error:
        conn.execute(sql, params)
    conn.execute("ROLLBACK")
    return error.value


def take_over(db, ledger_clock, owner="host-2"):
    """The lease of nightly expires and ``owner`` takes it: the new token."""
    ledger_clock.advance(timedelta(hours=1, seconds=1))
    return value(db, "SELECT token FROM ledger.acquire('nightly', %s, '1 hour')", (owner,))


# -- the zombie ---------------------------------------------------------------------------

@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_zombie_cannot_write_one_row_after_a_takeover(db, connect, orders, ledger_clock, write):
    zombie = connect()
    new = take_over(db, ledger_clock)
    assert new > orders

    carrying(zombie, orders)
    error = refused(zombie, WRITES[write])

    assert error.sqlstate == "LD001"
    facts = json.loads(error.diag.message_detail)
    assert (facts["job"], facts["token"], facts["current_token"], facts["holder"]) == \
        ("nightly", orders, new, "host-2")
    assert table_rows(db) == [(1, "first")]
    # The new holder writes, with zero lines of its SQL changed either.
    carrying(db, new)
    db.execute(WRITES[write])
    db.execute("COMMIT")
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'public.orders'") == new


def test_a_zombie_copy_is_refused_too(db, connect, orders, ledger_clock):
    zombie = connect()
    take_over(db, ledger_clock)
    carrying(zombie, orders)
    with pytest.raises(psycopg.DatabaseError) as error:
        with zombie.cursor() as cur, cur.copy("COPY orders (id, note) FROM STDIN") as copy:
            copy.write_row((7, "zombie"))
    zombie.execute("ROLLBACK")
    assert error.value.sqlstate == "LD001"
    assert table_rows(db) == [(1, "first")]


def test_every_statement_is_checked_so_a_takeover_between_two_statements_refuses_the_second(
        db, connect, orders, ledger_clock):
    zombie = connect()
    carrying(zombie, orders)
    zombie.execute("INSERT INTO orders VALUES (2, 'before the takeover')")

    take_over(db, ledger_clock)

    assert refused(zombie, "UPDATE orders SET note = 'after the takeover'").sqlstate == "LD001"
    assert table_rows(db) == [(1, "first")]  # the first statement went with its transaction


def test_a_write_with_no_token_is_refused_with_the_fences_detail_and_a_hint(db, orders):
    for setting in (None, ""):
        db.execute("BEGIN")
        if setting is not None:
            db.execute("SET LOCAL ledger.token = ''")
        error = refused(db, "INSERT INTO orders VALUES (2, 'no token')")
        assert error.sqlstate == "LD001"
        assert "no fencing token" in error.diag.message_primary and "public.orders" in error.diag.message_primary
        facts = json.loads(error.diag.message_detail)
        assert facts.pop("expires_at") is not None
        assert facts == {"job": "nightly", "token": None, "current_token": orders, "holder": "host-1",
                         "released": False, "resource": "public.orders", "setting": "ledger.token"}
        assert "ledger.token" in error.diag.message_hint
    # Autocommit statements carry nothing either.
    with pytest.raises(psycopg.DatabaseError) as error:
        db.execute("DELETE FROM orders")
    assert error.value.sqlstate == "LD001"
    assert table_rows(db) == [(1, "first")]


def test_the_live_holder_writes_and_the_fence_records_its_token_under_the_tables_name(db, connect, orders):
    holder = connect()
    carrying(holder, orders)
    holder.execute("INSERT INTO orders VALUES (2, 'second')")
    holder.execute("UPDATE orders SET note = 'updated' WHERE id = 1")
    holder.execute("DELETE FROM orders WHERE id = 2")
    holder.execute("COMMIT")
    assert table_rows(db) == [(1, "updated")]
    assert one(db, "SELECT job, token FROM ledger.fences WHERE resource = 'public.orders'") == \
        {"job": "nightly", "token": orders}
    # A session setting serves as well as SET LOCAL (what PGOPTIONS gives a psql).
    holder.execute("SET ledger.token = %s" % int(orders))
    holder.execute("INSERT INTO orders VALUES (3, 'session setting')")
    assert value(db, "SELECT count(*) FROM orders") == 2


def test_a_token_of_another_job_is_refused_as_a_fence_of_another_job(db, orders):
    other = value(db, "SELECT token FROM ledger.acquire('weekly', 'host-1', '1 hour')")
    carrying(db, other, job="weekly")
    error = refused(db, "INSERT INTO orders VALUES (2, 'weekly')")
    assert error.sqlstate == "LD006"
    assert json.loads(error.diag.message_detail) == {
        "resource": "public.orders", "job": "weekly", "bound_job": "nightly", "token": other}
    assert table_rows(db) == [(1, "first")]


def test_a_newer_token_that_wrote_first_refuses_an_older_one_that_is_live_again(db, connect, orders):
    # The same owner re-acquires (a new token) and writes; the old token is no longer current.
    newer = value(db, "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    carrying(db, newer)
    db.execute("INSERT INTO orders VALUES (2, 'newer')")
    db.execute("COMMIT")
    old = connect()
    carrying(old, orders)
    assert refused(old, "INSERT INTO orders VALUES (3, 'older')").sqlstate == "LD001"


# -- lenient and strict ----------------------------------------------------------------

def test_lenient_the_live_token_writes_in_as_many_transactions_as_it_likes(db, orders):
    for i in range(2, 5):
        carrying(db, orders)
        db.execute("INSERT INTO orders VALUES (%s, 'lenient')", (i,))
        db.execute("COMMIT")
    assert value(db, "SELECT count(*) FROM orders") == 4
    assert value(db, "SELECT mode FROM ledger.protected_tables") == "lenient"


def test_strict_a_token_writes_in_one_transaction_only(db, connect, orders):
    db.execute("SELECT ledger.unprotect('orders')")
    db.execute("SELECT ledger.protect('orders', 'nightly', mode => 'strict')")
    carrying(db, orders)
    db.execute("INSERT INTO orders VALUES (2, 'strict')")
    db.execute("UPDATE orders SET note = 'strict, same transaction'")
    db.execute("SAVEPOINT s")
    db.execute("DELETE FROM orders WHERE id = 2")
    db.execute("RELEASE SAVEPOINT s")
    db.execute("COMMIT")

    carrying(db, orders)
    error = refused(db, "INSERT INTO orders VALUES (3, 'a second transaction')")
    assert error.sqlstate == "LD002"
    assert json.loads(error.diag.message_detail) == {
        "resource": "public.orders", "job": "nightly", "token": orders, "highest_token": orders, "strict": True}

    # A new token (the holder re-acquired) writes once again.
    newer = value(db, "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    carrying(db, newer)
    db.execute("INSERT INTO orders VALUES (3, 'the next token')")
    db.execute("COMMIT")
    assert table_rows(db) == [(1, "strict, same transaction"), (3, "the next token")]


def test_strict_a_write_rolled_back_to_a_savepoint_does_not_use_the_token_up(db, orders):
    db.execute("SELECT ledger.unprotect('orders')")
    db.execute("SELECT ledger.protect('orders', 'nightly', mode => 'strict')")
    carrying(db, orders)
    db.execute("SAVEPOINT s")
    db.execute("INSERT INTO orders VALUES (2, 'rolled back')")
    db.execute("ROLLBACK TO SAVEPOINT s")
    db.execute("ROLLBACK")
    carrying(db, orders)
    db.execute("INSERT INTO orders VALUES (3, 'the one write')")
    db.execute("COMMIT")
    assert table_rows(db) == [(1, "first"), (3, "the one write")]


# -- what protect leaves, and unprotect --------------------------------------------------

def test_a_protected_table_names_its_job_in_its_trigger_and_in_the_view(db, orders):
    [definition] = db.execute("SELECT pg_get_triggerdef(t.oid) FROM pg_trigger t "
                              "WHERE t.tgrelid = 'orders'::regclass").fetchone()
    # What `\d orders` prints under Triggers:
    assert definition == ("CREATE TRIGGER ledger_protect BEFORE INSERT OR DELETE OR UPDATE OR TRUNCATE ON "
                          "public.orders FOR EACH STATEMENT EXECUTE FUNCTION "
                          "ledger._protect('nightly', 'public.orders', 'lenient')")
    assert rows(db, "SELECT table_name::text, job, resource, mode, enabled, trigger_name::text "
                    "FROM ledger.protected_tables") == [
        {"table_name": "orders", "job": "nightly", "resource": "public.orders", "mode": "lenient",
         "enabled": True, "trigger_name": "ledger_protect"}]
    assert value(db, "SELECT obj_description('orders'::regclass, 'pg_class')") is None  # the table's comment is the user's


def test_unprotect_restores_the_table_and_leaves_the_fence(db, orders):
    carrying(db, orders)
    db.execute("INSERT INTO orders VALUES (2, 'fenced')")
    db.execute("COMMIT")

    assert value(db, "SELECT ledger.unprotect('orders')") is True
    db.execute("INSERT INTO orders VALUES (3, 'no token')")
    db.execute("TRUNCATE orders")
    assert value(db, "SELECT count(*) FROM ledger.protected_tables") == 0
    assert value(db, "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'orders'::regclass") == 0
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'public.orders'") == orders
    assert value(db, "SELECT ledger.unprotect('orders')") is False
    # Protected again, by the same job: its fence goes on from where it was.
    assert value(db, "SELECT ledger.protect('orders', 'nightly')") == "public.orders"
    assert refused(db, "BEGIN; INSERT INTO orders VALUES (4, 'no token')").sqlstate == "LD001"


def test_a_renamed_table_keeps_its_protection_and_its_fence_a_dropped_one_leaves_nothing(db, orders):
    db.execute("ALTER TABLE orders RENAME TO orders_2026")
    carrying(db, orders)
    db.execute("INSERT INTO orders_2026 VALUES (2, 'renamed')")
    db.execute("COMMIT")
    assert one(db, "SELECT table_name::text, resource FROM ledger.protected_tables") == \
        {"table_name": "orders_2026", "resource": "public.orders"}
    db.execute("BEGIN")
    assert refused(db, "DELETE FROM orders_2026").sqlstate == "LD001"

    db.execute("DROP TABLE orders_2026")
    assert value(db, "SELECT count(*) FROM ledger.protected_tables") == 0


def test_a_disabled_trigger_shows_in_the_view(db, orders):
    db.execute("ALTER TABLE orders DISABLE TRIGGER ledger_protect")
    assert value(db, "SELECT enabled FROM ledger.protected_tables") is False


def test_uninstalling_the_ledger_unprotects_every_table(db, orders):
    db.execute("DROP SCHEMA ledger CASCADE")
    db.execute("INSERT INTO orders VALUES (2, 'no ledger')")
    assert value(db, "SELECT count(*) FROM orders") == 2


# -- bad input: a documented SQLSTATE naming the argument, and nothing changed ---------------

PROTECTION = """SELECT coalesce(jsonb_agg(jsonb_build_array(t.tgrelid::regclass::text, t.tgname, t.tgargs::text)
                                ORDER BY t.tgrelid, t.tgname), '[]') FROM pg_trigger t WHERE NOT t.tgisinternal"""


def unchanged(db):
    return state(db), value(db, PROTECTION)


@pytest.fixture
def shapes(db):
    """A view, a partitioned table and its partition, an inheritance tree, beside orders."""
    db.execute("CREATE VIEW orders_view AS SELECT * FROM orders")
    db.execute("CREATE TABLE events (at date NOT NULL) PARTITION BY RANGE (at)")
    db.execute("CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01')")
    db.execute("CREATE TABLE parent (id integer)")
    db.execute("CREATE TABLE child () INHERITS (parent)")


BAD_PROTECT = [
    # (call, sqlstate, argument named in the DETAIL, or in the message when there is no DETAIL)
    ("ledger.protect(4000000000::oid::regclass, 'nightly')", "42P01", "table_name"),
    ("ledger.protect(NULL, 'nightly')", "22004", "table_name"),
    ("ledger.protect('orders', NULL)", "22004", "job"),
    ("ledger.protect('orders', '')", "22023", "job"),
    ("ledger.protect('orders', 'nightly', mode => 'sloppy')", "22023", "mode"),
    ("ledger.protect('orders', 'nightly', mode => NULL)", "22004", "mode"),
    ("ledger.protect('orders', 'never-heard-of')", "LD005", "job"),
    ("ledger.protect('orders', 'nightly')", "42710", "table_name"),  # twice
    ("ledger.protect('orders_view', 'nightly')", "22023", "table_name"),
    ("ledger.protect('events', 'nightly')", "22023", "table_name"),
    ("ledger.protect('events_2026', 'nightly')", "22023", "table_name"),
    ("ledger.protect('parent', 'nightly')", "22023", "table_name"),
    ("ledger.protect('child', 'nightly')", "22023", "table_name"),
    ("ledger.protect('ledger.fences', 'nightly')", "22023", "table_name"),
    ("ledger.protect('pg_catalog.pg_class', 'nightly')", "22023", "table_name"),
    ("ledger.unprotect(4000000000::oid::regclass)", "42P01", "table_name"),
    ("ledger.unprotect(NULL)", "22004", "table_name"),
]


@pytest.mark.parametrize("call, sqlstate, argument", BAD_PROTECT, ids=[c for c, *_ in BAD_PROTECT])
def test_bad_input_to_protect_and_unprotect_names_the_argument_and_changes_nothing(
        db, orders, shapes, call, sqlstate, argument):
    before = unchanged(db)
    with pytest.raises(psycopg.DatabaseError) as error:
        db.execute(f"SELECT {call}")
    assert error.value.sqlstate == sqlstate, error.value
    detail = error.value.diag.message_detail
    if detail:
        facts = json.loads(detail)
        assert facts.get("argument", argument if "job" in facts else None) == argument, facts
    else:
        assert f"argument {argument}" in error.value.diag.message_primary
    assert unchanged(db) == before


def test_a_name_that_resolves_to_no_table_is_postgresqls_own_42p01_before_the_call(db, orders):
    before = unchanged(db)
    with pytest.raises(psycopg.errors.UndefinedTable):
        db.execute("SELECT ledger.protect('no_such_table', 'nightly')")
    assert unchanged(db) == before


def test_a_resource_another_job_fenced_is_refused_at_protect_time(db):
    db.execute("CREATE TABLE reports (id integer)")
    token = value(db, "SELECT token FROM ledger.acquire('weekly', 'host-1', '1 hour')")
    db.execute("SELECT ledger.fence('weekly', 'public.reports', %s)", (token,))
    db.execute("SELECT ledger.register_job('nightly')")
    before = unchanged(db)
    with pytest.raises(psycopg.DatabaseError) as error:
        db.execute("SELECT ledger.protect('reports', 'nightly')")
    assert error.value.sqlstate == "LD006"
    assert json.loads(error.value.diag.message_detail) == {
        "resource": "public.reports", "job": "nightly", "bound_job": "weekly", "token": None}
    assert unchanged(db) == before


@pytest.mark.parametrize("setting", ["abc", "0", "-3", "1.5", " 5", "99999999999999999999", "1e3"])
def test_a_ledger_token_that_is_not_a_token_is_22023_naming_the_setting(db, orders, setting):
    db.execute("BEGIN")
    db.execute("SELECT set_config('ledger.token', %s, true)", (setting,))
    error = refused(db, "INSERT INTO orders VALUES (2, 'bad token')")
    assert error.sqlstate == "22023"
    assert json.loads(error.diag.message_detail) == {"argument": "ledger.token", "value": setting}
    assert table_rows(db) == [(1, "first")]
    assert value(db, "SELECT count(*) FROM ledger.fences") == 0


@pytest.mark.parametrize("call", ["ledger.protect('orders', 'nightly')", "ledger.unprotect('orders')"])
def test_a_table_another_transaction_has_open_is_55p03_within_the_bound_and_nothing_changed(db, connect, call):
    db.execute("CREATE TABLE orders (id integer PRIMARY KEY, note text)")
    db.execute("SELECT ledger.register_job('nightly')")
    if "unprotect" in call:
        db.execute("SELECT ledger.protect('orders', 'nightly')")
    busy = connect()
    busy.execute("BEGIN")
    busy.execute("SELECT * FROM orders")  # ACCESS SHARE: enough to hold off DROP TRIGGER, not CREATE TRIGGER
    if "unprotect" not in call:
        busy.execute("LOCK TABLE orders IN ROW EXCLUSIVE MODE")  # a writer
    before = unchanged(db)
    with pytest.raises(psycopg.DatabaseError) as error:
        db.execute(f"SELECT {call}")
    assert error.value.sqlstate == "55P03"
    facts = json.loads(error.value.diag.message_detail)
    assert facts["argument"] == "table_name" and facts["blocking_pids"] == [busy.info.backend_pid]
    assert value(db, "SHOW lock_timeout") == "0"  # the caller's own setting is left as it was
    busy.execute("ROLLBACK")
    assert unchanged(db) == before


# -- privileges ---------------------------------------------------------------------------

@pytest.fixture
def roles(db):
    """Three roles (cluster-wide names): an owner and a writer in ledger_client, an outsider in nothing."""
    suffix = os.getpid()
    names = {"owner": f"protect_owner_{suffix}", "writer": f"protect_writer_{suffix}",
             "outsider": f"protect_outsider_{suffix}"}
    for name in names.values():
        db.execute(f"DROP ROLE IF EXISTS {name}")
    db.execute(f"CREATE ROLE {names['owner']} NOLOGIN IN ROLE ledger_client")
    db.execute(f"CREATE ROLE {names['writer']} NOLOGIN IN ROLE ledger_client")
    db.execute(f"CREATE ROLE {names['outsider']} NOLOGIN")
    db.execute(f"GRANT CREATE ON SCHEMA public TO {names['owner']}")
    yield names
    db.execute("RESET ROLE")
    for name in names.values():
        db.execute(f"DROP OWNED BY {name}")
        db.execute(f"DROP ROLE {name}")


def test_the_tables_owner_in_ledger_client_protects_and_unprotects_it(db, roles):
    token = value(db, "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    db.execute(f"SET ROLE {roles['owner']}")
    db.execute("CREATE TABLE orders (id integer)")
    assert value(db, "SELECT ledger.protect('orders', 'nightly')") == "public.orders"
    carrying(db, token)
    db.execute("INSERT INTO orders VALUES (1)")
    db.execute("COMMIT")
    assert value(db, "SELECT ledger.unprotect('orders')") is True


def test_a_ledger_client_that_does_not_own_the_table_cannot_protect_or_unprotect_it(db, roles):
    db.execute("SELECT ledger.register_job('nightly')")
    db.execute(f"CREATE TABLE orders (id integer); ALTER TABLE orders OWNER TO {roles['owner']}")
    db.execute(f"GRANT TRIGGER, INSERT ON orders TO {roles['writer']}")  # TRIGGER: CREATE TRIGGER would let it
    db.execute(f"SET ROLE {roles['writer']}")
    for call in ("ledger.protect('orders', 'nightly')", "ledger.unprotect('orders')"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as error:
            db.execute(f"SELECT {call}")
        facts = json.loads(error.value.diag.message_detail)
        assert (facts["argument"], facts["owner"], facts["caller"]) == ("table_name", roles["owner"], roles["writer"])
    db.execute("RESET ROLE")
    db.execute(f"SET ROLE {roles['owner']}")
    db.execute("SELECT ledger.protect('orders', 'nightly')")
    db.execute(f"SET ROLE {roles['writer']}")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SELECT ledger.unprotect('orders')")
    db.execute("RESET ROLE")
    assert value(db, "SELECT count(*) FROM ledger.protected_tables") == 1


def test_an_owner_outside_ledger_client_cannot_protect(db, roles):
    db.execute("SELECT ledger.register_job('nightly')")
    db.execute(f"CREATE TABLE orders (id integer); ALTER TABLE orders OWNER TO {roles['outsider']}")
    db.execute(f"SET ROLE {roles['outsider']}")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        db.execute("SELECT ledger.protect('orders', 'nightly')")


def test_a_writer_needs_the_live_token_and_no_ledger_role(db, roles, ledger_clock):
    token = value(db, "SELECT token FROM ledger.acquire('nightly', 'host-1', '1 hour')")
    db.execute(f"CREATE TABLE orders (id integer); ALTER TABLE orders OWNER TO {roles['owner']}")
    db.execute(f"GRANT INSERT ON orders TO {roles['writer']}, {roles['outsider']}")
    db.execute(f"SET ROLE {roles['owner']}")
    db.execute("SELECT ledger.protect('orders', 'nightly')")
    for role in ("writer", "outsider"):  # the trigger fences as ledger_owner, whoever writes
        db.execute(f"SET ROLE {roles[role]}")
        carrying(db, token)
        db.execute("INSERT INTO orders VALUES (1)")
        db.execute("COMMIT")
        db.execute("BEGIN")
        assert refused(db, "INSERT INTO orders VALUES (2)").sqlstate == "LD001"
    db.execute("RESET ROLE")
    new = take_over(db, ledger_clock)
    db.execute(f"SET ROLE {roles['writer']}")
    carrying(db, token)
    assert refused(db, "INSERT INTO orders VALUES (3)").sqlstate == "LD001"
    carrying(db, new)
    db.execute("INSERT INTO orders VALUES (4)")
    db.execute("COMMIT")
    db.execute("RESET ROLE")
    assert value(db, "SELECT array_agg(id ORDER BY id) FROM orders") == [1, 1, 4]


def test_a_client_cannot_write_the_strict_memo_nor_call_the_trigger_function(db, roles):
    db.execute(f"SET ROLE {roles['writer']}")
    for write in ("INSERT INTO ledger.protected_writes VALUES ('x', 1, '1')",
                  "UPDATE ledger.protected_writes SET token = token", "DELETE FROM ledger.protected_writes"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            db.execute(write)
    with pytest.raises(psycopg.errors.FeatureNotSupported):  # "trigger functions can only be called as triggers"
        db.execute("SELECT ledger._protect()")
    assert value(db, "SELECT count(*) FROM ledger.protected_tables") == 0  # the view reads for a client
    db.execute("RESET ROLE")
    db.execute("SET ROLE ledger_reader")  # and for a reader (jobledger status, dashboards)
    assert value(db, "SELECT count(*) FROM ledger.protected_tables") == 0


def test_protect_runs_as_its_caller_and_the_trigger_as_the_ledger_owner(db):
    functions = rows(db, """SELECT p.proname::text AS name, p.prosecdef AS definer, r.rolname::text AS owner,
                                   has_function_privilege('ledger_client', p.oid, 'EXECUTE') AS client,
                                   has_function_privilege('ledger_reader', p.oid, 'EXECUTE') AS reader
                              FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner
                             WHERE p.oid IN ('ledger.protect(regclass, text, text)'::regprocedure,
                                             'ledger.unprotect(regclass)'::regprocedure,
                                             'ledger._protect()'::regprocedure) ORDER BY 1""")
    assert functions == [
        {"name": "_protect", "definer": True, "owner": "ledger_owner", "client": True, "reader": False},
        {"name": "protect", "definer": False, "owner": "ledger_owner", "client": True, "reader": False},
        {"name": "unprotect", "definer": False, "owner": "ledger_owner", "client": True, "reader": False}]


# -- run_guarded --------------------------------------------------------------------------

def test_run_guarded_writes_a_protected_table_with_zero_lines_changed(db, orders):
    db.execute("SELECT ledger.register_job('nightly', ttl => '1 hour')")
    db.execute("SELECT ledger.release('nightly', 'host-1', %s)", (orders,))
    db.execute("CALL ledger.run_guarded('nightly', $$INSERT INTO orders VALUES (2, 'guarded'); "
               "UPDATE orders SET note = 'guarded too' WHERE id = 1$$)")
    assert table_rows(db) == [(1, "guarded too"), (2, "guarded")]
    run = one(db, "SELECT status, token FROM ledger.job_execution_log WHERE job = 'nightly'")
    assert run["status"] == "success"
    assert value(db, "SELECT token FROM ledger.fences WHERE resource = 'public.orders'") == run["token"]


def test_run_guarded_whose_lease_is_taken_over_while_its_command_runs_writes_nothing(db, connect, orders,
                                                                                       ledger_clock):
    db.execute("SELECT ledger.register_job('nightly', ttl => '1 hour')")
    db.execute("SELECT ledger.release('nightly', 'host-1', %s)", (orders,))
    gate = connect()
    gate.execute("SELECT pg_advisory_lock(4242)")  # the command waits on it: the test decides when it writes
    guarded = connect()
    failure: list[BaseException] = []

    def call() -> None:
        try:
            guarded.execute("CALL ledger.run_guarded('nightly', $$SELECT pg_advisory_lock(4242); "
                            "INSERT INTO orders VALUES (2, 'zombie'); DELETE FROM orders WHERE id = 1$$)")
        except BaseException as error:  # noqa: BLE001 - inspected below
            failure.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    try:
        pid = guarded.info.backend_pid
        for _ in range(600):
            if value(db, "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory' "
                         "AND NOT granted", (pid,)):
                break
            threading.Event().wait(0.05)
        else:
            pytest.fail("run_guarded's command never reached the gate")
        take_over(db, ledger_clock)
    finally:
        gate.execute("SELECT pg_advisory_unlock(4242)")
        thread.join(60)
    assert len(failure) == 1 and getattr(failure[0], "sqlstate", None) == "LD001", failure
    assert table_rows(db) == [(1, "first")]
    assert value(db, "SELECT status FROM ledger.job_execution_log WHERE job = 'nightly'") != "success"
