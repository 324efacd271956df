"""The jobs file offline: `jobledger scheduler check FILE` and `jobledger scheduler import-crontab`.

No database: a file with a mistake is refused whole, each problem naming the job and the key; a
crontab converts to a file that `check` accepts, and what has no faithful translation is refused.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from clihelp import JOBLEDGER, environment, jobledger

from ledger.scheduler import crontab, jobsfile

NO_DATABASE = "host=/nonexistent dbname=none"

GOOD = """
    removed = "unregister"

    [upkeep]
    purge_log_older_than = "30d"
    purge_every = "6h"

    [jobs.nightly]
    schedule = "0 3 * * *"
    time_zone = "Europe/Paris"
    ttl = "80m"
    jitter = "5m"
    start_deadline = "1h"
    overlap_policy = "skip"
    command = ["./nightly.sh", "--full"]
    env = { MODE = "full" }
    cwd = "/srv/app"
    timeout = "2h"
    retries = 2

    [jobs.tick]
    schedule = "2 seconds"
    ttl = 30
    command = "echo tick"
    """


def check(tmp_path, text):
    path = tmp_path / "jobs.toml"
    path.write_text(textwrap.dedent(text))
    return jobledger("scheduler", "check", str(path), dsn=NO_DATABASE)


def test_check_accepts_a_valid_file_without_a_database(tmp_path):
    result = check(tmp_path, GOOD)
    assert result.returncode == 0, result.stderr
    assert "2 jobs" in result.stdout and "unregistered" in result.stdout


def test_the_definitions_sent_to_the_ledger_are_register_jobs_arguments_only():
    loaded = jobsfile.parse(textwrap.dedent(GOOD))
    nightly = loaded.definitions()["nightly"]
    assert set(nightly) == {"schedule", "time_zone", "ttl", "jitter", "start_deadline", "overlap_policy"}
    assert nightly["ttl"] == "4800 seconds"
    job = loaded.jobs["nightly"]
    assert job.argv == ("./nightly.sh", "--full") and job.env == {"MODE": "full"} and job.retries == 2
    assert loaded.jobs["tick"].argv == ("/bin/sh", "-c", "echo tick")
    assert loaded.upkeep.purge_log_older_than is not None and loaded.removed == "unregister"


@pytest.mark.parametrize("text, named", [
    ('[jobs.a]\nschedule = "1h"\ncommand = "x"\ncolour = "blue"\n', "job a, key colour"),
    ('[jobs.a]\nschedule = "61 * * * *"\ncommand = "x"\n', "job a, key schedule"),
    ('[jobs.a]\nschedule = "*/5 * * * fri-mon"\ncommand = "x"\n', "job a, key schedule"),
    ('[jobs.a]\nschedule = "5 fortnights"\ncommand = "x"\n', "job a, key schedule"),
    ('[jobs.a]\nschedule = "1h"\ntime_zone = "Mars/Olympus"\ncommand = "x"\n', "job a, key time_zone"),
    ('[jobs.a]\nschedule = "1h"\ncommand = "x"\n[jobs.a]\nschedule = "2h"\n', "job a: the job is defined twice"),
    ('[jobs.a]\nschedule = "1h"\nttl = "soon"\ncommand = "x"\n', "job a, key ttl"),
    ('[jobs.a]\nschedule = "1h"\noverlap_policy = "sometimes"\ncommand = "x"\n', "job a, key overlap_policy"),
    ('[jobs.a]\nschedule = "1h"\n', "job a, key command"),
    ('[jobs.a]\nschedule = "1h"\ncommand = "x"\nretries = -1\n', "job a, key retries"),
    ('removed = "delete"\n[jobs.a]\nschedule = "1h"\ncommand = "x"\n', "key removed"),
    ('[upkeep]\nreap = "1m"\n', "key upkeep.reap"),
])
def test_check_refuses_a_mistake_naming_the_job_and_the_key(tmp_path, text, named):
    result = check(tmp_path, text)
    assert result.returncode == 1
    assert named in result.stderr, result.stderr
    assert "nothing changed" in result.stderr


def test_every_problem_of_a_file_is_named_at_once(tmp_path):
    result = check(tmp_path, '[jobs.a]\nschedule = "1h"\ncommand = "x"\nfoo = 1\n'
                             '[jobs.b]\nschedule = "1h"\ncommand = "x"\nbar = 2\n')
    assert result.returncode == 1
    assert "job a, key foo" in result.stderr and "job b, key bar" in result.stderr




def import_crontab(text, *args):
    return subprocess.run([*JOBLEDGER, "scheduler", "import-crontab", *args, "-"], input=text,
                          env=environment(NO_DATABASE), capture_output=True, text=True, timeout=60)


def test_import_crontab_writes_a_jobs_file_that_check_accepts(tmp_path):
    result = import_crontab("# the backups\n*/15 * * * * /usr/local/bin/backup.sh --fast\n"
                            "@daily /usr/local/bin/backup.sh --full\n\n0 3 * * mon-fri cleanup -v\n")
    assert result.returncode == 0, result.stderr
    loaded = jobsfile.parse(result.stdout)
    assert {name: job.register["schedule"] for name, job in loaded.jobs.items()} == {
        "backup": "*/15 * * * *", "backup-2": "@daily", "cleanup": "0 3 * * mon-fri"}
    assert loaded.jobs["backup"].command == "/usr/local/bin/backup.sh --fast"
    (tmp_path / "jobs.toml").write_text(result.stdout)
    assert jobledger("scheduler", "check", str(tmp_path / "jobs.toml"), dsn=NO_DATABASE).returncode == 0


@pytest.mark.parametrize("line, reason", [
    ("MAILTO=ops@example.com", "environment line"),
    ("CRON_TZ=Europe/Paris", "environment line"),
    ("@reboot /usr/local/bin/warm-cache", "@reboot"),
    ("* * * * * date +%s", "% in the command"),
    ("61 * * * * true", "out of range"),
    ("* * * *", "five time fields"),
])
def test_import_crontab_refuses_what_has_no_faithful_translation(line, reason):
    result = import_crontab(f"0 * * * * true\n{line}\n")
    assert result.returncode == 1
    assert "line 2" in result.stderr and reason in result.stderr, result.stderr
    assert result.stdout == ""


def test_a_system_crontab_line_drops_its_user_field():
    text = crontab.convert(["17 * * * * root cd / && run-parts --report /etc/cron.hourly"], system=True)
    assert jobsfile.parse(text).jobs["cd"].command == "cd / && run-parts --report /etc/cron.hourly"
