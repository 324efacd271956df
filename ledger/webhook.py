"""Delivering an alert event to a webhook (`jobledger notify`): its JSON, the POST, the retries.

The standard library only (``urllib.request``). One POST per event, with
``Content-Type: application/json``; a 2xx answer delivers it. A connection
error, a timeout, a 5xx, 408 or 429 is tried again, up to ``retries``
times, after ``backoff`` doubled each time (``ledger.wrapper.backoff_delay``,
the wait `jobledger run --retries` uses; a 429's or 503's ``Retry-After``
in seconds when longer); any other 4xx, and a redirect (not followed: a
redirected POST would lose its body), is given up at once. Delivery is at
least once: an answer lost on its way back is a retry, so the receiver
deduplicates by ``event_id``.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from email.message import Message
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ledger import __version__
from ledger.durations import format_duration
from ledger.models import Event
from ledger.text import first_line
from ledger.backoff import BACKOFF_CAP, backoff_delay

__all__ = ["RETRIED_4XX", "Delivery", "deliver", "payload", "shown_url"]

RETRIED_4XX = frozenset({408, 429})
"""Client errors that say "later", not "never": Request Timeout, Too Many Requests."""

RESPONSE_LIMIT = 65536
"""Bytes of an answer read at most (its body is not used; reading it lets the connection close cleanly)."""


def payload(event: Event) -> dict[str, Any]:
    """The JSON object POSTed for an alert event: the event, and its alert's fields at the top."""
    return {"event_id": event.event_id, "at": event.at.isoformat(), "kind": event.kind, "job": event.job,
            "run_id": event.run_id, "alert": event.detail.get("alert"), "message": event.detail.get("message"),
            "since": event.detail.get("since"), "detail": event.detail}


def shown_url(url: str) -> str:
    """The URL for a log line: without its user, password, query and fragment (where tokens hide)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True)
class Delivery:
    """How an event's delivery ended: ``delivered``, after ``attempts`` POSTs, with the last ``outcome``."""

    delivered: bool
    attempts: int
    outcome: str  # "HTTP 200", "HTTP 503 Service Unavailable", "timed out after 10s", ...


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str,
                         headers: Message, newurl: str) -> urllib.request.Request | None:
        return None  # the 3xx is raised as an HTTPError and given up


_OPENER = urllib.request.build_opener(_NoRedirects())


def _post(url: str, body: bytes, timeout: float) -> tuple[int | None, str, float | None]:
    """One POST: (the status or None, the outcome in words, the Retry-After in seconds or None)."""
    request = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "User-Agent": f"jobledger/{__version__}"})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            response.read(RESPONSE_LIMIT)
            status = int(response.status)
            return status, f"HTTP {status}", None
    except urllib.error.HTTPError as error:
        with error:
            reason = f" {error.reason}" if error.reason else ""
            location = error.headers.get("Location") if 300 <= error.code < 400 else None
            where = f" to {shown_url(location)} (redirects are not followed)" if location else ""
            return error.code, f"HTTP {error.code}{reason}{where}", _retry_after(error.headers)
    except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as error:
        cause: BaseException | str = error.reason if isinstance(error, urllib.error.URLError) else error
        if isinstance(cause, TimeoutError):
            return None, f"timed out after {format_duration(timedelta(seconds=timeout))}", None
        return None, first_line(cause), None


def _retry_after(headers: Message | None) -> float | None:
    value = headers.get("Retry-After") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff decides


def retried(status: int | None) -> bool:
    """Whether an attempt that got ``status`` (None: no answer) is tried again."""
    return status is None or status >= 500 or status in RETRIED_4XX


def deliver(url: str, event: Event, *, retries: int, backoff: timedelta, timeout: timedelta,
            log: Callable[[str], None], sleep: Callable[[float], None] = time.sleep) -> Delivery:
    """POST ``event`` to ``url`` until a 2xx, a failure not worth retrying, or ``retries`` retries;
    ``log`` gets one line per attempt (event, kind, job, alert, status or error, attempt)."""
    body = json.dumps(payload(event), ensure_ascii=False).encode()
    what = f"event {event.event_id} {event.kind} {event.job} {event.detail.get('alert')}"
    attempts = retries + 1
    for attempt in range(1, attempts + 1):
        status, outcome, retry_after = _post(url, body, timeout.total_seconds())
        tried = f"attempt {attempt} of {attempts}"
        if status is not None and 200 <= status < 300:
            log(f"{what}: delivered, {outcome} ({tried})")
            return Delivery(True, attempt, outcome)
        if not retried(status):
            log(f"{what}: {outcome} ({tried}), not retried: given up")
            return Delivery(False, attempt, outcome)
        if attempt == attempts:
            log(f"{what}: {outcome} ({tried}): given up")
            return Delivery(False, attempt, outcome)
        wait = backoff_delay(backoff, attempt)
        if retry_after is not None:
            wait = max(wait, min(timedelta(seconds=retry_after), max(BACKOFF_CAP, backoff)))
        log(f"{what}: {outcome} ({tried}), retrying in {format_duration(wait)}")
        sleep(wait.total_seconds())
    raise AssertionError("unreachable")
