"""`make bench-smoke`: the benchmark harness runs end to end (issue 14).

The harness's correctness only, never a speed: benchmarks/run.py --smoke
(pgbench -t 20 per client on 200 jobs, one round, a few Python runs; about
15 s) must run every pgbench script and the Python rows, give a positive
number for every row of the issue's table and every reference, and write its
JSON, never BENCHMARKS.md. The Redis rows may say why they were skipped
(redis-py is in the `bench` extra, not in `test`; no Redis server in CI).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from repo import ROOT


# The rows of issue 14's table, the folded fence, the events' cost, the Python client and the references.
EXPECTED = {
    "acquire-1", "cycle-1", "fence-1", "fence-folded-1",
    "acquire-8", "cycle-8", "fence-8", "fence-folded-8", "hot-8", "cycle-8-no-events", "cycle-8-notify",
    "py-conn", "py-pool",
    "shedlock-1", "shedlock-8", "advisory-1", "advisory-8", "redis-1", "redis-8",
}
MAY_SKIP = {"redis-1", "redis-8"}


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def _pgbench_found() -> bool:
    if os.environ.get("PGBENCH") or shutil.which("pgbench"):
        return True
    return any(Path("/usr/lib/postgresql").glob("*/bin/pgbench"))


def test_bench_smoke(pg_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if not _pgbench_found() or not shutil.which("psql"):
        pytest.skip("needs pgbench and psql (apt-get install postgresql-client)")
    untouched = [ROOT / "BENCHMARKS.md", ROOT / "docs" / "images" / "bench-ratios.png"]
    before = [_digest(p) for p in untouched]
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--json", str(out),
         "--dsn", pg_server.dsn("postgres")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    results = json.loads(out.read_text())
    rows = {row["id"]: row for row in results["rows"]}
    assert set(rows) == EXPECTED
    for row_id, row in rows.items():
        if row.get("skipped"):
            assert row_id in MAY_SKIP, f"{row_id} skipped: {row['skipped']}"
            continue
        if row["kind"] in ("pair", "python"):
            assert row["raw"]["median"] > 0 and row["ledger"]["median"] > 0, row_id
            assert row["ratio"] > 0 and len(row["round_ratios"]) == 1, row_id
            if row["kind"] == "pair":
                # beside the floor, the ceiling: the raw statements in the API's kind of function
                assert row["ceiling"]["median"] > 0, row_id
                assert row["ceiling_ratio"] > 0 and row["ratio_to_ceiling"] > 0, row_id
        else:
            assert row["value"]["median"] > 0, row_id
    meta = results["meta"]
    assert meta["mode"] == "smoke"
    assert meta["software"]["settings"]["synchronous_commit"] == "on"
    assert meta["machine"]["nproc"] >= 1 and meta["software"]["psycopg"]
    # The section it would write, rendered, and nothing written into the repository.
    assert "| operation | clients | raw floor (tps)" in done.stdout
    assert [_digest(p) for p in untouched] == before
