"""The dashboard reads the ledger's clock (ledger._view_now(), the views' own), never the server's
now(): with the clock seam moved past a ttl, every part of a page agrees with the state it shows."""

from __future__ import annotations

import json
import urllib.request
from datetime import timedelta
from typing import Any

import psycopg

from clockseam import LedgerClock
from ledger.web.app import create_app
from ledger.web.server import BackgroundServer


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read().decode())


def test_the_pages_read_the_ledgers_clock_so_a_lease_past_its_ttl_is_not_live_there(
        dsn: str, db: psycopg.Connection, ledger_clock: LedgerClock) -> None:
    """The job page's lease and seats, the run page's token and a running run's duration read
    ledger._view_now(), the views' clock: once the ledger's time is past a ttl, the page that calls
    the job crashed does not show its lease live (before, they read now(): the server's time, not the ledger's)."""
    db.execute("SELECT ledger.register_job('single', ttl => '10 minutes')")
    db.execute("SELECT ledger.register_job('fanout', ttl => '10 minutes', max_concurrent => 2)")
    single = db.execute("SELECT run_id, token FROM ledger.start_run('single', 'host-a')").fetchone()
    seat = db.execute("SELECT run_id, token FROM ledger.start_run('fanout', 'host-b')").fetchone()
    assert single is not None and seat is not None
    ledger_clock.advance(timedelta(minutes=11))
    with BackgroundServer(create_app(dsn)) as server:
        assert _json(server.url + "/api/jobs/single")["state"] == "crashed"
        run = _json(server.url + f"/api/runs/{single[0]}")
        assert run["lease"]["live"] is False and run["token_is_current"] is False
        assert run["duration"] >= 11 * 60  # still running, by the ledger's clock
        assert [s["live"] for s in _json(server.url + "/api/jobs/fanout")["seats"]] == [False]
        assert _json(server.url + f"/api/runs/{seat[0]}")["token_is_current"] is False
