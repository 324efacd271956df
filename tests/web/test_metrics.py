"""`jobledger metrics`: Prometheus exposition of the ledger's views, once or served.

The ledger is built through the SQL API; the exposition must parse with
prometheus_client's own parser and carry the numbers of what was done.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clockseam import LedgerClock
from ledger.cli import main
from ledger.metrics import LedgerCollector, exposition, registry
from sqlhelp import one, rows


def _run(conn: psycopg.Connection, job: str, owner: str, fail: str | None = None) -> None:
    started = one(conn, "SELECT * FROM ledger.start_run(job => %s, owner => %s)", (job, owner))
    assert started is not None and started["outcome"] == "started"
    if fail is None:
        conn.execute("SELECT ledger.complete_run(%s, %s)", (started["run_id"], started["token"]))
    else:
        conn.execute("SELECT ledger.fail_run(%s, %s, %s)", (started["run_id"], started["token"], fail))


@pytest.fixture
def ledger(db) -> dict[str, Any]:
    """A ledger with successes, a failure, an overlap skip, a lost lease, dropped slots, an overdue job."""
    db.execute("SELECT ledger.register_job('etl', ttl => '10 minutes')")
    _run(db, "etl", "host-a")
    _run(db, "etl", "host-a")
    held = one(db, "SELECT * FROM ledger.start_run('etl', 'host-a')")
    skipped = one(db, "SELECT * FROM ledger.start_run('etl', 'host-b')")
    assert held is not None and skipped is not None and skipped["outcome"] == "skipped_overlap"
    db.execute("SELECT ledger.fail_run(%s, %s, 'boom')", (held["run_id"], held["token"]))

    # the same owner starts again while its run is running: the first is superseded (lease lost)
    db.execute("SELECT ledger.register_job('lost', ttl => '10 minutes')")
    db.execute("SELECT ledger.start_run('lost', 'host-a')")
    db.execute("SELECT ledger.start_run('lost', 'host-a')")

    db.execute("SELECT ledger.register_job('tick', '200 milliseconds', ttl => '1 hour', max_backfill => 1)")
    db.execute("SELECT ledger.register_job('late', '100 milliseconds', ttl => '100 milliseconds', "
               "late_after => '100 milliseconds')")
    first = one(db, "SELECT * FROM ledger.start_due_run('tick', 'host-a')")
    assert first is not None
    db.execute("SELECT ledger.complete_run(%s, %s)", (first["run_id"], first["token"]))
    LedgerClock(db).advance(timedelta(milliseconds=700))  # tick misses slots (the bound of 1 drops them); late never runs: overdue
    second = one(db, "SELECT * FROM ledger.start_due_run('tick', 'host-a')")
    assert second is not None and second["outcome"] == "started"
    db.execute("SELECT ledger.complete_run(%s, %s)", (second["run_id"], second["token"]))
    dropped = round((second["slot"] - first["slot"]) / timedelta(milliseconds=200)) - 1
    assert dropped >= 1

    etl = sorted((r["completed_at"] - r["started_at"]).total_seconds() for r in rows(
        db, "SELECT started_at, completed_at FROM ledger.job_execution_log WHERE job = 'etl' AND status = 'success'"))
    return {"dropped": dropped, "etl_durations": etl}


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _at(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_the_exposition_parses_and_carries_the_ledgers_numbers(dsn, ledger):
    text = exposition(lambda: psycopg.connect(dsn, autocommit=True))
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families["jobledger_runs"] == "counter" and families["jobledger_skipped"] == "counter"
    assert families["jobledger_job_state"] == "gauge" and "jobledger_job_overdue" not in families
    samples = _samples(text)
    assert _at(samples, "jobledger_up") == 1
    assert _at(samples, "jobledger_runs_started_total", job="etl") == 3
    assert _at(samples, "jobledger_runs_total", job="etl", status="success") == 2
    assert _at(samples, "jobledger_runs_total", job="etl", status="failure") == 1
    assert _at(samples, "jobledger_skipped_total", job="etl", reason="overlap") == 1
    assert _at(samples, "jobledger_skipped_total", job="etl", reason="backfill_limit") == 0
    assert _at(samples, "jobledger_skipped_total", job="tick", reason="backfill_limit") == ledger["dropped"]
    assert _at(samples, "jobledger_leases_lost_total", job="lost") == 1
    assert _at(samples, "jobledger_leases_lost_total", job="etl") == 0
    assert _at(samples, "jobledger_runs_total", job="lost", status="failure") == 1
    assert _at(samples, "jobledger_runs_running", job="lost") == 1
    assert _at(samples, "jobledger_runs_running", job="etl") == 0
    # each job's one state, the ledger's word: late never ran, so it is down
    assert _at(samples, "jobledger_job_state", job="late", state="down") == 1
    assert _at(samples, "jobledger_job_state", job="etl", state="failing") == 1
    assert _at(samples, "jobledger_job_state", job="lost", state="running") == 1
    assert [name for name, labels in samples if name == "jobledger_job_state" and ("job", "etl") in labels] == [
        "jobledger_job_state"]  # one series per job
    assert _at(samples, "jobledger_alerts", alert="down") == 1
    assert _at(samples, "jobledger_alerts", alert="overlap") == 0
    assert _at(samples, "jobledger_alerts", alert="too_fast") == 0
    assert "jobledger_duplicates" not in families and "jobledger_state_differences" not in families  # --audit
    assert _at(samples, "jobledger_consecutive_failures", job="etl") == 1
    assert _at(samples, "jobledger_run_failure_ratio", job="etl") == pytest.approx(1 / 3, abs=1e-4)
    etl = ledger["etl_durations"]  # two successes: the longest is the state row's (quantile 1 alone)
    assert _at(samples, "jobledger_run_duration_seconds", job="etl", quantile="1") == pytest.approx(etl[1], abs=1e-6)
    assert [labels for name, labels in samples if name == "jobledger_run_duration_seconds"
            and ("job", "etl") in labels] == [frozenset({("job", "etl"), ("quantile", "1")})]
    newest = _at(samples, "jobledger_last_success_duration_seconds", job="etl")  # the newer of the two
    assert any(newest == pytest.approx(duration, abs=1e-6) for duration in etl)


def test_the_audits_are_read_when_asked(dsn, ledger):
    samples = _samples(exposition(lambda: psycopg.connect(dsn, autocommit=True), audit=True))
    assert _at(samples, "jobledger_state_differences") == 0  # ledger.verify_state is empty
    assert _at(samples, "jobledger_duplicates") == 0
    result = CliRunner().invoke(main, ["metrics", "--audit", "--dsn", dsn])
    assert result.exit_code == 0 and "jobledger_state_differences 0.0" in result.output, result.output
    # a job with no success has no duration samples rather than zeros
    assert ("jobledger_run_duration_seconds", frozenset({("job", "lost"), ("quantile", "1")})) not in samples


def test_the_cli_prints_the_exposition_once(dsn, ledger):
    result = CliRunner().invoke(main, ["metrics", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    samples = _samples(result.output)
    assert _at(samples, "jobledger_runs_total", job="etl", status="success") == 2


def test_a_failed_scrape_answers_up_0_and_says_why():
    errors: list[Exception] = []
    collector = LedgerCollector(
        lambda: psycopg.connect("host=127.0.0.1 port=1 dbname=none connect_timeout=2"), on_error=errors.append)
    samples = _samples(generate_latest(registry(collector)).decode())
    assert samples == {("jobledger_up", frozenset()): 0.0}
    assert len(errors) == 1 and isinstance(errors[0], psycopg.OperationalError)


def test_the_one_shot_cli_fails_in_one_line_when_the_database_is_down():
    result = CliRunner().invoke(main, ["metrics", "--dsn", "host=127.0.0.1 port=1 connect_timeout=2"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1


def test_host_without_serve_is_a_usage_error(dsn):
    result = CliRunner().invoke(main, ["metrics", "--dsn", dsn, "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "--host only applies with --serve" in result.output


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _read_stderr_until(proc: subprocess.Popen[str], needle: str, seconds: float) -> str:
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + seconds
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise AssertionError(f"no {needle!r} on stderr in {seconds}s; got {seen!r}")
        ready, _, _ = select.select([proc.stderr], [], [], left)
        if ready:
            seen += proc.stderr.readline()
    return seen


def test_serve_answers_a_scrape_on_localhost_and_stops_cleanly_on_sigterm(dsn, ledger):
    port = _free_port()
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledger", "metrics", "--dsn", dsn, "--serve", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        _read_stderr_until(proc, f"serving metrics on {url}", 30)
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            body = response.read().decode()
        samples = _samples(body)
        assert _at(samples, "jobledger_up") == 1
        assert _at(samples, "jobledger_skipped_total", job="etl", reason="overlap") == 1
        # each scrape reads the views again
        with psycopg.connect(dsn, autocommit=True) as conn:
            _run(conn, "etl", "host-c")
        with urllib.request.urlopen(url, timeout=10) as response:
            again = _samples(response.read().decode())
        assert _at(again, "jobledger_runs_total", job="etl", status="success") == 3

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None and "metrics server stopped" in proc.stderr.read()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
