"""Lease renewals under a held snapshot (issue 21, item 5): renewal latency with an idle transaction open, and without.

    .venv/bin/python benchmarks/bench_held_snapshot.py                    # 10 minutes per side (BENCHMARKS.md)
    .venv/bin/python benchmarks/bench_held_snapshot.py --duration 180     # 3 minutes per side
    .venv/bin/python benchmarks/bench_held_snapshot.py --fillfactor 100,50 --duration 120
    .venv/bin/python benchmarks/bench_held_snapshot.py --sides none --jobs 10000 --fillfactor 100,70,50
    .venv/bin/python benchmarks/bench_held_snapshot.py --smoke            # the script runs: 2 s per side

Two sides, one after the other, each in a fresh scratch database
(``ledger_bench_held``; the ledger installed the way a psql user does, then
``--jobs`` leases ``renew-1`` .. ``renew-N`` taken by owner ``bench``):

- ``none``: pgbench ``-M prepared`` runs ``benchmarks/pgbench/ledger_renew.sql``
  (``ledger.renew`` of a random one of the N leases, one commit each) with
  ``--clients`` clients for ``--duration`` seconds;
- ``held``: the same, while another connection of the same database holds a
  snapshot: ``BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1;`` and then
  idle, as a forgotten session or a report left open does.

On both sides a VACUUM of ledger.leases runs every ``--vacuum-every``
seconds (60: autovacuum's part at its default naptime, whatever the
server's ``autovacuum``; under the held snapshot it removes nothing, as
autovacuum's would not).

Per side: throughput, the latency of every transaction (pgbench ``--log``:
mean, p50, p95, p99, and the p50 of the first and of the last tenth of the
run, since under a held snapshot each renewal walks a longer chain of dead
versions than the one before), and then the table: dead row versions,
updates and how many were HOT, the heap and index size, the rows of
``ledger.db_risks`` that are not ok (read while the snapshot is still held),
and how long the VACUUM took that removed the dead versions once it ended.

With ``--fillfactor 100,50`` the sides run once per fillfactor of
ledger.leases (set before the leases are taken; the default, 0, keeps the
install's own; 100 is PostgreSQL's default), with ``--sides none`` only
the side without a held snapshot.

Writes its results as JSON (``--json``, default
benchmarks/results/held_snapshot.json; ``--smoke``: a temporary file) and
prints a table; BENCHMARKS.md's section is written by hand from them. The
machine is shared and noisy: compare the two sides of one run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (benchmarks/, not a package)

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
SCRIPT = harness.SCRIPTS / "ledger_renew.sql"
DBNAME = "ledger_bench_held"

TABLE_STATS = """
SELECT s.n_live_tup, s.n_dead_tup, s.n_tup_upd, s.n_tup_hot_upd,
       pg_relation_size('ledger.leases') AS heap_bytes,
       pg_relation_size('ledger.leases_pkey') AS index_bytes
  FROM pg_stat_all_tables s WHERE s.relid = 'ledger.leases'::regclass
"""
RISKS = """
SELECT r.kind, r.relation, r.severity, r.value, r.unit, r.message
  FROM ledger.db_risks r WHERE r.severity <> 'ok' ORDER BY r.kind, r.relation
"""


def percentile(sorted_values: list[float], share: float) -> float:
    """The nearest-rank percentile of already sorted values."""
    index = max(0, math.ceil(share * len(sorted_values)) - 1)
    return sorted_values[index]


def latencies(log_dir: Path) -> dict[str, Any]:
    """Per-transaction latencies from pgbench's --log files (column 3, microseconds), in milliseconds."""
    points: list[tuple[float, float]] = []  # (epoch of the end, latency ms)
    for path in log_dir.glob("pgbench_log.*"):
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6:
                points.append((int(fields[4]) + int(fields[5]) / 1e6, int(fields[2]) / 1000.0))
    if not points:
        raise harness.HarnessError("pgbench --log wrote no transactions")
    points.sort()
    start, end = points[0][0], points[-1][0]
    tenth = (end - start) / 10
    first = sorted(ms for at, ms in points if at <= start + tenth)
    last = sorted(ms for at, ms in points if at >= end - tenth)
    every = sorted(ms for _, ms in points)
    return {
        "transactions": len(every),
        "mean_ms": round(statistics.fmean(every), 3),
        "p50_ms": round(percentile(every, 0.50), 3),
        "p95_ms": round(percentile(every, 0.95), 3),
        "p99_ms": round(percentile(every, 0.99), 3),
        "max_ms": round(every[-1], 3),
        "first_tenth_p50_ms": round(percentile(first, 0.50), 3),
        "last_tenth_p50_ms": round(percentile(last, 0.50), 3),
    }


