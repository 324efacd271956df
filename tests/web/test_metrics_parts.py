"""A scrape in parts (ledger.metrics.read_text with ``connect_part``): each range of jobs read at
once on a connection of its own, in the first one's exported snapshot, writes the text a scrape in
one part writes; it reads one snapshot (a change committed while the parts open is in no part); a
ledger under ``parts_from_jobs`` is read on one connection; a part that fails fails the scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from ledger.metrics import LedgerCollector, read_text
from situations import build_situations

#: A live run's running time moves between two reads: its lines are left out of a comparison.
MOVING = "jobledger_run_running_seconds"


def _steady(body: bytes) -> list[str]:
    return [line for line in body.decode().splitlines() if not line.startswith(MOVING)]


def _of_jobs(body: bytes) -> list[str]:
    """The lines a snapshot decides: the jobs' and the alert counts (not the statistics' dead rows)."""
    return [line for line in _steady(body) if '{job="' in line or line.startswith("jobledger_alerts{")]


def _parts_of(dsn: str, opened: list[int], before: Callable[[], None] = lambda: None
              ) -> Callable[[], Any]:
    """A ``connect_part`` that counts the connections it opens, and runs ``before`` first."""
    @contextmanager
    def connect_part() -> Iterator[psycopg.Connection[Any]]:
        before()
        opened.append(1)
        with psycopg.connect(dsn, autocommit=True) as conn:
            yield conn
    return connect_part


def _register(db: psycopg.Connection, names: list[str]) -> None:
    for name in names:
        db.execute("SELECT ledger.register_job(%s, ttl => '1 minute')", (name,))
        run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(%s, 'parts')", (name,)).fetchone()
        db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))


def test_a_scrape_in_three_parts_writes_what_one_part_writes(db, dsn, ledger_clock):
    states = build_situations(db, ledger_clock)
    _register(db, [f"part-{n:02d}" for n in range(12)])
    opened: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        one = read_text(conn)
        three = read_text(conn, connect_part=_parts_of(dsn, opened), parts=3, parts_from_jobs=1)
    assert len(opened) == 2, "the first part is this connection's, the two others a connection each"
    # line for line, in the same order: the jobs' order, every family's lines once
    assert _steady(three) == _steady(one)
    assert sum(line.startswith("jobledger_job_state{") for line in _steady(three)) == len(states) + 12
    assert [line for line in one.decode().splitlines() if line.startswith(MOVING)], "a live run is among them"


def test_the_parts_read_one_snapshot(db, dsn, ledger_clock):
    build_situations(db, ledger_clock)
    _register(db, [f"part-{n:02d}" for n in range(6)])

    def commit_a_change() -> None:
        # while the first part's transaction is open: a new job, last in name order (the last
        # part's range), and a failure of a job in it
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("SELECT ledger.register_job('zz-late-comer', ttl => '1 minute')")
            run_id, token = other.execute(
                "SELECT run_id, token FROM ledger.start_run('part-05', 'parts')").fetchone()
            other.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => 'boom')", (run_id, token))

    with psycopg.connect(dsn, autocommit=True) as conn:
        before = read_text(conn)
        opened: list[int] = []
        parted = read_text(conn, connect_part=_parts_of(dsn, opened, commit_a_change), parts=2, parts_from_jobs=1)
        after = read_text(conn)
    assert len(opened) == 1
    assert _of_jobs(parted) == _of_jobs(before)
    assert "zz-late-comer" not in parted.decode()
    # the change was committed: a read after it sees both
    assert 'jobledger_job_state{job="zz-late-comer",state="never_run"} 1.0' in after.decode()
    assert 'jobledger_runs_total{job="part-05",status="failure"} 1.0' in after.decode()


def test_a_ledger_under_parts_from_jobs_is_read_on_one_connection(db, dsn):
    _register(db, ["a", "b", "c"])
    opened: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        body = read_text(conn, connect_part=_parts_of(dsn, opened), parts=2, parts_from_jobs=4)
    assert opened == []
    assert 'jobledger_job_state{job="c",state="ok"} 1.0' in body.decode()


def test_a_part_that_fails_fails_the_scrape(db, dsn):
    _register(db, ["a", "b", "c", "d"])

    @contextmanager
    def unreachable() -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect("host=127.0.0.1 port=1 connect_timeout=2") as conn:
            yield conn

    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.OperationalError):
            read_text(conn, connect_part=unreachable, parts=2, parts_from_jobs=1)
        # the connection is as it was: idle, and reads again
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert b"jobledger_job_state" in read_text(conn)


def test_parts_must_be_at_least_one(dsn):
    with pytest.raises(ValueError, match="parts must be at least 1"):
        LedgerCollector(lambda: psycopg.connect(dsn), parts=0)
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(ValueError, match="parts must be at least 1"):
        read_text(conn, parts=0)
