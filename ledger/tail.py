"""Following ``ledger.events`` as it grows: :class:`EventCursor` (where a reader is) and :class:`Follower`
(the loop `jobledger watch` and `jobledger notify` share).

An event's id is taken when its change is written, and two transactions may
commit in the other order: event 11 can be read while event 10 is still
uncommitted, and ``WHERE event_id > 11`` would then never return 10. So the
cursor keeps, besides the highest id it read, the ids below it it has not
seen (its gaps) and reads them again on every read, until the database's
snapshot says no transaction that could have taken one is still running
(then the gap was a rollback, or a purge), however long that takes: the
snapshot, not an age, gives a gap up. An event that commits late is returned
late, out of id order; none is skipped. Each read is one statement
(``queries.EVENT_TAIL_PAGE``). What a gap costs is bounded: at most
:data:`MAX_GAPS` ranges are waited for.

The follower keeps one connection (autocommit, named ``jobledger``): it
records the alert events each ``interval`` (``ledger.sync_alerts``, unless
told not to or the role may not), reads what is new, and waits for the next
poll; while events are notified (``configure_events(notify => true)``) it
LISTENs on ``ledger_events`` and a notification ends the wait early. A
connection that breaks (a restart, a failover, a terminated backend) is
opened again with a short backoff, and the cursor goes on where it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from ledger import queries
from ledger.client import Ledger
from ledger.models import Event
from ledger.text import first_line

__all__ = ["EventCursor", "Follower", "Gap"]

log = logging.getLogger("ledger")

PAGE = 1000
"""Events a read returns at most; a full page is read on at once."""

SETTLE = 1.0
"""Seconds after a gap is first seen before the snapshot that bounds it is taken.

