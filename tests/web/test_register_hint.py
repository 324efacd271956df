"""The dashboard's "change its definition" hint says what `jobledger register` does.

register changes the options it is given and keeps the others as they are
(docs/cli.md: "the others stay as they are"): the hint on a job's page says
so, and running the command with options left out proves it.
"""

from __future__ import annotations

import urllib.request

from clihelp import jobledger
from ledger.web.app import create_app
from ledger.web.server import BackgroundServer

HINT = "register changes the options given, and options left out are kept as they are"


def test_the_job_page_says_options_left_out_are_kept(dsn, db):
    db.execute("SELECT ledger.register_job(job => 'rollup', schedule => '10 * * * *', ttl => '20 minutes', "
               "max_backfill => 3)")
    with BackgroundServer(create_app(dsn)) as server:
        with urllib.request.urlopen(server.url + "/jobs/rollup", timeout=30) as response:
            page = response.read().decode()
    assert "change its definition" in page
    assert HINT in page
    assert "get their defaults" not in page


def test_register_keeps_the_options_left_out(dsn, db):
    db.execute("SELECT ledger.register_job(job => 'rollup', schedule => '10 * * * *', ttl => '20 minutes', "
               "max_backfill => 3, time_zone => 'Europe/Berlin')")
    result = jobledger("register", "rollup", "--ttl", "30m", dsn=dsn)
    assert result.returncode == 0, result.stderr
    row = db.execute("SELECT schedule, ttl, max_backfill, time_zone FROM ledger.jobs WHERE job = 'rollup'").fetchone()
    assert row is not None
    schedule, ttl, max_backfill, time_zone = row
    assert (schedule, ttl.total_seconds(), max_backfill, time_zone) == ("10 * * * *", 1800, 3, "Europe/Berlin")
