"""`jobledger pool register/resize/drop/list`, `jobledger pools`, `jobledger register --pool/--no-pool`,
the pools in `jobledger status`, and `jobledger run` on a full pool: a skip, its own words, the skip
exit code, counted in skipped_pool_full (real subprocesses, a real database)."""

from __future__ import annotations

import json

from clihelp import jobledger, start
from waiting import wait_for


def _pool(db, pool):
    return db.execute("SELECT size, used, jobs, skipped_pool_full FROM ledger.pool_status WHERE pool = %s",
                      (pool,)).fetchone()


def test_register_resize_list_and_drop(dsn, db):
    created = jobledger("pool", "register", "heavy", "3", dsn=dsn)
    assert created.returncode == 0, created.stderr
    assert created.stdout == "registered pool heavy: size 3 (at most 3 live leases of its jobs at once)\n"
    assert _pool(db, "heavy") == (3, 0, 0, 0)

    resized = jobledger("pool", "resize", "heavy", "1", "--json", dsn=dsn)
    assert resized.returncode == 0, resized.stderr
    row = json.loads(resized.stdout)
    assert (row["pool"], row["size"]) == ("heavy", 1) and set(row) == {
        "pool", "size", "created_at", "updated_at", "admitted_at"}
    assert jobledger("pool", "register", "heavy", "2", dsn=dsn).returncode == 0  # register changes a size too
    assert _pool(db, "heavy")[0] == 2

    joined = jobledger("register", "report-a", "--ttl", "10m", "--pool", "heavy", dsn=dsn)
    assert joined.returncode == 0, joined.stderr
    assert joined.stdout.rstrip().endswith("pool heavy")
    assert jobledger("register", "report-b", "--ttl", "10m", "--pool", "heavy", dsn=dsn).returncode == 0

    for listing in (["pools"], ["pool", "list"]):
        table = jobledger(*listing, dsn=dsn)
        assert table.returncode == 0, table.stderr
        assert "ledger.pool_status" in table.stdout
        line = next(line for line in table.stdout.splitlines() if line.strip().startswith("heavy"))
        assert line.split()[:7] == ["heavy", "2", "0", "0", "2", "0", "0"]
        [listed] = json.loads(jobledger(*listing, "--json", dsn=dsn).stdout)
        assert {key: listed[key] for key in ("pool", "size", "used", "running", "jobs", "waiting",
                                            "skipped_pool_full")} == {
            "pool": "heavy", "size": 2, "used": 0, "running": 0, "jobs": 2, "waiting": 0, "skipped_pool_full": 0}

    # jobs belong to it: refused in one line that names them, nothing dropped
    refused = jobledger("pool", "drop", "heavy", dsn=dsn)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "report-a, report-b" in refused.stderr and "detach" in refused.stderr
    assert _pool(db, "heavy") is not None

    left = jobledger("register", "report-b", "--no-pool", dsn=dsn)
    assert left.returncode == 0 and "pool" not in left.stdout
    assert db.execute("SELECT pool FROM ledger.jobs WHERE job = 'report-b'").fetchone() == (None,)
    assert jobledger("register", "report-b", "--pool", "heavy", dsn=dsn).returncode == 0
    assert jobledger("register", "report-b", "--pool", "", dsn=dsn).returncode == 0  # '' leaves it too
    assert db.execute("SELECT pool FROM ledger.jobs WHERE job = 'report-b'").fetchone() == (None,)
    assert jobledger("register", "report-b", "--ttl", "20m", dsn=dsn).returncode == 0  # no --pool: kept out
    assert db.execute("SELECT pool FROM ledger.jobs WHERE job = 'report-a'").fetchone() == ("heavy",)

    dropped = jobledger("pool", "drop", "heavy", "--detach", dsn=dsn)
    assert dropped.returncode == 0 and dropped.stdout == "dropped pool heavy\n"
    assert db.execute("SELECT pool FROM ledger.jobs WHERE job = 'report-a'").fetchone() == (None,)
    again = jobledger("pool", "drop", "heavy", dsn=dsn)
    assert again.returncode == 0 and again.stdout == "no pool named heavy: nothing dropped\n"
    assert jobledger("pools", dsn=dsn).stdout == "no pools: `jobledger pool register NAME SIZE` creates one\n"
    assert json.loads(jobledger("pools", "--json", dsn=dsn).stdout) == []


