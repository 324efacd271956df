"""The dashboard's application: :func:`create_app` gives the ASGI app (Starlette) that uvicorn serves.

Around the routes (:mod:`ledger.web.routes`): the access check
(:mod:`ledger.web.access`), headers that keep a page from running anything
but its own script (a Content-Security-Policy of ``'self'``: even a name
that escaped escaping could not load or run code), and error pages: 404 for
an unknown job or run, 400 for a bad filter, 503 when the ledger cannot be
read (its reason in one line). An error page links only to the dashboard's
own pages, never to the address it was asked for (``//evil.example/x`` is
another site to a browser).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import jinja2
import psycopg
from psycopg_pool import PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ledger import __version__
from ledger.states import UNKNOWN
from ledger.text import first_line
from ledger.web import pages, routes
from ledger.web.access import Access, AccessMiddleware
from ledger.web.reads import DEFAULT_TIMEOUT, Reader
from ledger.web.routes import DEFAULT_METRICS_CACHE, Scrapes

__all__ = ["DEFAULT_REFRESH", "create_app"]

HERE = Path(__file__).resolve().parent
#: Seconds between two refreshes of an open page.
DEFAULT_REFRESH = 15

SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
     b"form-action 'self'; base-uri 'none'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def environment() -> jinja2.Environment:
    """The templates' environment: autoescape on for everything, undefined names are errors."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _error(request: Request, status: int, heading: str, message: str) -> Response:
    path = request.url.path
    if "/api/" in path:
        return JSONResponse({"error": heading, "message": message}, status_code=status)
    if "/badge/" in path:
        return routes.badge_response("jobledger", heading, UNKNOWN.colour, status)
    config = routes.settings(request)
    urls = routes.Urls(request)
    # no JSON link: it would be the request's own path, and an error has no JSON page of its own
    return config.templates.TemplateResponse(request, "error.html", {
        "status": status, "heading": heading, "message": message, "refresh": config.refresh, "root": urls.root,
        "json_url": None, "static": urls.static, "nav": "", "version": __version__,
    }, status_code=status)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    if error.status_code == 405:
        return _error(request, 405, "read-only", "this dashboard only reads: GET and HEAD")
    return _error(request, error.status_code, "not found" if error.status_code == 404 else "bad request",
                  str(error.detail))


async def _unknown(request: Request, error: Exception) -> Response:
    what = "job" if isinstance(error, pages.UnknownJob) else "run"
    return _error(request, 404, f"no such {what}", f"this ledger has no {what} {error.args[0]!r}")


async def _unreadable(request: Request, error: Exception) -> Response:
    return _error(request, 503, "the ledger cannot be read", first_line(error))


def create_app(dsn: str | Reader, *, access: Access | None = None, refresh: int = DEFAULT_REFRESH,
               timeout: timedelta = DEFAULT_TIMEOUT,
               metrics_cache: timedelta = DEFAULT_METRICS_CACHE) -> Starlette:
    """The dashboard of the ledger at ``dsn`` (a conninfo, or a :class:`Reader` of one).

    ``access``: the credentials every request must carry (default: none;
    :func:`ledger.web.access.check_bind` decides whether that may be);
    ``refresh``: seconds between two refreshes of an open page; ``timeout``:
    the statement timeout of each read; ``metrics_cache``: how long a
    ``/metrics`` body is served again after its read (:class:`~ledger.web.routes.Scrapes`).
    Every request reads through the reader's pool.
    """
    if refresh < 1:
        raise ValueError("refresh must be at least one second")
    scrapes = Scrapes(metrics_cache)
    reader = dsn if isinstance(dsn, Reader) else Reader(dsn, timeout=timeout)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            # the pool opened before the first request (`jobledger web` has opened it already); a
            # database that does not answer yet is no reason not to start: the pages say 503 meanwhile
            await run_in_threadpool(reader.open)
        except psycopg.Error:
            pass
        try:
            yield
        finally:
            reader.close()

    handlers: dict[Any, Any] = {
        HTTPException: _http_error, pages.UnknownJob: _unknown, pages.UnknownRun: _unknown,
        psycopg.Error: _unreadable, PoolTimeout: _unreadable,
    }
    app = Starlette(
        routes=routes.routes(str(HERE / "static")),
        middleware=[Middleware(SecurityHeaders), Middleware(AccessMiddleware, access=access or Access())],
        exception_handlers=handlers, lifespan=lifespan)
    app.state.settings = routes.Settings(reader=reader, templates=Jinja2Templates(env=environment()),
                                         refresh=refresh, scrapes=scrapes)
    return app
