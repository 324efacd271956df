"""Prometheus metrics for the ledger, read from its views on every scrape.

A custom collector (no state in the process: the counters live in the
database, so any number of exporters agree and a restart loses nothing). Each
scrape opens a connection, reads ``ledger.job_status``, ``ledger.run_stats``
and ``ledger.alerts`` in one read-only transaction as ``ledger_reader`` (see
:func:`ledger.report.read_only_transaction`), and closes it.

Metrics (labels in braces):

- ``jobledger_up``: 1 when the scrape read the ledger, 0 when it failed.
- ``jobledger_runs_started_total{job}``: runs started (counter).
- ``jobledger_runs_total{job,status}``: runs ended, status ``success`` or ``failure`` (counter).
- ``jobledger_runs_running{job}``: 1 while a run of the job is running.
- ``jobledger_skipped_total{job,reason}``: skips, reason ``overlap`` (a start
  that found another owner's live lease) or ``backfill_limit`` (slots the
  catch-up bound dropped) (counter).
- ``jobledger_leases_lost_total{job}``: runs closed because their lease
  expired or was superseded (counter).
- ``jobledger_run_duration_seconds{job,quantile}``: p50 (``0.5``), p95
  (``0.95``) and max (``1``) duration of the successful runs in the log.
- ``jobledger_run_failure_ratio{job}``: failures / ended runs in the log.
- ``jobledger_job_overdue{job}``: 1 when a slot is more than one ttl old and
  has not succeeded, with no live run on it.
- ``jobledger_consecutive_failures{job}``: failures since the last success.
- ``jobledger_alerts{alert}``: live rows of ``ledger.alerts`` per kind.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from wsgiref.simple_server import WSGIServer

import psycopg
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ledger.report import read_only_transaction

__all__ = [
    "ALERT_KINDS",
    "LedgerCollector",
    "MetricsServer",
    "Snapshot",
    "exposition",
    "read_snapshot",
    "registry",
    "serve",
]

DEFAULT_TIMEOUT = timedelta(seconds=10)
ALERT_KINDS = ("long_running", "overdue", "consecutive_failures", "overlap", "ttl_too_short")
QUANTILES = (("0.5", "p50"), ("0.95", "p95"), ("1", "max"))

JOBS = """
SELECT s.job,
       coalesce(s.runs_started, 0), coalesce(s.successes, 0), coalesce(s.failures, 0),
       coalesce(s.skipped_overlap, 0), coalesce(s.skipped_backfill, 0), coalesce(s.leases_lost, 0),
       s.running_run_id IS NOT NULL, s.overdue, s.consecutive_failures
  FROM ledger.job_status AS s
 ORDER BY s.job
"""

RUN_STATS = """
SELECT r.job, r.failure_rate::float8,
       extract(epoch FROM r.p50_duration)::float8,
       extract(epoch FROM r.p95_duration)::float8,
       extract(epoch FROM r.max_duration)::float8
  FROM ledger.run_stats AS r
 ORDER BY r.job
