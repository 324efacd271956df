"""The endpoints: each page as HTML and as JSON (``/api/...``), the badge, ``/metrics``; GET and HEAD only.

A page is read in one read-only transaction (:meth:`Reader.transaction`),
built by :mod:`ledger.web.pages`, then drawn by its template or returned as
JSON. Handlers are plain functions: Starlette runs them in its thread pool,
where the synchronous reads belong. ``/metrics`` is the exception: it waits
for its scrape in the event loop (:class:`Scrapes`), not in a thread.

Every address a page or a redirect writes is built from the routes and the
root path (:class:`Urls`, :func:`local`), never copied from the request's path:
``//evil.example/x`` is another site to a browser.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast
from urllib.parse import quote, urlencode

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import Scope

from ledger import __version__
from ledger.metrics import DEFAULT_TIMEOUT as METRICS_TIMEOUT
from ledger.metrics import LedgerCollector
from ledger.models import Run
from ledger.web import charts, display, pages
from ledger.web.jsonable import jsonable
from ledger.web.reads import Reader
from ledger.states import STATES, UNKNOWN, look

P = TypeVar("P")

#: The longest name filter a request may give (a job's name is at most this long too).
MAX_FILTER = 200
#: How long a ``/metrics`` body is served again after its read ended.
DEFAULT_METRICS_CACHE = timedelta(seconds=1)


class Scrapes:
    """``/metrics``: one read at a time (single flight), its body served again for ``cache`` after it.

    A scrape that comes while a read is in flight waits for that read and gets
    its body; one within ``cache`` of the last read's end gets the last body;
    any other starts a read. However many scrape at once, the ledger is read by
    one connection of the pool at a time, and the waiting scrapes hold no
    thread (they wait in the event loop).
    """

    def __init__(self, cache: timedelta = DEFAULT_METRICS_CACHE) -> None:
        if cache < timedelta(0):
            raise ValueError("the metrics cache cannot be negative")
        self.cache = cache.total_seconds()
        self._body: bytes | None = None
        self._read_at = 0.0
        self._flight: asyncio.Task[bytes] | None = None

    async def body(self, read: Callable[[], bytes]) -> bytes:
        if self._body is not None and time.monotonic() - self._read_at < self.cache:
            return self._body
        flight = self._flight
        if flight is None or flight.get_loop() is not asyncio.get_running_loop():
            flight = self._flight = asyncio.ensure_future(self._read(read))
        # shielded: a scraper that goes away does not cancel the read the others wait for
        return await asyncio.shield(flight)

    async def _read(self, read: Callable[[], bytes]) -> bytes:
        try:
            body = await run_in_threadpool(read)
            self._body, self._read_at = body, time.monotonic()
            return body
        finally:
            self._flight = None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every page needs besides its data: the reads, the templates, the refresh period, the scrapes."""

    reader: Reader
    templates: Jinja2Templates
    refresh: int
    scrapes: Scrapes = dataclasses.field(default_factory=Scrapes)


def settings(request: Request) -> Settings:
    return cast(Settings, request.app.state.settings)


# -- addresses ------------------------------------------------------------------------

def root_of(scope: Scope) -> str:
    """The prefix the dashboard is served under (``root_path``): ``""`` or ``/a/b``, never ``//host``."""
    root = str(scope.get("root_path", "")).strip("/\\")
    return f"/{root}" if root else ""


def local(scope: Scope, query: str = "") -> str:
    """The request's own address, as a link or a Location that stays on the dashboard.

    The path the routes saw (root path taken off), its leading slashes and
    backslashes folded into one ``/`` (a browser reads ``//host`` and ``/\\host``
    as another site), quoted again, under :func:`root_of`.
    """
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        path = path[len(root):]  # uvicorn puts the root path in front of the path; the routes take it off
    path = path.lstrip("/\\")
    return f"{root_of(scope)}/{quote(path, safe='/')}" + (f"?{query}" if query else "")


