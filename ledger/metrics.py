"""Prometheus metrics for the ledger, read from its views on every scrape.

A custom collector (no state in the process: the counters live in the
database, so any number of exporters agree and a restart loses nothing). Each
scrape opens a connection (or takes one from a pool: the dashboard's), reads
each job's state row (``ledger._job_state``, what ``ledger.job_status`` and
``ledger.job_health`` show) with the kinds of alerts it raises (counted by
kind from those rows: what ``ledger.alerts`` unnests), the database's
risks to the ledger (``ledger.db_risks``) and the schedulers' rows
(``ledger.schedulers``), in one read-only transaction as
``ledger_reader`` (see :func:`ledger.readonly.read_only_transaction`), and
closes it (or gives it back). Nothing it reads per job grows with the log: a
scrape costs microseconds per job. The text exposition of a ledger of
:data:`PARTS_FROM_JOBS` jobs or more is read in parts at once, each range of
jobs on a connection of its own, all in the first one's snapshot
(:func:`read_text`).

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
  or ``pool_full`` (a start the job's full pool refused: ``job_status.skipped_pool_full``)
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
- ``jobledger_schedulers``: the live schedulers (rows of ``ledger.schedulers``
  not expired: ``jobledger scheduler``, ``ledger.serve``).
- ``jobledger_scheduler_up{scheduler,host}``: 1 for a live scheduler, 0 for
  an expired one (it died: its row stays until ``ledger.scheduler_stop``);
  ``jobledger_scheduler_heartbeat_age_seconds{scheduler,host}``: since its
  last heartbeat; ``jobledger_scheduler_jobs{scheduler}``: the jobs it serves;
  ``jobledger_upkeep_leader{scheduler}``: 1 for the one that holds the upkeep
  lease now (none when no one does).
- ``jobledger_pool_size{pool}``, ``jobledger_pool_used{pool}`` (live leases; a start is skipped while
  used >= size), ``jobledger_pool_running{pool}``, ``jobledger_pool_jobs{pool}`` and
  ``jobledger_pool_waiting{pool}`` (jobs a scheduler keeps waiting a place): each row of
  ``ledger.pool_status``.
- With ``audit`` (``jobledger metrics --audit``), the two audits, which read
  the log rather than the state rows: ``jobledger_state_differences``, the
  jobs whose stored state differs from the log's (``ledger.verify_state``),
  and ``jobledger_duplicates``, slots and idempotency keys that succeeded
  more than once (``ledger.duplicates``, over each job's newest 1,000
  successes); both always 0.

Gone since 0.1.0 (docs/monitoring.md): ``jobledger_job_overdue`` (the state
says ``late`` or ``down``), the p50 and p95 quantiles of
``jobledger_run_duration_seconds`` and the histogram
``jobledger_recent_run_duration_seconds``: they read each job's runs on every
scrape.
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psycopg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ledger import queries
from ledger.models import SEVERITIES, DbRisk
from ledger.readonly import read_only_transaction

__all__ = [
    "ALERT_KINDS",
    "JobRow",
    "LedgerCollector",
    "MetricsServer",
    "PoolRow",
    "SchedulerRow",
    "Snapshot",
    "exposition",
    "families",
    "read_snapshot",
    "read_text",
    "registry",
    "samples",
    "serve",
    "text",
]

DEFAULT_TIMEOUT = timedelta(seconds=10)
#: How many parts :func:`read_text` cuts the jobs into, each read at once on a connection of its
#: own (in one snapshot), and from how many jobs on: below, the second connection costs more than
#: it saves (BENCHMARKS.md, "A scrape in parts").
DEFAULT_PARTS = 2
PARTS_FROM_JOBS = 10_000
#: The bounds of ``queries.METRIC_JOBS`` that read every job.
EVERY_JOB: dict[str, str | None] = {"first": None, "end": None}
UP_HELP = "1 when the scrape read the ledger, 0 when it failed"
#: The kinds of ``ledger.alerts`` (each written, 0 when none is live): the states that are trouble,
#: and the problems that are no state.
ALERT_KINDS = ("crashed", "overrun", "paused", "down", "late", "failing", "long_running", "too_fast", "overlap",
               "ttl_too_short")


@dataclass(frozen=True)
class JobRow:
    """A row of ``queries.METRIC_JOBS``: a job's state row, durations in seconds (None: no sample)."""

    job: str
    state: str
    consecutive_failures: int
    runs_started: int
    successes: int
    failures: int
    skipped_overlap: int
    skipped_backfill: int
    skipped_pool_full: int | None  # None: the job is in no pool and none refused it (no sample)
    leases_lost: int
    running: int
    ttl_seconds: float | None
    running_seconds: float | None
    longest_success_seconds: float | None
    last_success_seconds: float | None
    failure_ratio: float | None
    alerts: list[str] = field(default_factory=list)  # the kinds of ledger.alerts it raises


