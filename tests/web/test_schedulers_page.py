"""The schedulers' registry on the dashboard (/schedulers and /api/schedulers, linked from the nav)
and in the metrics (issue 23, point 5): live, stopping and expired rows, the upkeep leader marked,
the same facts in the HTML, the JSON, the text exposition and prometheus_client's families. The
rows are written by the SQL API the schedulers call (ledger.scheduler_heartbeat)."""

from __future__ import annotations

import json
import urllib.request
from datetime import timedelta

import psycopg
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clockseam import LedgerClock
from ledger.metrics import LedgerCollector, exposition, registry
from ledger.web.app import create_app
from ledger.web.server import BackgroundServer


def _heartbeat(db: psycopg.Connection, scheduler: str, host: str, pid: int, jobs: list[str],
               ttl: str = "30 seconds", stopping: bool = False) -> bool:
    row = db.execute("SELECT ledger.scheduler_heartbeat(%s, %s, %s, '0.2.0-test', %s, %s::interval, %s)",
                     (scheduler, host, pid, jobs, ttl, stopping)).fetchone()
    assert row is not None
    return bool(row[0])


def _three_schedulers(db: psycopg.Connection, ledger_clock: LedgerClock) -> None:
    """``dead`` (expired: it died), ``leader`` (live, holds the upkeep lease), ``quitting`` (stopping)."""
    assert _heartbeat(db, "dead", "host-d", 40, ["a"], ttl="10 seconds")
    ledger_clock.advance(timedelta(seconds=20))
    assert _heartbeat(db, "leader", "host-l", 50, ["a", "b", "c"])
    assert not _heartbeat(db, "quitting", "host-q", 60, ["a"], stopping=True)


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.headers["content-type"], response.read().decode()


def test_the_schedulers_page_shows_every_row_and_the_leader(dsn: str, db: psycopg.Connection,
                                                            ledger_clock: LedgerClock) -> None:
    with BackgroundServer(create_app(dsn)) as server:
        status, _, empty = _get(server.url + "/schedulers")
        assert status == 200 and "No scheduler has a row" in empty
        assert json.loads(_get(server.url + "/api/schedulers")[2])["schedulers"] == []
        # the nav links the page from every page
        assert 'href="/schedulers"' in _get(server.url + "/")[2]

        _three_schedulers(db, ledger_clock)
        status, content_type, html = _get(server.url + "/schedulers")
        assert status == 200 and content_type.startswith("text/html")
        assert 'aria-current="page">Schedulers' in html and "style=" not in html and "<script>" not in html
        assert "1 live" not in html and "2 live · 1 expired" in html
        rows = [line for line in html.splitlines() if '<tr class="' in line]
        by_name = {name: next(line for line in rows if f'<td class="job">{name}' in line)
                   for name in ("dead", "leader", "quitting")}
        assert len(rows) == 3
        assert 'class="expired"' in by_name["dead"] and "scheduler-expired" in by_name["dead"]
        assert "upkeep leader" in by_name["leader"] and "scheduler-live" in by_name["leader"]
        assert "host-l" in by_name["leader"] and ">50<" in by_name["leader"] and ">3<" in by_name["leader"]
        assert "scheduler-stopping" in by_name["quitting"]
        assert all("upkeep leader" not in by_name[name] for name in ("dead", "quitting"))

        page = json.loads(_get(server.url + "/api/schedulers")[2])
        found = {row["scheduler"]: row for row in page["schedulers"]}
        assert {name: row["status"] for name, row in found.items()} == {
            "dead": "expired", "leader": "live", "quitting": "stopping"}
        assert [name for name, row in found.items() if row["leader"]] == ["leader"]
        assert found["leader"]["jobs"] == ["a", "b", "c"] and found["leader"]["job_count"] == 3
        assert (found["leader"]["host"], found["leader"]["pid"], found["leader"]["version"]) == (
            "host-l", 50, "0.2.0-test")


def test_the_page_lists_a_bounded_number_of_jobs_per_scheduler(dsn: str, db: psycopg.Connection) -> None:
    many = [f"job-{i}" for i in range(120)]
    _heartbeat(db, "big", "host", 1, many)
    with BackgroundServer(create_app(dsn)) as server:
        [row] = json.loads(_get(server.url + "/api/schedulers")[2])["schedulers"]
        assert row["job_count"] == 120 and row["jobs"] == many[:50]
        assert ">120<" in _get(server.url + "/schedulers")[2]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_the_metrics_count_the_live_schedulers_and_mark_the_leader(dsn: str, db: psycopg.Connection,
                                                                   ledger_clock: LedgerClock) -> None:
    def scrape() -> str:
        return exposition(lambda: psycopg.connect(dsn, autocommit=True))

    none = _samples(scrape())
    assert none[("jobledger_schedulers", ())] == 0
    assert not any(name.startswith(("jobledger_scheduler_", "jobledger_upkeep_")) for name, _ in none)

    _three_schedulers(db, ledger_clock)
    text = scrape()
    found = _samples(text)
    assert found[("jobledger_schedulers", ())] == 2
    up = {dict(labels)["scheduler"]: value for (name, labels), value in found.items()
          if name == "jobledger_scheduler_up"}
    assert up == {"dead": 0, "leader": 1, "quitting": 1}
    assert found[("jobledger_scheduler_up", (("host", "host-d"), ("scheduler", "dead")))] == 0
    ages = {dict(labels)["scheduler"]: value for (name, labels), value in found.items()
            if name == "jobledger_scheduler_heartbeat_age_seconds"}
    assert set(ages) == {"dead", "leader", "quitting"} and ages["dead"] >= 20 > ages["leader"] >= 0
    assert found[("jobledger_scheduler_jobs", (("scheduler", "leader"),))] == 3
    assert {labels: value for (name, labels), value in found.items() if name == "jobledger_upkeep_leader"} == {
        (("scheduler", "leader"),): 1}

    # one definition feeds both writers: prometheus_client's families say the same
    families = _samples(generate_latest(registry(LedgerCollector(
        lambda: psycopg.connect(dsn, autocommit=True), raise_errors=True))).decode())
    names = {key for key in found if key[0].startswith(("jobledger_scheduler", "jobledger_upkeep"))}
    assert names == {key for key in families if key[0].startswith(("jobledger_scheduler", "jobledger_upkeep"))}

    # the leader stops gracefully: its row and its leadership go
    db.execute("SELECT ledger.scheduler_stop('leader')")
    after = _samples(scrape())
    assert after[("jobledger_schedulers", ())] == 1
    assert not any(name == "jobledger_upkeep_leader" for name, _ in after)
