"""`jobledger web` over HTTP: every page and its JSON on a seeded ledger, escaping, access, no writes.

The dashboard runs in this process (uvicorn in a thread, a free loopback
port) against a ledger seeded through the SQL API (tests/webseed.py); the
real browser's tests are tests/web/test_web_browser.py.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clihelp import environment, jobledger, start
from ledger import metrics
from ledger.models import JobStatus
from ledger.web.access import Access, AccessError, check_bind, is_loopback
from ledger.web import pages
from ledger.web.app import create_app
from ledger.web.commands import exact_duration, job_commands
from ledger.web.schedules import in_words
from ledger.web.server import BackgroundServer
from webseed import XSS_ERROR, XSS_JOB, Seeded, seeded_database

EXPECTED_STATES = {
    "etl": "failing", "ingest": "running", "sync-orders": "crashed", "tick": "ok",
    "weekly-cleanup": "paused", "nightly-report": "ok", "dst-day": "never_run", XSS_JOB: "failing",
    "never-ran": "never_run",
}


@pytest.fixture(scope="module")
def ledger_db(pg_server, ledger_template):
    with seeded_database(pg_server, ledger_template, "web") as found:
        yield found


@pytest.fixture(scope="module")
def site(ledger_db):
    dsn, _ = ledger_db
    with BackgroundServer(create_app(dsn)) as server:
        yield server.url


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def get_json(url: str) -> Any:
    status, headers, body = get(url)
    assert status == 200, (url, status, body)
    assert headers["content-type"].startswith("application/json")
    return json.loads(body)


def quoted(job: str) -> str:
    return urllib.request.quote(job, safe="")


# -- the pages and their JSON -----------------------------------------------------------

def test_every_page_answers_in_html_and_json(site, ledger_db):
    _, seeded = ledger_db
    pages = ["/", "/alerts", f"/runs/{seeded.detail_run_id}", *(f"/jobs/{quoted(job)}" for job in seeded.jobs),
             *(f"/jobs/etl?window={window}" for window in ("1h", "6h", "24h", "7d", "30d"))]
    for page in pages:
        status, headers, body = get(site + page)
        assert status == 200, (page, body[:500])
        assert headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in headers["content-security-policy"]
        assert '<main id="live">' in body and 'rel="alternate" type="application/json"' in body
    for endpoint in ["/api/jobs", "/api/alerts", f"/api/runs/{seeded.detail_run_id}",
                     *(f"/api/jobs/{quoted(job)}" for job in seeded.jobs)]:
        get_json(site + endpoint)


def test_the_jobs_page_reads_each_jobs_state(site):
    page = get_json(site + "/api/jobs")
    assert {row["job"]: row["state"] for row in page["jobs"]} == EXPECTED_STATES
    assert page["counts"]["failing"] == 2 and page["counts"]["paused"] == 1 and page["total"] == 9
    etl = next(row for row in page["jobs"] if row["job"] == "etl")
    assert etl["schedule_words"] == "every 5 minutes" and etl["time_zone"] == "UTC"
    assert len(etl["runs"]) == 20 and etl["last_run"]["status"] == "failure" and etl["last_run"]["owner"] == "host-b"
    assert etl["success_rate"] == pytest.approx(17 / 20)  # 2 seeded failures, and history run 273
    paused = next(row for row in page["jobs"] if row["job"] == "weekly-cleanup")
    assert paused["paused"] is True
    nightly = next(row for row in page["jobs"] if row["job"] == "nightly-report")
    assert nightly["time_zone"] == "Europe/Berlin" and nightly["schedule_words"] == "at 02:30"


def test_the_jobs_page_filters_by_state_and_name(site):
    failing = get_json(site + "/api/jobs?state=failing")
    assert sorted(row["job"] for row in failing["jobs"]) == sorted(["etl", XSS_JOB])
    assert failing["counts"]["running"] == 1  # the counts are over the name filter only
    assert [row["job"] for row in get_json(site + "/api/jobs?q=ET")["jobs"]] == ["etl"]
    assert get_json(site + "/api/jobs?q=nothing-like-this")["jobs"] == []
    status, _, body = get(site + "/?state=sleeping")
    assert status == 400 and "unknown state" in body
    assert get(site + "/api/jobs?page=x")[0] == 400
    html = get(site + "/?state=paused")[2]
    assert 'class="paused"' in html and "weekly-cleanup" in html and "etl" not in re.sub(r"<[^>]+>", "", html)


def test_the_job_page_shows_its_window(site, ledger_db):
    _, seeded = ledger_db
    etl = get_json(site + "/api/jobs/etl?window=1h")
    assert etl["state"] == "failing" and etl["status"]["consecutive_failures"] == 2
    assert 12 <= len(etl["runs"]) <= 24 and etl["runs"][-1]["run_id"] == seeded.failure_run_id
    assert etl["slot_count"] == len(etl["slot_marks"]) and 11 <= etl["slot_count"] <= 13  # every 5 minutes
    assert [failure["run_id"] for failure in etl["failures"]][:1] == [seeded.failure_run_id]
    assert "connection to warehouse lost" in etl["failures"][0]["error"]
    assert etl["advice"]["verdict"] in {"ok", "too_long", "too_short"} and etl["advice"]["longest_run"] >= 20
    assert len(etl["upcoming"]) == 10
    commands = {command["action"]: command["command"] for command in etl["commands"]}
    assert commands["pause"] == "jobledger pause etl"
    assert commands["change its definition"] == \
        "jobledger register etl --schedule '*/5 * * * *' --tz UTC --ttl 10m --max-backfill 1"

    day = get_json(site + "/api/jobs/etl?window=30d")
    assert len(day["runs"]) >= 280

    tick = get_json(site + "/api/jobs/tick")
    assert len(tick["skipped"]) == 1 and tick["skipped"][0]["reason"] == "backfill_limit"
    assert tick["status"]["skipped_backfill"] == tick["skipped"][0]["slot_count"]

    lost = get_json(site + "/api/jobs/sync-orders")
    assert [run["outcome"] for run in lost["runs"]] == ["lost", "running"]
    assert {command["action"] for command in lost["commands"]} >= {"close the crashed run"}

    paused = get_json(site + "/api/jobs/weekly-cleanup")
    assert paused["status"]["paused"] is True and "jobledger resume weekly-cleanup" in \
        [command["command"] for command in paused["commands"]]
    assert "Paused: none of these is due" in get(site + "/jobs/weekly-cleanup")[2]


def test_upcoming_slots_mark_the_daylight_saving_change(site, ledger_db):
    _, seeded = ledger_db
    page = get_json(site + "/api/jobs/dst-day")
    first = page["upcoming"][0]
    assert first["slot"].startswith(seeded.dst_day.isoformat()) or \
        first["local_time"].startswith(seeded.dst_day.isoformat())
    assert first["dst_change"] and ("spring forward" in first["dst_change"] or "fall back" in first["dst_change"])
    html = get(site + "/jobs/dst-day")[2]
    assert 'class="badge dst"' in html and "Europe/Berlin (local)" in html


def test_the_run_page_shows_its_row_lease_and_fence_writes(site, ledger_db):
    _, seeded = ledger_db
    run = get_json(site + f"/api/runs/{seeded.running_run_id}")
    assert run["run"]["job"] == "ingest" and run["run"]["status"] == "running" and run["outcome"] == "running"
    assert run["token_is_current"] is True and run["lease"]["token"] == seeded.running_token
    assert [fence["resource"] for fence in run["fences"]] == ["warehouse.orders"]
    detail = get_json(site + f"/api/runs/{seeded.detail_run_id}")
    assert detail["run"]["detail"] == {"rows": 1234, "source": "orders"} and detail["token_is_current"] is False
    assert detail["neighbours"]["previous_run_id"] is not None and detail["neighbours"]["next_run_id"] is not None
    html = get(site + f"/runs/{seeded.detail_run_id}")[2]
    for field in ("run_id", "owner", "token", "slot", "idempotency_key", "status", "started_at", "heartbeat_at",
                  "completed_at", "failure_reason", "error", "detail"):
        assert f"<th>{field}</th>" in html
    assert "&#34;rows&#34;: 1234" in html or "&quot;rows&quot;: 1234" in html or '"rows": 1234' in html
    lost = get_json(site + f"/api/runs/{seeded.lost_run_id}")
    assert lost["outcome"] == "lost" and lost["run"]["failure_reason"] == "lease_expired"


def test_the_alerts_page_lists_live_alerts(site):
    page = get_json(site + "/api/alerts")
    assert {"alert": "failing", "job": XSS_JOB} in \
        [{"alert": row["alert"], "job": row["job"]} for row in page["alerts"]]
    html = get(site + "/alerts")[2]
    assert "failing" in html and f'href="/jobs/{quoted(XSS_JOB)}"' in html


def test_unknown_jobs_and_runs_are_404(site):
    assert get(site + "/jobs/no-such-job")[0] == 404
    assert get(site + "/api/jobs/no-such-job") [0] == 404
    assert get(site + "/runs/999999")[0] == 404
    assert get(site + "/badge/no-such-job.svg")[0] == 404
    assert get(site + "/badge/etl.png")[0] == 404
    assert get(site + "/jobs/etl?window=2y")[0] == 400


# -- escaping ------------------------------------------------------------------------

def test_a_job_named_like_markup_is_text_everywhere(site):
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    for page in ["/", "/alerts", f"/jobs/{quoted(XSS_JOB)}", f"/badge/{quoted(XSS_JOB)}.svg"]:
        body = get(site + page)[2]
        assert XSS_JOB not in body, page
        assert "<b>owner</b>" not in body and 'onerror="alert(2)"' not in body, page
        assert escaped in body, page
    job = get(site + f"/jobs/{quoted(XSS_JOB)}")[2]
    assert "&lt;img src=x onerror=&#34;alert(2)&#34;&gt; failed &amp; stopped" in job  # the error text
    # the commands quote it for the shell, and the page escapes the quoted form
    assert "jobledger pause &#39;&lt;script&gt;alert(1)&lt;/script&gt;&#39;" in job
    api = get_json(site + f"/api/jobs/{quoted(XSS_JOB)}")
    assert api["job"] == XSS_JOB and api["failures"][0]["error"] == XSS_ERROR  # JSON carries the data as it is


# -- reading only ---------------------------------------------------------------------

def test_no_endpoint_writes(site):
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        for page in ("/", "/api/jobs", "/jobs/etl", "/metrics"):
            assert get(site + page, method=method)[0] == 405, (method, page)


def test_a_login_with_only_ledger_reader_reads_every_page(ledger_db, db_admin_dsn):
    dsn, seeded = ledger_db
    role = f"web_reader_{secrets.token_hex(4)}"
    with psycopg.connect(db_admin_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN IN ROLE ledger_reader")
    try:
        reader_dsn = psycopg.conninfo.make_conninfo(dsn, user=role)
        with BackgroundServer(create_app(reader_dsn)) as server:
            for page in ["/", "/api/jobs", "/alerts", f"/jobs/{quoted(XSS_JOB)}", "/jobs/dst-day", "/jobs/tick",
                         f"/runs/{seeded.running_run_id}", "/badge/etl.svg"]:
                status, _, body = get(server.url + page)
                assert status == 200, (page, body[:300])
            assert "jobledger_up 1.0" in get(server.url + "/metrics")[2]
    finally:
        with psycopg.connect(db_admin_dsn, autocommit=True) as admin:
            admin.execute(f"DROP ROLE {role}")


@pytest.fixture(scope="module")
def db_admin_dsn(pg_server):
    return pg_server.dsn("postgres")


def test_a_database_that_does_not_answer_is_a_503(tmp_path):
    app = create_app("host=127.0.0.1 port=1 dbname=none connect_timeout=2", timeout=timedelta(seconds=2))
    with BackgroundServer(app) as server:
        status, _, body = get(server.url + "/")
        assert status == 503 and "the ledger cannot be read" in body
        assert get(server.url + "/api/jobs")[0] == 503
        assert get(server.url + "/badge/etl.svg")[0] == 503
        assert get(server.url + "/metrics")[2].strip().endswith("jobledger_up 0.0")


# -- the badge and the metrics -----------------------------------------------------------

def test_the_badge_says_the_state(site):
    status, headers, body = get(site + "/badge/etl.svg")
    assert status == 200 and headers["content-type"].startswith("image/svg+xml")
    assert ">failing</text>" in body and 'fill="#d1242f"' in body and "no-cache" in headers["cache-control"]
    assert ">paused</text>" in get(site + "/badge/weekly-cleanup.svg")[2]


def _promtool_problems(text: str) -> list[str]:
    """promtool's findings on an exposition, less the quantile gauge's (a known lint, kept for compatibility)."""
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    lines = (result.stdout + result.stderr).splitlines()
    assert "parsing error" not in result.stdout + result.stderr, lines
    return [line for line in lines
            if line.strip() and 'jobledger_run_duration_seconds non-summary metrics should not have "quantile"'
            not in line]


def test_metrics_are_the_collectors_read_from_the_state_rows(site):
    status, headers, body = get(site + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {family.name: family for family in text_string_to_metric_families(body)}
    assert families["jobledger_up"].samples[0].value == 1
    states = {sample.labels["job"]: sample.labels["state"] for sample in families["jobledger_job_state"].samples}
    assert states == EXPECTED_STATES  # one series per job, its state's, value 1
    assert all(sample.value == 1 for sample in families["jobledger_job_state"].samples)
    longest = {sample.labels["job"]: sample for sample in families["jobledger_run_duration_seconds"].samples}
    assert longest["etl"].labels["quantile"] == "1" and longest["etl"].value >= 20  # the history's 20 s runs
    assert "jobledger_recent_run_duration_seconds" not in families  # a histogram would read every job's runs
    assert families["jobledger_job_ttl_seconds"].samples  # the rules compare runs with it
    assert any(sample.labels["job"] == "ingest" for sample in families["jobledger_run_running_seconds"].samples)
    # the crashed run is no live run: not running, no running time
    assert not any(sample.labels["job"] == "sync-orders" for sample in families["jobledger_run_running_seconds"].samples)
    assert "jobledger_state_differences" not in families  # an audit: `jobledger metrics --audit`
    if shutil.which("promtool"):
        assert _promtool_problems(body) == []


def test_metrics_of_a_ledger_read_in_parts_take_the_second_connection_from_the_pool(ledger_db, monkeypatch):
    # every ledger this size is read in two parts (the threshold lowered to 1 job): the other
    # part's connection comes from the dashboard's pool, and the text is the one-part text
    dsn, _ = ledger_db
    with psycopg.connect(dsn, autocommit=True) as conn:
        one = metrics.read_text(conn).decode()
    monkeypatch.setattr(metrics, "PARTS_FROM_JOBS", 1)
    read, ranges = metrics._read_job_text, []

    def reading(cur: psycopg.Cursor, first: str | None, end: str | None) -> Any:
        ranges.append((first, end, cur.connection.info.backend_pid))
        return read(cur, first, end)

    monkeypatch.setattr(metrics, "_read_job_text", reading)
    with BackgroundServer(create_app(dsn, metrics_cache=timedelta(0))) as server:
        status, _, body = get(server.url + "/metrics")
    assert status == 200
    # two ranges that meet at one bound, on two backends
    [(_, bound, first_pid), (start, end, other_pid)] = sorted(ranges, key=lambda r: r[0] is not None)
    assert start == bound and end is None and bound is not None and first_pid != other_pid
    steady = [line for line in one.splitlines() if '{job="' in line and "running_seconds" not in line]
    assert [line for line in body.splitlines() if '{job="' in line and "running_seconds" not in line] == steady
    assert "jobledger_up 1.0" in body


# -- access --------------------------------------------------------------------------

def test_loopback_needs_no_credentials_and_anything_else_does():
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1")
    assert is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example.org")
    check_bind("127.0.0.1", Access())
    with pytest.raises(AccessError, match="refusing to listen on 0.0.0.0 without credentials"):
        check_bind("0.0.0.0", Access())
    check_bind("0.0.0.0", Access(token="t"))
    check_bind("0.0.0.0", Access.parse(None, "ops:secret"))
    for bad in ("ops", "ops:", ":secret"):
        with pytest.raises(AccessError, match="user:password"):
            Access.parse(None, bad)


def test_the_cli_refuses_another_address_without_credentials():
    result = jobledger("web", "--host", "0.0.0.0", "--dsn", "host=127.0.0.1 port=1")
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0 without credentials" in result.stderr
    assert "--token" in result.stderr and "--basic-auth" in result.stderr


def test_a_token_is_required_once_given(ledger_db):
    dsn, _ = ledger_db
    with BackgroundServer(create_app(dsn, access=Access(token="s3cret"))) as server:
        status, headers, _ = get(server.url + "/api/jobs")
        assert status == 401 and "Bearer" in headers["www-authenticate"]
        assert get(server.url + "/metrics")[0] == 401
        assert get(server.url + "/api/jobs", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(server.url + "/api/jobs", {"Authorization": "Bearer s3cret"})[0] == 200
        opener = urllib.request.build_opener(NoRedirect)
        try:
            opener.open(server.url + "/jobs/etl?token=s3cret&window=1h", timeout=10)
            raise AssertionError("no redirect")
        except urllib.error.HTTPError as redirect:
            assert redirect.code == 303 and redirect.headers["location"] == "/jobs/etl?window=1h"
            cookie = redirect.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert get(server.url + "/", {"Cookie": cookie.split(";")[0]})[0] == 200
        assert get(server.url + "/", {"Cookie": "jobledger_token=wrong"})[0] == 401


def test_basic_auth_is_required_once_given(ledger_db):
    dsn, _ = ledger_db
    with BackgroundServer(create_app(dsn, access=Access.parse(None, "ops:pa:ss"))) as server:
        status, headers, _ = get(server.url + "/")
        assert status == 401 and headers["www-authenticate"].startswith("Basic")

        def basic(credentials: str) -> dict[str, str]:
            return {"Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()}

        assert get(server.url + "/", basic("ops:pa:ss"))[0] == 200
        assert get(server.url + "/", basic("ops:wrong"))[0] == 401
        assert get(server.url + "/", {"Authorization": "Basic !!!"})[0] == 401


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_jobledger_web_serves_until_sigterm(ledger_db):
    dsn, _ = ledger_db
    proc = start("web", "--port", "0", "--refresh", "10", env=environment(dsn))
    try:
        line = proc.stderr.readline() if proc.stderr else ""
        found = re.search(r"serving the dashboard on (http://\S+?)/,", line)
        assert found, line
        assert get(found.group(1) + "/api/jobs")[0] == 200
        assert 'data-refresh="10"' in get(found.group(1) + "/")[2]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "dashboard stopped" in err


def test_a_wrong_dsn_fails_in_one_line():
    result = jobledger("web", "--port", "0", "--dsn", "host=127.0.0.1 port=1 connect_timeout=2")
    assert result.returncode == 1
    assert result.stderr.startswith("Error: ") and len(result.stderr.strip().splitlines()) == 1


# -- the parts ---------------------------------------------------------------------------

def test_schedules_in_words():
    assert in_words("*/5 * * * *") == "every 5 minutes"
    assert in_words("30 2 * * *") == "at 02:30"
    assert in_words("@hourly") == "every hour"
    assert in_words("15 minutes") == "every 15 minutes"
    assert in_words("1 hour") == "every hour"
    assert in_words(None).startswith("no schedule")


def test_durations_in_commands_are_exact():
    assert [exact_duration(timedelta(seconds=s)) for s in (4800, 86400 * 2, 90, 1.5, 129600)] == \
        ["80m", "2d", "90s", "1500ms", "36h"]


def _status(**changes: Any) -> JobStatus:
    base: dict[str, Any] = {name: None for name in JobStatus.__dataclass_fields__}
    base.update(job="j", paused=False, consecutive_failures=0, runs_started=0, successes=0, failures=0,
                skipped_overlap=0, skipped_backfill=0, leases_lost=0)
    base.update(changes)
    return JobStatus(**base)


def test_the_dashboard_shows_the_ledgers_word_and_computes_none():
    """The state is job_status.state as read; nothing here works one out from the other columns."""
    assert pages._state(_status(state="down", last_run_id=1, consecutive_failures=2)) == "down"
    assert pages._state(_status(state="ok", running_run_id=3, holder=None)) == "ok"
    assert pages._state(_status(state=None)) == "unknown"
    crashed = {command.action for command in job_commands(_status(state="crashed"), "crashed")}
    assert "close the crashed run" in crashed and "close crashed runs" not in crashed


def test_commands_quote_what_the_shell_would_read():
    commands = job_commands(_status(job="it's; rm -rf /", schedule="0 * * * *", time_zone="UTC",
                                    ttl=timedelta(minutes=80), max_backfill=2), "ok")
    lines = {command.action: command.command for command in commands}
    assert lines["pause"] == "jobledger pause 'it'\"'\"'s; rm -rf /'"
    assert lines["change its definition"].endswith("--schedule '0 * * * *' --tz UTC --ttl 80m --max-backfill 2")


def test_demo_refuses_a_dsn_in_one_line():
    result = jobledger("web", "--demo", "--port", "0", "--dsn", "host=127.0.0.1 dbname=app")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("Error: --demo shows the demo's ledger") and len(result.stderr.splitlines()) == 1


def test_demo_refuses_the_pg_variables_whose_demo_leaves_no_ledger(tmp_path):
    result = jobledger("web", "--demo", "--port", "0", env=environment(PGHOST="127.0.0.1",
                                                                     LEDGER_HOME=str(tmp_path / "home")))
    assert result.returncode == 2, result.stderr
    assert "scratch database it drops at its end" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "home").exists()  # no embedded server started for nothing


def test_demo_before_any_demo_says_to_run_it_first(tmp_path):
    home = tmp_path / "home"
    result = jobledger("web", "--demo", "--port", "0", env=environment(LEDGER_HOME=str(home)), timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().endswith("run `jobledger demo` first") and len(result.stderr.splitlines()) == 1
    assert not (home / "pgdata" / "postmaster.pid").exists()  # the server it started is stopped again
