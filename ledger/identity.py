"""Who holds a lease: the default owner identity, ``hostname:pid:random``."""

from __future__ import annotations

import os
import secrets
import socket

_owner: tuple[int, str] | None = None


def default_owner() -> str:
    """``hostname:pid:random``, unique per process, made anew in a forked child.

    The same owner re-acquiring a job supersedes its own earlier lease (see the
    contract), so two processes must never share one: the random part covers
    pid reuse and containers that all run as pid 1 on the same hostname.
    """
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:
        host = socket.gethostname()[:150] or "localhost"
        _owner = (pid, f"{host}:{pid}:{secrets.token_hex(4)}")
    return _owner[1]