"""

ALERTS = "SELECT a.alert, count(*) FROM ledger.alerts AS a GROUP BY a.alert"


@dataclass(frozen=True)
class JobRow:
    job: str
    runs_started: int
    successes: int
    failures: int
    skipped_overlap: int
    skipped_backfill: int
    leases_lost: int
    running: bool
    overdue: bool
    consecutive_failures: int


@dataclass(frozen=True)
class StatsRow:
    job: str
    failure_rate: float | None
    p50: float | None
    p95: float | None
    max: float | None


@dataclass(frozen=True)
class Snapshot:
    """What one scrape read, in one transaction (so the numbers agree with each other)."""

    jobs: list[JobRow] = field(default_factory=list)
    stats: list[StatsRow] = field(default_factory=list)
    alerts: dict[str, int] = field(default_factory=dict)


def read_snapshot(conn: psycopg.Connection[Any], timeout: timedelta = DEFAULT_TIMEOUT) -> Snapshot:
    """Read the views once, read-only, as ledger_reader, each statement under ``timeout``.

    Nothing is prepared (``prepare=False``), whatever the connection's
    ``prepare_threshold``: a scrape works behind a transaction pooler.
    """
    with read_only_transaction(conn, timeout) as cur:
        jobs = [JobRow(str(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]),
                       bool(r[7]), bool(r[8]), int(r[9] or 0))
                for r in cur.execute(JOBS, prepare=False).fetchall()]
        stats = [StatsRow(str(r[0]), r[1], r[2], r[3], r[4])
                 for r in cur.execute(RUN_STATS, prepare=False).fetchall()]
        alerts = {str(r[0]): int(r[1]) for r in cur.execute(ALERTS, prepare=False).fetchall()}
    return Snapshot(jobs, stats, alerts)


def families(snapshot: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (without ``jobledger_up``)."""
    started = CounterMetricFamily("jobledger_runs_started", "Runs started", labels=["job"])
    ended = CounterMetricFamily("jobledger_runs", "Runs ended, by status (success, failure)",
                                labels=["job", "status"])
    running = GaugeMetricFamily("jobledger_runs_running", "1 while a run of the job is running",
                                labels=["job"])
    skipped = CounterMetricFamily(
        "jobledger_skipped", "Skips: starts that met another owner's lease (overlap), "
        "slots dropped by the catch-up bound (backfill_limit)", labels=["job", "reason"])
    lost = CounterMetricFamily("jobledger_leases_lost", "Runs closed because their lease expired "
                               "or was superseded", labels=["job"])
    overdue = GaugeMetricFamily("jobledger_job_overdue", "1 when a slot is more than one ttl old "
                                "and has not succeeded, with no live run on it", labels=["job"])
    failing = GaugeMetricFamily("jobledger_consecutive_failures", "Failures since the last success",
                                labels=["job"])
    for job in snapshot.jobs:
        started.add_metric([job.job], job.runs_started)
        ended.add_metric([job.job, "success"], job.successes)
        ended.add_metric([job.job, "failure"], job.failures)
        running.add_metric([job.job], 1 if job.running else 0)
        skipped.add_metric([job.job, "overlap"], job.skipped_overlap)
        skipped.add_metric([job.job, "backfill_limit"], job.skipped_backfill)
        lost.add_metric([job.job], job.leases_lost)
        overdue.add_metric([job.job], 1 if job.overdue else 0)
        failing.add_metric([job.job], job.consecutive_failures)

    duration = GaugeMetricFamily(
        "jobledger_run_duration_seconds", "Duration of the successful runs in the log: "
        "p50 (quantile 0.5), p95 (0.95) and max (1)", labels=["job", "quantile"])
    failure_ratio = GaugeMetricFamily("jobledger_run_failure_ratio", "Failures / ended runs in the log",
                                      labels=["job"])
    for row in snapshot.stats:
        for quantile, attribute in QUANTILES:
            value = getattr(row, attribute)
            if value is not None:
                duration.add_metric([row.job, quantile], value)
        if row.failure_rate is not None:
            failure_ratio.add_metric([row.job], row.failure_rate)

    alerts = GaugeMetricFamily("jobledger_alerts", "Live rows of ledger.alerts, by kind", labels=["alert"])
    for kind in sorted(set(ALERT_KINDS) | set(snapshot.alerts)):
        alerts.add_metric([kind], snapshot.alerts.get(kind, 0))

    yield from (started, ended, running, skipped, lost, duration, failure_ratio, overdue, failing, alerts)


class LedgerCollector:
    """Reads the ledger on every scrape (``registry.register(LedgerCollector(...))``).

    ``connect`` opens a connection (closed after the scrape; ``ledger.connect.connect``
    gives one with the ledger's settings, e.g. ``lambda: connect(dsn)``). When the read
    fails, the scrape still answers, with ``jobledger_up 0``, and ``on_error``
    hears why; with ``raise_errors`` the error propagates instead (one-shot use).
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], *,
                 timeout: timedelta = DEFAULT_TIMEOUT, raise_errors: bool = False,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self._connect = connect
        self._timeout = timeout
        self._raise_errors = raise_errors
        self._on_error = on_error

    def describe(self) -> Iterable[Metric]:
        return []  # no read at registration time: the database may not be up yet

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("jobledger_up", "1 when the scrape read the ledger, 0 when it failed")
        try:
            with self._connect() as conn:
                snapshot = read_snapshot(conn, self._timeout)
        except psycopg.Error as error:
            if self._raise_errors:
                raise
            if self._on_error is not None:
                self._on_error(error)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, *families(snapshot)]


def registry(collector: LedgerCollector) -> CollectorRegistry:
    """A registry of its own (not the process-wide default, which has Python's own metrics)."""
    result = CollectorRegistry(auto_describe=False)
    result.register(collector)
    return result


def exposition(connect: Callable[[], psycopg.Connection[Any]],
               timeout: timedelta = DEFAULT_TIMEOUT) -> str:
    """One scrape, as Prometheus text exposition; database errors propagate."""
    collector = LedgerCollector(connect, timeout=timeout, raise_errors=True)
    return generate_latest(registry(collector)).decode()


@dataclass
class MetricsServer:
    """A running exporter: ``url`` to scrape, ``close()`` to stop."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(collector: LedgerCollector, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` on host:port in a background thread (port 0: any free port)."""
    server, thread = start_http_server(port, addr=host, registry=registry(collector))
    return MetricsServer(server, thread)
