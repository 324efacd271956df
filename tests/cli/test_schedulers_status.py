"""The schedulers' registry as the command line shows it (issue 23, point 5): `jobledger status`
(the live ones, a `schedulers` key in --json, nothing printed when there is none), `jobledger
schedulers` (`--all`: the expired ones too, and the upkeep leader); and `jobledger register`'s
scheduling options (--jitter, --start-deadline, --overlap-policy), through the client's
register_job (tests/client/test_register_job_options.py has the client's own). Rows are written by the SQL API the schedulers call (ledger.scheduler_heartbeat)."""

from __future__ import annotations

import json
import shlex
from datetime import timedelta

import psycopg
from clihelp import jobledger

from clockseam import LedgerClock
from ledger.client import Ledger
from repo import DOCS


def _heartbeat(db: psycopg.Connection, scheduler: str, host: str, pid: int, jobs: list[str],
               ttl: str = "30 seconds") -> bool:
    row = db.execute("SELECT ledger.scheduler_heartbeat(%s, %s, %s, '0.2.0-test', %s, %s::interval)",
                     (scheduler, host, pid, jobs, ttl)).fetchone()
    assert row is not None
    return bool(row[0])


def _options(db: psycopg.Connection, job: str) -> tuple[timedelta | None, timedelta | None, str]:
    """The job's jitter, start deadline and overlap policy, as ledger.jobs holds them."""
    row = db.execute("SELECT j.jitter, j.start_deadline, j.overlap_policy FROM ledger.jobs AS j WHERE j.job = %s",
                     (job,)).fetchone()
    assert row is not None
    return row[0], row[1], row[2]


def test_status_without_schedulers_prints_nothing_of_them(dsn: str, db: psycopg.Connection) -> None:
    Ledger(db).register_job("nightly", schedule="1 hour", ttl=timedelta(minutes=5))
    out = jobledger("status", dsn=dsn)
    assert out.returncode == 0, out.stderr
    assert "scheduler" not in out.stdout
    assert json.loads(jobledger("status", "--json", dsn=dsn).stdout)["schedulers"] == []


def test_status_shows_the_live_schedulers_and_not_the_expired(dsn: str, db: psycopg.Connection,
                                                               ledger_clock: LedgerClock) -> None:
    Ledger(db).register_job("nightly", schedule="1 hour", ttl=timedelta(minutes=5))
    assert _heartbeat(db, "gone", "host-b", 222, ["nightly"], ttl="10 seconds")  # the first one leads
    ledger_clock.advance(timedelta(seconds=20))  # gone's row expires: it died
    assert _heartbeat(db, "alpha", "host-a", 111, ["nightly", "weekly"])  # takes the free leadership

    out = jobledger("status", dsn=dsn)
    assert out.returncode == 0, out.stderr
    assert "live schedulers" in out.stdout
    assert "alpha" in out.stdout and "host-a" in out.stdout and "leader" in out.stdout
    assert "gone" not in out.stdout

    document = json.loads(jobledger("status", "--json", dsn=dsn).stdout)
    [alpha] = document["schedulers"]
    assert (alpha["scheduler"], alpha["host"], alpha["pid"], alpha["version"]) == ("alpha", "host-a", 111,
                                                                                   "0.2.0-test")
    assert alpha["jobs"] == ["nightly", "weekly"] and alpha["job_count"] == 2
    assert alpha["live"] is True and alpha["leader"] is True and alpha["stopping"] is False
    # a job filter keeps the schedulers that serve one of the jobs
    Ledger(db).register_job("other", ttl=timedelta(minutes=5))
    assert json.loads(jobledger("status", "--json", "other", dsn=dsn).stdout)["schedulers"] == []
    assert len(json.loads(jobledger("status", "--json", "nightly", dsn=dsn).stdout)["schedulers"]) == 1


