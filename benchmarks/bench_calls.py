"""Per-call costs over one connection (the sections of BENCHMARKS.md outside the side-by-side tables).

    .venv/bin/python benchmarks/bench_calls.py [--calls N]

`make bench` (benchmarks/run.py) runs these sections too, after the
side-by-side tables, and prints them (they are not written into
BENCHMARKS.md):

1. Catch-up cost does not grow with the downtime: `due_slots` and
   `start_due_run` for a one-minute schedule that missed 2 slots vs one that
   missed a year (525,600 slots), cron and interval, UTC and Europe/Berlin.
2. The hot path: acquire, start_run + complete_run, heartbeat, fence, per
   call over one connection (round trips included).
3. What the durable-token trigger costs: acquire and a run cycle with the
   deferred trigger enabled and disabled, alternated in one run.

Uses a scratch database on the server named by LEDGER_BENCH_DSN (default
the local postgres), dropped at the end. Machines are noisy: compare the
ratios within one run, not absolute numbers across machines.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import psycopg
from psycopg.conninfo import make_conninfo

from ledger.resources import install_sql

ADMIN_DSN = os.environ.get("LEDGER_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres")


def timed(fn: Callable[[int], None], calls: int, repeats: int = 5) -> float:
    """Best-of-`repeats` microseconds per call."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(calls):
            fn(i)
        best = min(best, time.perf_counter() - started)
    return best / calls * 1e6


def catch_up(conn: psycopg.Connection, calls: int) -> None:
    print("## Catch-up cost against downtime (us per call, best of 5)\n")
    print("| schedule | zone | call | 2 missed slots | 1 year missed | ratio |")
    print("|---|---|---|---:|---:|---:|")
    for schedule, zone in (("* * * * *", "UTC"), ("* * * * *", "Europe/Berlin"), ("1 minute", "UTC")):
        results = {}
        for label, downtime in (("short", "2 minutes"), ("year", "365 days")):
            job = f"bench-{label}-{zone}-{schedule}".replace(" ", "_").replace("*", "x")
            conn.execute("SELECT ledger.register_job(%s, %s, ttl => '1 hour', time_zone => %s)", (job, schedule, zone))
            # The last success lies `downtime` before now.
            slot = conn.execute("SELECT ledger._slot_at_or_before(schedule_spec, time_zone, now() - %s::interval) "
                                "FROM ledger.jobs WHERE job = %s", (downtime, job)).fetchone()[0]
            run = conn.execute("SELECT run_id, token FROM ledger.start_run(%s, 'setup', slot => %s)", (job, slot)).fetchone()
            conn.execute("SELECT ledger.complete_run(%s, %s)", run)
            due = timed(lambda _: conn.execute("SELECT count(*) FROM ledger.due_slots(%s)", (job,)).fetchone(), calls)

            def start_and_roll_back(_: int) -> None:
                with conn.transaction(force_rollback=True):
                    conn.execute("SELECT outcome FROM ledger.start_due_run(%s, 'bench')", (job,)).fetchone()

            start = timed(start_and_roll_back, calls)
            results[label] = (due, start)
        for i, call in enumerate(("due_slots", "start_due_run")):
            short, year = results["short"][i], results["year"][i]
            print(f"| `{schedule}` | {zone} | {call} | {short:.0f} | {year:.0f} | {year / short:.2f} |")
    print()


def hot_path(conn: psycopg.Connection, calls: int) -> None:
    print("## Hot path over one connection (us per call incl. round trip, best of 5)\n")
    conn.execute("SELECT ledger.acquire('hot', 'a', '1 hour')")
    token = [conn.execute("SELECT token FROM ledger.leases WHERE job = 'hot'").fetchone()[0]]

    def acquire(_: int) -> None:
        token[0] = conn.execute("SELECT token FROM ledger.acquire('hot', 'a', '1 hour')").fetchone()[0]

    def run_cycle(_: int) -> None:
        run = conn.execute("SELECT run_id, token FROM ledger.start_run('cycle', 'a', '1 hour')").fetchone()
        conn.execute("SELECT ledger.complete_run(%s, %s)", run).fetchone()

    started = conn.execute("SELECT run_id, token FROM ledger.start_run('beat', 'a', '1 hour')").fetchone()
    # The fence checks the job's live lease too: a holder fencing with its current token.
    fencing = conn.execute("SELECT token FROM ledger.acquire('fenced', 'a', '1 hour')").fetchone()
    rows = [
        ("SELECT 1 (round-trip floor)", lambda _: conn.execute("SELECT 1").fetchone()),
        ("acquire (same owner, new token)", acquire),
        ("is_current", lambda _: conn.execute("SELECT ledger.is_current('hot', %s)", token).fetchone()),
        ("heartbeat", lambda _: conn.execute("SELECT ledger.heartbeat(%s, %s)", started).fetchone()),
        ("fence (lenient, current token)",
         lambda _: conn.execute("SELECT ledger.fence('fenced', 'r', %s)", fencing).fetchone()),
        ("start_run + complete_run", run_cycle),
    ]
    print("| call | us per call |")
    print("|---|---:|")
    for label, fn in rows:
        print(f"| {label} | {timed(fn, calls):.0f} |")
    print()


def durable_trigger_cost(conn: psycopg.Connection, calls: int) -> None:
    print("## The durable-token trigger (us per call incl. round trip, best of 5, alternated twice)\n")

    def acquire(_: int) -> None:
        conn.execute("SELECT token FROM ledger.acquire('trig', 'a', '1 hour')").fetchone()

    def run_cycle(_: int) -> None:
        run = conn.execute("SELECT run_id, token FROM ledger.start_run('trig-cycle', 'a', '1 hour')").fetchone()
        conn.execute("SELECT ledger.complete_run(%s, %s)", run).fetchone()

    results: dict[tuple[str, bool], list[float]] = {}
    for _ in range(2):
        for enabled in (True, False):
            conn.execute(f"ALTER TABLE ledger.leases {'ENABLE' if enabled else 'DISABLE'} TRIGGER leases_durable_token")
            for label, fn in (("acquire", acquire), ("start_run + complete_run", run_cycle)):
                results.setdefault((label, enabled), []).append(timed(fn, calls))
    conn.execute("ALTER TABLE ledger.leases ENABLE TRIGGER leases_durable_token")
    print("| call | with trigger | without | ratio |")
    print("|---|---:|---:|---:|")
    for label in ("acquire", "start_run + complete_run"):
        on, off = min(results[(label, True)]), min(results[(label, False)])
        print(f"| {label} | {on:.0f} | {off:.0f} | {on / off:.2f} |")
    print()


def sections(admin_dsn: str, calls: int) -> None:
    """The three sections, printed as markdown, in a scratch database dropped at the end."""
    name = f"ledger_bench_calls_{os.getpid()}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    try:
        with psycopg.connect(make_conninfo(admin_dsn, dbname=name), autocommit=True) as conn:
            conn.execute(install_sql())  # type: ignore[arg-type]
            version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            print(f"PostgreSQL {version}, {os.cpu_count()} cores, {calls} calls per timing\n")
            catch_up(conn, calls)
            hot_path(conn, calls)
            durable_trigger_cost(conn, calls)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls per timing")
    args = parser.parse_args()
    sections(ADMIN_DSN, args.calls)


if __name__ == "__main__":
    main()
