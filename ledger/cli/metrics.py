"""`jobledger metrics`: Prometheus metrics of the ledger, printed once or served (``ledger.metrics``)."""

from __future__ import annotations

import signal
import sys
import threading
from datetime import timedelta
from types import FrameType
from typing import Any

import click
import psycopg

from ledger.cli._options import DURATION, connect, dsn_option
from ledger.cli._output import say
from ledger.metrics import DEFAULT_PARTS, PARTS_FROM_JOBS, LedgerCollector, serve
from ledger.text import first_line


@click.command()
@click.option("--serve", "port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve /metrics on PORT for Prometheus to scrape (0: any free port) "
                   "instead of printing once.")
@click.option("--host", default=None, metavar="ADDRESS",
              help="Address to bind with --serve  [default: 127.0.0.1; 0.0.0.0 for every interface]")
@click.option("--timeout", type=DURATION, default="10s", show_default=True,
              help="statement_timeout of each query of a scrape.")
@click.option("--parts", type=click.IntRange(1, 16), default=DEFAULT_PARTS, show_default=True,
              help=f"Read a ledger of {PARTS_FROM_JOBS:,} jobs or more in this many ranges of jobs at once, "
                   "each on a connection of its own, in one snapshot (1: one connection).")
@click.option("--audit", is_flag=True,
              help="Also the audits, which read the whole log (seconds on a large one): "
                   "jobledger_state_differences (ledger.verify_state) and jobledger_duplicates.")
@dsn_option
def metrics(port: int | None, host: str | None, timeout: timedelta, parts: int, audit: bool, dsn: str) -> None:
    """Prometheus metrics of the ledger, read from each job's state row (text exposition format).

    Once on stdout, or on every scrape with --serve (stop with SIGTERM or Ctrl-C).
    Metrics: jobledger_up, jobledger_job_state{state} (1 for the job's state),
    jobledger_runs_started_total, jobledger_runs_total{status}, jobledger_runs_running,
    jobledger_skipped_total{reason}, jobledger_leases_lost_total,
    jobledger_run_duration_seconds{quantile="1"}, jobledger_last_success_duration_seconds,
    jobledger_run_failure_ratio, jobledger_consecutive_failures, jobledger_job_ttl_seconds,
    jobledger_run_running_seconds (all by job) and jobledger_alerts{alert}; the database's
    risks to the ledger (ledger.db_risks): jobledger_db_risk{kind,relation},
    jobledger_xmin_horizon_age_transactions, jobledger_xmin_horizon_age_seconds,
    jobledger_xmin_horizon_holder and jobledger_dead_rows{relation}; with --audit,
    jobledger_state_differences and jobledger_duplicates.
    """
    def open_connection() -> psycopg.Connection[Any]:
        return connect(dsn)

    if port is None:
        if host is not None:
            raise click.UsageError("--host only applies with --serve PORT")
        # the bytes as read (72.7 MB over 100,000 jobs: not decoded into text to be encoded again)
        click.echo(LedgerCollector(open_connection, timeout=timeout, raise_errors=True, audit=audit,
                                   parts=parts).text(), nl=False)
        return

    def scrape_failed(error: Exception) -> None:
        say(f"scrape failed, answering jobledger_up 0: {first_line(error)}")

    collector = LedgerCollector(open_connection, timeout=timeout, on_error=scrape_failed, audit=audit, parts=parts)
    try:
        server = serve(collector, port, host or "127.0.0.1")
    except OSError as error:
        raise click.ClickException(f"cannot listen on {host or '127.0.0.1'}:{port}: "
                                   f"{error.strerror or error}") from error
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {signum: signal.signal(signum, request_stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        say(f"serving metrics on {server.url} (SIGTERM or Ctrl-C to stop)")
        sys.stderr.flush()
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    say("metrics server stopped")


COMMANDS = (metrics,)