class Urls:
    """The dashboard's addresses, under the prefix it is mounted at (``root_path``)."""

    def __init__(self, request: Request) -> None:
        self.root = root_of(request.scope)

    def job(self, job: str, window: str | None = None) -> str:
        query = f"?{urlencode({'window': window})}" if window else ""
        return f"{self.root}/jobs/{quote(job, safe='')}{query}"

    def run(self, run_id: int) -> str:
        return f"{self.root}/runs/{run_id}"

    def jobs(self, name: str | None = None, state: str | None = None, page: int | None = None) -> str:
        query = {key: value for key, value in (("q", name), ("state", state), ("page", page)) if value}
        return f"{self.root}/" + (f"?{urlencode(query)}" if query else "")

    def static(self, name: str) -> str:
        return f"{self.root}/static/{name}?v={__version__}"


# -- the two forms of a page ----------------------------------------------------------

def _html(request: Request, template: str, page: Any, *, nav: str, json_url: str, **extra: Any) -> Response:
    urls = Urls(request)
    config = settings(request)
    context = {
        "page": page, "nav": nav, "json_url": json_url, "refresh": config.refresh, "root": urls.root,
        "version": __version__, "states": STATES,
        "static": urls.static, "job_url": urls.job, "run_url": urls.run, "jobs_url": urls.jobs,
        "clock": display.clock, "stamp": display.stamp, "relative": display.relative,
        "duration": display.duration, "offset": display.offset, "percent": display.percent,
        "sparkline": lambda runs: charts.sparkline(runs, urls.run),
        "timeline": lambda job_page: charts.timeline(job_page, urls.run),
        "durations": lambda job_page: charts.durations(job_page, urls.run),
        **extra,
    }
    return config.templates.TemplateResponse(request, template, context,
                                             headers={"cache-control": "no-cache"})


def _json(page: Any) -> Response:
    return JSONResponse(jsonable(page), headers={"cache-control": "no-cache"})


def _read(request: Request, build: Callable[[Any], P]) -> P:
    with settings(request).reader.transaction() as cur:
        return build(cur)


# -- the request's choices ------------------------------------------------------------

def _jobs_choices(request: Request) -> dict[str, Any]:
    name = request.query_params.get("q", "").strip() or None
    if name is not None and len(name) > MAX_FILTER:
        raise HTTPException(400, f"the name filter is at most {MAX_FILTER} characters")
    state = request.query_params.get("state", "").strip() or None
    if state is not None and state not in STATES:
        raise HTTPException(400, f"unknown state {state!r}: one of {', '.join(STATES)}")
    try:
        page = int(request.query_params.get("page", "1"))
    except ValueError:
        raise HTTPException(400, "page must be a number") from None
    return {"name": name, "state": state, "page": page}


def _window(request: Request) -> str:
    window = request.query_params.get("window", pages.DEFAULT_WINDOW)
    if window not in pages.WINDOWS:
        raise HTTPException(400, f"unknown window {window!r}: one of {', '.join(pages.WINDOWS)}")
    return window


# -- the pages ------------------------------------------------------------------------

def jobs(request: Request) -> Response:
    choices = _jobs_choices(request)
    page = _read(request, lambda cur: pages.jobs_page(cur, **choices))
    json_url = Urls(request).root + "/api/jobs" + (f"?{request.url.query}" if request.url.query else "")
    return _html(request, "jobs.html", page, nav="jobs", json_url=json_url)


def jobs_json(request: Request) -> Response:
    choices = _jobs_choices(request)
    return _json(_read(request, lambda cur: pages.jobs_page(cur, **choices)))


def job(request: Request) -> Response:
    name, window = request.path_params["job"], _window(request)
    page = _read(request, lambda cur: pages.job_page(cur, name, window=window))
    json_url = f"{Urls(request).root}/api/jobs/{quote(name, safe='')}?{urlencode({'window': window})}"
    return _html(request, "job.html", page, nav="jobs", json_url=json_url, windows=list(pages.WINDOWS))


def job_json(request: Request) -> Response:
    name, window = request.path_params["job"], _window(request)
    return _json(_read(request, lambda cur: pages.job_page(cur, name, window=window)))


