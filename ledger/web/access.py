"""Who may read the dashboard: anyone on this machine by default, a token or basic-auth elsewhere.

The dashboard binds to loopback unless told otherwise; listening on another
address shows the ledger (job names, owners, error texts) to whoever reaches
it, so :func:`check_bind` refuses that without credentials given by the
operator. With credentials, every request must carry them, on loopback too:

- a token: ``Authorization: Bearer TOKEN`` (a Prometheus scrape's
  ``authorization`` setting), or once ``?token=TOKEN`` in a browser, which
  answers with a cookie (HttpOnly, SameSite=Strict) and a redirect to the same
  address without the token, so it stays out of the history and of links (an
  address on the dashboard, whatever the path: ``//evil.example/?token=T``
  redirects to ``/evil.example/``, see :func:`ledger.web.routes.local`);
- basic auth: ``user:password``, which browsers ask for themselves.

Secrets are compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from dataclasses import dataclass
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Receive, Scope, Send

from ledger.web.routes import local, root_of

COOKIE = "jobledger_token"


class AccessError(ValueError):
    """The dashboard would listen where it must not, or the credentials are malformed; the message says how to fix it."""


@dataclass(frozen=True)
class Access:
    """The credentials a request must carry (neither: none)."""

    token: str | None = None
    basic: tuple[str, str] | None = None

    @property
    def required(self) -> bool:
        return self.token is not None or self.basic is not None

    @classmethod
    def parse(cls, token: str | None, basic_auth: str | None) -> Access:
        """From the command line: ``--token T``, ``--basic-auth user:password``."""
        if token is not None and not token.strip():
            raise AccessError("--token must not be empty")
        basic = None
        if basic_auth is not None:
            user, colon, password = basic_auth.partition(":")
            if not colon or not user or not password:
                raise AccessError("--basic-auth takes user:password, both non-empty")
            basic = (user, password)
        return cls(token, basic)


def is_loopback(host: str) -> bool:
    """``127.0.0.1``, any 127/8 address, ``::1``, ``localhost``; not ``0.0.0.0`` or a name."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, access: Access) -> None:
    """AccessError unless ``host`` is loopback or credentials are required."""
    if not is_loopback(host) and not access.required:
        raise AccessError(
            f"refusing to listen on {host} without credentials: anyone who reaches it could read the "
            f"ledger; give --token TOKEN or --basic-auth USER:PASSWORD (or leave --host at 127.0.0.1)")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class AccessMiddleware:
    """Answers 401 to a request without the credentials of ``access`` (nothing to check: passes all)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.access.required:
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = dict(query).get("token")
        if self.access.token is not None and given is not None and _same(given, self.access.token):
            await self._set_cookie_and_redirect(scope, [(key, value) for key, value in query if key != "token"],
                                                send)
            return
        if self._allowed(headers):
            await self.app(scope, receive, send)
            return
        await self._refuse(send)

    def _allowed(self, headers: dict[str, str]) -> bool:
        authorization = headers.get("authorization", "")
        scheme, _, credentials = authorization.partition(" ")
        if self.access.token is not None:
            if scheme.lower() == "bearer" and _same(credentials.strip(), self.access.token):
                return True
            cookie: SimpleCookie = SimpleCookie()
            try:
                cookie.load(headers.get("cookie", ""))
            except Exception:  # a malformed cookie header is no credential
                cookie = SimpleCookie()
            if COOKIE in cookie and _same(cookie[COOKIE].value, self.access.token):
                return True
        if self.access.basic is not None and scheme.lower() == "basic":
            try:
                user, _, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False
            expected_user, expected_password = self.access.basic
            # both compared, whatever the first says: the time does not tell which was wrong
            return _same(user, expected_user) & _same(password, expected_password)
        return False

    async def _set_cookie_and_redirect(self, scope: Scope, query: list[tuple[str, str]], send: Send) -> None:
        assert self.access.token is not None
        location = local(scope, urlencode(query))
        cookie: SimpleCookie = SimpleCookie()
        cookie[COOKIE] = self.access.token
        cookie[COOKIE]["httponly"] = True
        cookie[COOKIE]["samesite"] = "Strict"
        cookie[COOKIE]["path"] = root_of(scope) or "/"
        await send({"type": "http.response.start", "status": 303, "headers": [
            (b"location", location.encode("latin-1")),
            (b"set-cookie", cookie[COOKIE].OutputString().encode("latin-1")),
            (b"cache-control", b"no-store"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, send: Send) -> None:
        challenges = []
        if self.access.basic is not None:
            challenges.append((b"www-authenticate", b'Basic realm="jobledger", charset="UTF-8"'))
        if self.access.token is not None:
            challenges.append((b"www-authenticate", b'Bearer realm="jobledger"'))
        body = (b"401: this dashboard needs credentials: a token (Authorization: Bearer, or ?token= once "
                b"in a browser) or basic auth, as its operator set them\n")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"), *challenges]})
        await send({"type": "http.response.body", "body": body})
