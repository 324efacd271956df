"""The ledger's benchmarks in one run: `make bench` (full) and `make bench-smoke`.

    .venv/bin/python benchmarks/run.py [--duration S] [--rounds R] [--jobs N] [--no-write]
    .venv/bin/python benchmarks/run.py --smoke [--json PATH]
    .venv/bin/python benchmarks/run.py --only acquire-1,hot-8 [--duration S]   # a few rows, written nowhere
    .venv/bin/python benchmarks/run.py --render benchmarks/results/latest.json   # re-render only

1. Side by side (issue 14; benchmarks/harness.py): every row of the issue's
   table, the ledger against the raw SQL floor, pgbench ``-M prepared`` scripts
   (benchmarks/pgbench/) at 1 and 8 clients on 10,000 jobs and on one hot job,
   alternated raw, ledger, raw, ledger; the Python client against raw psycopg;
   reference rows for ShedLock's upsert, ``pg_try_advisory_lock`` and Redis
   ``SET NX EX`` (non-durable). Prints the machine, versions and settings.
   Writes benchmarks/results/latest.json, the tables between the markers
   ``<!-- bench:start -->`` / ``<!-- bench:end -->`` of BENCHMARKS.md, and
   docs/images/bench-ratios.png.
2. Per call over one connection (benchmarks/bench_calls.py): catch-up cost
   against downtime, the hot path's calls, the durable-token trigger; printed.

``--smoke`` checks the harness, not the speed: pgbench ``-t 20`` per client,
200 jobs, one round, a few Python runs; every script must run and give a
number. It writes its JSON (and chart) under a temporary directory, or
``--json PATH``, and never BENCHMARKS.md.

The server is the one LEDGER_BENCH_DSN names (default the local postgres);
Redis the one LEDGER_BENCH_REDIS names (default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_calls  # noqa: E402  (benchmarks/, not a package)
import harness  # noqa: E402

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")
REDIS_URL = os.environ.get("LEDGER_BENCH_REDIS", "redis://127.0.0.1:6379/0")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="check the harness in seconds; write no BENCHMARKS.md")
    parser.add_argument("--duration", type=int, default=10, help="pgbench -T seconds per side and round (full)")
    parser.add_argument("--rounds", type=int, help="alternations of each pair (default 2; smoke 1)")
    parser.add_argument("--jobs", type=int, help="jobs for the 10,000-job rows (default 10000; smoke 200)")
    parser.add_argument("--python-runs", type=int, help="runs per side and round of the Python rows (default 200)")
    parser.add_argument("--calls", type=int, help="calls per timing of the per-call sections (default 300; smoke 3)")
    parser.add_argument("--no-calls", action="store_true", help="skip the per-call sections (bench_calls.py)")
    parser.add_argument("--only", default="", help="comma-separated row ids (implies --no-calls): "
                                                   + ",".join(harness.ROW_IDS))
    parser.add_argument("--dsn", default=ADMIN_DSN, help="an admin conninfo on the server (LEDGER_BENCH_DSN)")
    parser.add_argument("--redis", default=REDIS_URL, help="the Redis of the reference rows (LEDGER_BENCH_REDIS)")
    parser.add_argument("--json", type=Path, help="where the results go (default benchmarks/results/latest.json; "
                                                  "smoke: a temporary directory)")
    parser.add_argument("--no-write", action="store_true", help="write no BENCHMARKS.md section and no chart")
    parser.add_argument("--keep-db", action="store_true", help="keep the scratch database ledger_bench")
    parser.add_argument("--dbname", help="the scratch database's name (default ledger_bench): two runs on one "
                                         "server at once need two names")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: rewrite BENCHMARKS.md's section and the chart from a results file")
    args = parser.parse_args()

    if args.render:
        results = json.loads(args.render.read_text())
        harness.write_markdown(harness.ROOT / "BENCHMARKS.md", harness.markdown(results))
        harness.chart(results, harness.ROOT / "docs" / "images" / "bench-ratios.png")
        print(f"BENCHMARKS.md and docs/images/bench-ratios.png rewritten from {args.render}")
        return 0
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    unknown = set(only) - set(harness.ROW_IDS)
    if unknown:
        parser.error(f"unknown row ids: {', '.join(sorted(unknown))}")
    common = {"redis_url": args.redis, "keep_db": args.keep_db, "only": only}
    for key in ("rounds", "jobs", "python_runs", "dbname"):
        if getattr(args, key) is not None:
            common[key] = getattr(args, key)
    if args.smoke:
        config = harness.Config.smoke_mode(args.dsn, **common)
        out_dir = args.json.parent if args.json else Path(tempfile.mkdtemp(prefix="ledger-bench-smoke-"))
        json_path = args.json or out_dir / "smoke.json"
        chart_path = out_dir / "bench-ratios.png"
    else:
        config = harness.Config(args.dsn, duration=args.duration, **common)
        # A run of a few rows (--only) leaves the full run's results alone.
        json_path = args.json or harness.HERE / "results" / ("partial.json" if only else "latest.json")
        chart_path = harness.ROOT / "docs" / "images" / "bench-ratios.png"

    try:
        results = harness.run(config)
    except harness.HarnessError as error:
        print(f"make bench: {error}", file=sys.stderr)
        return 1
    section = harness.markdown(results)
    print()
    print(section)
    harness.write_json(results, json_path)
    print(f"results: {json_path}")
    if args.smoke or not (args.no_write or only):
        if harness.chart(results, chart_path):
            print(f"chart: {chart_path}")
        else:
            print("chart: skipped (matplotlib not installed: pip install -e '.[bench]')")
    if not args.smoke and not args.no_write and not only:
        harness.write_markdown(harness.ROOT / "BENCHMARKS.md", section)
        print("BENCHMARKS.md: the section between the bench markers rewritten")
    print(f"side by side: {results['meta']['seconds']:.0f} s")

    if not (args.no_calls or only):
        print("\n# Per call over one connection (benchmarks/bench_calls.py)\n", flush=True)
        bench_calls.sections(args.dsn, args.calls or (3 if args.smoke else 300))
    return 0


if __name__ == "__main__":
    sys.exit(main())