def run(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    page = _read(request, lambda cur: pages.run_page(cur, run_id))
    fields = [(field.name, getattr(page.run, field.name)) for field in dataclasses.fields(Run)]
    return _html(request, "run.html", page, nav="jobs", json_url=f"{Urls(request).root}/api/runs/{run_id}",
                 fields=fields)


def run_json(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    return _json(_read(request, lambda cur: pages.run_page(cur, run_id)))


def alerts(request: Request) -> Response:
    page = _read(request, pages.alerts_page)
    return _html(request, "alerts.html", page, nav="alerts", json_url=f"{Urls(request).root}/api/alerts")


def alerts_json(request: Request) -> Response:
    return _json(_read(request, pages.alerts_page))


def schedulers(request: Request) -> Response:
    page = _read(request, pages.schedulers_page)
    return _html(request, "schedulers.html", page, nav="schedulers",
                 json_url=f"{Urls(request).root}/api/schedulers")


def schedulers_json(request: Request) -> Response:
    return _json(_read(request, pages.schedulers_page))


def pools(request: Request) -> Response:
    page = _read(request, pages.pools_page)
    return _html(request, "pools.html", page, nav="pools", json_url=f"{Urls(request).root}/api/pools")


def pools_json(request: Request) -> Response:
    return _json(_read(request, pages.pools_page))


BADGE_HEADERS = {"cache-control": "no-cache, max-age=0"}


def badge_response(label: str, message: str, colour: str, status: int = 200) -> Response:
    return Response(charts.badge(label, message, colour), status_code=status, media_type="image/svg+xml",
                    headers=BADGE_HEADERS)


def badge(request: Request) -> Response:
    """``/badge/JOB.svg``: the job's state as a status badge."""
    path: str = request.path_params["job"]
    if not path.endswith(".svg"):
        raise HTTPException(404, "a badge's address ends in .svg: /badge/JOB.svg")
    name = path[:-len(".svg")]
    try:
        found = _read(request, lambda cur: pages.badge(cur, name))
    except pages.UnknownJob:
        return badge_response(name, "unknown job", UNKNOWN.colour, 404)
    return badge_response(name, found.state, look(found.state).colour)


def state_styles(request: Request) -> Response:
    """``/static/states.css``: each state's colour and symbol, from the one table of them (ledger.states).

    The symbol is the badge's ``::before``: drawn, not part of the text (which is the state's word)."""
    rules = [f'.state-{state} {{ background: {found.colour}; }}\n.state-{state}::before {{ content: "{found.symbol} "; }}'
             for state, found in STATES.items()]
    return Response("\n".join(rules) + "\n", media_type="text/css",
                    headers={"cache-control": "public, max-age=3600"})


async def metrics(request: Request) -> Response:
    """The same collector as ``jobledger metrics``, on a connection of the pool, one read at a time
    (:class:`Scrapes`): a failed read answers ``jobledger_up 0``."""
    config = settings(request)
    # as `jobledger metrics`: a scrape reads every job and the alerts, and gets its longer default
    timeout = max(config.reader.timeout, METRICS_TIMEOUT)

    def read() -> bytes:
        body: bytes = LedgerCollector(config.reader.connection, timeout=timeout).text()
        return body

    return Response(await config.scrapes.body(read), media_type=CONTENT_TYPE_LATEST,
                    headers={"cache-control": "no-cache"})


def routes(static_directory: str) -> list[BaseRoute]:
    return [
        Route("/", jobs),
        Route("/api/jobs", jobs_json),
        Route("/jobs/{job:path}", job),
        Route("/api/jobs/{job:path}", job_json),
        Route("/runs/{run_id:int}", run),
        Route("/api/runs/{run_id:int}", run_json),
        Route("/alerts", alerts),
        Route("/api/alerts", alerts_json),
        Route("/schedulers", schedulers),
        Route("/api/schedulers", schedulers_json),
        Route("/pools", pools),
        Route("/api/pools", pools_json),
        Route("/badge/{job:path}", badge),
        Route("/metrics", metrics),
        Route("/static/states.css", state_styles),
        Mount("/static", StaticFiles(directory=static_directory), name="static"),
    ]