@dataclass(frozen=True)
class SchedulerRow:
    """A row of ``queries.METRIC_SCHEDULERS``: a scheduler's row of ``ledger.schedulers``."""

    scheduler: str
    host: str
    live: bool
    heartbeat_age_seconds: float
    jobs: int
    leader: bool


@dataclass(frozen=True)
class PoolRow:
    """A row of ``queries.METRIC_POOLS``: a pool's row of ``ledger.pool_status``."""

    pool: str
    size: int
    used: int
    running: int
    jobs: int
    waiting: int


@dataclass(frozen=True)
class Snapshot:
    """What one scrape read, in one transaction (so the numbers agree with each other).

    ``state_differences`` and ``duplicates`` are None unless the scrape audited."""

    jobs: list[JobRow] = field(default_factory=list)
    alerts: dict[str, int] = field(default_factory=dict)
    state_differences: int | None = None
    duplicates: int | None = None
    risks: list[DbRisk] = field(default_factory=list)
    schedulers: list[SchedulerRow] = field(default_factory=list)
    pools: list[PoolRow] = field(default_factory=list)


def read_snapshot(conn: psycopg.Connection[Any], timeout: timedelta = DEFAULT_TIMEOUT, *,
                  audit: bool = False) -> Snapshot:
    """Read the views once, read-only, as ledger_reader, each statement under ``timeout``;
    with ``audit``, the two audits too (they read the log: seconds over a large one).

    Nothing is prepared (``prepare=False``), whatever the connection's
    ``prepare_threshold``: a scrape works behind a transaction pooler.
    """
    with read_only_transaction(conn, timeout, repeatable_read=True) as cur:  # one snapshot for every statement
        jobs = [JobRow(*row) for row in cur.execute(queries.METRIC_JOBS, EVERY_JOB, prepare=False).fetchall()]
        # the alerts by kind from the same rows (each job's kinds: what ledger.alerts unnests)
        return _read_rest(cur, jobs, dict(Counter(kind for job in jobs for kind in job.alerts)), audit)


def _read_rest(cur: psycopg.Cursor[Any], jobs: list[JobRow], alerts: dict[str, int], audit: bool) -> Snapshot:
    """What a scrape reads besides the state rows (a few rows, whatever the number of jobs)."""
    differences = duplicates = None
    cur.execute(queries.DB_RISKS, prepare=False)
    names = [column.name for column in cur.description or []]
    risks = [DbRisk(**dict(zip(names, row))) for row in cur.fetchall()]
    schedulers = [SchedulerRow(*row) for row in cur.execute(queries.METRIC_SCHEDULERS, prepare=False).fetchall()]
    pools = [PoolRow(*row) for row in cur.execute(queries.METRIC_POOLS, prepare=False).fetchall()]
    if audit:
        differences = _count(cur.execute(queries.STATE_DIFFERENCES, prepare=False).fetchone())
        duplicates = _count(cur.execute(queries.DUPLICATE_COUNT, prepare=False).fetchone())
    return Snapshot(jobs, alerts, differences, duplicates, risks, schedulers, pools)


def _count(row: tuple[Any, ...] | None) -> int:
    return int(row[0]) if row else 0


