"""Client-side lease deadlines: the client never believes it holds a lease the server considers expired.

The local deadline is send time + the time left the server reported, on
the monotonic clock (so a slow answer does not stretch it), and once it
passes the lease is lost: ``check``/``fence``/``advance_fence``/the end say
so, ``lost`` is set and ``on_lost`` called, and ``jobledger run`` stops CMD
(exit 124), even while the heartbeat is stuck in a call that will never
return. The partition is a TCP proxy (tests/tcp_proxy.py) that stops
forwarding without closing anything: no RST, no FIN, keepalives answered by
the proxy's kernel, no statement timeout reaching the server. The takeover
goes straight to the database, around the proxy.

Every wait is a poll with a generous timeout; no test asserts a duration.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import pytest
from clihelp import environment, runs_of, start
from psycopg.conninfo import conninfo_to_dict
from tcp_proxy import TcpProxy

from ledger import AsyncLedger, LeaseLost, LeaseSuperseded, Ledger
from ledger.aio import fence as afence
from ledger.client import fence
from ledger.errors import LedgerUnavailable
from ledger.client import Heartbeat
from ledger.heartbeat import Deadline, LeaseState, Renewal
from waiting import wait_for

TTL = timedelta(seconds=2)
PATIENCE = 30.0  # seconds any poll may wait: generous, never asserted as a bound


@pytest.fixture
def proxy(dsn: str) -> Iterator[TcpProxy]:
    params = conninfo_to_dict(dsn)
    with TcpProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)) as tcp:
        yield tcp


@pytest.fixture
def reports(db: psycopg.Connection) -> psycopg.Connection:
    db.execute("CREATE TABLE reports (writer text, token bigint)")
    return db


def take_over(db: psycopg.Connection, job: str, owner: str = "successor") -> int:
    """Start another owner's run of ``job`` directly (around the proxy), once the lease expired there."""
    def started() -> int | None:
        row = db.execute("SELECT outcome, token FROM ledger.start_run(job => %s, owner => %s, "
                         "ttl => '1 minute')", (job, owner)).fetchone()
        assert row is not None
        return int(row[1]) if row[0] == "started" else None

    token = wait_for(started, timeout=PATIENCE, what="the server to let the lease expire")
    assert isinstance(token, int)
    return token


def fenced_insert(db: psycopg.Connection, job: str, writer: str, token: int) -> None:
    with db.transaction():
        fence(db, job, "reports", token)
        db.execute("INSERT INTO reports VALUES (%s, %s)", (writer, token))


def in_thread(action: Callable[[], object], timeout: float = PATIENCE) -> object:
    """Run ``action`` in a thread; its result, or its exception raised here; fail when it hangs."""
    outcome: list[object] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(action())
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still blocked after {timeout}s"
    if failure:
        raise failure[0]
    return outcome[0]


# -- a frozen connection, sync ---------------------------------------------------------------

def test_the_sync_client_notices_a_silent_partition_and_its_fenced_write_is_refused(dsn, reports, proxy):
    via = proxy.conninfo(dsn)
    lost_reports: list[LeaseLost] = []
    with psycopg.connect(via, autocommit=True, prepare_threshold=None) as conn:
        ledger = Ledger(conn, owner="holder")
        run = ledger.run("nightly", ttl=TTL, on_lost=lost_reports.append)
        with pytest.raises(LeaseLost) as at_exit:
            with run:
                assert run.started
                fenced_insert(conn, "nightly", "holder", run.token)  # through the proxy, before the partition
                time.sleep(0.8)  # a heartbeat or two get through
                assert not run.is_lost()
                proxy.freeze()
                # The heartbeat is stuck in a call that never returns; the deadline still passes.
                assert run.lost.wait(PATIENCE), "the loss was never noticed"
                assert len(lost_reports) == 1 and "deadline" in lost_reports[0].reason
                assert run.time_left == timedelta(0)
                with pytest.raises(LeaseLost):
                    run.check()

                successor = take_over(reports, "nightly")
                assert successor == run.token + 1
                fenced_insert(reports, "nightly", "successor", successor)

                proxy.resume()  # the partition heals; the holder tries to write
                with pytest.raises(LeaseLost) as local, conn.transaction():
                    run.fence(conn, "reports")  # refused here, no round trip
                    conn.execute("INSERT INTO reports VALUES ('holder-late', %s)", (run.token,))
                assert not isinstance(local.value.__cause__, LeaseSuperseded)  # not the server's answer
                with pytest.raises(LeaseLost):
                    run.advance_fence(conn, "reports")
                # A writer that does not ask the context (CMD, psql) meets the fence itself.
                with pytest.raises(LeaseSuperseded):
                    fenced_insert(conn, "nightly", "holder-late", run.token)
        # The end was refused too: the takeover closed the run.
        assert isinstance(at_exit.value.__cause__, LeaseSuperseded)
    assert reports.execute("SELECT writer, token FROM reports ORDER BY token").fetchall() == [
        ("holder", 1), ("successor", 2)]
    rows = [(r["owner"], r["status"], r["failure_reason"]) for r in runs_of(reports, "nightly")]
    assert rows == [("holder", "failure", "lease_expired"), ("successor", "running", None)]


