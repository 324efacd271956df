"""A TCP proxy for tests: between a client and PostgreSQL, it can freeze traffic or delay answers.

``freeze()`` stops forwarding bytes in both directions on every connection,
existing and new, while keeping every socket open: what a silent partition
looks like to the client (no RST, no FIN; the proxy's own kernel still
acknowledges what the client sends and answers its TCP keepalive probes, so
neither ``keepalives`` nor ``tcp_user_timeout`` notice). ``resume()``
forwards again, held bytes first. ``delay(seconds)`` holds every chunk the
server sends for that long before passing it on (requests go through at
once), so a call's answer arrives late while the server did the work on
time.

Threads, not asyncio, so a test can drive it from anywhere::

    with TcpProxy("127.0.0.1", 5432) as proxy:
        dsn = proxy.conninfo(dsn)   # host/port replaced by the proxy's
        ...
        proxy.freeze(); ...; proxy.resume()
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

from psycopg.conninfo import conninfo_to_dict, make_conninfo

_CHUNK = 65536


class TcpProxy:
    """Listens on 127.0.0.1 (a free port) and forwards each connection to ``upstream_host:upstream_port``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._cond = threading.Condition()
        self._frozen = False
        self._delay = 0.0
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.connections = 0
        """How many client connections the proxy accepted so far."""
        self._accepter = threading.Thread(target=self._accept, name="tcp-proxy-accept", daemon=True)
        self._accepter.start()

    # -- control ------------------------------------------------------------------------

    def conninfo(self, conninfo: str) -> str:
        """``conninfo`` with its host and port replaced by the proxy's."""
        params = conninfo_to_dict(conninfo)
        params.pop("hostaddr", None)
        params.update(host=self.host, port=str(self.port))
        return make_conninfo(**params)  # type: ignore[arg-type]

    def freeze(self) -> None:
        """Stop forwarding, both ways, on every connection; sockets stay open."""
        with self._cond:
            self._frozen = True

    def resume(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    def delay(self, seconds: float) -> None:
        """Hold each chunk from the server this long before forwarding it (0: no delay)."""
        with self._cond:
            self._delay = seconds

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._frozen = False
            self._cond.notify_all()
            sockets = list(self._sockets)
        try:
            self._listener.close()
        except OSError:
            pass
        for sock in sockets:
            _close(sock)
        for thread in [self._accepter, *self._threads]:
            thread.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- forwarding ---------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._cond:
                if self._closed:
                    _close(client)
                    _close(server)
                    return
                self.connections += 1
                self._sockets.update((client, server))
                pumps = [threading.Thread(target=self._pump, args=(client, server, False), daemon=True,
                                          name="tcp-proxy-up"),
                         threading.Thread(target=self._pump, args=(server, client, True), daemon=True,
                                          name="tcp-proxy-down")]
                self._threads.extend(pumps)
            for pump in pumps:
                pump.start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        try:
            while True:
                chunk = source.recv(_CHUNK)
                if not chunk:
                    break
                with self._cond:
                    delay = self._delay if from_server else 0.0
                if delay:
                    time.sleep(delay)
                with self._cond:
                    while self._frozen and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        break
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
