"""A process frozen past its ttl (SIGSTOP) loses the lease, and when it wakes up
its write through ``run.fence`` is rejected: another run has taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest

from ledger import Ledger

ZOMBIE = textwrap.dedent("""
    import asyncio, sys
    from datetime import timedelta
    import psycopg
    from ledger import AsyncLedger, LeaseLost, Ledger

    mode, dsn = sys.argv[1], sys.argv[2]
    TTL = timedelta(seconds=1)
    INSERT = "INSERT INTO reports (writer, token) VALUES ('zombie', %s)"

    def sync_main():
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                with Ledger(conn, owner="zombie").run("frozen", ttl=TTL) as run:
                    print("started", run.token, flush=True)
                    sys.stdin.readline()  # frozen here; the parent says go after SIGCONT
                    with conn.transaction():
                        run.fence(conn, "reports")
                        conn.execute(INSERT, (run.token,))
                    print("wrote", flush=True)
            except LeaseLost as error:
                print("rejected", error.reason, flush=True)

    async def async_main():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            try:
                async with AsyncLedger(conn, owner="zombie").run("frozen", ttl=TTL) as run:
                    print("started", run.token, flush=True)
                    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                    async with conn.transaction():
                        await run.fence(conn, "reports")
                        await conn.execute(INSERT, (run.token,))
                    print("wrote", flush=True)
            except LeaseLost as error:
                print("rejected", error.reason, flush=True)

    sync_main() if mode == "sync" else asyncio.run(async_main())
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_frozen_process_loses_the_lease_and_its_fenced_write_is_rejected(mode, dsn, db, tmp_path, ledger_clock):
    db.execute("CREATE TABLE reports (writer text, token bigint)")
    script = tmp_path / "zombie.py"
    script.write_text(ZOMBIE)
    zombie = subprocess.Popen([sys.executable, str(script), mode, dsn], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert zombie.stdout is not None and zombie.stdin is not None
        assert zombie.stdout.readline().split() == ["started", "1"]
        time.sleep(0.5)  # a heartbeat or so while alive
        os.kill(zombie.pid, signal.SIGSTOP)
        ledger_clock.advance(timedelta(seconds=1.5))  # frozen past its 1 s ttl, as the ledger's clock tells

        with Ledger(db, owner="successor").run("frozen", ttl=timedelta(seconds=30)) as successor:
            assert successor.started and successor.token == 2
            with db.transaction():
                successor.fence(db, "reports")
                db.execute("INSERT INTO reports VALUES ('successor', %s)", (successor.token,))
            # The zombie wakes up while the successor still runs, and tries to write.
            os.kill(zombie.pid, signal.SIGCONT)
            out, err = zombie.communicate("go\n", timeout=30)
        assert zombie.returncode == 0, err
        assert out.splitlines()[-1].startswith("rejected"), out + err
    finally:
        if zombie.poll() is None:
            os.kill(zombie.pid, signal.SIGCONT)
            zombie.kill()
            zombie.wait()
    assert db.execute("SELECT writer, token FROM reports").fetchall() == [("successor", 2)]
    assert db.execute("SELECT owner, status, failure_reason FROM ledger.job_execution_log ORDER BY run_id"
                      ).fetchall() == [("zombie", "failure", "lease_expired"), ("successor", "success", None)]