def test_the_end_of_a_run_does_not_hang_on_a_frozen_connection(dsn, reports, proxy):
    # The partition lasts past the body: the end cannot reach the ledger, yet returns (LeaseLost).
    with Ledger(proxy.conninfo(dsn), owner="holder") as ledger:
        run = ledger.run("nightly", ttl=TTL)

        def body() -> None:
            with run:
                proxy.freeze()
                assert run.lost.wait(PATIENCE)

        with pytest.raises(LeaseLost):
            in_thread(body, timeout=120)
        proxy.resume()
    rows = [(r["status"], r["failure_reason"]) for r in runs_of(reports, "nightly")]
    assert rows in ([("running", None)], [("failure", "error")])  # ended later by the reaper, or the end got through


def test_a_plain_lease_is_lost_at_its_local_deadline_while_its_renewal_is_stuck(dsn, reports, proxy):
    with psycopg.connect(proxy.conninfo(dsn), autocommit=True, prepare_threshold=None) as conn:
        lease = Ledger(conn, owner="holder").lease("singleton", ttl=TTL)
        with pytest.raises(LeaseLost):
            with lease:
                assert lease.acquired
                proxy.freeze()
                assert lease.lost.wait(PATIENCE)
                with pytest.raises(LeaseLost):
                    lease.fence(conn, "reports")
                wait_for(lambda: reports.execute(
                    "SELECT count(*) FROM ledger.acquire(job => 'singleton', owner => 'other', ttl => '1 minute')"
                ).fetchone() == (1,), timeout=PATIENCE, what="the server to let the lease expire")
                proxy.resume()
        assert lease.released is False


# -- a frozen connection, async --------------------------------------------------------------------

def test_the_async_client_notices_a_silent_partition_and_its_fenced_write_is_refused(dsn, reports, proxy):
    via = proxy.conninfo(dsn)
    direct = reports

    async def main() -> tuple[int, LeaseLost]:
        async with await psycopg.AsyncConnection.connect(via, autocommit=True, prepare_threshold=None) as conn:
            ledger = AsyncLedger(conn, owner="holder")
            with pytest.raises(LeaseLost) as at_exit:
                async with ledger.run("nightly", ttl=TTL) as run:
                    assert run.started
                    async with conn.transaction():
                        await run.fence(conn, "reports")
                        await conn.execute("INSERT INTO reports VALUES ('holder', %s)", (run.token,))
                    await asyncio.sleep(0.8)
                    proxy.freeze()
                    await asyncio.wait_for(run.lost.wait(), PATIENCE)
                    with pytest.raises(LeaseLost):
                        await run.check()
                    successor = await asyncio.to_thread(take_over, direct, "nightly")
                    await asyncio.to_thread(fenced_insert, direct, "nightly", "successor", successor)
                    proxy.resume()
                    with pytest.raises(LeaseLost):
                        async with conn.transaction():
                            await run.fence(conn, "reports")
                    with pytest.raises(LeaseSuperseded):
                        async with conn.transaction():
                            await afence(conn, "nightly", "reports", run.token)
                            await conn.execute("INSERT INTO reports VALUES ('holder-late', %s)", (run.token,))
            assert run.token is not None
            return run.token, at_exit.value

    token, error = asyncio.run(main())
    assert token == 1 and isinstance(error.__cause__, LeaseSuperseded)
    assert reports.execute("SELECT writer, token FROM reports ORDER BY token").fetchall() == [
        ("holder", 1), ("successor", 2)]


def test_the_async_end_does_not_hang_on_a_frozen_connection(dsn, reports, proxy):
    async def main() -> None:
        async with AsyncLedger(proxy.conninfo(dsn), owner="holder") as ledger:
            with pytest.raises(LeaseLost):
                async with ledger.run("nightly", ttl=TTL) as run:
                    proxy.freeze()
                    await asyncio.wait_for(run.lost.wait(), PATIENCE)
            proxy.resume()

    asyncio.run(asyncio.wait_for(main(), 120))


# -- the wrapper -----------------------------------------------------------------------------

STUBBORN = ('trap "echo TERM >> $MARKS" TERM; echo $$ > $READY; '
            'while :; do sleep 0.1; done')


def test_jobledger_run_stops_cmd_at_the_local_deadline_of_a_silent_partition(dsn, reports, proxy, tmp_path):
    marks, ready = tmp_path / "marks", tmp_path / "ready"
    wrapper = start("run", "sync", "--ttl", "2s", "--grace", "0.5s", "--", "sh", "-c", STUBBORN,
                    env=environment(proxy.conninfo(dsn), MARKS=str(marks), READY=str(ready)))
    try:
        wait_for(lambda: ready.exists() and ready.read_text().strip(), timeout=PATIENCE, what="CMD to start")
        child = int(ready.read_text())
        time.sleep(0.8)
        proxy.freeze()
        _, stderr = wrapper.communicate(timeout=120)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
        proxy.resume()
    assert wrapper.returncode == 124, stderr
    assert "lease lost" in stderr and "deadline" in stderr
    assert marks.read_text().splitlines()[0] == "TERM"
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # SIGKILL after the grace: CMD ignored SIGTERM and is gone anyway
    # The ledger never heard of the end (the partition): a takeover closes the run.
    assert take_over(reports, "sync") == 2
    rows = [(r["status"], r["failure_reason"]) for r in runs_of(reports, "sync")]
    assert rows[0] in (("failure", "lease_expired"), ("failure", "error"))