#: A family of samples: name, type, help, label names, samples (label values, value). What
#: :func:`families` makes prometheus_client's objects of (for a registry of one's own) and
#: :func:`text` writes as the text exposition.
Family = tuple[str, str, str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]


@dataclass(frozen=True)
class Col:
    """A column of ``queries.METRIC_JOBS`` (:class:`JobRow`'s field) as a label value or a sample's value."""

    name: str


#: One series of a job's family: its label values (a constant or a column) and its value (a
#: constant or a column; a row whose column is None has no sample of it).
Series = tuple[tuple[str | Col, ...], Col | int]
JobFamily = tuple[str, str, str, tuple[str, ...], tuple[Series, ...]]

_JOB = Col("job")

#: The one definition of the families with a series per job: name, type, help, label names,
#: each job's series. Both writers derive from it: the Python one (:func:`samples`, for
#: :func:`families`: prometheus_client's objects) and the query that has PostgreSQL write the
#: lines (:func:`_job_text_query`, for :func:`text`'s scrape: a scrape of 100,000 jobs is 1.3
#: million lines, and Python building them took 70 to 110 us a job).
JOB_FAMILIES: tuple[JobFamily, ...] = (
    ("jobledger_job_state", "gauge", "1 for the job's state, the ledger's word (ledger.job_health.state)",
     ("job", "state"), (((_JOB, Col("state")), 1),)),
    ("jobledger_runs_started", "counter", "Runs started", ("job",), (((_JOB,), Col("runs_started")),)),
    ("jobledger_runs", "counter", "Runs ended, by status (success, failure)", ("job", "status"),
     (((_JOB, "success"), Col("successes")), ((_JOB, "failure"), Col("failures")))),
    ("jobledger_runs_running", "gauge", "1 while a run of the job is live", ("job",), (((_JOB,), Col("running")),)),
    ("jobledger_skipped", "counter", "Skips: starts that met another owner's lease (overlap), "
     "slots dropped by the catch-up bound (backfill_limit), starts the job's full pool refused (pool_full)",
     ("job", "reason"),
     (((_JOB, "overlap"), Col("skipped_overlap")), ((_JOB, "backfill_limit"), Col("skipped_backfill")),
      ((_JOB, "pool_full"), Col("skipped_pool_full")))),
    ("jobledger_leases_lost", "counter", "Runs closed because their lease expired or was superseded", ("job",),
     (((_JOB,), Col("leases_lost")),)),
    ("jobledger_run_duration_seconds", "gauge", "The longest successful run (quantile 1)", ("job", "quantile"),
     (((_JOB, "1"), Col("longest_success_seconds")),)),
    ("jobledger_last_success_duration_seconds", "gauge", "How long the newest success took", ("job",),
     (((_JOB,), Col("last_success_seconds")),)),
    ("jobledger_run_failure_ratio", "gauge", "Failures / ended runs", ("job",), (((_JOB,), Col("failure_ratio")),)),
    ("jobledger_consecutive_failures", "gauge", "Failures in a row since the last success", ("job",),
     (((_JOB,), Col("consecutive_failures")),)),
    ("jobledger_job_ttl_seconds", "gauge", "The job's lease ttl", ("job",), (((_JOB,), Col("ttl_seconds")),)),
    ("jobledger_run_running_seconds", "gauge", "How long the job's live run has run", ("job",),
     (((_JOB,), Col("running_seconds")),)),
)


def _job_samples(jobs: list[JobRow]) -> list[Family]:
    """:data:`JOB_FAMILIES` over the jobs' rows, in Python."""
    out: list[Family] = []
    for name, kind, documentation, labels, series in JOB_FAMILIES:
        found: list[tuple[tuple[str, ...], float]] = []
        for job in jobs:
            for values, value in series:
                number = getattr(job, value.name) if isinstance(value, Col) else value
                if number is not None:
                    found.append((tuple(getattr(job, v.name) if isinstance(v, Col) else v for v in values), number))
        out.append((name, kind, documentation, labels, found))
    return out


