"""The scrape counts the alerts by kind in the pass that writes the job lines (each job's kinds,
``ledger._job_state.alerts``, what ledger.alerts unnests): its ``jobledger_alerts`` say what
``SELECT alert, count(*) FROM ledger.alerts GROUP BY alert`` says, on a ledger whose jobs raise
seven kinds, one job two of them."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from prometheus_client.parser import text_string_to_metric_families

from ledger.metrics import ALERT_KINDS, read_snapshot, read_text
from situations import build_situations


def _run(db: psycopg.Connection, job: str, *, fail: bool = False, clock=None, lasting: timedelta | None = None) -> None:
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'alerts')",
                               (job,)).fetchone()
    if lasting is not None:
        clock.advance(lasting)
    if fail:
        db.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => 'boom')", (run_id, token))
    else:
        db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))


def _scraped_alerts(body: str) -> dict[str, float]:
    [family] = [f for f in text_string_to_metric_families(body) if f.name == "jobledger_alerts"]
    return {s.labels["alert"]: s.value for s in family.samples}


def test_the_scrapes_alert_counts_are_ledger_alerts_grouped_by_kind(db, dsn, ledger_clock):
    # ttl_too_short: five successes of 50 minutes under a 1-hour lease (the ttl under 1.5 times them)
    db.execute("SELECT ledger.register_job('slow', ttl => '1 hour')")
    for _ in range(5):
        _run(db, "slow", clock=ledger_clock, lasting=timedelta(minutes=50))
    # failing, down, late, crashed (one job each)
    build_situations(db, ledger_clock)
    # too_fast; paused by pause_after_failures; and one job both failing and too_fast
    db.execute("SELECT ledger.register_job('quick', ttl => '1 minute', min_runtime => '1 hour')")
    _run(db, "quick")
    db.execute("SELECT ledger.register_job('tripped', ttl => '1 minute', pause_after_failures => 2)")
    _run(db, "tripped", fail=True)
    _run(db, "tripped", fail=True)
    db.execute("SELECT ledger.register_job('both', ttl => '1 minute', min_runtime => '1 hour')")
    _run(db, "both")
    for _ in range(3):
        _run(db, "both", fail=True)

    with psycopg.connect(dsn, autocommit=True) as conn:
        body = read_text(conn).decode()
        snapshot = read_snapshot(conn)
        grouped = dict(conn.execute("SELECT alert, count(*) FROM ledger.alerts GROUP BY alert").fetchall())
        both = sorted(r[0] for r in conn.execute("SELECT alert FROM ledger.alerts WHERE job = 'both'"))

    assert grouped == {"failing": 2, "down": 1, "late": 1, "crashed": 1, "too_fast": 2, "paused": 1,
                       "ttl_too_short": 1}
    assert both == ["failing", "too_fast"]
    # every kind written, 0 when none is live; the counts are the view's
    assert _scraped_alerts(body) == {kind: float(grouped.get(kind, 0)) for kind in ALERT_KINDS}
    # the Python writer's snapshot counts the same, from the same rows
    assert snapshot.alerts == grouped
