"""ledger.db_risks: the ledger watches its own failure mode (issue 21, item 5).

A snapshot held open in the ledger's database keeps every row version the
renewals leave. Here a second connection holds one (``BEGIN ISOLATION LEVEL
REPEATABLE READ; SELECT 1;`` and idle) while a fixed number of renewals run:
the view names the holder, the dead rows on ledger.leases grow by at least
one per renewal, the risk rises with the horizon's age (the ledger's clock
seam moves it, no sleeping) and with the transactions started since (a
threshold redefined as the database's owner, as the clock is), and once the
snapshot ends and a VACUUM ran, every risk is ok again. The metric and the
command line say the same. Only invariants; no duration is asserted.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from ledger.cli import main
from ledger.metrics import exposition
from sqlhelp import rows
from waiting import wait_for

JOBS = 5
RENEWALS = 2000  # 400 per lease: past the dead rows' warn threshold (1,000 and 10 per live row), under critical
HOT_TABLES = {"ledger.leases", "ledger.counters", "ledger.skip_counts"}


def risks(conn: psycopg.Connection) -> dict[tuple[str, str | None], dict[str, Any]]:
    """The view's rows by (kind, relation), in a transaction of their own (statistics are read afresh)."""
    return {(row["kind"], row["relation"]): row for row in rows(conn, "SELECT * FROM ledger.db_risks")}


def until(conn: psycopg.Connection, check: Callable[[dict[tuple[str, str | None], dict[str, Any]]], bool],
          seconds: float = 60.0) -> dict[tuple[str, str | None], dict[str, Any]]:
    """The view once ``check`` holds: statistics reach the view a moment after the backend that counted them."""
    def reached() -> dict[tuple[str, str | None], dict[str, Any]] | None:
        found = risks(conn)
        return found if check(found) else None
    return wait_for(reached, seconds, "ledger.db_risks to show the statistics")


def flush(conn: psycopg.Connection) -> None:
    """Send this backend's pending table statistics now (PostgreSQL 15+; older servers send them within 0.5 s)."""
    if conn.info.server_version >= 150000:
        conn.execute("SELECT pg_stat_force_next_flush()")


def hold_snapshot(connect: Callable[..., psycopg.Connection]) -> psycopg.Connection:
    holder = connect(application_name="risk-holder")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")
    return holder


def take_leases(db: psycopg.Connection) -> list[tuple[str, str, int]]:
    leases = [db.execute("SELECT job, owner, token FROM ledger.acquire(%s, 'worker', '1 hour')",
                         (f"job-{i}",)).fetchone() for i in range(JOBS)]
    db.execute("VACUUM ledger.leases")
    return leases  # type: ignore[return-value]


def renew(db: psycopg.Connection, leases: list[tuple[str, str, int]]) -> None:
    for i in range(RENEWALS):
        assert db.execute("SELECT ledger.renew(%s, %s, %s)", leases[i % JOBS]).fetchone()[0] is not None
    flush(db)


def burn_transactions(db: psycopg.Connection, count: int) -> None:
    for _ in range(count):
        db.execute("SELECT txid_current()")


def lower_the_horizon_threshold(db: psycopg.Connection, transactions: int) -> None:
    """The owner's seam: redefine the warn threshold in transactions, as LedgerClock redefines the offset."""
    db.execute("CREATE OR REPLACE FUNCTION ledger._risk_horizon_warn_xids() RETURNS bigint LANGUAGE sql "
               f"IMMUTABLE PARALLEL SAFE AS $$ SELECT {int(transactions)}::bigint $$")  # type: ignore[arg-type]


def test_every_risk_has_a_row_and_a_fresh_ledger_runs_none(db):
    found = risks(db)
    assert set(found) == ({("xmin_horizon", None)} | {(kind, table) for kind in ("dead_rows", "autovacuum_lag")
                                                       for table in HOT_TABLES})
    assert {row["severity"] for row in found.values()} == {"ok"}
    assert found[("xmin_horizon", None)]["holder"] is None and found[("xmin_horizon", None)]["value"] == 0
    assert {found[("dead_rows", table)]["unit"] for table in HOT_TABLES} == {"rows"}
    # the hot tables leave room on each page for their renewals' HOT updates
    assert {found[("dead_rows", table)]["detail"]["fillfactor"] for table in HOT_TABLES} == {50}


def test_the_reader_reads_the_view(db):
    db.execute("SET ROLE ledger_reader")
    found = risks(db)
    assert len(found) == 7 and {row["severity"] for row in found.values()} == {"ok"}


