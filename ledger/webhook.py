"""Delivering an alert event to a webhook (`jobledger notify`): its JSON, the POST, the retries.

The standard library only (``urllib.request``). One POST per event, with
``Content-Type: application/json``; a 2xx answer delivers it. A connection
error, a timeout, a 5xx, 408 or 429 is tried again, up to ``retries``
times, after ``backoff`` doubled each time (``ledger._backoff.backoff_delay``,
the wait `jobledger run --retries` uses too; a 429's or 503's ``Retry-After``
in seconds when longer); any other 4xx, and a redirect (not followed: a
redirected POST would lose its body), is given up at once. Delivery is at
least once: an answer lost on its way back is a retry, so the receiver
deduplicates by ``event_id``.

``timeout`` bounds an attempt in all (connecting, sending, the whole
answer), not each read of a socket: a receiver that drips its answer a byte
at a time is cut at it and the attempt is a timeout. So an event holds the
next ones back at most (``retries`` + 1) × ``timeout`` plus the waits in
between.

A webhook's secret hides in its user and password, its path (Slack's,
Discord's, Teams' webhooks), its query or its fragment: nothing here prints
more of a URL than its scheme, host and port (:func:`shown_url`), and an
error's message is cleared of the rest (:func:`scrubbed`). A user and
password in the URL are sent as HTTP basic authentication.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from email.message import Message
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ledger import __version__
from ledger._backoff import BACKOFF_CAP, backoff_delay
from ledger.durations import format_duration
from ledger.models import Event
from ledger.text import first_line

__all__ = ["RETRIED_4XX", "Delivery", "deliver", "payload", "scrubbed", "shown_url", "url_problem"]

RETRIED_4XX = frozenset({408, 429})
"""Client errors that say "later", not "never": Request Timeout, Too Many Requests."""

RESPONSE_LIMIT = 65536
"""Bytes of an answer read at most (its body is not used; reading it lets the connection close cleanly)."""

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_UNSENDABLE = re.compile(r"[\x00-\x20\x7f]")  # what http.client refuses in a request line (a space too)


def payload(event: Event) -> dict[str, Any]:
    """The JSON object POSTed for an alert event: the event, and its alert's fields at the top."""
    return {"event_id": event.event_id, "at": event.at.isoformat(), "kind": event.kind, "job": event.job,
            "run_id": event.run_id, "alert": event.detail.get("alert"), "message": event.detail.get("message"),
            "since": event.detail.get("since"), "detail": event.detail}


def shown_url(url: str) -> str:
    """The URL for a log line or an error: its scheme, host and port, nothing more (a webhook's secret
    hides in its user, password, path, query or fragment). ``""`` when it has no host to show."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an IPv6 address not in brackets
        return ""
    host = parts.hostname or ""
    if not host or _UNSENDABLE.search(host) or not host.isascii():
        return ""
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: not shown
        port = None
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return f"{parts.scheme}://{netloc}" if _SCHEME.fullmatch(parts.scheme) else netloc


def url_problem(url: str, subject: str = "the URL") -> str | None:
    """Why ``url`` cannot be a webhook, a sentence about ``subject`` that quotes none of the URL; None when
    it can be one."""
    if _UNSENDABLE.search(url):
        return f"{subject} holds a space or a control character: percent-encode it (a space is %20)"
    if not url.isascii():
        return (f"{subject} holds a character that is not ASCII: percent-encode it (and give an international "
                "host name in punycode)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        return (f"cannot read {subject} as a URL: its port is not a number from 0 to 65535, or its IPv6 address "
                "is not in brackets")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{subject} is not an http or https URL with a host (https://hooks.example.com/ledger)"
    return None


def _secrets(url: str) -> list[str]:
    """The pieces of ``url`` an error's message must not show, longest first."""
    pieces = [url, url.partition("://")[2]]
    try:
        parts = urlsplit(url)
    except ValueError:
        return pieces
    after_host = url.partition("://")[2].partition("/")[2]
    pieces += [parts.netloc, parts.netloc.rpartition("@")[0], parts.username or "", parts.password or "",
               after_host, "/" + after_host, parts.path, parts.query, parts.fragment,
               urlunsplit(("", "", parts.path, parts.query, "")),
               urlunsplit(("", "", parts.path, parts.query, parts.fragment))]
    words = [word for piece in (parts.path, parts.query, parts.fragment) for word in re.split(r"[/?&=#;]", piece)]
    pieces += [word for word in words if len(word) >= 6]
    pieces += [unquote(piece) for piece in pieces]
    pieces += [repr(piece)[1:-1] for piece in pieces]  # as a message quotes it: "'/x\\x7fTOKEN'"
    shown = shown_url(url)
    kept = {piece for piece in pieces if len(piece) >= 2 and piece not in shown}
    return sorted(kept, key=len, reverse=True)


