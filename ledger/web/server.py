"""Serving the dashboard with uvicorn: in the foreground (``jobledger web``) or in a thread (tests, benchmarks).

uvicorn handles SIGINT and SIGTERM itself in the foreground: a graceful
stop, open requests answered first.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from types import FrameType, TracebackType

import uvicorn
from starlette.applications import Starlette


def serve(app: Starlette, sock: socket.socket) -> None:
    """Serve on ``sock`` (see :func:`bind`) until SIGINT or SIGTERM, then return.

    uvicorn stops gracefully on either signal, then raises it again under the
    handlers it found, to end the process by it; the handlers here take it
    instead, so that ``jobledger web`` ends as ``jobledger metrics --serve``
    does: its last message said, exit status 0.
    """
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))

    def stopped(signum: int, frame: FrameType | None) -> None:
        pass  # uvicorn's own handler has stopped the server already

    previous = {signum: signal.signal(signum, stopped) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free port), bound before uvicorn starts, so a
    busy port fails at once, in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class BackgroundServer:
    """The dashboard on a free loopback port, in a thread: ``with BackgroundServer(app) as s: s.url``.

    ``root_path``: the prefix a reverse proxy serves it under (uvicorn's ``--root-path``).
    """

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, *, root_path: str = "") -> None:
        self.socket = bind(host, port)
        self.url = url_of(self.socket)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                                     root_path=root_path))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="jobledger-web", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 15
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        self.socket.close()
