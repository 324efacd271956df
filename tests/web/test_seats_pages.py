"""A job in seats mode (max_concurrent > 1) on the dashboard: the job page says how many of its seats
are live and who holds each, with its token; the run page knows a run's token is live in its seat
(its lease row is only the token counter, kept released). HTML and JSON say the same."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import psycopg

from ledger.web.app import create_app
from ledger.web.server import BackgroundServer


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return str(response.read().decode())


def _json(url: str) -> Any:
    return json.loads(_get(url))


def test_a_seats_jobs_pages_show_its_live_seats_and_tokens(dsn: str, db: psycopg.Connection) -> None:
    db.execute("SELECT ledger.register_job('fanout', ttl => '10 minutes', max_concurrent => 3)")
    first = db.execute("SELECT run_id, token FROM ledger.start_run('fanout', 'host-a')").fetchone()
    second = db.execute("SELECT run_id, token FROM ledger.start_run('fanout', 'host-b')").fetchone()
    assert first is not None and second is not None and second[1] > first[1]
    db.execute("SELECT ledger.complete_run(%s, %s)", (first[0], first[1]))
    with BackgroundServer(create_app(dsn)) as server:
        page = _json(server.url + "/api/jobs/fanout")
        assert page["max_concurrent"] == 3
        assert [(seat["owner"], seat["token"], seat["live"]) for seat in page["seats"]] == \
            [("host-a", first[1], False), ("host-b", second[1], True)]
        html = _get(server.url + "/jobs/fanout")
        assert f"1 of 3 seats live: seat 2 held by host-b, token {second[1]}" in html
        assert "free (last token" not in html

        live = _json(server.url + f"/api/runs/{second[0]}")
        assert live["token_is_current"] is True and live["seat"]["seat"] == 2 and live["seat"]["owner"] == "host-b"
        assert "It is live in seat 2 of the job's 3, held by host-b" in _get(server.url + f"/runs/{second[0]}")

        ended = _json(server.url + f"/api/runs/{first[0]}")
        assert ended["token_is_current"] is False and ended["seat"] is None
        assert "No live seat of the job carries it" in _get(server.url + f"/runs/{first[0]}")


def test_a_single_holder_jobs_page_reads_no_seats(dsn: str, db: psycopg.Connection) -> None:
    db.execute("SELECT ledger.register_job('single', ttl => '10 minutes')")
    run = db.execute("SELECT run_id, token FROM ledger.start_run('single', 'host-a')").fetchone()
    assert run is not None
    with BackgroundServer(create_app(dsn)) as server:
        page = _json(server.url + "/api/jobs/single")
        assert page["max_concurrent"] == 1 and page["seats"] == []
        assert f"held by host-a, token {run[1]}" in _get(server.url + "/jobs/single")
        found = _json(server.url + f"/api/runs/{run[0]}")
        assert found["token_is_current"] is True and found["seat"] is None
