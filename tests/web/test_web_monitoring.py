"""The shipped Prometheus alert rules and Grafana dashboard (ledger/monitoring): valid, and about real metrics.

``promtool check rules`` validates the rules file and ``promtool test rules``
runs a few of them against made-up series (Debian's ``prometheus`` package
has promtool; the tests skip with that reason without it). Every metric name
the rules and the dashboard use must be one the exporter writes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledger import monitoring
from ledger.metrics import exposition

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (apt-get install prometheus)")
METRIC = re.compile(r"\bjobledger_[a-z_]+")


def _rules_text() -> str:
    return monitoring.path(monitoring.ALERT_RULES).read_text()


def _dashboard() -> dict:
    return json.loads(monitoring.path(monitoring.GRAFANA_DASHBOARD).read_text())


@pytest.fixture
def exported_names(db, dsn, connect) -> set[str]:
    """Every sample name the exporter writes (with --audit), on a ledger with a success and a running
    run, a live scheduler, a pool, and a snapshot held past the xmin horizon's warn threshold (lowered to 0 transactions, as the
    database's owner: the holder's series is written only then)."""
    db.execute("SELECT ledger.register_pool('heavy', 2)")  # a pool, so that the per-pool series are written
    db.execute("SELECT ledger.register_job('etl', ttl => '10 minutes', pool => 'heavy')")
    run = db.execute("SELECT run_id, token FROM ledger.start_run('etl', 'w')").fetchone()
    db.execute("SELECT ledger.complete_run(%s, %s)", run)
    db.execute("SELECT ledger.start_run('etl', 'w')")
    # a scheduler's row, so that the per-scheduler series are written
    db.execute("SELECT ledger.scheduler_heartbeat('s1', 'host', 1, 'v', ARRAY['etl'], '1 minute')")
    db.execute("CREATE OR REPLACE FUNCTION ledger._risk_horizon_warn_xids() RETURNS bigint LANGUAGE sql "
               "IMMUTABLE PARALLEL SAFE AS $$ SELECT 0::bigint $$")
    holder = connect()
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")
    text = exposition(lambda: psycopg.connect(dsn, autocommit=True), audit=True)  # the audits too
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run([PROMTOOL, "check", "rules", str(monitoring.path(monitoring.ALERT_RULES))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


RULE_TESTS = """
rule_files:
  - {rules}
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'jobledger_up{{instance="ledger:8187"}}'
        values: '0x10'
      - series: 'jobledger_job_state{{job="etl",state="ok"}}'
        values: '1 _ _ _'
      - series: 'jobledger_job_state{{job="etl",state="failing"}}'
        values: '_ 1 1 1'
      - series: 'jobledger_job_state{{job="nightly",state="late"}}'
        values: '1x10'
      - series: 'jobledger_job_state{{job="backup",state="crashed"}}'
        values: '1x10'
      - series: 'jobledger_job_state{{job="sync",state="down"}}'
        values: '1x10'
      - series: 'jobledger_run_running_seconds{{job="ingest"}}'
        values: '500+60x10'
      - series: 'jobledger_job_ttl_seconds{{job="ingest"}}'
        values: '600x10'
      - series: 'jobledger_alerts{{alert="overlap"}}'
        values: '0 0 1'
    alert_rule_test:
      - eval_time: 6m
        alertname: JobLedgerScrapeDown
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "ledger:8187"}}
            exp_annotations:
              summary: "jobledger cannot read the ledger"
              description: "ledger:8187 has answered jobledger_up 0 for 5 minutes: the ledger's database is unreachable or its reader lacks privileges. The other jobledger alerts cannot fire meanwhile."
      - eval_time: 0m
        alertname: JobLedgerJobFailing
        exp_alerts: []
      - eval_time: 1m
        alertname: JobLedgerJobFailing
        exp_alerts:
          - exp_labels: {{severity: warning, job: etl, state: failing}}
            exp_annotations:
              summary: "job etl is failing"
              description: "etl has failed since its last success. `jobledger runs etl` shows the errors."
      - eval_time: 6m
        alertname: JobLedgerJobLate
        exp_alerts:
          - exp_labels: {{severity: warning, job: nightly, state: late}}
            exp_annotations:
              summary: "job nightly is late"
              description: "A slot of nightly is past its grace and no run took it: nothing is running it. `jobledger health nightly`."
      - eval_time: 1m
        alertname: JobLedgerJobCrashed
        exp_alerts:
          - exp_labels: {{severity: critical, job: backup, state: crashed}}
            exp_annotations:
              summary: "job backup crashed"
              description: "A run of backup is still marked running but its lease is gone: its runner was killed or froze. `jobledger reap backup` closes it (the next start does too)."
      # one job, one state, one alert: the late job raises no other state's rule
      - eval_time: 6m
        alertname: JobLedgerJobDown
        exp_alerts:
          - exp_labels: {{severity: critical, job: sync, state: down}}
            exp_annotations:
              summary: "job sync is down"
              description: "sync has missed several slots, or has not succeeded for longer than its down_after. `jobledger health sync` says why."
      - eval_time: 1m
        alertname: JobLedgerRunOverTtl
        exp_alerts: []
      - eval_time: 5m
        alertname: JobLedgerRunOverTtl
        exp_alerts:
          - exp_labels: {{severity: warning, job: ingest}}
            exp_annotations:
              summary: "a run of ingest has run past its ttl"
              description: "The running run of ingest has run 13m 20s, longer than its ttl: it holds the lease only by renewing it."
      - eval_time: 2m
        alertname: JobLedgerOverlap
        exp_alerts:
          - exp_labels: {{severity: critical, alert: overlap}}
            exp_annotations:
              summary: "overlapping runs in the ledger"
              description: "ledger.alerts has 1 overlap rows: two runs of one job overlapped in time. `jobledger report \\"SELECT * FROM ledger.overlaps\\"`."
  # ledger.db_risks: a snapshot held from minute 1 (warn), critical from minute 7; dead rows on
  # ledger.leases from the start; ledger.counters past autovacuum's trigger from the start.
  - interval: 1m
    input_series:
      - series: 'jobledger_db_risk{{instance="ledger:8187",kind="xmin_horizon"}}'
        values: '0 1 1 1 1 1 1 2x10'
      - series: 'jobledger_xmin_horizon_holder{{instance="ledger:8187",holder_type="backend",holder="4242",application_name="psql"}}'
        values: '_ 1x16'
      - series: 'jobledger_db_risk{{instance="ledger:8187",kind="dead_rows",relation="ledger.leases"}}'
        values: '1x20'
      - series: 'jobledger_dead_rows{{instance="ledger:8187",relation="ledger.leases"}}'
        values: '14312x20'
      - series: 'jobledger_db_risk{{instance="ledger:8187",kind="autovacuum_lag",relation="ledger.counters"}}'
        values: '0 1x20'
    alert_rule_test:
      - eval_time: 5m
        alertname: JobLedgerXminHorizonOld
        exp_alerts: []
      - eval_time: 7m
        alertname: JobLedgerXminHorizonOld
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "ledger:8187", kind: xmin_horizon}}
            exp_annotations:
              summary: "a transaction holds vacuum back from the ledger's rows"
              description: 'The backend 4242 (application_name "psql") has held the xmin horizon of the ledger''s database for too long: vacuum keeps every row version written since, and lease renewals slow down. `jobledger risks` says how old it is and how to end it (docs/operations.md).'
      - eval_time: 11m
        alertname: JobLedgerXminHorizonCritical
        exp_alerts: []
      - eval_time: 12m
        alertname: JobLedgerXminHorizonCritical
        exp_alerts:
          - exp_labels: {{severity: critical, instance: "ledger:8187", kind: xmin_horizon}}
            exp_annotations:
              summary: "a transaction has held vacuum back from the ledger's rows for over an hour"
              description: 'The backend 4242 (application_name "psql") has held the xmin horizon of the ledger''s database for over an hour or 100,000,000 transactions. End it: `jobledger risks` says how.'
      - eval_time: 9m
        alertname: JobLedgerDeadRows
        exp_alerts: []
      - eval_time: 10m
        alertname: JobLedgerDeadRows
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "ledger:8187", kind: dead_rows, relation: ledger.leases}}
            exp_annotations:
              summary: "dead rows pile up on ledger.leases"
              description: "ledger.leases has had 14.31k dead row versions for 10 minutes: each lease renewal walks past them. `jobledger risks` says whether a held snapshot keeps them."
      - eval_time: 16m
        alertname: JobLedgerAutovacuumLag
        exp_alerts:
          - exp_labels: {{severity: warning, instance: "ledger:8187", kind: autovacuum_lag, relation: ledger.counters}}
            exp_annotations:
              summary: "autovacuum is behind on ledger.counters"
              description: "ledger.counters is past autovacuum's trigger and was last vacuumed over 10 minutes ago (or never, or autovacuum is off for it). `jobledger risks`; VACUUM it, and check autovacuum's settings (docs/operations.md)."
"""


@needs_promtool
def test_the_rules_fire_when_they_should(tmp_path: Path):
    tests = tmp_path / "rules-test.yml"
    tests.write_text(textwrap.dedent(RULE_TESTS).format(rules=monitoring.path(monitoring.ALERT_RULES)))
    result = subprocess.run([PROMTOOL, "test", "rules", str(tests)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_and_the_dashboard_use_only_exported_metrics(exported_names):
    used_by_rules = set(METRIC.findall(_rules_text()))
    dashboard = _dashboard()
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    expressions.append(dashboard["templating"]["list"][1]["query"]["query"])
    used_by_dashboard = set(METRIC.findall("\n".join(expressions)))
    assert used_by_rules and used_by_dashboard
    assert used_by_rules - exported_names == set()
    assert used_by_dashboard - exported_names == set()
    assert "jobledger_job_state" in used_by_rules and "jobledger_job_state" in used_by_dashboard


def test_the_dashboard_is_a_grafana_dashboard():
    dashboard = _dashboard()
    assert dashboard["uid"] == "jobledger" and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]
    assert {variable["name"] for variable in dashboard["templating"]["list"]} == {"datasource", "job"}