def test_schedulers_lists_every_row_with_all_the_expired_marked(dsn: str, db: psycopg.Connection,
                                                                 ledger_clock: LedgerClock) -> None:
    assert jobledger("schedulers", dsn=dsn).stdout.startswith("no live scheduler")
    assert json.loads(jobledger("schedulers", "--all", "--json", dsn=dsn).stdout) == []
    assert _heartbeat(db, "dead", "host-d", 4, ["a"], ttl="10 seconds")
    ledger_clock.advance(timedelta(seconds=20))
    assert _heartbeat(db, "leader", "host-l", 5, ["a", "b"])
    assert not _heartbeat(db, "second", "host-s", 6, ["a"])  # the leadership is held: one at a time
    db.execute("SELECT ledger.scheduler_heartbeat('quitting', 'host-q', 7, 'v', ARRAY['a'], '30 seconds', true)")

    live = json.loads(jobledger("schedulers", "--json", dsn=dsn).stdout)
    assert [row["scheduler"] for row in live] == ["leader", "quitting", "second"]
    every = {row["scheduler"]: row for row in json.loads(jobledger("schedulers", "--all", "--json", dsn=dsn).stdout)}
    assert sorted(every) == ["dead", "leader", "quitting", "second"]
    assert every["dead"]["live"] is False and every["dead"]["leader"] is False
    assert [name for name, row in every.items() if row["leader"]] == ["leader"]
    assert every["quitting"]["stopping"] is True and every["quitting"]["live"] is True
    assert {name: row["status"] for name, row in every.items()} == {
        "dead": "expired", "leader": "live", "quitting": "stopping", "second": "live"}

    table = jobledger("schedulers", "--all", dsn=dsn)
    assert table.returncode == 0, table.stderr
    lines = {line.split()[0]: line for line in table.stdout.splitlines() if line.strip()
             and line.split()[0] in every}
    assert "expired" in lines["dead"] and "leader" not in lines["dead"].split()[1:]
    assert "live" in lines["leader"] and "leader" in lines["leader"].split()[1:]
    assert "stopping" in lines["quitting"]
    assert "dead" not in jobledger("schedulers", dsn=dsn).stdout

    # a graceful stop removes the row, and its leadership with it
    db.execute("SELECT ledger.scheduler_stop('leader')")
    rows = json.loads(jobledger("schedulers", "--all", "--json", dsn=dsn).stdout)
    assert "leader" not in {row["scheduler"] for row in rows}
    assert not any(row["leader"] for row in rows)


def test_register_sets_jitter_start_deadline_and_overlap_policy(dsn: str, db: psycopg.Connection) -> None:
    out = jobledger("register", "hourly", "--schedule", "1 hour", "--ttl", "5m", "--jitter", "30s",
                    "--start-deadline", "10m", "--overlap-policy", "buffer_one", dsn=dsn)
    assert out.returncode == 0, out.stderr
    assert "jitter 30s" in out.stdout and "start deadline 10m" in out.stdout
    assert "overlap policy buffer_one" in out.stdout
    assert _options(db, "hourly") == (timedelta(seconds=30), timedelta(minutes=10), "buffer_one")
    # an option left out keeps what the job has; 0 clears
    document = json.loads(jobledger("register", "hourly", "--jitter", "0", "--json", dsn=dsn).stdout)
    assert document["jitter"] is None and document["start_deadline"] == 600.0
    assert document["overlap_policy"] == "buffer_one"


def test_register_refuses_a_bad_overlap_policy_and_a_jitter_past_the_interval(dsn: str,
                                                                              db: psycopg.Connection) -> None:
    Ledger(db).register_job("hourly", schedule="1 hour", ttl=timedelta(minutes=5))
    bad = jobledger("register", "hourly", "--overlap-policy", "allow_all", dsn=dsn)
    assert bad.returncode == 2 and "--overlap-policy" in bad.stderr
    wide = jobledger("register", "hourly", "--jitter", "2h", dsn=dsn)
    assert wide.returncode == 1 and "jitter" in wide.stderr
    assert _options(db, "hourly") == (None, None, "catch_up")


def test_the_cli_pages_register_example_prints_what_it_shows(dsn: str) -> None:
    page = (DOCS / "cli.md").read_text()
    section = page.split("\n### Scheduling options\n", 1)[1].split("\n### ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    command, shown = block[0].removeprefix("$ "), block[1]
    out = jobledger(*shlex.split(command)[1:], dsn=dsn)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == shown
