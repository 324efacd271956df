"""How catch-up cost grows with downtime: _slot_at_or_before + _slot_count for
a one-minute cron after 2 missed slots and after one year (525,600), in one
run, printed as a ratio (no absolute thresholds: machines differ).

    .venv/bin/python benchmarks/bench_schedule_eval.py [--calls N]

Uses a scratch database (LEDGER_BENCH_DSN, default the local postgres) that
holds the ledger (sql/, the truth), dropped at the end.
"""

import argparse
import os
import time

import psycopg
from psycopg.conninfo import make_conninfo

from ledger.resources import install_sql

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")

# Each row gets a different `at` (one microsecond apart), so the IMMUTABLE
# functions run once per row instead of being folded into a constant.
# The MATERIALIZED CTE parses the schedule once, not once per row.
QUERY = """
WITH s AS MATERIALIZED (SELECT ledger._parse_schedule('* * * * *', %(tz)s) AS spec)
SELECT count(ledger._slot_at_or_before(s.spec, %(tz)s, t.at))
     + sum(ledger._slot_count(s.spec, %(tz)s, t.at - %(downtime)s::interval, t.at))
FROM s,
     LATERAL (SELECT timestamptz '2025-06-15 12:00:30+00' + i * interval '1 microsecond' AS at
              FROM generate_series(1, %(calls)s) i) t
"""


def per_call_us(conn, tz, downtime, calls, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        conn.execute(QUERY, {"tz": tz, "downtime": downtime, "calls": calls})
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed query")
    args = parser.parse_args()
    name = f"sched_bench_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        with psycopg.connect(make_conninfo(ADMIN_DSN, dbname=name), autocommit=True) as conn:
            conn.execute(install_sql())
            print(f"one-minute cron, _slot_at_or_before + _slot_count, {args.calls} calls, best of 5")
            for tz in ("UTC", "Europe/Berlin"):
                short = per_call_us(conn, tz, "2 minutes", args.calls)
                year = per_call_us(conn, tz, "365 days", args.calls)
                print(f"  {tz:14} 2 missed slots: {short:7.1f} us/call   "
                      f"525,600 missed slots: {year:7.1f} us/call   ratio {year / short:5.2f}")
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    main()
