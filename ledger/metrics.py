"""Prometheus metrics for the ledger, read from its views on every scrape.

A custom collector (no state in the process: the counters live in the
database, so any number of exporters agree and a restart loses nothing). Each
scrape opens a connection (or takes one from a pool: the dashboard's), reads
each job's state row (``ledger._job_state``, what ``ledger.job_status`` and
``ledger.job_health`` show) and the alerts grouped by kind, in one read-only
transaction as ``ledger_reader`` (see
:func:`ledger.readonly.read_only_transaction`), and closes it (or gives it
back). Nothing it reads per job grows with the log: a scrape costs
microseconds per job.

Metrics (labels in braces):

- ``jobledger_up``: 1 when the scrape read the ledger, 0 when it failed.
- ``jobledger_job_state{job,state}``: 1, for the job's one state (the
  ledger's word: crashed, overrun, paused, running, down, late, failing,
  never_run, ok; docs/contract.md). One series per job: when its state
  changes, the old series ends.
- ``jobledger_runs_started_total{job}``: runs started (counter).
- ``jobledger_runs_total{job,status}``: runs ended, status ``success`` or ``failure`` (counter).
- ``jobledger_runs_running{job}``: 1 while a run of the job is live (a run
  whose lease is gone is ``crashed``, not running).
- ``jobledger_skipped_total{job,reason}``: skips, reason ``overlap`` (a start
  that found another owner's live lease: ``job_status.skipped_overlap``) or
  ``backfill_limit`` (slots the catch-up bound dropped, the reason
  ``ledger.skipped_slots`` records them with: ``job_status.skipped_backfill``)
  (counter).
- ``jobledger_leases_lost_total{job}``: runs closed because their lease
  expired or was superseded (counter).
- ``jobledger_run_duration_seconds{job,quantile="1"}``: the longest
  successful run (the job's state keeps it: purge does not lower it).
- ``jobledger_last_success_duration_seconds{job}``: how long the newest
  success took (``quantile_over_time`` over it gives percentiles).
- ``jobledger_run_failure_ratio{job}``: failures / ended runs, counted
  since the job's first run.
- ``jobledger_consecutive_failures{job}``: failures in a row since the last
  success (a cancel is none); the job is ``failing`` from the ledger's
  threshold on.
- ``jobledger_job_ttl_seconds{job}``: the job's lease ttl (none without one),
  and ``jobledger_run_running_seconds{job}``: how long its live run has run
  (none without one): the alert rules compare them (a run past its ttl).
- ``jobledger_alerts{alert}``: live rows of ``ledger.alerts`` per kind.
- With ``audit`` (``jobledger metrics --audit``), the two audits, which read
  the log rather than the state rows: ``jobledger_state_differences``, the
  jobs whose stored state differs from the log's (``ledger.verify_state``),
  and ``jobledger_duplicates``, slots and idempotency keys that succeeded
  more than once (``ledger.duplicates``, over each job's newest 1,000
  successes); both always 0.

Gone in 0.2.0 (docs/monitoring.md): ``jobledger_job_overdue`` (the state
says ``late`` or ``down``), the p50 and p95 quantiles of
``jobledger_run_duration_seconds`` and the histogram
``jobledger_recent_run_duration_seconds``: they read each job's runs on every
scrape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from wsgiref.simple_server import WSGIServer

import psycopg
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ledger import queries
from ledger.readonly import read_only_transaction

__all__ = [
    "ALERT_KINDS",
    "JobRow",
    "LedgerCollector",
    "MetricsServer",
    "Snapshot",
    "exposition",
    "read_snapshot",
    "registry",
    "serve",
]

DEFAULT_TIMEOUT = timedelta(seconds=10)
#: The kinds of ``ledger.alerts`` (each written, 0 when none is live): the states that are trouble,
#: and the problems that are no state.
ALERT_KINDS = ("crashed", "overrun", "paused", "down", "late", "failing", "long_running", "too_fast", "overlap",
               "ttl_too_short")


@dataclass(frozen=True)
class JobRow:
    """A row of ``queries.METRIC_JOBS``: a job's state row, durations in seconds."""

    job: str
    state: str
    consecutive_failures: int
    runs_started: int
    successes: int
    failures: int
    skipped_overlap: int
    skipped_backfill: int
    leases_lost: int
    running: bool
    ttl_seconds: float | None
    running_seconds: float | None
    longest_success_seconds: float | None
    last_success_seconds: float | None


