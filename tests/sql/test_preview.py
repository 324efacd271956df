"""Schedule preview: ``ledger.next_slots`` and ``ledger.preview_slots`` (sql/57_preview.sql), and
`jobledger next`, on a real database.

The slots are the evaluator's (sql/15_schedule_eval.sql), so a preview shows
what the ledger runs. The reference cases are Europe/Berlin's 2026 changes:
spring forward on 29 March (02:00 -> 03:00, 01:00 UTC), fall back on 25
October (03:00 -> 02:00, 01:00 UTC). The examples of docs/sql.md and
docs/cli.md marked as executed by this file are run here, and the output they
show is checked.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from datetime import datetime, timedelta, timezone

import psycopg
import pytest
from clihelp import JOBLEDGER, environment, jobledger

from ledger.schedule_words import describe, is_cron
from repo import ROOT
from sqlhelp import rows, state, value

UTC = timezone.utc
BERLIN = "Europe/Berlin"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def preview(db, schedule, time_zone="UTC", count=10, after=None):
    return rows(db, "SELECT * FROM ledger.preview_slots(schedule => %s, time_zone => %s, count => %s, after => %s)",
                (schedule, time_zone, count, after))


def table(found):
    """(slot in UTC, wall clock, offset in hours, note) per row: the shape the cases are written in."""
    return [(r["slot"].astimezone(UTC), r["local_time"], r["utc_offset"].total_seconds() / 3600, r["dst_change"])
            for r in found]


# -- the 2026 changes in Berlin ------------------------------------------------------------------

def test_spring_forward_2026_runs_the_missing_0230_at_0300(db):
    assert table(preview(db, "30 2 * * *", BERLIN, 4, utc(2026, 3, 27, 12))) == [
        (utc(2026, 3, 28, 1, 30), datetime(2026, 3, 28, 2, 30), 1, None),
        (utc(2026, 3, 29, 1, 0), datetime(2026, 3, 29, 3, 0), 2,
         "spring forward: 02:00-03:00 skipped; 02:30 runs at 03:00"),
        (utc(2026, 3, 30, 0, 30), datetime(2026, 3, 30, 2, 30), 2, None),
        (utc(2026, 3, 31, 0, 30), datetime(2026, 3, 31, 2, 30), 2, None),
    ]


def test_fall_back_2026_runs_a_fixed_time_once_and_a_wildcard_twice(db):
    assert table(preview(db, "30 2 * * *", BERLIN, 3, utc(2026, 10, 24, 12))) == [
        (utc(2026, 10, 25, 0, 30), datetime(2026, 10, 25, 2, 30), 2,
         "fall back: 02:00-03:00 twice; 02:30 runs once, the first time"),
        (utc(2026, 10, 26, 1, 30), datetime(2026, 10, 26, 2, 30), 1, "fall back on 2026-10-25: 02:00-03:00 twice"),
        (utc(2026, 10, 27, 1, 30), datetime(2026, 10, 27, 2, 30), 1, None),
    ]
    twice = "fall back: 02:00-03:00 twice"
    assert table(preview(db, "*/30 2 * * *", BERLIN, 5, utc(2026, 10, 24, 12))) == [
        (utc(2026, 10, 25, 0, 0), datetime(2026, 10, 25, 2, 0), 2, twice),
        (utc(2026, 10, 25, 0, 30), datetime(2026, 10, 25, 2, 30), 2, twice),
        (utc(2026, 10, 25, 1, 0), datetime(2026, 10, 25, 2, 0), 1, twice),
        (utc(2026, 10, 25, 1, 30), datetime(2026, 10, 25, 2, 30), 1, twice),
        (utc(2026, 10, 26, 1, 0), datetime(2026, 10, 26, 2, 0), 1, None),  # the offset of the slot before
    ]


def test_a_wildcard_expression_skips_the_gap(db):
    found = table(preview(db, "*/30 2 * * *", BERLIN, 2, utc(2026, 3, 28, 12)))
    assert found == [
        (utc(2026, 3, 30, 0, 0), datetime(2026, 3, 30, 2, 0), 2, "spring forward on 2026-03-29: 02:00-03:00 skipped"),
        (utc(2026, 3, 30, 0, 30), datetime(2026, 3, 30, 2, 30), 2, None),
    ]


@pytest.mark.parametrize(("schedule", "note"), [
    ("0,30 2 * * *", "spring forward: 02:00-03:00 skipped; 02:00 and 02:30 run once, at 03:00"),
    ("0,30 2,3 * * *", "spring forward: 02:00-03:00 skipped; 3 times from 02:00 to 03:00 run once, at 03:00"),
    ("0 2,3 * * *", "spring forward: 02:00-03:00 skipped; 02:00 and 03:00 run once, at 03:00"),
])
def test_the_note_names_the_fixed_times_a_gap_merges(db, schedule, note):
    [first] = preview(db, schedule, BERLIN, 1, utc(2026, 3, 28, 12))
    assert (first["slot"], first["dst_change"]) == (utc(2026, 3, 29, 1, 0), note)


def test_a_change_on_another_day_is_dated_and_a_change_of_a_whole_day_too(db):
    weekly = table(preview(db, "0 12 * * mon", BERLIN, 2, utc(2026, 3, 24)))
    assert weekly[0][3] == "spring forward on 2026-03-29: 02:00-03:00 skipped"
    assert weekly[1][3] is None
    # Samoa skipped 30 December 2011: the day's 02:30 runs at the end of the jump.
    [skipped, after] = table(preview(db, "30 2 * * *", "Pacific/Apia", 4, utc(2011, 12, 28)))[2:]
    assert skipped[:2] == (utc(2011, 12, 30, 10), datetime(2011, 12, 31, 0, 0))
    assert skipped[3] == ("spring forward on 2011-12-30: 00:00 to 2011-12-31 00:00 skipped; "
                          "02:30 runs at 2011-12-31 00:00")
    assert after[1] == datetime(2011, 12, 31, 2, 30)


def test_zones_without_changes_have_no_notes(db):
    for tz in ("UTC", "Asia/Kolkata", "Etc/GMT-14"):
        found = preview(db, "*/20 * * * *", tz, 100, utc(2026, 3, 29))
        assert len(found) == 100 and {r["dst_change"] for r in found} == {None}, tz
    assert {r["utc_offset"] for r in preview(db, "1 hour", "Asia/Kolkata", 3)} == {timedelta(hours=5, minutes=30)}


# -- the preview is the ledger's own answer -----------------------------------------------------

@pytest.mark.parametrize(("schedule", "tz"), [
    ("30 2 * * *", BERLIN), ("*/15 2 * * *", BERLIN), ("0,30 2,3 * * *", BERLIN), ("0 * * * *", "America/New_York"),
    ("1 day", "America/Santiago"), ("90 minutes", BERLIN), ("45 1 * * *", "Australia/Lord_Howe"),
    ("0 0 * * sat-sun", BERLIN),
])
def test_the_slots_are_the_evaluators_and_the_ones_a_runner_gets_due(db, schedule, tz):
    after = utc(2026, 3, 27)
    found = preview(db, schedule, tz, 40, after)
    slots = [r["slot"] for r in found]
    walked = [value(db, "SELECT ledger._slot_after(ledger._parse_schedule(%s, %s), %s, %s)",
                    (schedule, tz, tz, slot)) for slot in [after] + slots[:-1]]
    assert slots == walked
    db.execute("SELECT ledger.register_job(job => 'previewed', schedule => %s, time_zone => %s, ttl => '1 hour')",
               (schedule, tz))
    assert [r["slot"] for r in rows(db, "SELECT * FROM ledger.next_slots(job => 'previewed', count => 40, "
                                        "after => %s)", (after,))] == slots
    # A runner at each slot's instant (a job that never ran) is due exactly that slot.
    for slot in slots[:12]:
        assert [r["s"] for r in rows(db, "SELECT s FROM ledger.due_slots(job => 'previewed', at => %s) AS s",
                                     (slot + timedelta(microseconds=1),))] == [slot]
    for r in found:
        assert r["local_time"] == r["slot"].astimezone(UTC).replace(tzinfo=None) + r["utc_offset"]


def test_next_slots_defaults_to_ten_slots_from_now(db):
    db.execute("SELECT ledger.register_job(job => 'hourly', schedule => '0 * * * *', time_zone => 'Europe/Berlin')")
    now = value(db, "SELECT clock_timestamp()")
    found = rows(db, "SELECT * FROM ledger.next_slots(job => 'hourly')")
    assert len(found) == 10
    assert now < found[0]["slot"] <= now + timedelta(hours=1)
    db.execute("SELECT ledger.pause_job(job => 'hourly')")  # the schedule's slots, whatever the pause flag
    assert len(rows(db, "SELECT * FROM ledger.next_slots('hourly', 3)")) == 3


def test_a_rare_schedule_stops_before_2200(db):
    found = preview(db, "0 0 29 2 *", "UTC", 1000, utc(2026, 1, 1))
    leap_days = [year for year in range(2026, 2200) if year % 4 == 0 and (year % 100 or year % 400 == 0)]
    assert [r["slot"].year for r in found] == leap_days


def test_a_thousand_slots_a_call(db):
    assert len(preview(db, "*/5 * * * *", BERLIN, 1000, utc(2026, 3, 28, 20))) == 1000


# -- bad input ----------------------------------------------------------------------------------

BAD = [
    ("ledger.next_slots(NULL)", "22004", "job"),
    ("ledger.next_slots('')", "22023", "job"),
    ("ledger.next_slots('nightly', NULL)", "22004", "count"),
    ("ledger.next_slots('nightly', 0)", "22023", "count"),
    ("ledger.next_slots('nightly', 1001)", "22023", "count"),
    ("ledger.next_slots('nightly', after => 'infinity')", "22023", "after"),
    ("ledger.next_slots('nightly', after => '1900-01-01')", "22023", "after"),
    ("ledger.next_slots('unscheduled')", "22023", "job"),
    ("ledger.preview_slots(NULL)", "22004", "schedule"),
    ("ledger.preview_slots('every blue moon')", "22023", "schedule"),
    ("ledger.preview_slots('0 0 * * mon-sun/2')", "22023", "schedule"),
    ("ledger.preview_slots('30 2 * * *', NULL)", "22004", "time_zone"),
    ("ledger.preview_slots('30 2 * * *', 'PST')", "22023", "time_zone"),
    ("ledger.preview_slots('30 2 * * *', count => -1)", "22023", "count"),
    ("ledger.preview_slots('30 2 * * *', count => NULL)", "22004", "count"),
    ("ledger.preview_slots('30 2 * * *', after => '2200-01-01 00:00+00')", "22023", "after"),
]


@pytest.mark.parametrize(("call", "sqlstate", "argument"), BAD, ids=[c[0] for c in BAD])
def test_bad_input_raises_a_documented_sqlstate_naming_the_argument_and_changes_nothing(db, call, sqlstate,
                                                                                        argument):
    db.execute("SELECT ledger.register_job(job => 'nightly', schedule => '30 2 * * *', ttl => '1 hour')")
    db.execute("SELECT ledger.register_job(job => 'unscheduled', ttl => '1 hour')")
    db.execute("SELECT ledger.start_run('nightly', 'host-1')")
    before = state(db)
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"SELECT * FROM {call}")
    assert caught.value.sqlstate == sqlstate
    assert argument in caught.value.diag.message_primary
    if sqlstate == "22023":
        assert json.loads(caught.value.diag.message_detail)["argument"] == argument
    assert state(db) == before


def test_an_unknown_job_is_ld005(db):
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT * FROM ledger.next_slots(job => 'never-registered')")
    assert caught.value.sqlstate == "LD005"
    assert json.loads(caught.value.diag.message_detail) == {"job": "never-registered"}


def test_one_signature_each_security_definer_and_callable_by_client_and_reader(db):
    signatures = db.execute("""
        SELECT p.proname::text, pg_get_function_identity_arguments(p.oid), p.prosecdef, p.provolatile::text
          FROM pg_proc p WHERE p.pronamespace = 'ledger'::regnamespace
           AND p.proname IN ('next_slots', 'preview_slots') ORDER BY 1""").fetchall()
    assert signatures == [("next_slots", "job text, count integer, after timestamp with time zone", True, "s"),
                          ("preview_slots", "schedule text, time_zone text, count integer, "
                                            "after timestamp with time zone", True, "s")]
    db.execute("SELECT ledger.register_job(job => 'nightly', schedule => '30 2 * * *')")
    for role in ("ledger_reader", "ledger_client"):
        db.execute(f"SET ROLE {role}")
        try:
            assert len(rows(db, "SELECT * FROM ledger.next_slots(job => 'nightly', count => 2)")) == 2
            assert len(rows(db, "SELECT * FROM ledger.preview_slots(schedule => '1 hour', count => 2)")) == 2
        finally:
            db.execute("RESET ROLE")


# -- docs/sql.md's example --------------------------------------------------------------------------

def _marked_blocks(page: str, lang: str) -> list[str]:
    text = (ROOT / page).read_text()
    pattern = rf"<!-- executed by tests/sql/test_preview\.py[^>]*-->\n```{lang}\n(.*?)```"
    return re.findall(pattern, text, re.S)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("|")]


def test_the_sql_page_example_runs_and_shows_its_rows(dsn):
    [block] = _marked_blocks("docs/sql.md", "sql")
    shown = [_cells(line.lstrip("-")) for line in block.splitlines()
             if line.startswith("--") and "|" in line and re.match(r"--\s+\d", line)]
    result = subprocess.run(["psql", "-v", "ON_ERROR_STOP=1", "-X", "-q", "-A", "-t", "-F", " | ", "-d", dsn,
                             "-f", "-"], input=block, capture_output=True, text=True, timeout=60,
                            env=environment(PGTZ="UTC"))
    assert result.returncode == 0, result.stderr
    printed = [_cells(line) for line in result.stdout.splitlines() if re.match(r"\d", line)]
    assert len(shown) == 7 and printed == shown


# -- `jobledger next` --------------------------------------------------------------------------------

def test_the_cli_page_example_runs_and_prints_what_it_shows(dsn):
    [block] = _marked_blocks("docs/cli.md", "console")
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            steps[-1][1].append(line.rstrip())
    assert [command.split()[1] for command, _ in steps] == ["next", "register", "next", "next"]
    for command, shown in steps:
        words = shlex.split(command)
        assert words[0] == "jobledger"
        result = subprocess.run([*JOBLEDGER, *words[1:]], env=environment(dsn), capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, (command, result.stderr)
        assert [line.rstrip() for line in result.stdout.splitlines()] == shown, command


def test_next_prints_the_spring_forward_in_local_time_and_utc(dsn):
    result = jobledger("next", "--schedule", "30 2 * * *", "--tz", BERLIN, "-n", "10", "--after", "2026-03-25",
                       dsn=dsn)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "'30 2 * * *' in Europe/Berlin: at 02:30"
    [gap_day] = [line for line in lines if "2026-03-29" in line]
    assert re.search(r"Sun 2026-03-29 03:00 \+02:00\s+2026-03-29 01:00Z\s+spring forward: 02:00-03:00 skipped; "
                     r"02:30 runs at 03:00", gap_day), gap_day
    assert re.search(r"Sat 2026-03-28 02:30 \+01:00\s+2026-03-28 01:30Z\s*$", next(
        line for line in lines if "2026-03-28" in line))
    assert len([line for line in lines if re.match(r"\s*\d+\s+\w{3} 2026-", line)]) == 10


def test_next_json_and_a_job(dsn, db):
    db.execute("SELECT ledger.register_job(job => 'backup', schedule => '*/30 2 * * *', time_zone => %s)", (BERLIN,))
    db.execute("SELECT ledger.pause_job(job => 'backup')")
    result = jobledger("next", "backup", "-n", "5", "--after", "2026-10-24T12:00:00Z", "--json", dsn=dsn)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert {key: shown[key] for key in ("job", "schedule", "time_zone", "paused")} == \
        {"job": "backup", "schedule": "*/30 2 * * *", "time_zone": BERLIN, "paused": True}
    assert shown["description"].startswith("every 30 minutes")
    assert [(s["slot"], s["local_time"], s["utc_offset"]) for s in shown["slots"][:4]] == [
        ("2026-10-25T00:00:00+00:00", "2026-10-25T02:00:00", 7200.0),
        ("2026-10-25T00:30:00+00:00", "2026-10-25T02:30:00", 7200.0),
        ("2026-10-25T01:00:00+00:00", "2026-10-25T02:00:00", 3600.0),
        ("2026-10-25T01:30:00+00:00", "2026-10-25T02:30:00", 3600.0),
    ]
    assert {s["dst_change"] for s in shown["slots"][:4]} == {"fall back: 02:00-03:00 twice"}
    table_out = jobledger("next", "backup", "-n", "2", dsn=dsn)
    assert table_out.returncode == 0, table_out.stderr
    assert "paused: none of these runs until `jobledger resume backup`" in table_out.stdout


@pytest.mark.parametrize(("args", "code", "message"), [
    ([], 2, "give JOB or --schedule"),
    (["job", "--schedule", "1 hour"], 2, "not both"),
    (["job", "--tz", "UTC"], 2, "--tz goes with --schedule"),
    (["--schedule", "1 hour", "-n", "1001"], 2, "1001"),
    (["--schedule", "1 hour", "--after", "tomorrow"], 2, "ISO 8601"),
    (["--schedule", "every blue moon"], 1, "invalid schedule"),
    (["--schedule", "1 hour", "--tz", "Mars/Olympus"], 1, "time_zone"),
    (["never-registered"], 1, "no job named never-registered"),
    (["unscheduled"], 1, "has no schedule"),
])
def test_next_refuses_bad_input_in_one_line(dsn, db, args, code, message):
    db.execute("SELECT ledger.register_job(job => 'unscheduled', ttl => '1 hour')")
    result = jobledger("next", *args, dsn=dsn)
    assert result.returncode == code, result.stderr
    assert message in result.stderr


@pytest.mark.parametrize(("schedule", "words"), [
    ("30 2 * * *", "at 02:30"),
    ("*/15 * * * *", "every 15 minutes"),
    ("@daily", "at 00:00"),
    ("0 0 * * Sat-Sun", "at 00:00, saturday through sunday"),
    ("15 minutes", "every 15 minutes"),
    ("1 day", "every day"),
    ("2 hours", "every 2 hours"),
    ("90 mins", "every 90 minutes"),
    ("PT45M", "every PT45M"),
    ("1 day 2 hours 3", "every 1 day 2 hours 3"),
])
def test_the_schedule_in_words(schedule, words):
    assert describe(schedule) == words


def test_cron_or_interval_as_the_ledger_reads_it():
    assert is_cron("30 2 * * *") and is_cron("@weekly") and is_cron("0 0 * jan-mar mon-fri")
    assert not is_cron("1 day 2 hours 3") and not is_cron("45 minutes") and not is_cron("* * * *")