def pgbench(binary: str, dsn: str, *, clients: int, threads: int, duration: int, jobs: int, token: int,
            log_dir: Path) -> dict[str, Any]:
    args = [binary, "-n", "-M", "prepared", "-c", str(clients), "-j", str(threads), "-T", str(duration),
            "-f", str(SCRIPT), "-D", f"jobs={jobs}", "-D", f"token={token}",
            "--log", "--log-prefix", str(log_dir / "pgbench_log"), dsn]
    done = subprocess.run(args, capture_output=True, text=True, timeout=duration * 2 + 120)
    out = done.stdout + done.stderr
    if done.returncode != 0 or "aborted" in out:
        raise harness.HarnessError(f"pgbench {SCRIPT.name} failed (exit {done.returncode}): {out[-1500:]}")
    tps = next((float(line.split()[2]) for line in out.splitlines()
                if line.startswith("tps = ") and "without initial connection time" in line), None)
    if tps is None:
        raise harness.HarnessError(f"pgbench {SCRIPT.name}: no tps in its output: {out[-1500:]}")
    return {"tps": tps, **latencies(log_dir)}


class Vacuumer:
    """VACUUM ledger.leases every `every` seconds while pgbench runs: autovacuum's part, whatever the server's setting.

    autovacuum_naptime is a minute by default, and a hot table past its
    trigger is vacuumed about that often; the project's own server runs with
    autovacuum off, so the benchmark does it, on both sides alike (under the
    held snapshot those VACUUMs remove nothing, as autovacuum's would not).
    """

    def __init__(self, dsn: str, every: float) -> None:
        self.dsn = dsn
        self.every = every
        self.durations_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="vacuumer", daemon=True)

    def __enter__(self) -> Vacuumer:
        if self.every > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=600)

    def _loop(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name="bench-vacuumer") as conn:
            while not self._stop.wait(self.every):
                started = time.perf_counter()
                conn.execute("VACUUM ledger.leases")
                self.durations_ms.append(round((time.perf_counter() - started) * 1000, 1))