def scrubbed(text: str, url: str) -> str:
    """``text`` (an error's message) without any piece of ``url`` but its scheme, host and port."""
    for piece in _secrets(url):
        text = text.replace(piece, "…")
    return text


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


class _Attempt:
    """The sockets of one POST, so that its deadline can cut them: a socket's timeout bounds each read,
    and a receiver that drips its answer a byte at a time never trips it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._over = False

    def connect(self, address: tuple[str, int], timeout: float | None = None,
                source_address: tuple[str, int] | None = None) -> socket.socket:
        """``socket.create_connection``, the socket kept (a duplicate: TLS takes the original over)."""
        sock = socket.create_connection(address, timeout, source_address)
        with self._lock:
            if self._over:
                sock.close()
                raise TimeoutError("the attempt's deadline has passed")
            self._sockets.append(sock.dup())
        return sock

    def end(self, cut: bool) -> None:
        """The attempt is over: no new connection; with ``cut``, its connections are shut down, so that
        what still waits on them (the POST's thread) returns at once."""
        with self._lock:
            self._over = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            if cut:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class _HTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: Any, attempt: _Attempt, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = attempt.connect  # what connect() opens its socket with (3.10 to 3.13)


class _HTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: Any, attempt: _Attempt, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = attempt.connect


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, attempt: _Attempt) -> None:
        super().__init__()
        self._attempt = attempt

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_HTTPConnection, req, attempt=self._attempt)  # type: ignore[arg-type]


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, attempt: _Attempt) -> None:
        super().__init__()
        self._attempt = attempt

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        context = getattr(self, "_context", None)
        return self.do_open(_HTTPSConnection, req, context=context,  # type: ignore[arg-type]
                            attempt=self._attempt)


_Outcome = tuple[int | None, str, float | None]


def _post(url: str, body: bytes, timeout: float) -> _Outcome:
    """One POST, over by ``timeout`` whatever the receiver does: (the status or None, the outcome in
    words, the Retry-After in seconds or None).

    It runs in a thread of its own, waited for ``timeout`` seconds at most (a name's resolution is not
    bounded by a socket's timeout either); past that its connections are shut down, so the thread ends
    soon after, and the attempt is a timeout."""
    attempt = _Attempt()
    result: list[_Outcome] = []

    def post() -> None:
        try:
            result.append(_exchange(url, body, timeout, attempt))
        except BaseException as error:  # noqa: BLE001 - the thread never dies with a traceback
            result.append((None, scrubbed(first_line(error), url), None))
        finally:
            attempt.end(cut=False)

    worker = threading.Thread(target=post, name="jobledger-webhook-post", daemon=True)
    timed_out = True
    try:
        worker.start()
        worker.join(timeout)
        timed_out = not result
    finally:
        if timed_out:
            attempt.end(cut=True)
    # Decided once: a cut attempt is a timeout even when the worker, its read cut short by the
    # shutdown, goes on to append a status (a dripping 200 would otherwise count as delivered).
    if not timed_out:
        return result[0]
    return None, f"timed out after {format_duration(timedelta(seconds=timeout))}", None


def _exchange(given: str, body: bytes, timeout: float, attempt: _Attempt) -> _Outcome:
    url = given
    parts = urlsplit(url)
    headers = {"Content-Type": "application/json", "User-Agent": f"jobledger/{__version__}"}
    if parts.username is not None or parts.password is not None:
        credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    opener = urllib.request.build_opener(_NoRedirects(), _HTTPHandler(attempt), _HTTPSHandler(attempt))
    try:
        with opener.open(request, timeout=timeout) as response:
            response.read(RESPONSE_LIMIT)
            status = int(response.status)
            return status, f"HTTP {status}", None
    except urllib.error.HTTPError as error:
        with error:
            reason = f" {error.reason}" if error.reason else ""
            location = error.headers.get("Location") if 300 <= error.code < 400 else None
            shown = shown_url(location) if location else ""
            where = f" to {shown}" if shown else ""
            redirect = f"{where} (redirects are not followed)" if location else ""
            return error.code, f"HTTP {error.code}{reason}{redirect}", _retry_after(error.headers)
    except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as error:
        cause: BaseException | str = error.reason if isinstance(error, urllib.error.URLError) else error
        if isinstance(cause, TimeoutError):
            return None, f"timed out after {format_duration(timedelta(seconds=timeout))}", None
        return None, scrubbed(first_line(cause), given), None


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
    ``log`` gets one line per attempt (event, kind, job, alert, status or error, attempt), which shows
    none of ``url``. Each attempt is over by ``timeout``, whatever the receiver does: it returns within
    (``retries`` + 1) × ``timeout`` plus the waits (``sleep``) between the attempts."""
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
