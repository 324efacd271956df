"""Everything the ledger ships, behind a real PgBouncer in transaction mode (tests/pgbouncer.py).

With ``pool_mode = transaction`` and two server connections per database,
consecutive transactions of one client run on whichever server connection is
free: a statement psycopg prepared (after 5 executions, by default) on one
is missing on the other, or another client's statement of the same name is
there. The first test shows the bouncer really does that; the others run
the sync and async clients (over a DSN, a caller's connection, heartbeats),
``jobledger run``, ``status``, ``report``, ``metrics`` and ``demo`` through it.

Also here: a DSN that leads nowhere fails at once with LedgerUnavailable.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from datetime import timedelta

import psycopg
import pytest
from clihelp import environment, jobledger
from pgbouncer import Bouncer, pgbouncer  # noqa: F401 - the fixture

from ledger import AsyncLedger, Ledger
from ledger.errors import LedgerError, LedgerUnavailable
from ledger.metrics import read_text

THREADS = 4
RUNS = 200


def _status(db: psycopg.Connection, job: str) -> tuple[int, int, int]:
    row = db.execute("SELECT runs_started, successes, leases_lost FROM ledger.job_status WHERE job = %s",
                     (job,)).fetchone()
    assert row is not None
    return row


def test_the_bouncer_shares_server_connections_so_prepared_statements_break(pgbouncer: Bouncer, dsn):
    # The failure the ledger avoids: clients that prepare (threshold 0: at once) meet each
    # other's statements, or miss their own, on the two shared server connections.
    via = pgbouncer(dsn)
    errors: list[str] = []
    stop = threading.Event()

    def client(n: int) -> None:
        with psycopg.connect(via, autocommit=True, prepare_threshold=0) as conn:
            for i in range(200):
                if stop.is_set():
                    return
                try:
                    conn.execute("SELECT %s::int + 0 * pg_backend_pid()", (i,)).fetchone()
                    conn.execute("SELECT %s::text || pg_backend_pid()", (str(n),)).fetchone()
                except psycopg.Error as error:
                    errors.append(str(error))
                    stop.set()
                    return

    threads = [threading.Thread(target=client, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors, "four clients on two server connections never met another's prepared statement"
    assert any("prepared statement" in error or "bind message" in error for error in errors), errors


def test_200_runs_through_a_ledger_over_the_bouncer_from_several_threads(pgbouncer: Bouncer, dsn, db):
    failures: list[BaseException] = []
    with Ledger(pgbouncer(dsn), owner="pooled", pool_kwargs={"max_size": THREADS * 2}) as ledger:
        def worker(n: int) -> None:
            job = f"job-{n}"
            try:
                for i in range(RUNS // THREADS):
                    with ledger.run(job, ttl=timedelta(seconds=30),
                                    heartbeat_interval=timedelta(milliseconds=5)) as run:
                        assert run.started, run.outcome
                        if i % 10 == 0:
                            time.sleep(0.02)  # a few heartbeats
                        run.check()
                        status = ledger.job_status(job)
                        assert status is not None and status.running_run_id == run.run_id
                    assert run.result is not None and run.result.status == "success"
            except BaseException as error:  # reported below, with its traceback
                failures.append(error)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    assert not failures, failures[0]
    for n in range(THREADS):
        assert _status(db, f"job-{n}") == (RUNS // THREADS, RUNS // THREADS, 0)
    assert db.execute("SELECT count(*) FROM ledger.job_execution_log WHERE status = 'success'"
                      ).fetchone() == (RUNS,)


def test_200_runs_through_an_async_ledger_over_the_bouncer(pgbouncer: Bouncer, dsn, db):
    async def worker(ledger: AsyncLedger, n: int) -> None:
        job = f"job-{n}"
        for i in range(RUNS // THREADS):
            async with ledger.run(job, ttl=timedelta(seconds=30),
                                  heartbeat_interval=timedelta(milliseconds=5)) as run:
                assert run.started, run.outcome
                if i % 10 == 0:
                    await asyncio.sleep(0.02)
                await run.check()
                status = await ledger.job_status(job)
                assert status is not None and status.running_run_id == run.run_id
            assert run.result is not None and run.result.status == "success"

    async def main() -> None:
        async with AsyncLedger(pgbouncer(dsn), owner="pooled", pool_kwargs={"max_size": THREADS * 2}) as ledger:
            await asyncio.gather(*(worker(ledger, n) for n in range(THREADS)))

    asyncio.run(main())
    for n in range(THREADS):
        assert _status(db, f"job-{n}") == (RUNS // THREADS, RUNS // THREADS, 0)


def test_contexts_over_callers_connections_heartbeat_and_fence_through_the_bouncer(pgbouncer: Bouncer, dsn, db):
    # The caller's connections say prepare_threshold=None (as they must behind this pooler);
    # each context's own connection, opened from the caller's conninfo, takes that setting.
    db.execute("CREATE TABLE reports (writer text, token bigint)")
    via = pgbouncer(dsn)
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with psycopg.connect(via, autocommit=True, prepare_threshold=None) as conn:
                ledger = Ledger(conn, owner=f"worker-{n}")
                for _ in range(5):
                    with ledger.run(f"job-{n}", ttl=timedelta(seconds=1),
                                    heartbeat_interval=timedelta(milliseconds=50)) as run:
                        # the context's calls take their connections from the ledger's spares,
                        # opened with conn's setting
                        assert ledger._spares is not None and ledger._spares._idle
                        assert all(spare.prepare_threshold is None for spare in ledger._spares._idle)
                        for _ in range(4):
                            time.sleep(0.1)  # heartbeats meanwhile, on the context's own connection
                            with conn.transaction():
                                run.fence(conn, f"reports-{n}")
                                conn.execute("INSERT INTO reports VALUES (%s, %s)", (f"worker-{n}", run.token))
                            assert ledger.job_status(f"job-{n}") is not None
                    assert run.result is not None and run.result.status == "success"
                    assert run.result.heartbeat_at is not None
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures[0]
    assert db.execute("SELECT count(*) FROM reports").fetchone() == (THREADS * 5 * 4,)
    for n in range(THREADS):
        assert _status(db, f"job-{n}") == (5, 5, 0)


def _leave_prepared_statements_behind(via: str) -> None:
    """Earlier clients that prepared statements on the bouncer's server connections, then left."""
    def client() -> None:
        with psycopg.connect(via, autocommit=True, prepare_threshold=0) as conn:
            for i in range(20):
                try:
                    conn.execute("SELECT %s::int", (i,)).fetchone()
                    conn.execute("SELECT ledger.is_current(job => %s, token => %s)", ("x", 1)).fetchone()
                except psycopg.Error:
                    pass  # they break each other; what matters is what they leave prepared

    threads = [threading.Thread(target=client) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def test_jobledger_run_through_the_bouncer_keeps_its_lease(pgbouncer: Bouncer, dsn, db):
    via = pgbouncer(dsn)
    _leave_prepared_statements_behind(via)
    result = jobledger("run", "nightly", "--ttl", "3s", "--", "sleep", "5", dsn=via, timeout=60)
    assert result.returncode == 0, result.stderr
    run = db.execute("SELECT status, heartbeat_at - started_at, completed_at - started_at "
                     "FROM ledger.job_execution_log WHERE job = 'nightly'").fetchone()
    assert run is not None and run[0] == "success"
    assert run[1] > timedelta(seconds=3) and run[2] > timedelta(seconds=5)  # renewed past its ttl
    assert _status(db, "nightly") == (1, 1, 0)


def test_status_report_metrics_and_demo_through_the_bouncer(pgbouncer: Bouncer, dsn, db):
    via = pgbouncer(dsn)
    _leave_prepared_statements_behind(via)
    for i in range(3):
        assert jobledger("run", "nightly", "--ttl", "1m", "--", "true", dsn=via).returncode == 0
    for _ in range(2):  # each command more than once: nothing of the first is assumed by the second
        status = jobledger("status", "--json", dsn=via)
        assert status.returncode == 0, status.stderr
        [job] = json.loads(status.stdout)["jobs"]
        assert (job["job"], job["successes"]) == ("nightly", 3)

        report = jobledger("report", "--format", "json", "--allow-superuser",
                           "SELECT j.job, j.successes FROM ledger.job_status AS j ORDER BY j.job", dsn=via)
        assert report.returncode == 0, report.stderr
        assert json.loads(report.stdout) == [{"job": "nightly", "successes": 3}]

        metrics = jobledger("metrics", dsn=via)
        assert metrics.returncode == 0, metrics.stderr
        assert "jobledger_up 1.0" in metrics.stdout
        assert 'jobledger_runs_total{job="nightly",status="success"} 3.0' in metrics.stdout

    demo = jobledger("demo", "--speed", "3", "--dsn", via, "--yes-write-here", timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert demo.stdout.rstrip("\n").splitlines()[-1] == "audit: ledger.overlaps has 0 rows"
    assert "problem:" not in demo.stdout and "unexpected" not in demo.stdout


def test_a_scrape_in_parts_through_the_bouncer_writes_what_one_part_writes(pgbouncer: Bouncer, dsn, db):
    # the other part's transaction imports the first's snapshot: both on server connections the
    # bouncer picks, each within its transaction (SET TRANSACTION SNAPSHOT, then the read)
    via = pgbouncer(dsn)
    for name in ("a", "b", "c", "d", "e"):
        db.execute("SELECT ledger.register_job(%s, ttl => '1 minute')", (name,))
        run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(%s, 'bouncer')", (name,)).fetchone()
        db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    with psycopg.connect(via, autocommit=True) as conn:
        one = read_text(conn).decode()
        for _ in range(3):
            parted = read_text(conn, connect_part=lambda: psycopg.connect(via, autocommit=True), parts=2,
                               parts_from_jobs=1).decode()
            assert [line for line in parted.splitlines() if '{job="' in line] == [
                line for line in one.splitlines() if '{job="' in line]
    assert 'jobledger_job_state{job="e",state="ok"} 1.0' in one


# -- a DSN that leads nowhere ------------------------------------------------------------

@pytest.mark.parametrize("conninfo, named", [
    ("host=nowhere.invalid port=5432 dbname=x user=u password=s3cret", "host nowhere.invalid, port 5432"),
    ("host=127.0.0.1 port=1 dbname=x user=u password=s3cret", "host 127.0.0.1, port 1"),
])
def test_a_wrong_dsn_fails_at_once_naming_host_and_port(conninfo, named):
    with pytest.raises(LedgerUnavailable) as failed:
        Ledger(conninfo)
    error = failed.value
    assert isinstance(error, LedgerError) and isinstance(error, psycopg.OperationalError)
    assert named in str(error) and "s3cret" not in str(error) and "s3cret" not in repr(error.facts)
    assert error.facts["dbname"] == "x" and error.facts["user"] == "u"
    # At once, not after the pool's 30 s wait: the connection failure itself is
    # the cause, not psycopg_pool's PoolTimeout.
    assert isinstance(error.__cause__, psycopg.OperationalError), repr(error.__cause__)
    assert type(error.__cause__).__module__.startswith("psycopg"), repr(error.__cause__)
    assert "PoolTimeout" not in repr(error.__cause__)

    async def main() -> None:
        ledger = AsyncLedger(conninfo)  # opened on first use
        with pytest.raises(LedgerUnavailable, match=named):
            await ledger.job_statuses()
        with pytest.raises(LedgerUnavailable, match=named):  # and again: nothing half-open in between
            async with ledger:
                pass

    asyncio.run(main())
    cli = jobledger("status", dsn=conninfo)
    assert cli.returncode == 1 and named in cli.stderr and "s3cret" not in cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1
