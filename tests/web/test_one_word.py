"""One word per job on every surface (issue 22): the eight situations of tests/situations.py, each
job's state as SQL says it (ledger.job_health.state), and the same word from `jobledger status
--json`, its table, `jobledger health` (JSON and table), the dashboard's jobs page, job pages and
/api/jobs, the badge, and the metrics; and no job with two alerts for one cause, anywhere."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

import psycopg
from prometheus_client.parser import text_string_to_metric_families

from clihelp import jobledger
from ledger.metrics import exposition
from ledger.web.app import create_app
from ledger.web.server import BackgroundServer
from situations import TROUBLE, build_situations
from sqlhelp import rows


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _json(url: str) -> Any:
    status, body = _get(url)
    assert status == 200, (url, status, body)
    return json.loads(body)


def _table_rows(text: str, jobs: set[str]) -> dict[str, str]:
    """The line of each job in a table: its name first, at the table's edge (a cell's wrapped
    continuation is indented)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        words = line.replace("⚠", " ").split()  # the status table marks a job with an alert ⚠
        edge = len(line) - len(line.lstrip()) <= 3
        if edge and words and words[0] in jobs and words[0] not in found:
            found[words[0]] = line
    return found


def test_every_surface_gives_each_job_the_ledgers_one_word_and_one_alert_per_cause(db, dsn, ledger_clock):
    expected = build_situations(db, ledger_clock)
    jobs = set(expected)
    trouble = {job: [alert] for job, alert in TROUBLE.items()}

    # SQL: the one state machine
    assert {r["job"]: r["state"] for r in rows(db, "SELECT job, state FROM ledger.job_health")} == expected
    sql_alerts: dict[str, list[str]] = {}
    for row in rows(db, "SELECT job, alert FROM ledger.alerts ORDER BY job, alert"):
        sql_alerts.setdefault(row["job"], []).append(row["alert"])
    assert sql_alerts == trouble

    # jobledger status: --json has the word in `state`, the table shows it
    status = jobledger("status", "--json", dsn=dsn)
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    assert {row["job"]: row["state"] for row in document["jobs"]} == expected
    assert Counter((a["job"], a["alert"]) for a in document["alerts"]) == Counter(
        (job, alert) for job, alert in TROUBLE.items())
    table = jobledger("status", dsn=dsn)
    assert table.returncode == 0, table.stderr
    found = _table_rows(table.stdout.split("ledger.alerts")[0], jobs)
    assert set(found) == jobs, table.stdout
    for job, line in found.items():
        assert re.search(rf"\s{expected[job]}\b", line), (job, line)

    # jobledger health: the same word; exit 1, as jobs are in a state that raises an alert
    health = jobledger("health", "--json", dsn=dsn)
    assert health.returncode == 1, health.stderr
    assert {row["job"]: row["state"] for row in json.loads(health.stdout)} == expected
    health_table = jobledger("health", dsn=dsn)
    found = _table_rows(health_table.stdout, jobs)
    assert set(found) == jobs, health_table.stdout
    for job, line in found.items():
        assert re.search(rf"\s{expected[job]}\b", line), (job, line)
    # a job not in a trouble state exits 0
    assert jobledger("health", "ok", "running", "never_run", "paused", dsn=dsn).returncode == 0

    # the dashboard: /api/jobs, the jobs page, each job's page and JSON, the badge, /metrics
    with BackgroundServer(create_app(dsn)) as server:
        api = _json(server.url + "/api/jobs")
        assert {row["job"]: row["state"] for row in api["jobs"]} == expected
        assert {state: count for state, count in api["counts"].items() if count} == dict(Counter(expected.values()))
        _, html = _get(server.url + "/")
        drawn = dict(re.findall(r'data-job="([^"]+)">\s*<td><span class="badge state-([a-z_]+)"', html))
        assert drawn == expected
        for job, state in expected.items():
            page = _json(f"{server.url}/api/jobs/{job}")
            assert page["state"] == state, job
            _, job_html = _get(f"{server.url}/jobs/{job}")
            assert re.search(rf'<h1>.*<span class="badge state-{state}"[^>]*>{state}</span></h1>', job_html), job
            code, badge = _get(f"{server.url}/badge/{job}.svg")
            assert code == 200 and f'aria-label="{job}: {state}"' in badge, (job, badge)
        api_alerts = _json(server.url + "/api/alerts")["alerts"]
        assert Counter((a["job"], a["alert"]) for a in api_alerts) == Counter(TROUBLE.items())
        _, scraped = _get(server.url + "/metrics")

    # the metrics: one jobledger_job_state series per job, its word's, value 1; the alerts per kind
    for text in (scraped, exposition(lambda: psycopg.connect(dsn, autocommit=True))):
        families = {family.name: family for family in text_string_to_metric_families(text)}
        samples = families["jobledger_job_state"].samples
        assert Counter(sample.labels["job"] for sample in samples) == Counter(jobs)  # one series each
        assert {sample.labels["job"]: sample.labels["state"] for sample in samples} == expected
        assert all(sample.value == 1 for sample in samples)
        counts = {sample.labels["alert"]: sample.value for sample in families["jobledger_alerts"].samples}
        assert {kind: count for kind, count in counts.items() if count} == dict(Counter(TROUBLE.values()))
    assert rows(db, "SELECT * FROM ledger.verify_state()") == []
