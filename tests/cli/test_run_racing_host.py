"""A scheduled job's losing overlap, counted as docs/cli.md says ("A skip").

Two kinds of "someone else runs it now" end `jobledger run` without running
CMD, exit 0 (or --skip-exit-code):

- a skip, ``skipped: held by HOLDER until TIME``: the start met another
  owner's live lease (``ledger.start_run``'s ``skipped_overlap``). It is
  counted: ``job_status.skipped_overlap``, the metric
  ``jobledger_skipped_total{reason="overlap"}``.
- a scheduled job whose due slot another host is running right now: the
  ledger answers ``nothing_due`` (the slot is taken), the wrapper says who
  runs it, and nothing is counted: no start met the lease, and the slot runs
  once, on the other host.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from clihelp import jobledger
from repo import DOCS

CLI_DOCS = DOCS / "cli.md"


def _counted(dsn: str, job: str) -> tuple[int, float]:
    """(job_status.skipped_overlap, jobledger_skipped_total{reason="overlap"}) of ``job``."""
    status = jobledger("status", job, "--json", dsn=dsn)
    assert status.returncode == 0, status.stderr
    skipped = re.search(r'"skipped_overlap": (\d+)', status.stdout)
    assert skipped, status.stdout
    scrape = jobledger("metrics", dsn=dsn)
    assert scrape.returncode == 0, scrape.stderr
    [metric] = [family for family in text_string_to_metric_families(scrape.stdout)
                if family.name == "jobledger_skipped"]
    [overlap] = [sample.value for sample in metric.samples
                 if sample.labels == {"job": job, "reason": "overlap"} and sample.name.endswith("_total")]
    return int(skipped.group(1)), overlap


def test_a_skip_is_counted(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'export', ttl => '1 minute')")
    assert db.execute("SELECT outcome FROM ledger.start_run(job => 'export', owner => 'host-1')").fetchone() == (
        "started",)
    result = jobledger("run", "export", "--", "touch", str(tmp_path / "ran"), dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "skipped: held by host-1" in result.stderr
    assert _counted(dsn, "export") == (1, 1.0)


def test_the_racing_host_of_a_scheduled_job_is_not_counted(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_job(job => 'nightly', schedule => '1 day', ttl => '1 minute')")
    assert db.execute("SELECT outcome FROM ledger.start_due_run(job => 'nightly', owner => 'host-1')").fetchone() == (
        "started",)
    marker = tmp_path / "ran"
    result = jobledger("run", "nightly", "--skip-exit-code", "75", "--", "touch", str(marker), dsn=dsn)
    assert result.returncode == 75, result.stderr  # exits as for a skip
    assert "nothing due: slot" in result.stderr and "is being run by host-1" in result.stderr
    assert not marker.exists()
    assert _counted(dsn, "nightly") == (0, 0.0)  # not a skip: nothing counted


def test_the_docs_say_the_racing_host_is_not_counted():
    text = " ".join(CLI_DOCS.read_text().split())
    assert "A skip is counted as a skip (`skipped_overlap`" in text
    assert ("is being run by OWNER (lease until TIME)`, and exits as for a skip. That is not counted as a skip"
            in text)