def one_side(args: argparse.Namespace, binary: str, threads: int, fillfactor: int, held: bool) -> dict[str, Any]:
    """A fresh database, N leases, pgbench for the duration with or without a held snapshot, then the table."""
    dsn = make_conninfo(args.dsn, dbname=DBNAME)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{DBNAME}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{DBNAME}"')
        admin.execute(f'ALTER DATABASE "{DBNAME}" SET synchronous_commit = on')
    harness.psql(dsn, script=harness.install_sql())
    side: dict[str, Any] = {"side": "held" if held else "none", "fillfactor": fillfactor}
    with psycopg.connect(dsn, autocommit=True) as ctl:
        if fillfactor:
            ctl.execute(f"ALTER TABLE ledger.leases SET (fillfactor = {int(fillfactor)})")
        row = ctl.execute("SELECT coalesce((SELECT o.option_value::integer FROM pg_options_to_table(c.reloptions) o "
                          "WHERE o.option_name = 'fillfactor'), 100) FROM pg_class c "
                          "WHERE c.oid = 'ledger.leases'::regclass").fetchone()
        side["fillfactor"] = int(row[0]) if row else None
        ctl.execute("SELECT count(*) FROM generate_series(1, %s) AS i, "
                    "ledger.acquire('renew-' || i, 'bench', interval '1 day') AS a", (args.jobs,))
        row = ctl.execute("SELECT min(token), max(token), count(*) FROM ledger.leases").fetchone()
        assert row is not None
        if row[0] != row[1] or row[2] != args.jobs:
            raise harness.HarnessError(f"setup: expected {args.jobs} leases with one token, got {row}")
        token = int(row[0])
        ctl.execute("VACUUM ANALYZE ledger.leases")
        ctl.execute("CHECKPOINT")
        holder = psycopg.connect(dsn, autocommit=True, application_name="bench-held-snapshot")
        try:
            if held:
                holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                holder.execute("SELECT 1")
            harness.log(f"  fillfactor {side['fillfactor']:3} {side['side']:4}: pgbench {args.clients} clients, "
                        f"{args.duration} s on {args.jobs} leases")
            with (tempfile.TemporaryDirectory(prefix="ledger-bench-held-") as log_dir,
                  Vacuumer(dsn, args.vacuum_every) as vacuums):
                side.update(pgbench(binary, dsn, clients=args.clients, threads=threads, duration=args.duration,
                                    jobs=args.jobs, token=token, log_dir=Path(log_dir)))
            side["vacuums"] = vacuums.durations_ms
            stats = ctl.execute(TABLE_STATS).fetchone()
            assert stats is not None
            live, dead, updates, hot, heap, index = (int(x) for x in stats)
            side.update(n_live_tup=live, n_dead_tup=dead, updates=updates,
                        hot_update_share=round(hot / updates, 4) if updates else None,
                        heap_kib=heap // 1024, index_kib=index // 1024)
            side["risks"] = [dict(zip(("kind", "relation", "severity", "value", "unit", "message"), r))
                             for r in ctl.execute(RISKS).fetchall()]
        finally:
            # ends the held snapshot before the VACUUM below: a ROLLBACK is answered once the server
            # has ended it (a close alone lets the backend exit later, with its snapshot still held)
            if held and not holder.closed:
                holder.execute("ROLLBACK")
            holder.close()
        started = time.perf_counter()
        ctl.execute("VACUUM ledger.leases")
        side["vacuum_ms"] = round((time.perf_counter() - started) * 1000, 1)
        row = ctl.execute("SELECT n_dead_tup FROM pg_stat_all_tables WHERE relid = 'ledger.leases'::regclass"
                          ).fetchone()
        side["n_dead_tup_after_vacuum"] = int(row[0]) if row else None
    harness.log(f"    {side['tps']:9.1f} tps, p50 {side['p50_ms']:.3f} ms (first tenth {side['first_tenth_p50_ms']:.3f},"
                f" last {side['last_tenth_p50_ms']:.3f}), {side['n_dead_tup']} dead rows")
    if not args.keep_db:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{DBNAME}" WITH (FORCE)')
    return side


def table(results: dict[str, Any]) -> str:
    lines = ["| fillfactor | snapshot | tps | mean ms | p50 ms | p95 ms | p99 ms | p50 first → last tenth ms "
             "| dead rows | HOT share | heap KiB | VACUUM ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in results["sides"]:
        hot = "" if s["hot_update_share"] is None else f"{s['hot_update_share']:.0%}"
        lines.append(f"| {s['fillfactor']} | {s['side']} | {s['tps']:,.0f} | {s['mean_ms']:.2f} | {s['p50_ms']:.2f} "
                     f"| {s['p95_ms']:.2f} | {s['p99_ms']:.2f} | {s['first_tenth_p50_ms']:.2f} → "
                     f"{s['last_tenth_p50_ms']:.2f} | {s['n_dead_tup']:,} | {hot} | {s['heap_kib']:,} "
                     f"| {s['vacuum_ms']:,.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=int, default=600, help="pgbench -T seconds per side (default 600)")
    parser.add_argument("--jobs", type=int, default=100, help="leases renewed (default 100)")
    parser.add_argument("--clients", type=int, default=4, help="pgbench clients (default 4)")
    parser.add_argument("--fillfactor", default="0", help="fillfactors of ledger.leases, comma-separated "
                                                          "(default 0: as installed)")
    parser.add_argument("--sides", default="none,held", help="which sides, comma-separated (default none,held)")
    parser.add_argument("--vacuum-every", type=float, default=60.0,
                        help="seconds between the VACUUMs of ledger.leases during a side (default 60; 0: none)")
    parser.add_argument("--smoke", action="store_true", help="check the script: 2 s per side, 10 leases")
    parser.add_argument("--dsn", default=ADMIN_DSN, help="an admin conninfo on the server (LEDGER_BENCH_DSN)")
    parser.add_argument("--json", type=Path, help="where the results go (default "
                                                  "benchmarks/results/held_snapshot.json; smoke: a temporary file)")
    parser.add_argument("--keep-db", action="store_true", help=f"keep the last scratch database {DBNAME}")
    args = parser.parse_args()
    if args.smoke:
        args.duration, args.jobs, args.vacuum_every = 2, 10, 1.0
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    if not sides or set(sides) - {"none", "held"}:
        parser.error("--sides takes none, held or both")
    fillfactors = [int(x) for x in args.fillfactor.split(",") if x.strip()]
    if not fillfactors or any(ff != 0 and not 10 <= ff <= 100 for ff in fillfactors):
        parser.error("--fillfactor takes 0 (as installed) or values from 10 to 100")

    with psycopg.connect(args.dsn, autocommit=True) as admin:
        major = int(str(admin.info.server_version)[:-4])
        binary = harness.find_pgbench(major)
        software = harness.software_info(admin, binary)
    machine = harness.machine_info()
    threads = max(1, min(args.clients, machine["nproc"]))
    started = time.perf_counter()
    try:
        measured = [one_side(args, binary, threads, ff, side == "held") for ff in fillfactors for side in sides]
    except harness.HarnessError as error:
        print(f"bench_held_snapshot: {error}", file=sys.stderr)
        return 1
    results = {
        "meta": {"date": dt.date.today().isoformat(), "duration_s": args.duration, "jobs": args.jobs,
                 "clients": args.clients, "threads": threads,
                 "vacuum_every_s": args.vacuum_every, "script": f"benchmarks/pgbench/{SCRIPT.name}",
                 "machine": machine, "software": software, "seconds": round(time.perf_counter() - started)},
        "sides": measured,
    }
    print()
    print(table(results))
    path = args.json or (Path(tempfile.mkdtemp(prefix="ledger-bench-held-")) / "held_snapshot.json" if args.smoke
                         else harness.HERE / "results" / "held_snapshot.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
