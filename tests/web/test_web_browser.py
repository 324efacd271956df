"""`jobledger web` in a real browser: Debian's chromium, headless, driven by Playwright.

The dashboard runs in this process against a seeded ledger (tests/webseed.py),
refreshing every second. Each page must load without a console error (a
Content-Security-Policy violation is one), show the seeded facts, link jobs
to a job to a run, pick up a run's end without a reload, and show a job named
``<script>alert(1)</script>`` as text (no dialog opens).

Screenshots of each page are written to the test's tmp_path; with
LEDGER_WEB_SCREENSHOTS=DIR they are also written to DIR, as the docs' copies
(``LEDGER_WEB_SCREENSHOTS=docs/images .venv/bin/python -m pytest tests/web/test_web_browser.py``).

Needs ``chromium`` (Debian: ``apt-get install chromium chromium-driver``)
and the ``playwright`` Python package; Playwright downloads no browser here,
it launches /usr/bin/chromium.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from ledger.web.app import create_app
from ledger.web.server import BackgroundServer
from webseed import XSS_JOB, end_running_run, seeded_database

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None  # type: ignore[assignment]

pytestmark = [
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason="needs chromium (apt-get install chromium chromium-driver)"),
    pytest.mark.skipif(sync_playwright is None,
                       reason="needs playwright (pip install -e '.[test]')"),
]


@pytest.fixture(scope="module")
def ledger_db(pg_server, ledger_template):
    with seeded_database(pg_server, ledger_template, "webbrowser") as found:
        yield found


@pytest.fixture(scope="module")
def site(ledger_db):
    dsn, _ = ledger_db
    with BackgroundServer(create_app(dsn, refresh=1)) as server:
        yield server.url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert sync_playwright is not None
    with sync_playwright() as playwright:
        # --no-sandbox: the suite runs as root, where chromium's sandbox refuses to start
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield launched
        launched.close()


class Watched:
    """A browser page, and what went wrong on it: console errors, script errors, failed loads, dialogs."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.problems: list[str] = []
        self.dialogs: list[str] = []
        page.on("console", lambda message: self.problems.append(f"console {message.type}: {message.text}")
                if message.type == "error" else None)
        page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        page.on("response", lambda response: self.problems.append(f"HTTP {response.status}: {response.url}")
                if response.status >= 400 else None)
        page.on("dialog", self._dialog)

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()


@pytest.fixture
def watched(browser) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    yield Watched(context.new_page())
    context.close()


@pytest.fixture
def shoot(tmp_path: Path):
    """Save a screenshot of the page as an artifact (and in LEDGER_WEB_SCREENSHOTS, for the docs)."""
    copies = os.environ.get("LEDGER_WEB_SCREENSHOTS")

    def save(page: Any, name: str) -> Path:
        path = tmp_path / f"dashboard-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        if copies:
            Path(copies).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, Path(copies) / path.name)
        return path

    return save


def text_of(page: Any, selector: str) -> str:
    return str(page.locator(selector).first.inner_text())


