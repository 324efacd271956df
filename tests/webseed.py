"""A ledger with something of everything the dashboard shows, built through the SQL API.

Shared by the dashboard's tests (tests/web/test_web.py, tests/web/test_web_browser.py):

- ``etl`` (every 5 minutes, UTC): a day of history (inserted directly,
  backdated), then eight successes (one with a detail object), then two
  failures: state ``failing``;
- ``ingest`` (no schedule): a run in progress under a live lease, with a
  fence write: state ``running`` (the auto-refresh test ends it);
- ``sync-orders``: a run closed by the reaper when its lease expired (lost),
  then one still open whose lease expired: state ``lease_expired``;
- ``tick`` (every 200 ms, catch-up bound 1): slots skipped by the catch-up
  bound, one range in ``ledger.skipped_slots``;
- ``weekly-cleanup`` (Sundays 04:00): one success, then paused;
- ``nightly-report`` (02:30 in Europe/Berlin): a success; and
  ``dst-day`` (02:30 on the day of the next EU daylight-saving change, in
  Europe/Berlin), whose next slot carries a daylight-saving note;
- ``<script>alert(1)</script>`` (hourly): three failures whose error text is
  markup too: a consecutive_failures alert; it must render as text;
- ``never-ran`` (hourly): registered only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from typing import Any

import psycopg

XSS_JOB = "<script>alert(1)</script>"
XSS_ERROR = '<img src=x onerror="alert(2)"> failed & stopped'


@dataclass
class Seeded:
    """The names and runs a test looks for."""

    running_run_id: int = 0
    running_token: int = 0
    failure_run_id: int = 0
    detail_run_id: int = 0
    lost_run_id: int = 0
    open_lost_run_id: int = 0
    dst_day: date = date.min
    jobs: list[str] = field(default_factory=list)


def _start(conn: psycopg.Connection, job: str, owner: str, ttl: str | None = None) -> tuple[int, int]:
    row = conn.execute("SELECT s.outcome, s.run_id, s.token FROM ledger.start_run(job => %s, owner => %s, "
                       "ttl => %s::interval) AS s", (job, owner, ttl)).fetchone()
    assert row is not None and row[0] == "started", (job, row)
    return int(row[1]), int(row[2])


def _complete(conn: psycopg.Connection, run: tuple[int, int], detail: str | None = None) -> None:
    conn.execute("SELECT ledger.complete_run(run_id => %s, token => %s, detail => %s::jsonb)", (*run, detail))


def _fail(conn: psycopg.Connection, run: tuple[int, int], error: str) -> None:
    conn.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => %s)", (*run, error))


def last_sunday(year: int, month: int) -> date:
    day = date(year, month + 1, 1) - timedelta(days=1) if month < 12 else date(year, 12, 31)
    return day - timedelta(days=(day.weekday() + 1) % 7)


def next_eu_dst_change(today: date) -> date:
    """The next last Sunday of March or October (the EU's changes) after today."""
    candidates = [last_sunday(year, month) for year in (today.year, today.year + 1) for month in (3, 10)]
    return min(day for day in candidates if day > today)


# A day of etl's history before the seeded runs: the API cannot backdate a
# run, so these rows go in directly (as the superuser the tests connect as;
# the log's trigger for writes from outside the ledger's functions recomputes
# the job's state), one run per 5-minute slot of the 23 hours before, 20 to
# 140 seconds long, every 13th failed; the lease row first (the log's foreign
# key) with the newest of their tokens, so the API's next token follows them.
HISTORY = [
    """
    INSERT INTO ledger.leases (job, owner, token, ttl, acquired_at, expires_at, released_at, timeline)
    VALUES ('etl', 'host-a', 276, interval '10 minutes', now() - interval '1 hour', now() - interval '1 hour',
            now() - interval '1 hour', 1)
    """,
    """
    INSERT INTO ledger.job_execution_log
           (job, owner, token, slot, status, started_at, heartbeat_at, completed_at, failure_reason, error)
    SELECT 'etl', CASE WHEN n % 2 = 0 THEN 'host-a' ELSE 'host-b' END, n, s.slot,
           CASE WHEN n % 13 = 0 THEN 'failure' ELSE 'success' END,
           s.slot + interval '1 second', NULL, s.slot + (20 + (n * 37) % 120) * interval '1 second',
           CASE WHEN n % 13 = 0 THEN 'error' END,
           CASE WHEN n % 13 = 0 THEN 'exit status 2: upstream export not ready' END
      FROM generate_series(1, 276) AS n
     CROSS JOIN LATERAL (
           -- run n's slot: 277 - n slots before the current 5-minute slot (the newest, the previous slot)
           SELECT date_trunc('hour', now()) + floor(extract(minute FROM now()) / 5) * interval '5 minutes'
                  - (277 - n) * interval '5 minutes' AS slot) AS s
    """,
    """
    UPDATE ledger.counters SET runs_started = runs_started + 276, successes = successes + 255,
                               failures = failures + 21
     WHERE job = 'etl'
    """,
]


def seed(conn: psycopg.Connection) -> Seeded:
    """Build the ledger above on an autocommit connection (takes about 2 s: leases must expire)."""
    seeded = Seeded()
    register = "SELECT ledger.register_job(job => %s, schedule => %s, ttl => %s::interval, " \
               "max_backfill => %s, time_zone => %s)"

    conn.execute(register, ("etl", "*/5 * * * *", "10 minutes", 1, "UTC"))
    with conn.transaction():
        for statement in HISTORY:
            conn.execute(statement)  # no parameters: psycopg sends the % signs as they are
    for number in range(8):
        run = _start(conn, "etl", "host-a")
        _complete(conn, run, '{"rows": 1234, "source": "orders"}' if number == 7 else None)
        if number == 7:
            seeded.detail_run_id = run[0]
    for _ in range(2):
        run = _start(conn, "etl", "host-b")
        _fail(conn, run, "psycopg.OperationalError: connection to warehouse lost\nretry later")
    seeded.failure_run_id = run[0]

    conn.execute(register, ("sync-orders", None, "1 second", 1, "UTC"))
    lost = _start(conn, "sync-orders", "host-c")
    seeded.lost_run_id = lost[0]
    time.sleep(1.1)
    conn.execute("SELECT ledger.reap_expired(job => 'sync-orders')")
    seeded.open_lost_run_id = _start(conn, "sync-orders", "host-c")[0]

    conn.execute(register, ("tick", "200 milliseconds", "1 hour", 1, "UTC"))
    first = conn.execute("SELECT s.run_id, s.token FROM ledger.start_due_run(job => 'tick', owner => 'host-a') AS s"
                         ).fetchone()
    assert first is not None
    _complete(conn, (int(first[0]), int(first[1])))
    time.sleep(1.2)  # also lets sync-orders' second lease expire
    second = conn.execute("SELECT s.outcome, s.run_id, s.token FROM ledger.start_due_run(job => 'tick', "
                          "owner => 'host-a') AS s").fetchone()
    assert second is not None and second[0] == "started"
    _complete(conn, (int(second[1]), int(second[2])))

    conn.execute(register, ("weekly-cleanup", "0 4 * * 0", "30 minutes", 1, "UTC"))
    _complete(conn, _start(conn, "weekly-cleanup", "host-a"))
    conn.execute("SELECT ledger.pause_job(job => 'weekly-cleanup')")

    conn.execute(register, ("nightly-report", "30 2 * * *", "20 minutes", 2, "Europe/Berlin"))
    _complete(conn, _start(conn, "nightly-report", "host-d"))
    seeded.dst_day = next_eu_dst_change(datetime.now(timezone.utc).date())
    conn.execute(register, ("dst-day", f"30 2 {seeded.dst_day.day} {seeded.dst_day.month} *", "20 minutes", 1,
                            "Europe/Berlin"))

    conn.execute(register, (XSS_JOB, "0 * * * *", "5 minutes", 1, "UTC"))
    for _ in range(3):
        _fail(conn, _start(conn, XSS_JOB, "<b>owner</b>"), XSS_ERROR)

    conn.execute(register, ("never-ran", "0 * * * *", "5 minutes", 1, "UTC"))

    # Last, so that the run is young: it holds its lease for an hour, and has written through a fence.
    conn.execute(register, ("ingest", None, "1 hour", 1, "UTC"))
    seeded.running_run_id, seeded.running_token = _start(conn, "ingest", "host-e")
    conn.execute("SELECT ledger.fence(job => 'ingest', resource => 'warehouse.orders', token => %s)",
                 (seeded.running_token,))

    seeded.jobs = [row[0] for row in conn.execute("SELECT job FROM ledger.jobs ORDER BY job").fetchall()]
    return seeded


def end_running_run(conn: psycopg.Connection, seeded: Seeded) -> None:
    _complete(conn, (seeded.running_run_id, seeded.running_token), '{"rows": 42}')


@contextmanager
def seeded_database(pg_server: Any, template: str, label: str) -> Iterator[tuple[str, Seeded]]:
    """A database of its own, cloned from the session's ledger template and seeded: (dsn, Seeded).

    For a module of tests that share one seeded ledger (seeding takes seconds);
    dropped at the end.
    """
    from pytest_postgresql.janitor import DatabaseJanitor

    name = f"ledger_{label}_{os.getpid()}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name, template_dbname=template)
    with janitor:
        dsn = pg_server.dsn(name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            seeded = seed(conn)
        yield dsn, seeded