def _escape(value: str) -> str:
    """A label value as the text format writes it (backslash, double quote and line feed escaped)."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _sql_label(column: str) -> str:
    """A label value as the text format writes it (backslash, double quote, line feed escaped), in SQL."""
    return (f"replace(replace(replace(m.{column}, '\\', '\\\\'), '\"', '\\\"'), "
            f"chr(10), '\\n')")


def _sql_number(column: str) -> str:
    """A value as the Python writer spells it (``repr(float(value))``): float8's text is the
    shortest that reads back the same, as Python's (``extra_float_digits`` 1, set with the
    query); a whole number below 1e15 gets Python's ``.0``; infinities are +Inf and -Inf, NaN NaN."""
    if JobRow.__annotations__[column] == "int":
        return f"q.{column}::text || '.0'"
    value = f"q.{column}::float8"
    return (f"CASE WHEN {value} = 'Infinity' THEN '+Inf' WHEN {value} = '-Infinity' THEN '-Inf' "
            f"WHEN {value} = trunc({value}) AND abs({value}) < 1e15 THEN {value}::text || '.0' "
            f"ELSE {value}::text END")


def _sql_concat(pieces: list[str | Col]) -> str:
    """The pieces (text, or an SQL expression as a Col) joined with ``||``, adjacent texts as one literal."""
    merged: list[str | Col] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    return " || ".join(piece.name if isinstance(piece, Col) else _sql_string(piece) for piece in merged)


def _job_text_query() -> str:
    """One row: each of :data:`JOB_FAMILIES`' sample lines, written by PostgreSQL, as UTF-8 bytes,
    and last the alerts by kind (``{kind: count}``, counted from the same rows).

    Generated here from the family table rather than written out in ``ledger.queries``: it is
    the table's second writer, and must change with it. It reads ``queries.METRIC_JOBS`` (one
    state row per job) once, each job's label values escaped once; a series whose value is NULL
    writes nothing (``||`` is NULL, ``concat`` and ``string_agg`` skip it). The lines come in the
    order of the jobs (the sorted rows, as the Python writer's); nothing in the format depends
    on it."""
    label_columns = sorted({v.name for *_, series in JOB_FAMILIES for values, _ in series
                            for v in values if isinstance(v, Col)})
    escaped = ", ".join(f"{_sql_label(c)} AS label_{c}" for c in label_columns)
    columns = []
    for name, kind, _, labels, series in JOB_FAMILIES:
        sample = f"{name}_total" if kind == "counter" else name
        lines = []
        for values, value in series:
            pieces: list[str | Col] = [sample, "{"]
            for i, (label, v) in enumerate(zip(labels, values)):
                pieces += [("," if i else "") + label + '="',
                           Col(f"q.label_{v.name}") if isinstance(v, Col) else _escape(v), '"']
            pieces.append("} ")
            pieces.append(Col(_sql_number(value.name)) if isinstance(value, Col) else repr(float(value)))
            pieces.append("\n")
            lines.append(_sql_concat(pieces))
        columns.append(f"convert_to(coalesce(string_agg(concat({', '.join(lines)}), ''), ''), 'UTF8')")
    return queries.metric_job_text(", ".join(columns), escaped)


#: The generated query (built once: the family table does not change while the process runs).
JOB_TEXT = _job_text_query()


def samples(snapshot: Snapshot) -> list[Family]:
    """The metric families of one snapshot (without ``jobledger_up``), as plain tuples."""
    return _job_samples(snapshot.jobs) + _other_samples(snapshot)


