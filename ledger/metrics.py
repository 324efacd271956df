"""Prometheus metrics for the ledger, read from its views on every scrape.

A custom collector (no state in the process: the counters live in the
database, so any number of exporters agree and a restart loses nothing). Each
scrape opens a connection (or takes one from a pool: the dashboard's), reads
``ledger.job_status``, ``ledger.run_stats``, ``ledger.alerts`` and
``ledger.db_risks`` in one read-only transaction as ``ledger_reader`` (see
:func:`ledger.readonly.read_only_transaction`), and closes it (or gives it back).

Metrics (labels in braces):

- ``jobledger_up``: 1 when the scrape read the ledger, 0 when it failed.
- ``jobledger_runs_started_total{job}``: runs started (counter).
- ``jobledger_runs_total{job,status}``: runs ended, status ``success`` or ``failure`` (counter).
- ``jobledger_runs_running{job}``: 1 while a run of the job is running.
- ``jobledger_skipped_total{job,reason}``: skips, reason ``overlap`` (a start
  that found another owner's live lease: ``job_status.skipped_overlap``) or
  ``backfill_limit`` (slots the catch-up bound dropped, the reason
  ``ledger.skipped_slots`` records them with: ``job_status.skipped_backfill``)
  (counter).
- ``jobledger_leases_lost_total{job}``: runs closed because their lease
  expired or was superseded (counter).
- ``jobledger_run_duration_seconds{job,quantile}``: p50 (``0.5``), p95
  (``0.95``) and max (``1``) duration of the successful runs in the log.
- ``jobledger_recent_run_duration_seconds{job,le}``: a histogram of the
  durations of the successful runs that started in the last
  :data:`DURATION_WINDOW` (24 hours), buckets :data:`DURATION_BUCKETS`. A
  window, not a running total: buckets go down as runs leave it, so take
  ``histogram_quantile`` of the buckets themselves, not of their ``rate()``.
  (Not named ``jobledger_run_duration_seconds``: the quantile gauges above
  have that name, and a histogram beside them under it would make the
  exposition invalid: ``promtool check metrics`` refuses it.)
- ``jobledger_run_failure_ratio{job}``: failures / ended runs in the log.
- ``jobledger_job_overdue{job}``: 1 when a slot is more than one ttl old and
  has not succeeded, with no live run on it.
- ``jobledger_consecutive_failures{job}``: failures since the last success.
- ``jobledger_job_ttl_seconds{job}``: the job's lease ttl (none without one),
  and ``jobledger_run_running_seconds{job}``: how long its running run has
  run (none without one): the alert rules compare them (a run past its ttl).
- ``jobledger_alerts{alert}``: live rows of ``ledger.alerts`` per kind.
- ``jobledger_duplicates``: slots and idempotency keys that succeeded more
  than once (``ledger.duplicates``, over each job's newest 1,000 successes);
  always 0.
- ``jobledger_db_risk{kind,relation}``: each row of ``ledger.db_risks`` by
  its severity, 0 ``ok``, 1 ``warn``, 2 ``critical``: ``xmin_horizon``
  (``relation=""``), ``dead_rows`` and ``autovacuum_lag`` per hot table.
- ``jobledger_xmin_horizon_age_transactions``: transactions started since
  the oldest snapshot, transaction, slot or prepared transaction that holds
  vacuum back (0: none), and ``jobledger_xmin_horizon_age_seconds``: for how
  long (none when the reader may not see it: ``pg_read_all_stats``).
- ``jobledger_xmin_horizon_holder{holder_type,holder,application_name}``: 1,
  only while the horizon's risk is ``warn`` or ``critical``: who holds it (a
  pid, a slot or a prepared transaction's gid). Not a label of the gauges
  above, so that short transactions do not make a new series per scrape.
- ``jobledger_dead_rows{relation}``: dead row versions on each hot table.
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ledger import queries
from ledger.models import SEVERITIES, DbRisk, JobStatus
from ledger.readonly import read_only_transaction

__all__ = [
    "ALERT_KINDS",
    "DURATION_BUCKETS",
    "DURATION_HISTOGRAM",
    "DURATION_WINDOW",
    "DurationBuckets",
    "LedgerCollector",
    "MetricsServer",
    "Snapshot",
    "exposition",
    "read_snapshot",
    "registry",
    "serve",
]

DEFAULT_TIMEOUT = timedelta(seconds=10)
ALERT_KINDS = ("long_running", "late", "down", "overrun", "failing", "paused", "too_fast", "overdue",
               "consecutive_failures", "overlap", "ttl_too_short")
QUANTILES = (("0.5", "p50"), ("0.95", "p95"), ("1", "max"))
#: The run duration histogram: its name, its buckets' upper bounds in seconds (``le``; +Inf
#: besides), and the window of runs it counts (successes started within it).
DURATION_HISTOGRAM = "jobledger_recent_run_duration_seconds"
DURATION_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0, 3600.0, 10800.0)
DURATION_WINDOW = timedelta(hours=24)


@dataclass(frozen=True)
class StatsRow:
    """A row of ``queries.RUN_STATS``: ``ledger.run_stats`` in seconds."""

    job: str
    failure_rate: float | None
    p50: float | None
    p95: float | None
    max: float | None


@dataclass(frozen=True)
class DurationBuckets:
    """A job's histogram: ``counts[i]`` runs took at most ``DURATION_BUCKETS[i]`` (cumulative)."""

    job: str
    counts: list[int]
    runs: int
    seconds: float


