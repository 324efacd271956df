"""What a protected table costs per written row, side by side (BENCHMARKS.md, "Protecting a table").

    .venv/bin/python benchmarks/bench_protect.py [--duration S] [--rounds R] [--rows 1,100]
                                                 [--synchronous-commit off] [--smoke]

Four sides, each a pgbench ``-M prepared`` script of benchmarks/pgbench/, one
client, alternated in every round (plain, session, local, fence, plain, ...)
as benchmarks/harness.py alternates its pairs:

- ``plain``: INSERT of ROWS rows into a table nobody protects;
- ``session``: the same INSERT into a table ``ledger.protect`` guards, the
  token a session setting (PGOPTIONS: what ``jobledger run --pgoptions``
  gives a psql), so the same statements;
- ``local``: the same, the token set in the transaction as the Python
  client's ``run.transaction(conn)`` sets it (one more statement);
- ``fence``: an unprotected table and an explicit ``ledger.fence`` in the
  write's transaction (one more statement, as docs/contract.md shows it).

Each transaction is one INSERT of ROWS rows (``--rows``, default 1 and 100):
the trigger runs once per statement, so its cost per row falls with the rows
a statement writes. Reported: the median tps per side, microseconds per
written row, and each side's cost per row over ``plain``.

Then the server side alone, which round trips and commits (the WAL flush)
do not blur: a PL/pgSQL loop of the same INSERTs in one transaction, rolled
back, on the unprotected table, the protected one (lenient and strict) and
with ``ledger.fence`` before each INSERT; microseconds per statement.

Uses a scratch database ``ledger_bench_protect`` on the server
LEDGER_BENCH_DSN names (default the local postgres), the ledger installed as
a psql user does, benchmarks/pgbench/protect_setup.sql; dropped at the end.
Machines are noisy: compare sides within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402  (benchmarks/, not a package)

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
SIDES = [
    ("plain", "protect_plain", "unprotected table"),
    ("session", "protect_session", "protected, token a session setting (PGOPTIONS)"),
    ("local", "protect_local", "protected, token set in the transaction (`run.transaction`)"),
    ("fence", "protect_fence", "unprotected, explicit `ledger.fence` in the transaction"),
]


def pgbench(binary: str, dsn: str, script: str, rows: int, token: int, seconds: int | None,
            transactions: int | None, pgoptions: str | None) -> dict[str, float]:
    args = [binary, "-n", "-M", "prepared", "-c", "1", "-j", "1", "-f", str(harness.SCRIPTS / f"{script}.sql"),
            "-D", f"rows={rows}", "-D", f"token={token}"]
    args += ["-t", str(transactions)] if transactions else ["-T", str(seconds)]
    env = dict(os.environ)
    env.pop("PGOPTIONS", None)
    if pgoptions:
        env["PGOPTIONS"] = pgoptions
    done = subprocess.run(args + [dsn], capture_output=True, text=True, env=env, timeout=(seconds or 60) * 3 + 60)
    out = done.stdout + done.stderr
    tps = re.search(r"^tps = ([\d.]+) \(without initial connection time\)", out, re.M)
    latency = re.search(r"latency average = ([\d.]+) ms", out)
    failed = re.search(r"number of failed transactions: (\d+)", out)
    if done.returncode != 0 or "aborted" in out or not tps or (failed and int(failed.group(1))):
        raise harness.HarnessError(f"pgbench {script}.sql failed (exit {done.returncode}): {out[-1500:]}")
    return {"tps": float(tps.group(1)), "latency_ms": float(latency.group(1)) if latency else float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="pgbench -T seconds per side and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the four sides")
    parser.add_argument("--rows", default="1,100", help="rows per INSERT, comma-separated")
    parser.add_argument("--smoke", action="store_true", help="pgbench -t 20, one round: the scripts run, no timing")
    parser.add_argument("--synchronous-commit", default="on", choices=["on", "off"],
                        help="the scratch database's synchronous_commit: off takes the WAL flush out of every "
                             "side, which leaves the trigger's own cost (informational; the durable figure is on)")
    parser.add_argument("--dsn", default=ADMIN_DSN, help="an admin conninfo on the server (LEDGER_BENCH_DSN)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.rows.split(",")]
    rounds = 1 if args.smoke else args.rounds
    name = f"ledger_bench_protect_{os.getpid()}" if args.smoke else "ledger_bench_protect"
    dsn = make_conninfo(args.dsn, dbname=name)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
        admin.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = {args.synchronous_commit}')
    began = time.perf_counter()
    try:
        harness.psql(dsn, script=harness.install_sql())
        harness.psql(dsn, file=harness.SCRIPTS / "protect_setup.sql")
        with psycopg.connect(dsn, autocommit=True) as conn:
            token = int(conn.execute("SELECT token FROM ledger.leases WHERE job = 'protect-bench'").fetchone()[0])
            binary = harness.find_pgbench(conn.info.server_version // 10000)
            version = conn.execute("SHOW server_version").fetchone()[0]
        machine = harness.machine_info()
        pgoptions = f"-c ledger.job=protect-bench -c ledger.token={token}"
        results: dict[tuple[int, str], list[dict[str, float]]] = {}
        for rows in sizes:
            for round_ in range(rounds):
                for side, script, _ in SIDES:
                    result = pgbench(binary, dsn, script, rows, token, None if args.smoke else args.duration,
                                     20 if args.smoke else None, pgoptions if side == "session" else None)
                    results.setdefault((rows, side), []).append(result)
                    print(f"  rows {rows:4} round {round_ + 1} {side:8} {result['tps']:9.1f} tps", flush=True)
        server = server_side(dsn, token, sizes, 1 if args.smoke else max(args.rounds, 5), args.smoke)
        with psycopg.connect(dsn, autocommit=True) as conn:
            fences = conn.execute("SELECT resource, token FROM ledger.fences ORDER BY 1").fetchall()
            written = conn.execute("SELECT (SELECT count(*) FROM bench_protect.guarded), "
                                   "(SELECT count(*) FROM bench_protect.plain)").fetchone()
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if fences != [("bench_protect.fenced", token), ("bench_protect.guarded", token),
                  ("bench_protect.strict", token)]:
        raise harness.HarnessError(f"the fences are not what the writes should leave: {fences}")
    length = "-t 20 (smoke: no timing)" if args.smoke else f"-T {args.duration} s"
    print(f"\nPostgreSQL {version}, synchronous_commit = {args.synchronous_commit}, pgbench -M prepared, 1 client, "
          f"{length} per side and round, "
          f"{rounds} rounds alternated; {machine['nproc']} cores ({machine['cpu_model']}), load average "
          f"{machine['load_average_start']}; {written[0]:,} rows into the protected table, "
          f"{written[1]:,} into the plain one; {time.perf_counter() - began:.0f} s in all.\n")
    print("| rows per INSERT | side | tps (median; per round) | µs per written row | over plain, per row |")
    print("|---:|---|---:|---:|---:|")
    for rows in sizes:
        plain = statistics.median(r["tps"] for r in results[(rows, "plain")])
        for side, _, label in SIDES:
            runs = results[(rows, side)]
            tps = statistics.median(r["tps"] for r in runs)
            per_row = 1e6 / (tps * rows)
            over = per_row - 1e6 / (plain * rows)
            rounds_text = " / ".join(f"{r['tps']:,.0f}" for r in runs)
            print(f"| {rows} | {label} | {tps:,.0f} ({rounds_text}) | {per_row:,.1f} | "
                  f"{'—' if side == 'plain' else f'{over:+,.1f}'} |")
    print("\nThe server side alone: a PL/pgSQL loop of INSERTs in one transaction (rolled back), no round trip "
          f"and no commit; median of {len(server[(sizes[0], 'plain')])} alternated rounds.\n")
    print("| rows per INSERT | side | µs per statement | over plain, per statement | over plain, per row |")
    print("|---:|---|---:|---:|---:|")
    for rows in sizes:
        plain = statistics.median(server[(rows, "plain")])
        for side, label in SERVER_SIDES:
            micros = statistics.median(server[(rows, side)])
            over = "—" if side == "plain" else f"{micros - plain:+,.1f}"
            per_row = "—" if side == "plain" else f"{(micros - plain) / rows:+,.2f}"
            print(f"| {rows} | {label} | {micros:,.1f} | {over} | {per_row} |")
    return 0


SERVER_SIDES = [
    ("plain", "unprotected table"),
    ("lenient", "protected (lenient)"),
    ("strict", "protected (strict; the transaction's first statement advanced the fence)"),
    ("fence", "unprotected, `ledger.fence` before each INSERT"),
]


def server_side(dsn: str, token: int, sizes: list[int], rounds: int, smoke: bool) -> dict[tuple[int, str], list[float]]:
    """Microseconds per statement of each side, by rows per INSERT: alternated rounds, each rolled back."""
    results: dict[tuple[int, str], list[float]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT set_config('ledger.job', 'protect-bench', false), "
                     "set_config('ledger.token', %s, false)", (str(token),))
        for rows in sizes:
            statements = 20 if smoke else max(200, 20_000 // rows)
            for _ in range(rounds):
                for side, _label in SERVER_SIDES:
                    with conn.transaction(force_rollback=True):
                        row = conn.execute("SELECT bench_protect.loop(%s, %s, %s)", (side, rows, statements)).fetchone()
                    assert row is not None
                    results.setdefault((rows, side), []).append(float(row[0]))
        # The fences the pgbench sides left, and one for the strict table (the loops rolled back).
        with conn.transaction():
            conn.execute("INSERT INTO bench_protect.strict (payload) VALUES ('kept')")
    return results


if __name__ == "__main__":
    sys.exit(main())