def _other_samples(snapshot: Snapshot) -> list[Family]:
    """The families after :data:`JOB_FAMILIES`: the alerts, the audits, the database's risks."""
    out: list[Family] = [
        ("jobledger_alerts", "gauge", "Live rows of ledger.alerts, by kind", ("alert",),
         [((kind,), snapshot.alerts.get(kind, 0)) for kind in sorted(set(ALERT_KINDS) | set(snapshot.alerts))]),
    ]
    if snapshot.state_differences is not None:
        out.append(("jobledger_state_differences", "gauge", "Jobs whose stored state differs from the log's "
                    "(ledger.verify_state; always 0 when the ledger holds)", (),
                    [((), snapshot.state_differences)]))
    if snapshot.duplicates is not None:
        out.append(("jobledger_duplicates", "gauge", "Slots and idempotency keys that succeeded twice, over each "
                    "job's newest 1,000 successes (ledger.duplicates; always 0 when the ledger holds)", (),
                    [((), snapshot.duplicates)]))
    return (out + _risk_samples(snapshot.risks) + _scheduler_samples(snapshot.schedulers)
            + _pool_samples(snapshot.pools))


def _risk_samples(risks: Iterable[DbRisk]) -> list[Family]:
    """The families of ``ledger.db_risks``' rows (a few rows, whatever the number of jobs)."""
    risk: list[tuple[tuple[str, ...], float]] = []
    horizon_xids: list[tuple[tuple[str, ...], float]] = []
    horizon_seconds: list[tuple[tuple[str, ...], float]] = []
    holder: list[tuple[tuple[str, ...], float]] = []
    dead: list[tuple[tuple[str, ...], float]] = []
    for row in risks:
        risk.append(((row.kind, row.relation or ""), SEVERITIES.index(row.severity)))
        if row.kind == "xmin_horizon":
            horizon_xids.append(((), row.value or 0))
            if row.holder is None:
                horizon_seconds.append(((), 0))
            elif row.age is not None:
                horizon_seconds.append(((), row.age.total_seconds()))
            if row.holder is not None and row.severity != "ok":
                holder.append(((row.holder_type or "", row.holder, row.application_name or ""), 1))
        elif row.kind == "dead_rows":
            dead.append(((row.relation or "",), row.value or 0))
    return [
        ("jobledger_db_risk", "gauge", "ledger.db_risks by severity: 0 ok, 1 warn, 2 critical",
         ("kind", "relation"), risk),
        ("jobledger_xmin_horizon_age_transactions", "gauge", "Transactions started since the oldest snapshot, "
         "transaction, slot or prepared transaction holding vacuum back", (), horizon_xids),
        ("jobledger_xmin_horizon_age_seconds", "gauge", "How long the xmin horizon's oldest holder has held it "
         "(none when hidden from the reader)", (), horizon_seconds),
        ("jobledger_xmin_horizon_holder", "gauge", "1 for the holder of the xmin horizon while its risk is warn "
         "or critical", ("holder_type", "holder", "application_name"), holder),
        ("jobledger_dead_rows", "gauge", "Dead row versions on the ledger's hot tables", ("relation",), dead),
    ]


def _scheduler_samples(rows: Iterable[SchedulerRow]) -> list[Family]:
    """The families of ``ledger.schedulers``' rows (one per scheduler process, whatever the number of jobs).

    No alert rule of its own: a job whose every scheduler expired is ``down`` (its
    state says why), which JobLedgerJobDown already raises."""
    found = list(rows)
    return [
        ("jobledger_schedulers", "gauge", "Live schedulers (ledger.schedulers rows not expired)", (),
         [((), sum(1 for row in found if row.live))]),
        ("jobledger_scheduler_up", "gauge", "1 for a live scheduler, 0 for an expired one (it died)",
         ("scheduler", "host"), [((row.scheduler, row.host), 1 if row.live else 0) for row in found]),
        ("jobledger_scheduler_heartbeat_age_seconds", "gauge", "Seconds since the scheduler's last heartbeat",
         ("scheduler", "host"), [((row.scheduler, row.host), row.heartbeat_age_seconds) for row in found]),
        ("jobledger_scheduler_jobs", "gauge", "The jobs the scheduler serves", ("scheduler",),
         [((row.scheduler,), row.jobs) for row in found]),
        ("jobledger_upkeep_leader", "gauge", "1 for the scheduler that runs the ledger's upkeep now",
         ("scheduler",), [((row.scheduler,), 1) for row in found if row.leader]),
    ]


