"""The dashboard under load and under hostile addresses (the hardening issue, items 5 and 9).

- Item 5: every request reads through the dashboard's pool, ``/metrics``
  too: sixty concurrent scrapes hold at most one backend (one scrape read at
  a time, the others wait for it and share its body), sixty concurrent page
  loads at most the pool's size. Backends are counted in ``pg_stat_activity``
  by a sampler of its own while the requests run.
- Item 9: a path such as ``//evil.example/x`` is never written back as a link
  (a browser reads ``//host`` and ``/\\host`` as another site), and the token's
  redirect never leaves the dashboard.

The dashboard is the real one: uvicorn in a thread on a loopback port
(:class:`ledger.web.server.BackgroundServer`), a seeded ledger of its own
(tests/webseed.py), real connections; raw requests go through http.client, which
sends the path exactly as given.
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledger.web.access import Access
from ledger.web.app import create_app
from ledger.web.reads import POOL_SIZE, Reader
from ledger.web.server import BackgroundServer
from webseed import Seeded, seeded_database

CONCURRENT = 60
#: A generous statement and pool-wait timeout: on two busy cores sixty page loads queue for the
#: pool's four connections; the invariants below are about connections, never about time.
PATIENT = timedelta(seconds=60)


@pytest.fixture(scope="module")
def ledger_db(pg_server: Any, ledger_template: str) -> Iterator[tuple[str, Seeded]]:
    with seeded_database(pg_server, ledger_template, "web_hardening") as found:
        yield found


# -- counting the dashboard's backends ---------------------------------------------------

class Backends:
    """Samples, in a thread, the client backends of the ledger's database but its own connection."""

    def __init__(self, dsn: str) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True, application_name="web-hardening-sampler")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backend-sampler", daemon=True)
        self.peak = 0
        self.samples = 0
        self.names: set[str] = set()

    def _run(self) -> None:
        while not self._stop.is_set():
            rows = self._conn.execute(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'").fetchall()
            self.peak = max(self.peak, len(rows))
            self.names.update(str(name) for name, in rows)
            self.samples += 1

    def __enter__(self) -> Backends:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._conn.close()


def fetch(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            return response.status, response.headers.get("content-type", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("content-type", ""), error.read().decode()


def burst(base: str, paths: list[str], count: int = CONCURRENT) -> list[tuple[str, int, str, str]]:
    """``count`` requests at once (they wait at a barrier, then all go), cycling through ``paths``."""
    barrier = threading.Barrier(count)

    def one(path: str) -> tuple[str, int, str, str]:
        barrier.wait()
        return (path, *fetch(base + path))

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, [paths[i % len(paths)] for i in range(count)]))


def dashboard(dsn: str, **options: Any) -> BackgroundServer:
    """The dashboard over a pool of POOL_SIZE, opened first as ``jobledger web`` opens it."""
    reader = Reader(dsn, timeout=PATIENT, pool_size=POOL_SIZE)
    reader.open()
    return BackgroundServer(create_app(reader, timeout=PATIENT, **options))


def assert_valid_scrape(status: int, content_type: str, body: str) -> None:
    assert status == 200, body[:300]
    assert content_type.startswith("text/plain"), content_type
    families = {family.name: family for family in text_string_to_metric_families(body)}
    assert [sample.value for sample in families["jobledger_up"].samples] == [1.0], body[:300]
    assert "jobledger_runs_started" in families


# -- item 5: one pool for every request ----------------------------------------------------

def test_concurrent_scrapes_read_one_at_a_time_through_the_pool(ledger_db):
    """Sixty scrapes at once: one backend at most (a scrape reads alone; the others share its body)."""
    dsn, _ = ledger_db
    with dashboard(dsn) as server, Backends(dsn) as backends:
        answers = burst(server.url, ["/metrics"])
    for _, status, content_type, body in answers:
        assert_valid_scrape(status, content_type, body)
    assert backends.samples > 0
    assert backends.peak <= 1, (backends.peak, backends.names)
    assert backends.names <= {"jobledger web"}, backends.names


def test_concurrent_page_loads_stay_within_the_pool(ledger_db):
    """Sixty loads of every kind of page (and scrapes among them) at once: never more backends than the pool."""
    dsn, seeded = ledger_db
    pages = ["/", "/api/jobs", "/jobs/etl", "/api/jobs/etl?window=7d", f"/runs/{seeded.running_run_id}",
             f"/api/runs/{seeded.failure_run_id}", "/alerts", "/api/alerts", "/badge/etl.svg", "/metrics",
             "/jobs/no-such-job"]
    with dashboard(dsn) as server, Backends(dsn) as backends:
        answers = burst(server.url, pages)
    for path, status, content_type, body in answers:
        if path == "/metrics":
            assert_valid_scrape(status, content_type, body)
        else:
            assert status == (404 if path == "/jobs/no-such-job" else 200), (path, status, body[:300])
    assert backends.samples > 0
    assert backends.peak <= POOL_SIZE, (backends.peak, backends.names)
    assert backends.names <= {"jobledger web"}, backends.names


def test_a_fresh_dashboard_opens_its_pool_once(ledger_db):
    """Sixty first requests of a dashboard given a DSN, not an open reader: still within the pool.

    The app opens its pool as it starts (a request that finds it not open yet
    opens it alone, the others wait for it rather than each connecting); the
    one connection that checks the DSN first is counted too.
    """
    dsn, _ = ledger_db
    with Backends(dsn) as backends:
        with BackgroundServer(create_app(Reader(dsn, timeout=PATIENT), timeout=PATIENT)) as server:
            answers = burst(server.url, ["/api/jobs", "/", "/metrics"])
    assert all(status == 200 for _, status, _, _ in answers), [(p, s) for p, s, _, _ in answers]
    assert backends.peak <= POOL_SIZE + 1, (backends.peak, backends.names)  # + the start's one probe


def test_first_reads_of_a_closed_reader_open_it_once(ledger_db):
    """A reader not open yet (the database was down when the app started) read by many at once:
    one of them opens the pool, the others wait for it; never a connection each."""
    dsn, _ = ledger_db
    reader = Reader(dsn, timeout=PATIENT, pool_size=POOL_SIZE)
    barrier = threading.Barrier(CONCURRENT)

    def read(_: int) -> int:
        barrier.wait()
        with reader.transaction() as cur:
            row = cur.execute("SELECT count(*) FROM ledger.job_status").fetchone()
            assert row is not None
            return int(row[0])

    try:
        with Backends(dsn) as backends, ThreadPoolExecutor(CONCURRENT) as pool:
            counts = list(pool.map(read, range(CONCURRENT)))
    finally:
        reader.close()
    assert len(set(counts)) == 1 and counts[0] > 0
    assert backends.peak <= POOL_SIZE + 1, (backends.peak, backends.names)  # + the one probe of the DSN


def running_seconds(body: str) -> float:
    """``jobledger_run_running_seconds`` of the seeded running job: different in every read."""
    for family in text_string_to_metric_families(body):
        if family.name == "jobledger_run_running_seconds":
            return sum(sample.value for sample in family.samples)
    raise AssertionError("no jobledger_run_running_seconds")


def test_a_scrape_is_served_from_a_short_cache(ledger_db):
    """Within the cache's period every scrape gets the same body, read once; after it, a new read."""
    dsn, _ = ledger_db
    with dashboard(dsn, metrics_cache=timedelta(minutes=10)) as server:
        bodies = {body for _, _, _, body in burst(server.url, ["/metrics"])}
        assert len(bodies) == 1  # one read for all sixty
        assert fetch(server.url + "/metrics")[2] in bodies  # and later ones, within the period
    with dashboard(dsn, metrics_cache=timedelta(seconds=1)) as server:
        first = fetch(server.url + "/metrics")[2]
        time.sleep(1.5)
        second = fetch(server.url + "/metrics")[2]
        assert running_seconds(second) > running_seconds(first)  # read again: the run has run longer
    with pytest.raises(ValueError):
        create_app(dsn, metrics_cache=timedelta(seconds=-1))


# -- item 9: no link, no redirect to another site -------------------------------------------

HOSTILE = ["//evil.example/x", "//evil.example/", "/\\evil.example/x", "/%2F%2Fevil.example/x",
           "/%5Cevil.example/x", "///evil.example/x", "/\\/evil.example/x"]


def hostile(root_path: str) -> list[str]:
    """The paths above, and under a root path also with it in front (a proxy that does not take it off)."""
    return HOSTILE + [root_path + path for path in HOSTILE if root_path]


class Links(HTMLParser):
    """Every attribute that a browser follows or loads: href, src, action, formaction, a refresh's url."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src", "action", "formaction", "data", "poster", "srcset"):
                self.found.append(value)
            elif name == "content" and "url=" in value.lower():
                self.found.append(value.lower().split("url=", 1)[1])


def off_site(address: str) -> bool:
    """Whether a browser at the dashboard would leave it for ``address`` (as a link or a Location)."""
    address = address.strip().replace("\\", "/")
    return address.startswith("//") or bool(urlsplit(address).scheme) or bool(urlsplit(address).netloc)


def raw_get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """GET ``path`` exactly as written (http.client neither normalises nor quotes it)."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        conn.close()


def assert_no_link_off_site(path: str, status: int, body: str) -> None:
    links = Links()
    links.feed(body)
    assert links.found or status >= 400 and "<html" not in body, (path, status, body[:300])
    for link in links.found:
        assert not off_site(link) and "evil.example" not in link, (path, status, link)


@pytest.mark.parametrize("root_path", ["", "/jl"])
def test_a_path_of_another_host_is_never_a_link(ledger_db, root_path):
    dsn, _ = ledger_db
    with BackgroundServer(create_app(dsn), root_path=root_path) as server:
        for path in hostile(root_path):
            status, headers, body = raw_get(server.url, path)
            assert status in (400, 404), (path, status)
            assert "location" not in headers, (path, headers)
            assert_no_link_off_site(path, status, body)
        # a real page still links where it should
        status, _, body = raw_get(server.url, "/jobs/etl")
        assert status == 200 and f'href="{root_path}/alerts"' in body and f'href="{root_path}/api/jobs/etl' in body


@pytest.mark.parametrize("root_path", ["", "/jl"])
def test_the_tokens_redirect_stays_on_the_dashboard(ledger_db, root_path):
    dsn, _ = ledger_db
    with BackgroundServer(create_app(dsn, access=Access(token="T")), root_path=root_path) as server:
        for path in hostile(root_path):
            status, headers, body = raw_get(server.url, path + "?token=T")
            assert status in (303, 400), (path, status, headers)
            if status == 400:
                continue
            location = headers["location"]
            assert not off_site(location), (path, location)
            assert location.startswith(f"{root_path}/") and "token" not in location, (path, location)
            cookie = headers["set-cookie"].split(";")[0]
            # where it sends the browser: the dashboard's 404, with no link elsewhere either
            followed = location[len(root_path):]
            status, headers, body = raw_get(server.url, followed, {"Cookie": cookie})
            assert status == 404 and "location" not in headers, (path, location, status)
            assert_no_link_off_site(location, status, body)
        # a real page keeps its address (under the root path, once) and its other parameters
        status, headers, _ = raw_get(server.url, "/jobs/etl?token=T&window=1h")
        assert status == 303 and headers["location"] == f"{root_path}/jobs/etl?window=1h"
