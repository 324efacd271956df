"""The gaps of the event tail (ledger/tail.py), which `jobledger watch`, `events --follow` and `notify`
share: an id a reader skipped because its transaction had not committed yet is waited for until the
snapshot says no transaction that could still commit it is running (its xmin has passed the gap's
horizon), however long that is, and no longer. The age a gap was once given up at (600 s) is lowered
here to a fraction of a second, so these tests prove past it what would otherwise take ten minutes.

Real connections: the late event is a run started inside a client transaction held open. Waits poll a
condition with a generous deadline; nothing asserts on a duration."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import psycopg
import pytest
from waiting import wait_for
from sqlhelp import value

from ledger import tail
from ledger.tail import EventCursor, Follower, Gap

TIMEOUT = 60.0  # seconds: a condition not reached by then is a hang
AGE = 0.3  # seconds: the "long gap" age, lowered from 600


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def saying(self, text: str) -> list[str]:
        return [message for message in self.messages if text in message]


@pytest.fixture
def said() -> Iterator[Records]:
    """What ledger.tail logs (the CLI's handler may keep it from the root logger, so caplog could miss it)."""
    records = Records()
    logger = logging.getLogger("ledger")
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)


@pytest.fixture(autouse=True)
def _short_ages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tail, "LONG_GAP_AGE", AGE, raising=False)
    # Before this fix the tailer gave a gap up at MAX_GAP_AGE whatever the snapshot said: lowered too, so
    # that these tests fail on such a tailer in a second instead of ten minutes (the name is gone since).
    monkeypatch.setattr(tail, "MAX_GAP_AGE", AGE, raising=False)


def run_once(db: psycopg.Connection, job: str) -> None:
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'w', "
                               "ttl => '1 minute')", (job,)).fetchone()
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))


def start_in_open_transaction(conn: psycopg.Connection, job: str) -> int:
    """A run started inside the client's transaction, left open (not autocommit): its event's id."""
    run_id = value(conn, "SELECT run_id FROM ledger.start_run(job => %s, owner => 'w', ttl => '1 hour')", (job,))
    return int(value(conn, "SELECT event_id FROM ledger.events WHERE run_id = %s", (run_id,)))


def ranges(cursor: EventCursor) -> list[tuple[int, int]]:
    return [(gap.first, gap.last) for gap in cursor.gap_ranges()]


def snapshot_xmin(db: psycopg.Connection) -> int:
    return int(value(db, "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint"))


def wait_past_the_age(read: object, cursor: EventCursor, gap: tuple[int, int], said: Records) -> None:
    """Read on until the tailer has said the gap is older than the age, checking on each read that it
    still waits for it (its transaction is running) and that nothing came."""

    def past() -> bool:
        assert read() == []  # type: ignore[operator]
        assert gap in ranges(cursor), (f"the gap {gap} of a transaction still running was given up "
                                       f"(gaps now {ranges(cursor)})")
        return bool(said.saying("still waiting for events"))

    wait_for(past, timeout=TIMEOUT, what=f"the tailer to say it has waited for {gap} past {AGE}s")
    first_seen = next(g.seen for g in cursor.gap_ranges() if (g.first, g.last) == gap)
    assert time.time() - first_seen > AGE


def test_an_event_committed_long_after_the_give_up_age_is_still_delivered(db, connect, said):
    follower = Follower(connect, EventCursor(), interval=0.05, sync_alerts=False, say=said.messages.append)
    follower.cursor.start_at_newest(follower.open())
    slow = connect(autocommit=False)  # a long client transaction: BEGIN; ledger.start_run(...); ...
    late = start_in_open_transaction(slow, "slow")
    run_once(db, "fast")  # later ids, committed first
    assert [(e.kind, e.job) for e in follower.poll()] == [("run_started", "fast"), ("run_ended", "fast")]
    assert ranges(follower.cursor) == [(late, late)]

    wait_past_the_age(follower.poll, follower.cursor, (late, late), said)
    assert snapshot_xmin(db) <= value(slow, "SELECT pg_current_xact_id()::text::bigint")  # it holds xmin back
    for _ in range(3):  # told once, not on every read
        assert follower.poll() == []
    assert len(said.saying("still waiting for events")) == 1
    assert f"events {late} " in said.saying("still waiting for events")[0]

    slow.commit()
    delivered = wait_for(follower.poll, timeout=TIMEOUT, what="the late event")
    assert [(e.event_id, e.kind, e.job) for e in delivered] == [(late, "run_started", "slow")]
    assert follower.cursor.gaps == 0 and follower.poll() == []
    follower.close()


def test_a_rolled_back_gap_is_kept_past_the_age_while_its_transaction_runs_and_given_up_once_it_ended(
        db, connect, said):
    cursor = EventCursor()
    cursor.start_at_newest(db)
    undone = connect(autocommit=False)
    lost = start_in_open_transaction(undone, "undone")
    run_once(db, "done")
    assert [(e.kind, e.job) for e in cursor.read(db)] == [("run_started", "done"), ("run_ended", "done")]

    wait_past_the_age(lambda: cursor.read(db), cursor, (lost, lost), said)
    settled = wait_for(lambda: cursor.read(db) == [] and [gap for gap in cursor.gap_ranges() if gap.horizon],
                       timeout=TIMEOUT, what="the gap to settle (its snapshot bound taken)")
    (gap,) = settled  # type: ignore[misc]
    assert (gap.first, gap.last) == (lost, lost) and snapshot_xmin(db) < gap.horizon  # the snapshot holds it

    undone.rollback()
    wait_for(lambda: cursor.read(db) == [] and cursor.gaps == 0, timeout=TIMEOUT, what="the gap given up")
    assert snapshot_xmin(db) >= gap.horizon  # given up by the snapshot, which has passed it
    run_once(db, "after")
    assert [(e.kind, e.job) for e in cursor.read(db)] == [("run_started", "after"), ("run_ended", "after")]


def test_a_kept_gap_whose_horizon_no_snapshot_of_this_cluster_had_is_not_held_forever(db, connect):
    # A state file's gap with a bound from another cluster (restored from a backup, say): far above xmax.
    undone = connect(autocommit=False)
    lost = start_in_open_transaction(undone, "undone")
    undone.rollback()
    run_once(db, "done")
    newest = int(value(db, "SELECT max(event_id) FROM ledger.events"))
    cursor = EventCursor(newest, gaps=[Gap(lost, lost, time.time(), horizon=2 ** 62)])
    assert ranges(cursor) == [(lost, lost)]
    wait_for(lambda: cursor.read(db) == [] and cursor.gaps == 0, timeout=TIMEOUT, what="the gap given up")


def test_past_the_cap_the_oldest_gaps_are_given_up_with_a_warning_naming_them(db, connect, said, monkeypatch):
    monkeypatch.setattr(tail, "MAX_GAPS", 2)
    holder = connect(autocommit=False)
    value(holder, "SELECT pg_current_xact_id()")  # a transaction id, held: no gap settles meanwhile
    cursor = EventCursor()
    cursor.start_at_newest(db)
    lost = []
    for number in range(3):
        undone = connect(autocommit=False)
        lost.append(start_in_open_transaction(undone, f"undone{number}"))
        undone.rollback()
        run_once(db, f"done{number}")
    assert len(cursor.read(db)) == 6
    assert ranges(cursor) == [(lost[1], lost[1]), (lost[2], lost[2])]
    (warning,) = said.saying("gave up waiting for events")
    assert warning.startswith(f"gave up waiting for events {lost[0]}: more than 2 ranges")
    holder.rollback()