def test_renewals_are_hot_updates(connect, db):
    """A renewal changes no indexed column of ledger.leases (its one index is the primary key) and its page
    has room (fillfactor 50): its new version is a HOT update, and the page is pruned without vacuum. Not
    every one: pruning is opportunistic (it needs the page to itself and the old versions out of every
    snapshot's sight at that moment), and an update that finds the page full goes to another one; a
    renewal that changed an indexed column would make none HOT."""
    leases = take_leases(db)
    reader = connect()
    statistics = "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_all_tables WHERE relid = 'ledger.leases'::regclass"
    updates, hot = reader.execute(statistics).fetchone()  # type: ignore[misc]
    renew(db, leases)
    def counted() -> tuple[int, int] | None:
        row = reader.execute(statistics).fetchone()
        return row if row is not None and row[0] - updates >= RENEWALS else None  # type: ignore[return-value]
    now = wait_for(counted, what="the renewals in pg_stat_all_tables")
    assert now[0] - updates == RENEWALS
    assert now[1] - hot >= 0.9 * RENEWALS

    def pruned() -> int | None:
        # a read of the pages prunes them once no snapshot of this database still sees the old
        # versions (an autovacuum worker's analyze of the new database may, for a moment, on a
        # busy machine); the statistics count the versions pruned
        reader.execute("SELECT count(*) FROM ledger.leases")
        dead = risks(reader)[("dead_rows", "ledger.leases")]["value"]
        return dead if dead < RENEWALS else None
    wait_for(pruned, what="the leases' pages pruned without vacuum")


def test_a_held_snapshot_is_named_and_its_age_raises_the_risk(connect, db, ledger_clock):
    holder = hold_snapshot(connect)
    pid = holder.info.backend_pid
    horizon = risks(db)[("xmin_horizon", None)]
    assert (horizon["holder_type"], horizon["holder"], horizon["pid"]) == ("backend", str(pid), pid)
    assert horizon["application_name"] == "risk-holder" and horizon["state"] == "idle in transaction"
    assert horizon["xact_start"] is not None and horizon["severity"] == "ok"

    ledger_clock.advance(timedelta(minutes=10))  # past the warn age (5 minutes)
    horizon = risks(db)[("xmin_horizon", None)]
    assert horizon["severity"] == "warn" and horizon["age"] >= timedelta(minutes=10)
    assert f"pg_terminate_backend({pid})" in horizon["message"]
    ledger_clock.advance(timedelta(hours=1))  # past the critical age (1 hour)
    assert risks(db)[("xmin_horizon", None)]["severity"] == "critical"

    holder.execute("ROLLBACK")
    horizon = risks(db)[("xmin_horizon", None)]
    assert horizon["pid"] != pid and horizon["severity"] == "ok"


def test_renewals_under_a_held_snapshot_leave_dead_rows_until_it_ends_and_vacuum_runs(connect, db, ledger_clock):
    leases = take_leases(db)
    holder = hold_snapshot(connect)
    pid = holder.info.backend_pid
    renew(db, leases)
    reader = connect()
    found = until(reader, lambda f: f[("dead_rows", "ledger.leases")]["value"] >= RENEWALS)

    dead = found[("dead_rows", "ledger.leases")]
    assert dead["value"] >= RENEWALS  # each renewal left a version that nothing may remove
    assert dead["severity"] == "warn" and f"backend {pid}" in dead["message"]
    horizon = found[("xmin_horizon", None)]
    assert horizon["pid"] == pid and horizon["value"] >= RENEWALS  # every renewal took a transaction id since
    # Past autovacuum's own trigger, and (by the ledger's clock) vacuumed two hours ago.
    ledger_clock.advance(timedelta(hours=2))
    lag = risks(reader)[("autovacuum_lag", "ledger.leases")]
    assert lag["severity"] == "critical" and lag["value"] >= 7200 and lag["detail"]["autovacuum_trigger"] < RENEWALS

    db.execute("VACUUM ledger.leases")  # with the snapshot held: removes nothing
    assert until(reader, lambda f: f[("dead_rows", "ledger.leases")]["value"] >= RENEWALS)[
        ("dead_rows", "ledger.leases")]["severity"] == "warn"

    holder.execute("ROLLBACK")
    db.execute("VACUUM ledger.leases")
    found = until(reader, lambda f: f[("dead_rows", "ledger.leases")]["severity"] == "ok")
    assert found[("dead_rows", "ledger.leases")]["value"] < 1000
    assert found[("autovacuum_lag", "ledger.leases")]["severity"] == "ok"  # not due: nothing to vacuum
    assert found[("xmin_horizon", None)]["pid"] != pid
    assert {row["severity"] for row in found.values()} == {"ok"}