def _pool_samples(rows: Iterable[PoolRow]) -> list[Family]:
    """The families of ``ledger.pool_status``' rows (one per pool). ``used / size`` is how full a pool
    is; at 1 a start of its jobs is skipped (``jobledger_skipped_total{reason="pool_full"}``)."""
    found = list(rows)
    return [
        ("jobledger_pool_size", "gauge", "The pool's size: at most this many live leases of its jobs at once",
         ("pool",), [((row.pool,), row.size) for row in found]),
        ("jobledger_pool_used", "gauge", "The pool's live leases (a start is skipped while used >= size)",
         ("pool",), [((row.pool,), row.used) for row in found]),
        ("jobledger_pool_running", "gauge", "The running runs of the pool's jobs", ("pool",),
         [((row.pool,), row.running) for row in found]),
        ("jobledger_pool_jobs", "gauge", "The jobs that belong to the pool", ("pool",),
         [((row.pool,), row.jobs) for row in found]),
        ("jobledger_pool_waiting", "gauge", "The pool's jobs a scheduler found it full for, waiting a place",
         ("pool",), [((row.pool,), row.waiting) for row in found]),
    ]


def families(snapshot: Snapshot) -> Iterator[Metric]:
    """The metric families of one snapshot (without ``jobledger_up``), as prometheus_client's objects."""
    for name, kind, documentation, labels, found in samples(snapshot):
        family: Metric
        if kind == "counter":
            family = CounterMetricFamily(name, documentation, labels=list(labels))
        else:
            family = GaugeMetricFamily(name, documentation, labels=list(labels))
        for values, value in found:
            family.add_metric(list(values), value)
        yield family


def _header(name: str, kind: str, documentation: str) -> str:
    """A family's HELP and TYPE lines, as prometheus_client writes them (help: backslash and line feed escaped)."""
    sample = f"{name}_total" if kind == "counter" else name
    return (f"# HELP {sample} {documentation.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + 'n')}\n"
            f"# TYPE {sample} {kind}\n")


def read_text(conn: psycopg.Connection[Any], timeout: timedelta = DEFAULT_TIMEOUT, *, audit: bool = False,
              connect_part: Callable[[], AbstractContextManager[psycopg.Connection[Any]]] | None = None,
              parts: int = DEFAULT_PARTS, parts_from_jobs: int = PARTS_FROM_JOBS) -> bytes:
    """One scrape as the text exposition (without ``jobledger_up``), read as :func:`read_snapshot`
    reads, the same families as ``text(samples(read_snapshot(...)))``: the per-job lines written
    by PostgreSQL (:data:`JOB_TEXT`, read as bytes), the rest by :func:`text`.

    With ``connect_part`` (what :class:`LedgerCollector` connects with), a ledger of
    ``parts_from_jobs`` jobs or more is read in ``parts`` ranges of jobs at once: this
    connection's transaction exports its snapshot, each other part reads it on a connection of
    ``connect_part`` (``SET TRANSACTION SNAPSHOT``), and the lines are joined in job order, so the
    text is the one a single read writes. PostgreSQL 15 runs ``string_agg`` on one core: the
    parts put the scrape on as many (BENCHMARKS.md). Each part's clock is its transaction's
    start, milliseconds apart."""
    return b"".join(_text_pieces(conn, timeout, audit, connect_part, parts, parts_from_jobs))


def _text_pieces(conn: psycopg.Connection[Any], timeout: timedelta, audit: bool,
                 connect_part: Callable[[], AbstractContextManager[psycopg.Connection[Any]]] | None,
                 parts: int, parts_from_jobs: int) -> list[bytes]:
    """:func:`read_text`'s text in pieces (72.7 MB over 100,000 jobs: joined once, by the caller)."""
    if parts < 1:
        raise ValueError("parts must be at least 1")
    with read_only_transaction(conn, timeout, repeatable_read=True) as cur:
        # float8's shortest exact text, whatever the session's setting (0 would round)
        cur.execute(queries.EXTRA_FLOAT_DIGITS, prepare=False)
        bounds: list[str] = []
        if connect_part is not None and parts > 1:
            bounds = [row[0] for row in cur.execute(queries.METRIC_PART_BOUNDS,
                                                    {"parts": parts, "from_jobs": parts_from_jobs},
                                                    prepare=False).fetchall()]
        found = _job_text(cur, bounds, connect_part, timeout)
        rest = _read_rest(cur, [], found.alerts, audit)
    out = [piece for (name, kind, documentation, _, _), bodies in zip(JOB_FAMILIES, found.bodies)
           for piece in (_header(name, kind, documentation).encode(), *bodies)]
    out.append(text(_other_samples(rest)))
    return out