A transaction takes an event's id just before it writes the row, and has a
transaction id by then in every path but one instant (the first row a
statement writes); a second is far beyond it."""

LONG_GAP_AGE = 600.0
"""Seconds a gap is waited for before a warning says so (once, until no gap is that old). It is still
waited for: a gap is given up only when the snapshot says no transaction that could fill it is running,
and one that stays open (anywhere in the cluster: it holds the snapshot's xmin back) keeps it, however long."""

MAX_GAPS = 1000
"""Gaps kept at most: ranges, so a purge's hole is one. Past it the oldest are given up (a warning names
their ids): an event of theirs that commits later is not returned. A committed event fills its gap, so
it takes a thousand rolled-back events (or purged ranges) while one transaction is held open to get there."""


@dataclass(frozen=True)
class Gap:
    """A range of ids a cursor still waits for, as it can be kept from one process to the next
    (:meth:`EventCursor.gap_ranges`, ``EventCursor(gaps=...)``): a notifier's state file."""

    first: int
    last: int
    seen: float
    """When the cursor first saw it (``time.time()``): it settles by this, across restarts."""
    horizon: int | None = None
    """The xmax of the snapshot taken once it settled (a transaction id, which outlives the process), or None.
    The gap is given up once the snapshot's xmin has reached it: no transaction that could fill it runs."""


@dataclass
class _Gap:
    first: int
    last: int
    seen_at: float  # monotonic
    seen: float  # wall clock, the same instant: what a Gap keeps
    horizon: int | None = None  # the xmax of a snapshot taken once it settled: its fillers' ids are below


class EventCursor:
    """Where a reader of ``ledger.events`` is: the events of ``job`` and ``kinds`` (None: any) after ``after``.

    :meth:`read` returns what is new since the last read, in id order except
    for an event that committed after a later one (it comes when it commits);
    :meth:`start_at_newest` puts the cursor at the newest event first. Not
    thread-safe; the connection is the caller's (autocommit, or each read
    joins the caller's transaction, which then sees no new commits).
    """

    def __init__(self, after: int = 0, *, job: str | None = None, kinds: Sequence[str] | None = None,
                 page: int = PAGE, gaps: Sequence[Gap] = ()) -> None:
        self.position = after
        """The highest event_id read (of any job or kind): the next read starts after it."""
        self.origin = after
        """The event_id it started after (:meth:`start_at_newest`: the newest then)."""
        self.more = False
        """Whether the last read returned a full page: there is more to read right away."""
        self._job = job
        self._kinds = list(kinds) if kinds else None
        self._page = page
        # ``gaps``: ranges of ids at or below ``after`` an earlier cursor still waited for (its gap_ranges,
        # kept in a notifier's state file): waited for again, as long as they would have been.
        mono, wall = time.monotonic(), time.time()
        self._gaps: list[_Gap] = [_Gap(gap.first, gap.last, mono - max(wall - gap.seen, 0.0), gap.seen, gap.horizon)
                                  for gap in gaps if 0 < gap.first <= gap.last <= after][-MAX_GAPS:]
        self._held: list[Event] = []  # read by start_at_newest, returned by the next read
        self._told_long = False  # whether a warning said a gap is older than LONG_GAP_AGE (and one still is)

    @property
    def gaps(self) -> int:
        """How many ranges of ids below :attr:`position` are still waited for."""
        return len(self._gaps)

    def gap_ranges(self, through: int | None = None) -> list[Gap]:
        """The ids at or below ``through`` (default :attr:`position`) still waited for, oldest first: what a
        cursor made with ``EventCursor(through, gaps=...)`` waits for again."""
        upto = self.position if through is None else through
        return [Gap(gap.first, min(gap.last, upto), gap.seen, gap.horizon) for gap in self._gaps if gap.first <= upto]

    def start_at_newest(self, conn: psycopg.Connection[Any], show: int = 0) -> list[Event]:
        """Put the cursor at the newest event; the newest ``show`` that match, oldest first.

        The last :data:`PAGE` ids before the newest are read as the cursor
        reads, so an event among them that commits later still comes; what
        commits meanwhile above the newest comes with the next :meth:`read`.
        """
        newest = int(_one(conn, queries.NEWEST_EVENT_ID))
        window = max(newest - self._page, 0)
        self.position, self.origin = window, newest
        listed: list[Event] = []
        while True:
            listed.extend(self.read(conn))
            if not self.more:
                break
        self._held = [event for event in listed if event.event_id > newest]
        listed = [event for event in listed if event.event_id <= newest]
        if len(listed) < show and window > 0:
            with conn.cursor(row_factory=class_row(Event)) as cur:
                cur.execute(queries.EVENTS_NEWEST, {"through": window, "job": self._job, "kinds": self._kinds,
                                                    "limit": show - len(listed)})
                listed = cur.fetchall() + listed
        return listed[-show:] if show > 0 else []

    def read(self, conn: psycopg.Connection[Any]) -> list[Event]:
        """The matching events that are new since the last read: after :attr:`position`, or in a gap."""
        held, self._held = self._held, []
        params = {"after": self.position, "limit": self._page, "job": self._job, "kinds": self._kinds,
                  "gap_first": [gap.first for gap in self._gaps], "gap_last": [gap.last for gap in self._gaps]}
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute(queries.EVENT_TAIL_PAGE, params)
            rows = cur.fetchall()
        xmin, xmax = int(rows[0]["xmin"]), int(rows[0]["xmax"])
        now, wall = time.monotonic(), time.time()
        seen = [int(row["seen"]) for row in rows if row["seen"] is not None]
        for event_id in (event_id for event_id in seen if event_id <= self.position):
            self._fill(event_id)
        fresh = [event_id for event_id in seen if event_id > self.position]
        for event_id in fresh:
            if event_id > self.position + 1:
                self._gaps.append(_Gap(self.position + 1, event_id - 1, now, wall))
            self.position = event_id
        self.more = len(fresh) >= self._page
        self._settle(xmin, xmax, now)
        events = [Event(**{name: row[name] for name in ("event_id", "at", "kind", "job", "run_id", "detail")})
                  for row in rows if row["event_id"] is not None]
        return held + events

    def _fill(self, event_id: int) -> None:
        """A late event turned up: its id is no longer a gap."""
        for index, gap in enumerate(self._gaps):
            if gap.first <= event_id <= gap.last:
                parts = [_Gap(first, last, gap.seen_at, gap.seen, gap.horizon)
                         for first, last in ((gap.first, event_id - 1), (event_id + 1, gap.last)) if first <= last]
                self._gaps[index:index + 1] = parts
                return

    def _settle(self, xmin: int, xmax: int, now: float) -> None:
        """Drop the gaps no transaction can fill any more, and bound the rest.

        A settled gap's ids were taken by transactions that had started by
        the snapshot that set its horizon (their ids are below it). Once this
        read's snapshot has every transaction id below the horizon ended, a
        commit among them would have been visible to this read, which found
        none: the gap stays empty. Until then it is kept, whatever its age.
        """
        kept: list[_Gap] = []
        for gap in self._gaps:
            if gap.horizon is not None and gap.horizon > xmax:
                # No past snapshot of this cluster's (a state file kept across a restore into another, say):
                # its fillers, if any, are running now, so now's bound holds them.
                gap.horizon = xmax
            if gap.horizon is not None and xmin >= gap.horizon:
                continue
            if gap.horizon is None and now - gap.seen_at >= SETTLE:
                gap.horizon = xmax
            kept.append(gap)
        if len(kept) > MAX_GAPS:
            dropped = kept[:-MAX_GAPS]
            log.warning("gave up waiting for events %s: more than %s ranges of ids are waited for, and an event "
                        "of theirs that commits later is not returned", _ids(dropped), MAX_GAPS)
            kept = kept[-MAX_GAPS:]
        self._gaps = kept
        long = [gap for gap in kept if now - gap.seen_at > LONG_GAP_AGE]
        if long and not self._told_long:
            log.warning("still waiting for events %s after %s s: a transaction running since before them (the "
                        "oldest running is %s, anywhere in the cluster: pg_stat_activity.backend_xid) may yet "
                        "commit them", _ids(long), f"{LONG_GAP_AGE:g}", xmin)
        self._told_long = bool(long)


def _ids(gaps: Sequence[_Gap]) -> str:
    """The ids of ``gaps`` as a warning names them: the first three ranges, and how many more."""
    shown = ", ".join(str(gap.first) if gap.first == gap.last else f"{gap.first}-{gap.last}" for gap in gaps[:3])
    return shown + (f" and {len(gaps) - 3} more ranges" if len(gaps) > 3 else "")


def _one(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


# -- the loop ---------------------------------------------------------------------------------

RECONNECT_BACKOFF = (0.5, 10.0)
"""Seconds before the first reconnect attempt, doubled after each failed one, at most the second."""

MIN_SPACING = 0.05
"""Seconds between two reads at least, however often notifications wake the follower (a burst is one read)."""

NOT_SYNCED = {"42501": "the role may not execute ledger.sync_alerts", "25006": "the database is read-only"}
"""SQLSTATEs of a ``sync_alerts`` that can never succeed on this connection: the follower stops calling it."""


class Follower:
    """Follows ``cursor`` over a connection from ``connect``: see the module's docstring.

    ``interval`` seconds between polls (a notification ends the wait early);
    ``sync_alerts``: record the alert events each poll, at most once an
    interval. ``say`` tells people what happened to the connection and the
    alert sync (a line on stderr). :meth:`open` the first connection (its
    failure is raised), then iterate :meth:`batches`; :meth:`close` at the end.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], cursor: EventCursor, *, interval: float,
                 sync_alerts: bool, say: Callable[[str], None]) -> None:
        self.cursor = cursor
        self._connect = connect
        self._interval = interval
        self._sync = sync_alerts
        self._say = say
        self._conn: psycopg.Connection[Any] | None = None
        self._listening = False
        self._synced_at: float | None = None
        self._read_at = 0.0

    def open(self) -> psycopg.Connection[Any]:
        """The connection, opened now if there is none (its failure is raised: LedgerUnavailable)."""
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._drop()
            self._conn = self._connect()
        return self._conn

    def close(self) -> None:
        """Close the connection as it is: Ctrl-C may have left it in the middle of a call."""
        self._drop()

    def poll(self) -> list[Event]:
        """One poll: the alert sync when it is due, then every new event (read until caught up)."""
        conn = self.open()
        self._sync_alerts(conn)
        self._follow_notify(conn)
        events: list[Event] = []
        while True:
            self._read_at = time.monotonic()
            events.extend(self.cursor.read(conn))
            if not self.cursor.more:
                return events

    def batches(self) -> Iterator[list[Event]]:
        """Each poll's new events (an empty batch is not yielded), until the caller stops; reconnects."""
        backoff = RECONNECT_BACKOFF[0]
        lost = False
        while True:
            position = self.cursor.position
            try:
                events = self.poll()
                if lost:
                    self._say(f"reconnected; going on after event {position}")
                    lost, backoff = False, RECONNECT_BACKOFF[0]
                if events:
                    yield events
                self._wait()
            except psycopg.OperationalError as error:  # LedgerUnavailable too: a reconnect that failed
                if not lost:
                    self._say(f"lost the connection to the database ({first_line(error)}); reconnecting")
                    lost = True
                self._drop()
                time.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_BACKOFF[1])

    def _sync_alerts(self, conn: psycopg.Connection[Any]) -> None:
        now = time.monotonic()
        if not self._sync or (self._synced_at is not None and now - self._synced_at < self._interval):
            return
        try:
            Ledger(conn).sync_alerts()
        except psycopg.Error as error:
            why = NOT_SYNCED.get(error.sqlstate or "")
            if why is None:
                raise
            self._say(f"alert events are not synced here: {why} ({first_line(error)}); the alert events "
                      "come only from another caller of ledger.sync_alerts (pg_cron, jobledger notify)")
            self._sync = False
            return
        self._synced_at = now

    def _follow_notify(self, conn: psycopg.Connection[Any]) -> None:
        """LISTEN while events are notified, UNLISTEN when they no longer are."""
        notified = bool(_one(conn, queries.EVENTS_NOTIFIED))
        if notified != self._listening:
            conn.execute(queries.LISTEN_EVENTS if notified else queries.UNLISTEN_EVENTS)
            self._listening = notified

    def _wait(self) -> None:
        """Until the next poll is due, or a notification comes (then at least MIN_SPACING after the last read)."""
        remaining = self._read_at + self._interval - time.monotonic()
        conn = self._conn
        if conn is not None and self._listening and remaining > 0:
            # A notification that came during a query waits for this call (psycopg keeps a backlog);
            # one missed (an older psycopg) costs a wait: the poll at the interval reads its event.
            for _ in conn.notifies(timeout=remaining, stop_after=1):
                pass
            remaining = self._read_at + MIN_SPACING - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._listening = False
        if conn is not None:
            try:
                conn.close()
            except Exception:  # closing a broken connection may fail; it is gone either way
                log.debug("closing the follower's connection failed", exc_info=True)
