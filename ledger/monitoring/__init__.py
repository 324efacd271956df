"""Monitoring the ledger from Prometheus: alert rules and a Grafana dashboard, shipped in the package.

- ``alert-rules.yml``: Prometheus alerting rules over the metrics of
  ``jobledger metrics`` (and ``/metrics`` of ``jobledger web``): the scrape
  down, one rule per state that is trouble (crashed, overrun, down, late,
  failing, paused after failures: ``jobledger_job_state``), overlapping
  runs, runs past their ttl, ttl advice, the state audit; checked by
  ``promtool check rules`` and ``promtool test rules`` in the tests.
- ``grafana-dashboard.json``: a Grafana dashboard of the same metrics
  (import it, pick the Prometheus data source).

Both expect the scrape to keep the exporter's ``job`` label (the ledger's
job name): ``honor_labels: true`` in its scrape config (see
docs/monitoring.md). :func:`path` finds a file in an installed package.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ALERT_RULES", "GRAFANA_DASHBOARD", "path"]

ALERT_RULES = "alert-rules.yml"
GRAFANA_DASHBOARD = "grafana-dashboard.json"


def path(name: str) -> Path:
    """Where the shipped file ``name`` is (``ALERT_RULES``, ``GRAFANA_DASHBOARD``)."""
    found = Path(__file__).resolve().parent / name
    if not found.is_file():
        raise FileNotFoundError(f"no monitoring file {name!r} in {found.parent}")
    return found