def duration_buckets(rows: Iterable[tuple[str, int, int, float]]) -> list[DurationBuckets]:
    """The rows of ``queries.RUN_DURATION_BUCKETS`` (job, bucket, runs, seconds) as cumulative histograms."""
    per_job: dict[str, list[tuple[int, int, float]]] = {}
    for job, bucket, runs, seconds in rows:
        per_job.setdefault(job, []).append((int(bucket), int(runs), float(seconds)))
    result = []
    for job, buckets in per_job.items():
        counts = [0] * len(DURATION_BUCKETS)
        for bucket, runs, _ in buckets:
            for index in range(bucket, len(DURATION_BUCKETS)):  # bucket len(...) is +Inf only
                counts[index] += runs
        result.append(DurationBuckets(job, counts, sum(runs for _, runs, _ in buckets),
                                      sum(seconds for _, _, seconds in buckets)))
    return result


@dataclass(frozen=True)
class Snapshot:
    """What one scrape read, in one transaction (so the numbers agree with each other)."""

    jobs: list[JobStatus] = field(default_factory=list)
    stats: list[StatsRow] = field(default_factory=list)
    alerts: dict[str, int] = field(default_factory=dict)
    durations: list[DurationBuckets] = field(default_factory=list)
    duplicates: int = 0
    risks: list[DbRisk] = field(default_factory=list)


def read_snapshot(conn: psycopg.Connection[Any], timeout: timedelta = DEFAULT_TIMEOUT) -> Snapshot:
    """Read the views once, read-only, as ledger_reader, each statement under ``timeout``.

    Nothing is prepared (``prepare=False``), whatever the connection's
    ``prepare_threshold``: a scrape works behind a transaction pooler.
    """
    with read_only_transaction(conn, timeout) as cur:
        jobs = [JobStatus(**row) for row in _as_dicts(cur.execute(queries.JOB_STATUSES, prepare=False))]
        stats = [StatsRow(**row) for row in _as_dicts(cur.execute(queries.RUN_STATS, prepare=False))]
        alerts = {str(r[0]): int(r[1]) for r in cur.execute(queries.ALERT_COUNTS, prepare=False).fetchall()}
        durations = duration_buckets(cur.execute(queries.RUN_DURATION_BUCKETS, {
            "bounds": list(DURATION_BUCKETS), "window": DURATION_WINDOW}, prepare=False).fetchall())
        row = cur.execute(queries.DUPLICATE_COUNT, prepare=False).fetchone()
        duplicates = int(row[0]) if row else 0
        risks = [DbRisk(**row) for row in _as_dicts(cur.execute(queries.DB_RISKS, prepare=False))]
    return Snapshot(jobs, stats, alerts, durations, duplicates, risks)


