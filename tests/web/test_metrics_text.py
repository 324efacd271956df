"""The exporter's own text writer (ledger.metrics.text) writes what prometheus_client's would, for
the same families: `jobledger metrics`, its server and the dashboard's /metrics answer with it (a
scrape of 100,000 jobs is 1.3 million lines), a registry of one's own gets the collector's objects."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ledger.metrics import LedgerCollector, families, read_snapshot, samples, serve, text

ODD = 'odd "job" \\ with [brackets]'  # a label may hold what the text format escapes (no control characters)


def _parsed(text: str) -> dict[str, tuple[str, str, list[tuple[str, list[tuple[str, str]], float]]]]:
    return {family.name: (family.type, family.documentation,
                          sorted((s.name, sorted(s.labels.items()), s.value) for s in family.samples))
            for family in text_string_to_metric_families(text)}


def test_the_text_writer_writes_what_prometheus_client_writes(db, dsn):
    db.execute("SELECT ledger.register_job(%s, ttl => '10 minutes')", (ODD,))
    db.execute("SELECT ledger.register_job('etl', schedule => '1 hour', ttl => '10 minutes')")
    for job, end in ((ODD, "ledger.complete_run(%s, %s)"), ("etl", "ledger.fail_run(%s, %s, 'boom')")):
        run = db.execute("SELECT run_id, token FROM ledger.start_run(%s, 'w')", (job,)).fetchone()
        db.execute(f"SELECT {end}", run)
    db.execute("SELECT ledger.start_run('etl', 'w')")
    with psycopg.connect(dsn, autocommit=True) as conn:
        snapshot = read_snapshot(conn, audit=True)  # one read for both writers (a running time moves)

    class Once:
        def collect(self):
            return list(families(snapshot))

    ours = text(samples(snapshot)).decode()
    own = CollectorRegistry(auto_describe=False)
    own.register(Once())
    theirs = generate_latest(own).decode()
    assert _parsed(ours) == _parsed(theirs)
    assert [line for line in ours.splitlines() if line.startswith("#")] == [
        line for line in theirs.splitlines() if line.startswith("#")]
    assert ODD in {s.labels.get("job") for f in text_string_to_metric_families(ours) for s in f.samples}
    if shutil.which("promtool"):
        result = subprocess.run(["promtool", "check", "metrics"], input=ours, capture_output=True, text=True,
                                timeout=60)
        problems = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()
                    and 'jobledger_run_duration_seconds non-summary metrics should not have "quantile"' not in line]
        assert problems == []
    server = serve(LedgerCollector(lambda: psycopg.connect(dsn, autocommit=True)), 0)
    try:
        with urllib.request.urlopen(server.url, timeout=30) as response:
            assert response.headers["content-type"].startswith("text/plain")
            assert _parsed(response.read().decode()).keys() == {"jobledger_up"} | _parsed(ours).keys() - {
                "jobledger_state_differences", "jobledger_duplicates"}
    finally:
        server.close()


def test_a_failed_read_writes_up_0_alone():
    def down() -> psycopg.Connection:
        return psycopg.connect("host=127.0.0.1 port=1 connect_timeout=2")
    text = LedgerCollector(down).text().decode()
    assert _parsed(text) == {"jobledger_up": ("gauge", "1 when the scrape read the ledger, 0 when it failed",
                                              [("jobledger_up", [], 0.0)])}