@dataclass(frozen=True)
class Snapshot:
    """What one scrape read, in one transaction (so the numbers agree with each other).

    ``state_differences`` and ``duplicates`` are None unless the scrape audited."""

    jobs: list[JobRow] = field(default_factory=list)
    alerts: dict[str, int] = field(default_factory=dict)
    state_differences: int | None = None
    duplicates: int | None = None


def read_snapshot(conn: psycopg.Connection[Any], timeout: timedelta = DEFAULT_TIMEOUT, *,
                  audit: bool = False) -> Snapshot:
    """Read the views once, read-only, as ledger_reader, each statement under ``timeout``;
    with ``audit``, the two audits too (they read the log: seconds over a large one).

    Nothing is prepared (``prepare=False``), whatever the connection's
    ``prepare_threshold``: a scrape works behind a transaction pooler.
    """
    differences = duplicates = None
    with read_only_transaction(conn, timeout) as cur:
        jobs = [JobRow(**row) for row in _as_dicts(cur.execute(queries.METRIC_JOBS, prepare=False))]
        alerts = {str(r[0]): int(r[1]) for r in cur.execute(queries.ALERT_COUNTS, prepare=False).fetchall()}
        if audit:
            differences = _count(cur.execute(queries.STATE_DIFFERENCES, prepare=False).fetchone())
            duplicates = _count(cur.execute(queries.DUPLICATE_COUNT, prepare=False).fetchone())
    return Snapshot(jobs, alerts, differences, duplicates)


def _count(row: tuple[Any, ...] | None) -> int:
    return int(row[0]) if row else 0