def test_each_page_loads_without_errors_and_shows_the_seeded_facts(site, ledger_db, watched, shoot):
    _, seeded = ledger_db
    page = watched.page

    page.goto(site + "/")
    rows = page.locator("table.jobs tbody tr")
    assert rows.count() == len(seeded.jobs)
    assert text_of(page, 'tr[data-job="etl"] .badge') == "failing"
    assert text_of(page, 'tr[data-job="ingest"] .badge') == "running"
    assert text_of(page, 'tr[data-job="sync-orders"] .badge') == "crashed"
    assert page.locator('tr[data-job="weekly-cleanup"]').get_attribute("class") == "paused"
    assert "every 5 minutes" in text_of(page, 'tr[data-job="etl"]')
    assert "Europe/Berlin" in text_of(page, 'tr[data-job="nightly-report"]')
    assert page.locator('tr[data-job="etl"] svg.spark rect').count() == 20
    shoot(page, "jobs")

    page.goto(site + "/jobs/etl")
    assert text_of(page, "h1") .startswith("etl")
    assert page.locator("svg.timeline rect.run").count() >= 280
    assert page.locator("svg.durations line.ttl").count() == 1 and page.locator("svg.durations rect.advice").count() == 1
    assert "connection to warehouse lost" in text_of(page, "table.failures")
    assert "jobledger pause etl" in text_of(page, "table.commands")
    shoot(page, "job")

    page.goto(site + "/jobs/tick?window=1h")
    assert page.locator("svg.timeline rect.skipped").count() == 1
    page.goto(site + "/jobs/dst-day")
    assert page.locator("table.slots tr.dst").count() >= 1
    assert "Europe/Berlin (local)" in text_of(page, "table.slots")

    page.goto(site + f"/runs/{seeded.detail_run_id}")
    assert text_of(page, "h1").startswith(f"Run {seeded.detail_run_id}")
    assert '"rows": 1234' in text_of(page, "pre.json")
    shoot(page, "run")

    page.goto(site + "/alerts")
    alerts = text_of(page, "table.alerts")
    assert "failures in a row" in alerts and "consecutive_failures" not in alerts  # the state's alert: failing
    assert "its runner is gone" in alerts  # sync-orders: crashed
    shoot(page, "alerts")

    page.wait_for_timeout(2500)  # two refreshes: the fetch loop must not err either
    assert watched.problems == []
    assert watched.dialogs == []


def test_links_lead_from_the_jobs_to_a_job_to_a_run(site, watched):
    page = watched.page
    page.goto(site + "/")
    page.locator('tr[data-job="etl"] td.job a').click()
    page.wait_for_url("**/jobs/etl")
    link = page.locator("table.runs tbody a").first
    run_id = link.inner_text()
    link.click()
    page.wait_for_url(f"**/runs/{run_id}")
    assert text_of(page, "h1").startswith(f"Run {run_id}")
    page.locator(".crumbs a", has_text="etl").click()
    page.wait_for_url("**/jobs/etl")
    page.locator("svg.timeline a").last.click()  # a timeline bar is a link to its run
    page.wait_for_url("**/runs/*")
    assert watched.problems == []


def test_a_job_named_like_markup_renders_as_text(site, watched):
    page = watched.page
    page.goto(site + "/")
    cell = page.locator("td.job a", has_text="alert(1)")
    assert cell.inner_text() == XSS_JOB
    assert "<b>owner</b>" in text_of(page, f'tr[data-job="{XSS_JOB}"]')  # the owner's markup, as text
    cell.click()
    page.wait_for_url("**/jobs/*")
    assert text_of(page, "h1 .job") == XSS_JOB
    assert '<img src=x onerror="alert(2)"> failed & stopped' in text_of(page, "table.failures")
    # the one script of the page is the dashboard's own; nothing the data said became an element
    assert page.evaluate("document.scripts.length") == 1
    assert page.evaluate("document.querySelectorAll('img, [onerror]').length") == 0
    page.goto(site + "/alerts")
    page.wait_for_timeout(1500)  # a refresh too: the swapped-in content is parsed as inert data
    assert watched.dialogs == [] and watched.problems == []


def test_auto_refresh_shows_a_run_ending(site, ledger_db, watched, shoot):
    dsn, seeded = ledger_db
    page = watched.page
    page.goto(site + "/jobs/ingest")
    assert text_of(page, "h1 .badge") == "running"
    page.evaluate("window.__not_reloaded = true")
    with psycopg.connect(dsn, autocommit=True) as conn:
        end_running_run(conn, seeded)
    # polled from here: the page's CSP refuses the string evaluation wait_for_function would use
    expect(page.locator("h1 .badge")).to_have_text("ok", timeout=30_000)
    assert page.evaluate("window.__not_reloaded") is True  # swapped in by the fetch loop, not a reload
    assert "success" in text_of(page, "table.runs")
    page.goto(site + "/")
    assert text_of(page, 'tr[data-job="ingest"] .badge') == "ok"
    assert watched.problems == []
