"""benchmarks/bench_client.py --smoke: the client-against-raw-psycopg benchmark runs (issue 24, point 4).

Its correctness only, never a speed: every side of both parts (one run at a
time; runs over a shared pool, threads and asyncio) runs and gives a positive
number, and every run it made ended in success.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from repo import ROOT


def test_bench_client_smoke(pg_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if not shutil.which("psql"):
        pytest.skip("needs psql (apt-get install postgresql-client)")
    out = tmp_path / "client.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_client.py"), "--smoke", "--json", str(out),
         "--dsn", pg_server.dsn("postgres")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["serial"]["median_ms"]) == {"raw", "raw-unprepared", "raw-bounded", "conn", "pool"}
    assert all(v > 0 for v in result["serial"]["median_ms"].values())
    assert set(result["concurrent"]["median"]) == {"raw-pool", "ledger-pool", "raw-apool", "ledger-apool"}
    assert all(v > 0 for v in result["concurrent"]["median"].values())
