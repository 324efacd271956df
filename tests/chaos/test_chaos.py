"""Chaos suite: workers on the Python client and on `jobledger run`, killed, frozen past their
ttl and woken as zombies, while PostgreSQL crashes (`pg_ctl -m immediate stop`) and restarts;
then the audit of tests/chaos/driver.py (Chaos.audit) over the database and what the workers
were acknowledged.

Short mode (in `make test`): 4 workers, 12 events, about a minute.
Long mode, by hand, until the log holds LEDGER_CHAOS_RUNS runs (RELIABILITY-chaos.md):

    LEDGER_CHAOS_RUNS=10000 .venv/bin/python -m pytest -q -s tests/chaos/test_chaos.py::test_chaos_long

LEDGER_CHAOS_SEED overrides the fixed seed (the faults are random from it; the
interleavings with the server are not, so a seed does not replay a run exactly).
Nothing here asserts a duration or a rate: conditions are polled with generous timeouts.
"""

from __future__ import annotations

import os
import re
import subprocess

import psycopg
import pytest

from cluster import cluster_root  # noqa: F401  (fixture)

from .driver import Chaos, Config

pytestmark = pytest.mark.cluster


def _chaos(cluster_root, tmp_path, config: Config) -> dict:  # noqa: F811
    if "LEDGER_CHAOS_SEED" in os.environ:
        config.seed = int(os.environ["LEDGER_CHAOS_SEED"])
    cluster = cluster_root("chaos").initdb()
    version = subprocess.run([str(cluster.bindir / "postgres"), "--version"], capture_output=True, text=True).stdout
    match = re.search(r"PostgreSQL\D*(\d+)", version)
    if match and int(match.group(1)) >= 14:
        # Crash recovery starts by syncing the data directory: one syncfs, not an fsync per
        # file, keeps a restart under a second. It changes nothing a process crash can show.
        cluster.configure(recovery_init_sync_method="syncfs")
    cluster.start()
    cluster.install_ledger()
    workdir = tmp_path / "chaos"
    workdir.mkdir()
    chaos = Chaos(cluster, workdir, config)
    try:
        figures = chaos.run()
    finally:
        chaos.close()
    print("\n" + chaos.summary_line())
    listed = "\n".join(chaos.violations[:50])
    assert figures["violations"] == 0, f"{figures['violations']} violations (see {workdir}/summary.json):\n{listed}"
    # An audit of nothing proves nothing: runs started, writes committed, the workers saw them.
    assert figures["runs"] > 0 and figures["writes"] > 0 and figures["acknowledged"]["write"] > 0, figures
    assert figures["kills"] >= 1 and figures["freezes"] >= 1 and figures["restarts"] >= 1, figures
    with psycopg.connect(chaos.dsn) as conn:  # the state rows are the log's, after every crash
        assert conn.execute("SELECT count(*) FROM ledger.verify_state()").fetchone()[0] == 0
    return figures


def test_chaos_short(cluster_root, tmp_path):  # noqa: F811
    _chaos(cluster_root, tmp_path, Config.short())


@pytest.mark.skipif(not os.environ.get("LEDGER_CHAOS_RUNS"),
                    reason="needs LEDGER_CHAOS_RUNS (e.g. LEDGER_CHAOS_RUNS=10000): the long mode")
def test_chaos_long(cluster_root, tmp_path):  # noqa: F811
    target = int(os.environ["LEDGER_CHAOS_RUNS"])
    figures = _chaos(cluster_root, tmp_path, Config.long(target))
    assert figures["runs"] >= target