def _as_dicts(cur: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
    names = [column.name for column in cur.description or []]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _le(bound: float) -> str:
    """A bucket's ``le`` as prometheus_client's own histograms write it (``1.0``, ``+Inf``)."""
    written: str = floatToGoString(bound)  # type: ignore[no-untyped-call]
    return written


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
    ttl = GaugeMetricFamily("jobledger_job_ttl_seconds", "The job's lease ttl", labels=["job"])
    running_for = GaugeMetricFamily("jobledger_run_running_seconds", "How long the job's running run has run",
                                    labels=["job"])
    for job in snapshot.jobs:
        started.add_metric([job.job], job.runs_started)
        ended.add_metric([job.job, "success"], job.successes)
        ended.add_metric([job.job, "failure"], job.failures)
        running.add_metric([job.job], 1 if job.running_run_id is not None else 0)
        skipped.add_metric([job.job, "overlap"], job.skipped_overlap)
        skipped.add_metric([job.job, "backfill_limit"], job.skipped_backfill)
        lost.add_metric([job.job], job.leases_lost)
        overdue.add_metric([job.job], 1 if job.overdue else 0)
        failing.add_metric([job.job], job.consecutive_failures)
        if job.ttl is not None:
            ttl.add_metric([job.job], job.ttl.total_seconds())
        if job.running_for is not None:
            running_for.add_metric([job.job], job.running_for.total_seconds())

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

    duplicates = GaugeMetricFamily(
        "jobledger_duplicates", "Slots and idempotency keys that succeeded twice, over each job's newest "
        "1,000 successes (ledger.duplicates; always 0 when the ledger holds)")
    duplicates.add_metric([], snapshot.duplicates)

    histogram = HistogramMetricFamily(
        DURATION_HISTOGRAM, f"Durations of the successful runs started in the last "
        f"{int(DURATION_WINDOW.total_seconds() // 3600)} hours (a window: buckets go down as runs leave it)",
        labels=["job"])
    for job_buckets in snapshot.durations:
        buckets = [(_le(bound), count) for bound, count in zip(DURATION_BUCKETS, job_buckets.counts)]
        histogram.add_metric([job_buckets.job], [*buckets, ("+Inf", job_buckets.runs)],
                             sum_value=job_buckets.seconds)

    yield from (started, ended, running, skipped, lost, duration, histogram, failure_ratio, overdue, failing,
                ttl, running_for, alerts, duplicates)
    yield from risk_families(snapshot.risks)


def risk_families(risks: Iterable[DbRisk]) -> Iterator[Metric]:
    """The metric families of ``ledger.db_risks``' rows."""
    risk = GaugeMetricFamily("jobledger_db_risk", "ledger.db_risks by severity: 0 ok, 1 warn, 2 critical",
                             labels=["kind", "relation"])
    horizon_xids = GaugeMetricFamily(
        "jobledger_xmin_horizon_age_transactions",
        "Transactions started since the oldest snapshot, transaction, slot or prepared transaction holding vacuum back")
    horizon_seconds = GaugeMetricFamily(
        "jobledger_xmin_horizon_age_seconds", "How long the xmin horizon's oldest holder has held it "
        "(none when hidden from the reader)")
    holder = GaugeMetricFamily(
        "jobledger_xmin_horizon_holder", "1 for the holder of the xmin horizon while its risk is warn or critical",
        labels=["holder_type", "holder", "application_name"])
    dead = GaugeMetricFamily("jobledger_dead_rows", "Dead row versions on the ledger's hot tables",
                             labels=["relation"])
    for row in risks:
        risk.add_metric([row.kind, row.relation or ""], SEVERITIES.index(row.severity))
        if row.kind == "xmin_horizon":
            horizon_xids.add_metric([], row.value or 0)
            if row.holder is None:
                horizon_seconds.add_metric([], 0)
            elif row.age is not None:
                horizon_seconds.add_metric([], row.age.total_seconds())
            if row.holder is not None and row.severity != "ok":
                holder.add_metric([row.holder_type or "", row.holder, row.application_name or ""], 1)
        elif row.kind == "dead_rows":
            dead.add_metric([row.relation or ""], row.value or 0)
    yield from (risk, horizon_xids, horizon_seconds, holder, dead)


class LedgerCollector:
    """Reads the ledger on every scrape (``registry.register(LedgerCollector(...))``).

    ``connect`` opens a connection (closed after the scrape; ``ledger.connect.connect``
    gives one with the ledger's settings, e.g. ``lambda: connect(dsn)``), or gives a
    context manager of one (e.g. a pool's ``connection``: given back after the
    scrape, as the dashboard's ``/metrics`` does). When the read
    fails, the scrape still answers, with ``jobledger_up 0``, and ``on_error``
    hears why; with ``raise_errors`` the error propagates instead (one-shot use).
    """

    def __init__(self, connect: Callable[[], AbstractContextManager[psycopg.Connection[Any]]], *,
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
