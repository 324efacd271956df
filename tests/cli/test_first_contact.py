"""First contact: the command line and the pytest plugin as a new user meets them.

Each failure a first try can hit is one line that names the thing (the
missing package, the job, the database) and the fix, with the documented exit
code: no tracebacks. The cases: no `embedded` extra and no DSN; `status` over
jobs whose ledger.job_status columns are NULL; `demo` never writing into a
database it did not create unless asked; `run` taking CMD only after `--`;
unknown job names; the plugin's default server when pytest runs as root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner
from clihelp import environment, jobledger

from ledger import render
from ledger.cli import main
from ledger.models import JobStatus

pytest_plugins = ["pytester"]


def invoke(*args: str) -> tuple[int, str, str]:
    """``jobledger ARGS`` in this process (parsing and one-line errors need no subprocess): code, stdout, stderr."""
    result = CliRunner().invoke(main, list(args), prog_name="jobledger")
    return result.exit_code, result.stdout, result.stderr


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# -- 1. no `embedded` extra, no DSN ---------------------------------------------------

# The CLI with the extra's modules made unimportable (an install without `[embedded]`).
WITHOUT_EXTRA = ("import sys; sys.modules['platformdirs'] = None; sys.modules['pgserver'] = None; "
                 "from ledger.cli import main; main()")


def _without_extra(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRA, *args], env=environment(**extra),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "code"), [
    (["status"], 1), (["where"], 1), (["runs", "nightly"], 1), (["register", "nightly"], 1),
    (["run", "nightly", "--ttl", "1m", "--", "true"], 125),
])
@pytest.mark.parametrize("home", [None, "set"], ids=["default-home", "LEDGER_HOME"])
def test_without_the_embedded_extra_and_a_dsn_one_line_says_what_to_install(args, code, home, tmp_path):
    extra = {"LEDGER_HOME": str(tmp_path / "home")} if home else {}
    result = _without_extra(*args, **extra)
    assert result.returncode == code, result.stderr
    line = _one_line(result.stderr)
    assert "pip install 'pg-job-ledger[embedded]'" in line and "--dsn" in line and "LEDGER_DSN" in line, line
    # It names what is missing: platformdirs first (the data directory), pgserver with LEDGER_HOME set.
    assert ("'pgserver'" if home else "'platformdirs'") in line, line
    assert result.stdout == ""


def test_the_demo_without_the_embedded_extra_says_how_else_to_run(tmp_path):
    result = _without_extra("demo")
    assert result.returncode == 1, result.stderr
    line = _one_line(result.stderr)
    assert "pg-job-ledger[embedded]" in line and "PG* variables" in line, line
    assert "--dsn DSN --yes-write-here" in line, line


def test_without_the_extra_a_dsn_still_works(dsn):
    result = _without_extra("status", "--json", LEDGER_DSN=dsn)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"jobs": [], "alerts": [], "protected_tables": [], "schedulers": [],
                                         "pools": []}


# -- 2. NULL columns of ledger.job_status ---------------------------------------------

def _nullable_jobs(db) -> None:
    db.execute("SELECT ledger.acquire(job => 'held', owner => 'host-1', ttl => '1 minute')")  # a lease, no run
    db.execute("SELECT ledger.register_job(job => 'fresh', schedule => '1 hour', ttl => '10 minutes')")  # never ran
    db.execute("SELECT ledger.register_job(job => 'sleepy', schedule => '*/5 * * * *', time_zone => 'Europe/Berlin')")
    db.execute("SELECT ledger.pause_job(job => 'sleepy')")


COUNTERS = ("runs_started", "successes", "failures", "skipped_overlap", "skipped_backfill", "leases_lost",
            "consecutive_failures")


def test_status_table_shows_jobs_with_a_lease_only_never_run_or_paused(dsn, db):
    _nullable_jobs(db)
    result = jobledger("status", dsn=dsn)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.split()[:1] in
            (["held"], ["fresh"], ["sleepy"])}
    assert set(rows) == {"held", "fresh", "sleepy"}, result.stdout
    # the ledger's state words (job_status.state): a lease and no run is never_run
    assert re.search(r"held\s+-\s+\S+ never_run\s+-\s+-\s+0\s+0\s+0\s+0\s+0\s+0\s*$", rows["held"]), rows["held"]
    assert "host-1 (1)" in result.stdout  # the holder, under its state
    assert re.search(r"fresh\s+1 hour\s+\S+ never_run\s+-\s+in \S+", rows["fresh"]), rows["fresh"]
    assert re.search(r"sleepy\s+\*/5 \* \* \* \* Europe/Berlin\s+\S+ paused\s+-\s+-\s+0", rows["sleepy"]), rows["sleepy"]
    narrow = jobledger("status", env=environment(dsn, COLUMNS="60"))
    assert narrow.returncode == 0, narrow.stderr
    assert "held" in narrow.stdout and "sleepy" in narrow.stdout


def test_status_json_of_jobs_with_null_columns_has_counters_at_zero(dsn, db):
    _nullable_jobs(db)
    result = jobledger("status", "--json", dsn=dsn)
    assert result.returncode == 0, result.stderr
    jobs = {row["job"]: row for row in json.loads(result.stdout)["jobs"]}
    assert set(jobs) == {"held", "fresh", "sleepy"}
    for job in jobs.values():
        assert all(job[name] == 0 for name in COUNTERS), job
        assert job["last_status"] is None and job["running_run_id"] is None
    assert (jobs["held"]["holder"], jobs["held"]["token"], jobs["held"]["schedule"]) == ("host-1", 1, None)
    assert jobs["held"]["time_zone"] is None and jobs["held"]["max_backfill"] is None
    assert jobs["fresh"]["next_slot"] is not None and jobs["fresh"]["holder"] is None
    assert jobs["sleepy"]["paused"] is True and jobs["sleepy"]["next_slot"] is None
    only = json.loads(jobledger("status", "held", "--json", dsn=dsn).stdout)
    assert [row["job"] for row in only["jobs"]] == ["held"]


def test_render_copes_with_every_column_null():
    now = datetime.now(timezone.utc)
    nothing = JobStatus(job="ghost", **{name: None for name in JobStatus.__dataclass_fields__ if name != "job"})
    out = render.console()
    for wide in (True, False):
        with out.capture() as captured:
            out.print(render.status_table([nothing], [], now, wide=wide))
        assert "ghost" in captured.get()  # no state word read: "-", nothing made up
    plain = json.loads(render.to_json(render.with_counters(nothing)))
    assert all(plain[name] == 0 for name in COUNTERS) and plain["holder"] is None


# -- 3. the demo writes only where it is allowed ----------------------------------------

def _jobs(db) -> list[str]:
    return [row[0] for row in db.execute("SELECT job FROM ledger.jobs UNION SELECT job FROM ledger.leases")]


def _databases(db, pattern: str) -> list[str]:
    return [row[0] for row in db.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", (pattern,))]


def test_the_demo_ignores_ledger_dsn_and_drops_its_scratch_database(dsn, db, pg_server):
    env = environment(dsn, PGHOST=pg_server.host, PGPORT=str(pg_server.port), PGUSER=pg_server.user,
                      **({"PGPASSWORD": pg_server.password} if pg_server.password else {}))
    result = jobledger("demo", "--speed", "4", env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip("\n").splitlines()[-1] == "audit: ledger.overlaps has 0 rows"
    assert "LEDGER_DSN is not used by the demo" in _one_line(result.stderr)
    [scratch] = re.findall(r"scratch database (jobledger_demo_[0-9a-f]{8})", result.stdout)
    assert _databases(db, scratch) == []  # dropped at the end
    assert _jobs(db) == []  # LEDGER_DSN's database: untouched


def test_the_demo_refuses_a_dsn_without_the_confirmation(dsn, db):
    code, out, err = invoke("demo", "--dsn", dsn)
    assert (code, out) == (2, "")
    line = _one_line(err)
    assert "--yes-write-here" in line and "dbname=" in line, line
    assert _jobs(db) == []
    code, _, err = invoke("demo", "--dsn", "postgresql://app:s3cret@db.example/ops")
    assert code == 2 and "db.example" in err and "s3cret" not in err
    code, _, err = invoke("demo", "--yes-write-here")
    assert code == 2 and "--dsn" in _one_line(err)


def test_the_demo_writes_into_a_given_database_when_confirmed(dsn, db):
    result = jobledger("demo", "--speed", "4", "--dsn", dsn, "--yes-write-here", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip("\n").splitlines()[-1] == "audit: ledger.overlaps has 0 rows"
    assert any(job.startswith("publish-") for job in _jobs(db))


# -- 4. run: jobledger's options before `--`, CMD after it ---------------------------------

@pytest.mark.parametrize(("args", "said"), [
    (["nightly", "--ttl", "1m", "echo", "-v", "hi"], "'echo' follows JOB 'nightly' without a `--`"),
    (["nightly", "--ttl", "1m", "ls", "-la"], "no such option: -l (if it is CMD's, put `--` before CMD"),
    (["nightly", "stray", "--ttl", "1m", "--", "echo", "hi"], "'stray' follows JOB 'nightly' before `--`"),
    (["nightly", "--ttl", "1m"], "missing `-- CMD`"),
    (["nightly", "--ttl", "1m", "--"], "no CMD after `--`"),
    (["--ttl", "1m", "--", "echo", "hi"], "missing JOB"),
    (["--", "echo", "hi"], "missing JOB"),
])
def test_run_refuses_cmd_without_a_double_dash_in_one_line(dsn, db, args, said):
    code, out, err = invoke("run", "--dsn", dsn, *args) if args[0] != "--" else invoke("run", *args)
    assert code == 2, err
    line = _one_line(err)
    assert said in line, line
    assert "[OPTIONS] -- " in line, line  # the right form
    assert out == "" and _jobs(db) == []  # nothing ran, no job named echo


def test_run_refuses_in_one_line_as_a_subprocess_too(dsn, db):
    result = jobledger("run", "nightly", "--ttl", "1m", "echo", "-v", "hi", dsn=dsn)
    assert result.returncode == 2
    assert "jobledger run nightly [OPTIONS] -- CMD [ARGS]..." in _one_line(result.stderr)
    assert _jobs(db) == []


def test_run_gives_cmd_everything_after_the_double_dash(dsn, db):
    result = jobledger("run", "nightly", "--ttl", "1m", "-v", "--", "sh", "-c", 'echo "$@"', "sh", "-v", "--ttl",
                       "--", "hi", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "-v --ttl -- hi\n"  # CMD's arguments, even ones that look like jobledger's
    assert "run 1 of job nightly started" in result.stderr  # and -v before `--` was jobledger's
    assert _jobs(db) == ["nightly"]


def test_run_help_shows_the_form():
    code, out, _ = invoke("run", "--help")
    assert code == 0
    assert out.startswith("Usage: jobledger run JOB [OPTIONS] -- CMD [ARGS]...")


# -- 5. unknown job names ------------------------------------------------------------------

@pytest.mark.parametrize("args", [["status", "nosuchjob"], ["status", "--json", "nosuchjob"],
                                  ["runs", "nosuchjob"], ["pause", "nosuchjob"], ["resume", "nosuchjob"]])
def test_an_unknown_job_is_one_line_naming_it_and_exit_1(dsn, args):
    code, out, err = invoke(*args, "--dsn", dsn)
    assert code == 1, out + err
    line = _one_line(err)
    assert line.startswith("Error: ") and "nosuchjob" in line and "jobledger status" in line, line
    assert "jobledger register nosuchjob" in line, line
    assert out == ""


def test_an_unknown_job_as_a_subprocess(dsn):
    result = jobledger("status", "nosuchjob", dsn=dsn)
    assert (result.returncode, result.stdout) == (1, "")
    assert "no job named nosuchjob" in _one_line(result.stderr)


def test_status_names_only_the_unknown_ones_and_a_known_job_without_runs_is_fine(dsn, db):
    db.execute("SELECT ledger.register_job(job => 'quiet')")
    code, _, err = invoke("status", "quiet", "nope", "nada", "--dsn", dsn)
    assert code == 1
    line = _one_line(err)
    assert "nope, nada" in line and "quiet" not in line, line
    assert invoke("runs", "quiet", "--dsn", dsn)[:2] == (0, "no runs of quiet\n")
    assert invoke("status", "quiet", "--dsn", dsn)[0] == 0


# -- 6. the pytest plugin's default server, also as root ------------------------------------

USER_TEST = '''
def test_the_ledger_is_there(ledger_postgresql):
    assert ledger_postgresql.execute("SELECT version_num FROM ledger.alembic_version").fetchone()
'''


def _has_pg_ctl() -> bool:
    return bool(shutil.which("pg_ctl") or list(__import__("pathlib").Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")))


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PGHOST", "PGPORT", "PGUSER", "PGDATABASE", "PGPASSWORD", "LEDGER_DSN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not _has_pg_ctl(), reason="needs pg_ctl (apt-get install postgresql)")
def test_the_plugin_default_base_starts_a_server_even_as_root(pytester: pytest.Pytester, monkeypatch) -> None:
    _clean_env(monkeypatch)
    pytester.makeconftest('pytest_plugins = ["ledger.testing"]')
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=1)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root (the suite run as root): the root path")
def test_as_root_without_the_os_user_the_plugin_says_what_to_set(pytester: pytest.Pytester, monkeypatch) -> None:
    _clean_env(monkeypatch)
    pytester.makeconftest('pytest_plugins = ["ledger.testing"]')
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ledger-postgresql-os-user", "no-such-user",
                                           timeout=120)
    result.assert_outcomes(errors=1)
    text = result.stdout.str()
    assert "PostgreSQL refuses to run as root, and there is no 'no-such-user' OS user" in text
    assert "--ledger-postgresql-base postgresql_noproc" in text and "--ledger-postgresql-os-user" in text
    assert "Traceback" not in text and "CalledProcessError" not in text


def test_a_base_whose_pg_ctl_fails_is_one_clear_error(pytester: pytest.Pytester, monkeypatch, tmp_path) -> None:
    _clean_env(monkeypatch)
    fake = tmp_path / "pg_ctl"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "pg_ctl (PostgreSQL) 15.4"; exit 0; fi\n'
                    'echo "initdb: error: cannot be run as root"; exit 1\n')
    fake.chmod(0o755)
    pytester.makeconftest(f'''
from pytest_postgresql import factories

pytest_plugins = ["ledger.testing"]
broken_proc = factories.postgresql_proc(executable={str(fake)!r})
''')
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--ledger-postgresql-base", "broken_proc",
                                           timeout=120)
    result.assert_outcomes(errors=1)
    # The error itself is one line (pytest-postgresql's own cleanup log may follow it).
    [line] = [line for line in result.stdout.lines if line.startswith("ledger.testing: ")]
    assert "broken_proc could not start PostgreSQL" in line and "initdb" in line, line
    assert "cannot be run as root" in line and "--ledger-postgresql-base postgresql_noproc" in line, line