@dataclass(frozen=True)
class _JobText:
    """What :data:`JOB_TEXT` read: each family's lines (a piece per part, in the jobs' order), and
    the alerts by kind."""

    bodies: list[list[bytes]]
    alerts: dict[str, int]

    @classmethod
    def of(cls, row: tuple[Any, ...] | None) -> _JobText:
        assert row is not None  # an aggregate without GROUP BY: always one row
        *bodies, alerts = row
        return cls([[body] for body in bodies], {str(kind): int(n) for kind, n in alerts.items()})

    @classmethod
    def joined(cls, parts: list[_JobText]) -> _JobText:
        """The parts' lines one after the other, in their order (the jobs' order), the alerts added up."""
        alerts: Counter[str] = Counter()
        for part in parts:
            alerts.update(part.alerts)
        return cls([[body for bodies in family for body in bodies] for family in zip(*(part.bodies for part in parts))],
                   dict(alerts))


def _read_job_text(cur: psycopg.Cursor[Any], first: str | None, end: str | None) -> _JobText:
    return _JobText.of(cur.execute(JOB_TEXT, {"first": first, "end": end}, prepare=False, binary=True).fetchone())


def _job_text(cur: psycopg.Cursor[Any], bounds: list[str],
              connect_part: Callable[[], AbstractContextManager[psycopg.Connection[Any]]] | None,
              timeout: timedelta) -> _JobText:
    """The job lines, in one part (no bounds) or in ``len(bounds) + 1``: this transaction reads the
    first, a thread per other part reads its range in this transaction's exported snapshot."""
    if not bounds:
        return _read_job_text(cur, None, None)
    assert connect_part is not None
    row = cur.execute(queries.EXPORT_SNAPSHOT, prepare=False).fetchone()
    assert row is not None
    snapshot = str(row[0])
    cur.execute(queries.PART_SETTINGS, prepare=False)

    def other(first: str, end: str | None) -> _JobText:
        with connect_part() as part, read_only_transaction(part, timeout, snapshot=snapshot) as part_cur:
            part_cur.execute(queries.PART_SETTINGS, prepare=False)
            return _read_job_text(part_cur, first, end)

    # the exporting transaction stays open until every other part has read (its snapshot lives with it)
    with ThreadPoolExecutor(max_workers=len(bounds), thread_name_prefix="jobledger-scrape") as pool:
        others = [pool.submit(other, first, end) for first, end in zip(bounds, [*bounds[1:], None])]
        mine = _read_job_text(cur, None, bounds[0])
        return _JobText.joined([mine, *(future.result() for future in others)])


def text(found: list[Family]) -> bytes:
    """The families in the Prometheus text exposition format (0.0.4), as prometheus_client writes it
    (a counter's samples are ``NAME_total``; values as Python writes a float, which Prometheus reads)."""
    out: list[str] = []
    for name, kind, documentation, labels, values in found:
        sample = f"{name}_total" if kind == "counter" else name
        out.append(_header(name, kind, documentation))
        if len(labels) == 1:
            label = labels[0]
            out.extend(f'{sample}{{{label}="{_escape(v[0])}"}} {float(value)!r}\n' for v, value in values)
        elif labels:
            out.extend(sample + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in zip(labels, names)) + "} "
                       + repr(float(value)) + "\n" for names, value in values)
        else:
            out.extend(f"{sample} {float(value)!r}\n" for _, value in values)
    return "".join(out).encode()