def test_a_reader_judges_other_roles_backends_by_transactions_only(connect, db, ledger_clock):
    holder = hold_snapshot(connect)
    pid = holder.info.backend_pid
    reader = connect()
    reader.execute("SET ROLE ledger_reader")
    ledger_clock.advance(timedelta(hours=2))  # an age the reader cannot see
    horizon = risks(reader)[("xmin_horizon", None)]
    assert (horizon["pid"], horizon["application_name"]) == (pid, "risk-holder")
    assert horizon["state"] is None and horizon["xact_start"] is None and horizon["age"] is None
    assert horizon["severity"] == "ok" and "state hidden from this role" in horizon["message"]

    lower_the_horizon_threshold(db, 100)
    burn_transactions(db, 150)
    horizon = risks(reader)[("xmin_horizon", None)]
    assert horizon["value"] >= 150 and horizon["severity"] == "warn"
    assert "hidden from this role (pg_read_all_stats)" in horizon["message"]


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_metrics_expose_the_risks_and_their_holder(connect, db, dsn):
    leases = take_leases(db)
    holder = hold_snapshot(connect)
    pid = holder.info.backend_pid
    renew(db, leases)
    lower_the_horizon_threshold(db, 100)  # the exporter reads as ledger_reader: by transactions only
    until(db, lambda f: f[("dead_rows", "ledger.leases")]["value"] >= RENEWALS)

    samples = _samples(exposition(lambda: psycopg.connect(dsn, autocommit=True)))
    assert samples[("jobledger_db_risk", frozenset({("kind", "xmin_horizon"), ("relation", "")}))] == 1
    assert samples[("jobledger_db_risk", frozenset({("kind", "dead_rows"), ("relation", "ledger.leases")}))] == 1
    assert samples[("jobledger_db_risk", frozenset({("kind", "dead_rows"), ("relation", "ledger.counters")}))] == 0
    assert samples[("jobledger_dead_rows", frozenset({("relation", "ledger.leases")}))] >= RENEWALS
    assert samples[("jobledger_xmin_horizon_age_transactions", frozenset())] >= RENEWALS
    assert samples[("jobledger_xmin_horizon_holder", frozenset(
        {("holder_type", "backend"), ("holder", str(pid)), ("application_name", "risk-holder")}))] == 1
    assert ("jobledger_xmin_horizon_age_seconds", frozenset()) not in samples  # hidden from ledger_reader

    holder.execute("ROLLBACK")
    db.execute("VACUUM ledger.leases")
    until(db, lambda f: f[("dead_rows", "ledger.leases")]["severity"] == "ok")
    samples = _samples(exposition(lambda: psycopg.connect(dsn, autocommit=True)))
    assert {value for (name, _), value in samples.items() if name == "jobledger_db_risk"} == {0}
    assert not [name for name, _ in samples if name == "jobledger_xmin_horizon_holder"]
    assert samples[("jobledger_xmin_horizon_age_seconds", frozenset())] == 0  # nothing holds it


def test_jobledger_risks_exits_1_while_a_risk_is_raised(connect, db, dsn):
    runner = CliRunner()
    calm = runner.invoke(main, ["risks", "--dsn", dsn])
    assert calm.exit_code == 0, calm.output
    assert "xmin_horizon" in calm.output and "ledger.leases" in calm.output

    leases = take_leases(db)
    holder = hold_snapshot(connect)
    renew(db, leases)
    until(db, lambda f: f[("dead_rows", "ledger.leases")]["severity"] == "warn")
    raised = runner.invoke(main, ["risks", "--json", "--dsn", dsn])
    assert raised.exit_code == 1, raised.output
    document = json.loads(raised.output)
    assert [row["kind"] for row in document][:1] == ["xmin_horizon"]
    assert document[0]["pid"] == holder.info.backend_pid
    assert {row["severity"] for row in document if row["kind"] == "dead_rows" and row["relation"] == "ledger.leases"} \
        == {"warn"}


@pytest.mark.parametrize("name, expected", [
    ("_risk_horizon_warn_age", timedelta(minutes=5)), ("_risk_horizon_critical_age", timedelta(hours=1)),
    ("_risk_horizon_warn_xids", 1_000_000), ("_risk_horizon_critical_xids", 100_000_000),
    ("_risk_dead_rows_warn", 1_000), ("_risk_dead_rows_critical", 10_000),
    ("_risk_dead_per_live_warn", 10), ("_risk_dead_per_live_critical", 100),
    ("_risk_vacuum_warn_lag", timedelta(minutes=10)), ("_risk_vacuum_critical_lag", timedelta(hours=1)),
])
def test_the_thresholds_are_the_documented_ones(db, name, expected):
    """docs/contract.md's table of the thresholds, as installed."""
    assert db.execute(f"SELECT ledger.{name}()").fetchone()[0] == expected  # type: ignore[index]
