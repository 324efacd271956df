"""The jobs file's pools: the top-level ``[pools]`` table (``name = size``), checked offline by
``jobledger scheduler check`` (every mistake named), registered by the scheduler before it syncs the
jobs, in the same transaction (a refused file registers no pool either); a job's ``pool`` key puts
it in one, a job without the key is out of any (a definition is the whole of it)."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path

import psycopg
import pytest
from clihelp import JOBLEDGER, environment, jobledger
from waiting import wait_for

from ledger.connect import connect
from ledger.scheduler.jobsfile import JobsFileError, parse
from ledger.scheduler.sync import sync_file

FILE = """
source = "pools-test"

[pools]
heavy = 2
light = 10

[jobs.report-a]
schedule = "1 hour"
ttl = "10m"
pool = "heavy"
command = ["true"]

[jobs.report-b]
schedule = "1 hour"
ttl = "10m"
pool = "heavy"
command = ["true"]

[jobs.tidy]
schedule = "1 hour"
ttl = "10m"
command = ["true"]
"""


def test_the_pools_table_is_parsed_and_check_says_it(tmp_path):
    loaded = parse(FILE, "jobs.toml")
    assert loaded.pools == {"heavy": 2, "light": 10}
    assert loaded.definitions()["report-a"]["pool"] == "heavy" and "pool" not in loaded.definitions()["tidy"]
    path = tmp_path / "jobs.toml"
    path.write_text(FILE)
    result = jobledger("scheduler", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (f"{path}: 3 jobs, pool heavy size 2, pool light size 10, source 'pools-test', "
                             "removed jobs are paused: ok\n")


@pytest.mark.parametrize(("pools", "named"), [
    ("[pools]\nheavy = 0", "key pools.heavy: the size must be from 1 to 100,000 (got 0)"),
    ("[pools]\nheavy = 100001", "key pools.heavy: the size must be from 1 to 100,000 (got 100001)"),
    ('[pools]\nheavy = "3"', "key pools.heavy: the size must be an integer (got '3')"),
    ("[pools]\nheavy = true", "key pools.heavy: the size must be an integer (got True)"),
    ('[pools]\n"bad name" = 3', "key pools.bad name: invalid pool name"),
    ('pools = 3', "key pools: must be a table of name = size"),
])
def test_check_names_a_bad_pool(tmp_path, pools, named):
    path = tmp_path / "jobs.toml"
    path.write_text(pools + "\n" + FILE.replace("[pools]\nheavy = 2\nlight = 10\n", ""))
    result = jobledger("scheduler", "check", str(path))
    assert result.returncode == 1 and named in result.stderr, result.stderr
    with pytest.raises(JobsFileError):
        parse(path.read_text(), str(path))


def test_a_jobs_pool_must_be_a_string():
    with pytest.raises(JobsFileError) as refused:
        parse(FILE.replace('pool = "heavy"', "pool = 3", 1))
    assert "job report-a, key pool: must be a string (got int)" in str(refused.value)


def _pools(db: psycopg.Connection) -> dict[str, tuple[int, int]]:
    return {row[0]: (row[1], row[2]) for row in db.execute("SELECT pool, size, jobs FROM ledger.pool_status")}


def _job_pools(db: psycopg.Connection) -> dict[str, str | None]:
    return dict(db.execute("SELECT job, pool FROM ledger.jobs").fetchall())


def test_sync_file_registers_the_pools_first_in_one_transaction(dsn, db):
    said: list[str] = []
    with connect(dsn) as conn:
        sync_file(conn, parse(FILE, "jobs.toml"), say=said.append)
        assert _pools(db) == {"heavy": (2, 2), "light": (10, 0)}
        assert _job_pools(db) == {"report-a": "heavy", "report-b": "heavy", "tidy": None}
        assert "pool heavy: registered, size 2" in said

        # a size changed in the file: resized; a job moved out of its pool
        said.clear()
        changed = FILE.replace("heavy = 2", "heavy = 3").replace('pool = "heavy"\ncommand', 'command', 1)
        sync_file(conn, parse(changed, "jobs.toml"), say=said.append)
        assert _pools(db) == {"heavy": (3, 1), "light": (10, 0)}
        assert _job_pools(db)["report-a"] is None
        assert "pool heavy: resized, size 3" in said and not any("light" in line for line in said)

        # a job names a pool neither the file nor the ledger has: refused whole, the file's new pool
        # not registered either
        refused = FILE.replace("light = 10", "light = 10\nfresh = 4").replace('pool = "heavy"', 'pool = "nope"', 1)
        with pytest.raises(psycopg.Error) as error:
            sync_file(conn, parse(refused, "jobs.toml"))
        assert "job report-a, key pool" in str(error.value) and "nope" in str(error.value)
        assert "fresh" not in _pools(db) and _pools(db)["heavy"] == (3, 1)


def test_the_scheduler_registers_the_files_pools(dsn, db, tmp_path: Path):
    path = tmp_path / "jobs.toml"
    path.write_text(textwrap.dedent(FILE))
    log = open(tmp_path / "scheduler.log", "wb")
    process = subprocess.Popen([*JOBLEDGER, "scheduler", "--jobs", str(path), "-v"], env=environment(dsn),
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _pools(db) == {"heavy": (2, 2), "light": (10, 0)}, timeout=60,
                 explain=lambda: (tmp_path / "scheduler.log").read_text(errors="replace"))
        assert _job_pools(db)["report-b"] == "heavy"
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        process.wait(timeout=90)