class LedgerCollector:
    """Reads the ledger on every scrape (``registry.register(LedgerCollector(...))``).

    ``connect`` opens a connection (closed after the scrape; ``ledger.connect.connect``
    gives one with the ledger's settings, e.g. ``lambda: connect(dsn)``), or gives a
    context manager of one (e.g. a pool's ``connection``: given back after the
    scrape, as the dashboard's ``/metrics`` does). When the read
    fails, the scrape still answers, with ``jobledger_up 0``, and ``on_error``
    hears why; with ``raise_errors`` the error propagates instead (one-shot use). With
    ``audit``, every scrape runs the audits too (:func:`read_snapshot`). :meth:`text` reads a
    ledger of :data:`PARTS_FROM_JOBS` jobs or more in ``parts`` parts at once, each on a
    connection of ``connect`` (:func:`read_text`; 1: one connection, one part).
    """

    def __init__(self, connect: Callable[[], AbstractContextManager[psycopg.Connection[Any]]], *,
                 timeout: timedelta = DEFAULT_TIMEOUT, raise_errors: bool = False,
                 on_error: Callable[[Exception], None] | None = None, audit: bool = False,
                 parts: int = DEFAULT_PARTS) -> None:
        if parts < 1:
            raise ValueError("parts must be at least 1")
        self._connect = connect
        self._parts = parts
        self._audit = audit
        self._timeout = timeout
        self._raise_errors = raise_errors
        self._on_error = on_error

    def describe(self) -> Iterable[Metric]:
        return []  # no read at registration time: the database may not be up yet

    def _read(self) -> Snapshot | None:
        """One snapshot, or None when the read failed (``on_error`` heard why)."""
        try:
            with self._connect() as conn:
                return read_snapshot(conn, self._timeout, audit=self._audit)
        except psycopg.Error as error:
            self._failed(error)
            return None

    def _failed(self, error: psycopg.Error) -> None:
        if self._raise_errors:
            raise error
        if self._on_error is not None:
            self._on_error(error)

    def collect(self) -> Iterable[Metric]:
        snapshot = self._read()
        up = GaugeMetricFamily("jobledger_up", UP_HELP)
        up.add_metric([], 0 if snapshot is None else 1)
        return [up] if snapshot is None else [up, *families(snapshot)]

    def text(self) -> bytes:
        """One scrape as the text exposition, the same families as :meth:`collect` (written
        directly: what ``jobledger metrics`` and the dashboard's ``/metrics`` answer)."""
        try:
            with self._connect() as conn:
                pieces = _text_pieces(conn, self._timeout, self._audit, self._connect, self._parts, PARTS_FROM_JOBS)
        except psycopg.Error as error:
            self._failed(error)
            return text([("jobledger_up", "gauge", UP_HELP, (), [((), 0)])])
        # joined once: over 100,000 jobs each copy of the text is 72.7 MB
        return b"".join([text([("jobledger_up", "gauge", UP_HELP, (), [((), 1)])]), *pieces])


def registry(collector: LedgerCollector) -> CollectorRegistry:
    """A registry of its own (not the process-wide default, which has Python's own metrics)."""
    result = CollectorRegistry(auto_describe=False)
    result.register(collector)
    return result


def exposition(connect: Callable[[], psycopg.Connection[Any]],
               timeout: timedelta = DEFAULT_TIMEOUT, *, audit: bool = False, parts: int = DEFAULT_PARTS) -> str:
    """One scrape, as Prometheus text exposition; database errors propagate."""
    return LedgerCollector(connect, timeout=timeout, raise_errors=True, audit=audit, parts=parts).text().decode()


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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per scrape on stderr."""


def serve(collector: LedgerCollector, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve the metrics on host:port (any path, as prometheus_client's server does) in a
    background thread (port 0: any free port)."""
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = collector.text()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body] if environ.get("REQUEST_METHOD") != "HEAD" else []

    server_class: type[_Server] = _Server
    if ":" in host:  # an IPv6 address
        server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
    server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="jobledger-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