# -- the deadline counts from the send time ----------------------------------------------------------

DELAY = 1.0


def server_time_left(db: psycopg.Connection, job: str) -> float:
    row = db.execute("SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM ledger.leases "
                     "WHERE job = %s", (job,)).fetchone()
    assert row is not None
    return float(row[0])


@pytest.mark.parametrize("kind", ["run", "lease"])
def test_a_slow_answer_does_not_stretch_the_local_deadline(dsn, reports, proxy, kind):
    # Answers take DELAY seconds to come back; the server renewed when the call arrived.
    # A deadline counted from the answer would be DELAY late: past the server's expiry.
    proxy.delay(DELAY)
    with psycopg.connect(proxy.conninfo(dsn), autocommit=True, prepare_threshold=None) as conn:
        ledger = Ledger(conn, owner="holder")
        every = timedelta(seconds=2.5)
        context = (ledger.run("slow", ttl=timedelta(seconds=30), heartbeat_interval=every) if kind == "run"
                   else ledger.lease("slow", ttl=timedelta(seconds=30), heartbeat_interval=every))
        with context as held:
            checks = 0
            for _ in range(2):  # the start, then renewals
                state = held._state
                assert state.deadline is not None
                before = state.deadline.at
                # Right after a renewal landed (none in flight for a while): compare with the server.
                server = server_time_left(reports, "slow")
                local = held.time_left
                assert local is not None
                # local is read after server: were the answer's delay counted, local would be ~DELAY more.
                assert local.total_seconds() <= server, (local, server)
                checks += 1
                wait_for(lambda: state.deadline is not None and state.deadline.at != before,
                         timeout=PATIENCE, what="a renewal")
                time.sleep(0.05)
            assert checks == 2
        proxy.delay(0)


def test_the_heartbeat_takes_the_send_time_of_each_renewal():
    # Unit level: the deadline is what the beat reports as sent + time left, whenever it returns.
    sent: list[float] = []

    def beat() -> Renewal:
        sent.append(time.monotonic())
        time.sleep(0.3)  # a slow answer
        return Renewal(timedelta(seconds=5), sent[-1])

    state = LeaseState("job", "owner", None, signal=lambda: None)
    state.token = 1
    state.deadline = Deadline(timedelta(seconds=5), time.monotonic())
    seen: list[float] = []
    heartbeat = Heartbeat(beat=beat, interval=0.05, state=state, name="test-heartbeat", renewed=seen.append)
    heartbeat.start()
    wait_for(lambda: len(seen) >= 2, timeout=PATIENCE, what="two renewals")
    heartbeat.stop()
    assert seen[0] == sent[0] + 5 and seen[1] == sent[1] + 5


def test_a_stuck_call_is_given_up_and_raises_ledger_unavailable(dsn, proxy):
    # The bound of a context's call, without the lease logic: no answer, so the socket is shut down.
    ledger = Ledger(psycopg.connect(proxy.conninfo(dsn), autocommit=True, prepare_threshold=None))
    control = ledger._open_control("probe")
    try:
        control.execute("SELECT 1", {}, psycopg.rows.tuple_row)  # connected
        control.timeout = 0.5
        proxy.freeze()
        with pytest.raises(LedgerUnavailable, match="no answer"):
            in_thread(lambda: control.execute("SELECT 1", {}, psycopg.rows.tuple_row))
        proxy.resume()
        assert control.execute("SELECT 2", {}, psycopg.rows.tuple_row) == [(2,)]  # a new connection
    finally:
        proxy.resume()
        control.close()
        assert ledger._conn is not None
        ledger._conn.close()


def test_the_statement_timeout_travels_with_each_call_and_stays_in_it(dsn, db):
    ledger = Ledger(db)
    control = ledger._open_control("probe")
    try:
        control.timeout = 0.2
        with pytest.raises(psycopg.errors.QueryCanceled):
            control.execute("SELECT pg_sleep(2)", {}, psycopg.rows.tuple_row)
        control.timeout = 5
        assert control.execute("SHOW statement_timeout", {}, psycopg.rows.tuple_row) == [("5s",)]
        # Local to the call's transaction: the session keeps its own setting.
        # The call gave its connection back to the ledger's spares: it is idle there.
        assert control._conn is None and ledger._spares is not None
        [spare] = ledger._spares._idle
        assert spare.execute("SHOW statement_timeout").fetchone() == ("0",)
    finally:
        control.close()
    assert db.execute("SHOW statement_timeout").fetchone() == ("0",)