def _as_dicts(cur: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
    names = [column.name for column in cur.description or []]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def families(snapshot: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (without ``jobledger_up``)."""
    state = GaugeMetricFamily("jobledger_job_state", "1 for the job's state, the ledger's word "
                              "(ledger.job_health.state)", labels=["job", "state"])
    started = CounterMetricFamily("jobledger_runs_started", "Runs started", labels=["job"])
    ended = CounterMetricFamily("jobledger_runs", "Runs ended, by status (success, failure)",
                                labels=["job", "status"])
    running = GaugeMetricFamily("jobledger_runs_running", "1 while a run of the job is live", labels=["job"])
    skipped = CounterMetricFamily(
        "jobledger_skipped", "Skips: starts that met another owner's lease (overlap), "
        "slots dropped by the catch-up bound (backfill_limit)", labels=["job", "reason"])
    lost = CounterMetricFamily("jobledger_leases_lost", "Runs closed because their lease expired "
                               "or was superseded", labels=["job"])
    failing = GaugeMetricFamily("jobledger_consecutive_failures", "Failures in a row since the last success",
                                labels=["job"])
    ttl = GaugeMetricFamily("jobledger_job_ttl_seconds", "The job's lease ttl", labels=["job"])
    running_for = GaugeMetricFamily("jobledger_run_running_seconds", "How long the job's live run has run",
                                    labels=["job"])
    duration = GaugeMetricFamily("jobledger_run_duration_seconds", "The longest successful run (quantile 1)",
                                 labels=["job", "quantile"])
    last_success = GaugeMetricFamily("jobledger_last_success_duration_seconds",
                                     "How long the newest success took", labels=["job"])
    failure_ratio = GaugeMetricFamily("jobledger_run_failure_ratio", "Failures / ended runs", labels=["job"])
    for job in snapshot.jobs:
        state.add_metric([job.job, job.state], 1)
        started.add_metric([job.job], job.runs_started)
        ended.add_metric([job.job, "success"], job.successes)
        ended.add_metric([job.job, "failure"], job.failures)
        running.add_metric([job.job], 1 if job.running else 0)
        skipped.add_metric([job.job, "overlap"], job.skipped_overlap)
        skipped.add_metric([job.job, "backfill_limit"], job.skipped_backfill)
        lost.add_metric([job.job], job.leases_lost)
        failing.add_metric([job.job], job.consecutive_failures)
        if job.ttl_seconds is not None:
            ttl.add_metric([job.job], job.ttl_seconds)
        if job.running_seconds is not None:
            running_for.add_metric([job.job], job.running_seconds)
        if job.longest_success_seconds is not None:
            duration.add_metric([job.job, "1"], job.longest_success_seconds)
        if job.last_success_seconds is not None:
            last_success.add_metric([job.job], job.last_success_seconds)
        if job.successes + job.failures:
            failure_ratio.add_metric([job.job], job.failures / (job.successes + job.failures))

    alerts = GaugeMetricFamily("jobledger_alerts", "Live rows of ledger.alerts, by kind", labels=["alert"])
    for kind in sorted(set(ALERT_KINDS) | set(snapshot.alerts)):
        alerts.add_metric([kind], snapshot.alerts.get(kind, 0))

    yield from (state, started, ended, running, skipped, lost, duration, last_success, failure_ratio, failing,
                ttl, running_for, alerts)
    if snapshot.state_differences is not None:
        differences = GaugeMetricFamily(
            "jobledger_state_differences", "Jobs whose stored state differs from the log's "
            "(ledger.verify_state; always 0 when the ledger holds)")
        differences.add_metric([], snapshot.state_differences)
        yield differences
    if snapshot.duplicates is not None:
        duplicates = GaugeMetricFamily(
            "jobledger_duplicates", "Slots and idempotency keys that succeeded twice, over each job's newest "
            "1,000 successes (ledger.duplicates; always 0 when the ledger holds)")
        duplicates.add_metric([], snapshot.duplicates)
        yield duplicates


class LedgerCollector:
    """Reads the ledger on every scrape (``registry.register(LedgerCollector(...))``).

    ``connect`` opens a connection (closed after the scrape; ``ledger.connect.connect``
    gives one with the ledger's settings, e.g. ``lambda: connect(dsn)``), or gives a
    context manager of one (e.g. a pool's ``connection``: given back after the
    scrape, as the dashboard's ``/metrics`` does). When the read
    fails, the scrape still answers, with ``jobledger_up 0``, and ``on_error``
    hears why; with ``raise_errors`` the error propagates instead (one-shot use). With
    ``audit``, every scrape runs the audits too (:func:`read_snapshot`).
    """

    def __init__(self, connect: Callable[[], AbstractContextManager[psycopg.Connection[Any]]], *,
                 timeout: timedelta = DEFAULT_TIMEOUT, raise_errors: bool = False,
                 on_error: Callable[[Exception], None] | None = None, audit: bool = False) -> None:
        self._connect = connect
        self._audit = audit
        self._timeout = timeout
        self._raise_errors = raise_errors
        self._on_error = on_error

    def describe(self) -> Iterable[Metric]:
        return []  # no read at registration time: the database may not be up yet

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily("jobledger_up", "1 when the scrape read the ledger, 0 when it failed")
        try:
            with self._connect() as conn:
                snapshot = read_snapshot(conn, self._timeout, audit=self._audit)
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
               timeout: timedelta = DEFAULT_TIMEOUT, *, audit: bool = False) -> str:
    """One scrape, as Prometheus text exposition; database errors propagate."""
    collector = LedgerCollector(connect, timeout=timeout, raise_errors=True, audit=audit)
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
