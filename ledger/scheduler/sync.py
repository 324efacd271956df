"""The jobs file into the ledger: ``ledger.sync_jobs(definitions, source, removed)``, one atomic call.

New jobs are registered, changed options applied, jobs the file no longer has
paused (or unregistered, ``removed = "unregister"``); an invalid definition
changes nothing (the SQL refuses it whole, 22023 naming the job and the key).
Two sources disagreeing about one job: the last writer wins, loudly (action
``overridden``, said here as a warning, and an event in ``ledger.events``).

:class:`FileWatch` tells when the file changed (its mtime and size, then the
hash of its bytes), so a scheduler resyncs on change without reading the file
every second.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ledger import queries
from ledger.scheduler.jobsfile import JobDefinition, JobsFile, load

__all__ = ["FileWatch", "register_pools", "sync_file", "sync_jobs"]

log = logging.getLogger("ledger.scheduler")


def sync_jobs(conn: psycopg.Connection[Any], jobs: Mapping[str, JobDefinition], *, source: str,
              removed: str = "pause", say: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """Sync ``jobs`` as ``source``'s whole set; the (job, action) rows, each action said but ``unchanged``."""
    rows = _sync(conn, jobs, source, removed)
    _say_actions(rows, source, say)
    return rows


def _sync(conn: psycopg.Connection[Any], jobs: Mapping[str, JobDefinition], source: str,
          removed: str) -> list[tuple[str, str]]:
    definitions = {name: job.sql_arguments() for name, job in jobs.items()}
    with conn.cursor(row_factory=dict_row) as cursor:
        cursor.execute(queries.SYNC_JOBS, {"definitions": json.dumps(definitions), "source": source,
                                           "removed": removed})
        return [(row["job"], row["action"]) for row in cursor.fetchall()]


def _say_actions(rows: list[tuple[str, str]], source: str, say: Callable[[str], None] | None) -> None:
    for job, action in rows:
        if action == "overridden":
            log.warning("job %s: its definition from %s overrides another source's (last writer wins)", job, source)
        elif action != "unchanged" and say is not None:
            say(f"job {job}: {action}")


def register_pools(conn: psycopg.Connection[Any], pools: Mapping[str, int], *,
                   say: Callable[[str], None] | None = None) -> None:
    """Register each of the file's ``[pools]`` (``ledger.register_pool``: created, or resized); a pool the
    file no longer names stays (``jobledger pool drop`` drops one)."""
    for name, size in sorted(pools.items()):
        with conn.cursor(row_factory=dict_row) as cursor:
            before = cursor.execute(queries.POOL_STATUS, {"pool": name}).fetchone()
            cursor.execute(queries.REGISTER_POOL, {"pool": name, "size": size})
        if say is not None and (before is None or before["size"] != size):
            say(f"pool {name}: {'registered' if before is None else 'resized'}, size {size}")


def sync_file(conn: psycopg.Connection[Any], loaded: JobsFile, *,
              say: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """The file into the ledger in one transaction: its ``[pools]`` registered first (so that a job's
    ``pool`` may name one), then its jobs synced; a refused file changes nothing, its pools neither.
    What changed is said once committed: a line in the log is in the ledger."""
    said: list[str] = []
    with conn.transaction():
        register_pools(conn, loaded.pools, say=said.append)
        rows = _sync(conn, loaded.jobs, loaded.source, loaded.removed)
    if say is not None:
        for line in said:
            say(line)
    _say_actions(rows, loaded.source, say)
    return rows


class FileWatch:
    """The jobs file at ``path``: loaded, and whether it changed since the last accepted load."""

    def __init__(self, path: str, *, require_command: bool = True) -> None:
        self.path = path
        self._require_command = require_command
        self._stat: tuple[float, int] | None = None
        self._digest: str | None = None

    def _look(self) -> tuple[float, int] | None:
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return (info.st_mtime, info.st_size)

    def changed(self) -> bool:
        """True when the file's mtime or size moved since the last :meth:`load`."""
        return self._look() != self._stat

    def load(self) -> JobsFile:
        """The file, checked (JobsFileError otherwise); remembers its stat, so a bad file is said once."""
        self._stat = self._look()
        return load(self.path, require_command=self._require_command)

    def accepted(self, loaded: JobsFile) -> None:
        self._digest = loaded.digest

    @property
    def digest(self) -> str | None:
        return self._digest