def test_bad_size_and_unknown_pool_in_one_line(dsn, db):
    for size in ("0", "100001", "-3"):
        result = jobledger("pool", "register", "heavy", "--", size, dsn=dsn)  # --: -3 is no option
        assert result.returncode == 1, result
        assert result.stderr.count("\n") == 1 and "argument size must be from 1 to 100000" in result.stderr
    assert db.execute("SELECT count(*) FROM ledger.pools").fetchone() == (0,)
    not_a_number = jobledger("pool", "register", "heavy", "three", dsn=dsn)
    assert not_a_number.returncode == 2 and "SIZE" in not_a_number.stderr

    fix = "pool not found: nope was never registered: `jobledger pool register nope SIZE` first"
    for args in (["pool", "resize", "nope", "2"], ["register", "etl", "--ttl", "10m", "--pool", "nope"]):
        result = jobledger(*args, dsn=dsn)
        assert result.returncode == 1, result
        assert result.stderr.count("\n") == 1 and fix in result.stderr, result.stderr
    assert db.execute("SELECT count(*) FROM ledger.jobs").fetchone() == (0,)  # the register changed nothing

    both = jobledger("register", "etl", "--pool", "heavy", "--no-pool", dsn=dsn)
    assert both.returncode == 2 and "--no-pool" in both.stderr


def test_status_shows_the_pool_column_and_the_pools(dsn, db):
    db.execute("SELECT ledger.register_job('plain', ttl => '10 minutes')")
    status = jobledger("status", dsn=dsn)
    assert "pool" not in status.stdout  # a ledger without pools: no column, no table
    assert json.loads(jobledger("status", "--json", dsn=dsn).stdout)["pools"] == []

    db.execute("SELECT ledger.register_pool('heavy', 1)")
    db.execute("SELECT ledger.register_job('report', ttl => '10 minutes', pool => 'heavy')")
    db.execute("SELECT ledger.start_run('report', 'w1')")
    db.execute("SELECT ledger.register_job('report-2', ttl => '10 minutes', pool => 'heavy')")
    assert db.execute("SELECT outcome FROM ledger.start_run('report-2', 'w2')").fetchone() == ("skipped_pool_full",)

    status = jobledger("status", dsn=dsn)
    assert status.returncode == 0, status.stderr
    header = next(line for line in status.stdout.splitlines() if line.split()[:1] == ["job"])
    assert "pool" in header.split() and header.rstrip().endswith("pool full")
    row = next(line for line in status.stdout.splitlines() if line.split()[:1] == ["report-2"])
    assert "heavy" in row.split() and row.split()[-1] == "1"  # its skipped_pool_full, the last column
    assert "ledger.pool_status" in status.stdout
    document = json.loads(jobledger("status", "--json", dsn=dsn).stdout)
    jobs = {row["job"]: row for row in document["jobs"]}
    assert (jobs["report-2"]["pool"], jobs["report-2"]["skipped_pool_full"]) == ("heavy", 1)
    assert jobs["plain"]["pool"] is None
    [pool] = document["pools"]
    assert (pool["pool"], pool["size"], pool["used"], pool["jobs"], pool["skipped_pool_full"]) == ("heavy", 1, 1, 2, 1)
    # a job asked for by name: its pool only
    assert json.loads(jobledger("status", "--json", "plain", dsn=dsn).stdout)["pools"] == []


def test_run_on_a_full_pool_is_a_skip(dsn, db, tmp_path):
    db.execute("SELECT ledger.register_pool('heavy', 1)")
    for job in ("report-a", "report-b"):
        db.execute("SELECT ledger.register_job(%s, ttl => '10 minutes', pool => 'heavy')", (job,))
    started = tmp_path / "started"
    holder = start("run", "report-a", "--", "sh", "-c", f"touch {started}; sleep 30", dsn=dsn)
    try:
        wait_for(lambda: started.exists() and _pool(db, "heavy")[1] == 1, timeout=30)
        ran = tmp_path / "ran"
        skipped = jobledger("run", "report-b", "--", "touch", str(ran), dsn=dsn)
        assert skipped.returncode == 0, skipped.stderr
        assert skipped.stderr == "jobledger: skipped: pool heavy of job report-b is full (1 of 1 live leases)\n"
        assert not ran.exists()
        coded = jobledger("run", "report-b", "--skip-exit-code", "75", "--", "touch", str(ran), dsn=dsn)
        assert coded.returncode == 75 and "is full" in coded.stderr and not ran.exists()
        assert db.execute("SELECT skipped_pool_full, skipped_overlap, failures, runs_started FROM ledger.job_status "
                          "WHERE job = 'report-b'").fetchone() == (2, 0, 0, 0)
        assert _pool(db, "heavy")[3] == 2
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    # the place freed: the next start runs
    wait_for(lambda: _pool(db, "heavy")[1] == 0, timeout=30)
    after = jobledger("run", "report-b", "--", "touch", str(tmp_path / "ran"), dsn=dsn)
    assert after.returncode == 0, after.stderr
    assert (tmp_path / "ran").exists()
