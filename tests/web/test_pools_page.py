"""Pools on the dashboard (/pools and /api/pools, linked from the nav; a job's pool on the jobs page
and the job page) and in the metrics (jobledger_pool_size/used/running/jobs/waiting per pool,
jobledger_skipped_total{reason="pool_full"} per job): the numbers are ledger.pool_status's and
ledger.job_status's, in the HTML, the JSON, the text exposition and prometheus_client's families."""

from __future__ import annotations

import json
import urllib.request

import psycopg
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ledger.metrics import LedgerCollector, exposition, registry
from ledger.web.app import create_app
from ledger.web.server import BackgroundServer

POOL_FIELDS = ("size", "used", "running", "jobs", "waiting", "skipped_pool_full")


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.headers["content-type"], response.read().decode()


def _two_pools(db: psycopg.Connection) -> None:
    """``heavy`` (size 2: two live runs, full, one start refused), ``light`` (size 5, one job, idle)."""
    db.execute("SELECT ledger.register_pool('heavy', 2)")
    db.execute("SELECT ledger.register_pool('light', 5)")
    for job in ("report-a", "report-b", "report-c"):
        db.execute("SELECT ledger.register_job(%s, ttl => '10 minutes', pool => 'heavy')", (job,))
    db.execute("SELECT ledger.register_job('small', ttl => '10 minutes', pool => 'light')")
    db.execute("SELECT ledger.register_job('free', ttl => '10 minutes')")
    for job in ("report-a", "report-b"):
        assert db.execute("SELECT outcome FROM ledger.start_run(%s, 'w')", (job,)).fetchone() == ("started",)
    assert db.execute("SELECT outcome FROM ledger.start_run('report-c', 'w')").fetchone() == ("skipped_pool_full",)


def _pool_status(db: psycopg.Connection) -> dict[str, dict[str, int]]:
    rows = db.execute(f"SELECT pool, {', '.join(POOL_FIELDS)} FROM ledger.pool_status").fetchall()
    return {row[0]: dict(zip(POOL_FIELDS, row[1:])) for row in rows}


def test_the_pools_page_shows_each_pools_numbers(dsn: str, db: psycopg.Connection) -> None:
    with BackgroundServer(create_app(dsn)) as server:
        status, _, empty = _get(server.url + "/pools")
        assert status == 200 and "No pools" in empty
        assert json.loads(_get(server.url + "/api/pools")[2])["pools"] == []
        assert 'href="/pools"' in _get(server.url + "/")[2]  # the nav links the page from every page

        _two_pools(db)
        expected = _pool_status(db)
        assert expected["heavy"] == {"size": 2, "used": 2, "running": 2, "jobs": 3, "waiting": 0,
                                     "skipped_pool_full": 1}
        status, content_type, html = _get(server.url + "/pools")
        assert status == 200 and content_type.startswith("text/html")
        assert 'aria-current="page">Pools' in html and "style=" not in html and "<script>" not in html
        assert "1 full" in html
        rows = {pool: next(line for line in html.splitlines() if f'data-pool="{pool}"' in line)
                for pool in ("heavy", "light")}
        for pool, row in rows.items():
            for field, value in expected[pool].items():
                assert f'<td class="{field}">{value}' in row or (
                    field == "used" and f"{value} / {expected[pool]['size']}" in row), (pool, field, row)
        assert "pool-full" in rows["heavy"] and "pool-full" not in rows["light"]

        page = json.loads(_get(server.url + "/api/pools")[2])
        assert {row["pool"]: {field: row[field] for field in POOL_FIELDS} for row in page["pools"]} == expected

        # a job's pool: on the jobs page, and on the job page with its pool-full count
        jobs = _get(server.url + "/")[2]
        line = next(line for line in jobs.splitlines() if ">report-c</a>" in line)
        assert 'href="/pools#pool-heavy">heavy</a>' in line
        assert "pool " not in next(line for line in jobs.splitlines() if ">free</a>" in line)
        job = _get(server.url + "/jobs/report-c")[2]
        assert 'href="/pools#pool-heavy">heavy</a>' in job and "1 skipped (pool full)" in job
        assert "skipped (pool full)" not in _get(server.url + "/jobs/free")[2]
        api_job = json.loads(_get(server.url + "/api/jobs/report-c")[2])
        assert (api_job["status"]["pool"], api_job["status"]["skipped_pool_full"]) == ("heavy", 1)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_metrics_are_ledger_pool_status(dsn: str, db: psycopg.Connection) -> None:
    def scrape() -> str:
        return exposition(lambda: psycopg.connect(dsn, autocommit=True))

    none = _samples(scrape())
    assert not any(name.startswith("jobledger_pool_") for name, _ in none)

    _two_pools(db)
    text = scrape()
    for name in ("size", "used", "running", "jobs", "waiting"):
        assert f"# HELP jobledger_pool_{name} " in text and f"# TYPE jobledger_pool_{name} gauge" in text
    found = _samples(text)
    for pool, row in _pool_status(db).items():
        for name in ("size", "used", "running", "jobs", "waiting"):
            assert found[(f"jobledger_pool_{name}", (("pool", pool),))] == row[name], (pool, name)
    # the refused starts: the per-job skip counter, reason pool_full, as job_status counts them,
    # for the jobs in a pool or that one refused (a job that never met one writes no line: 'free')
    counted = dict(db.execute("SELECT job, skipped_pool_full FROM ledger.job_status"
                              " WHERE pool IS NOT NULL OR skipped_pool_full > 0").fetchall())
    assert "free" not in counted
    skipped = {dict(labels)["job"]: value for (name, labels), value in found.items()
               if name == "jobledger_skipped_total" and dict(labels)["reason"] == "pool_full"}
    assert skipped == counted and skipped["report-c"] == 1
    assert 'jobledger_skipped_total{job="report-c",reason="pool_full"} 1.0\n' in text

    # one definition feeds both writers: prometheus_client's families say the same
    families = _samples(generate_latest(registry(LedgerCollector(
        lambda: psycopg.connect(dsn, autocommit=True), raise_errors=True))).decode())
    mine = {key: value for key, value in found.items()
            if key[0].startswith("jobledger_pool_") or (key[0] == "jobledger_skipped_total"
                                                        and ("reason", "pool_full") in key[1])}
    assert mine == {key: families[key] for key in mine}
