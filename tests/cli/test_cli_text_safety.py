"""Stored text is shown as text (the hardening issue's "stored text is read as rich markup"): a run's
error, an owner, a job name with brackets or control characters, as real `jobledger` subprocesses
on a real database. Every command that prints stored text exits 0, prints the text literally
(brackets and all: never rich markup, never a hyperlink), and writes no control character raw:
ESC, BEL and C1 are shown escaped (``\\x1b``, ``\\x9b``: ``ledger.text.visible``), and its ``--json``
carries the original text exactly, the control characters JSON-escaped."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

import psycopg
import pytest
from clihelp import JOBLEDGER, environment

from ledger import render
from ledger.text import first_line, visible

JOB = "nightly-[/]"  # labels may hold brackets (ledger._check_label refuses control characters only)
ALERTING = "alerting-[/]"  # in ledger.alerts too: the table that read it as markup
OWNER = "worker[/]"
PATH_ERROR = "cannot open [/var/log/app.log]"
LINK_ERROR = "[link=http://evil.example]click here[/link]"
STYLE_ERROR = "[bold red]x[/]"
# A command's stderr kept as a run's error: an OSC that retitles the terminal, C1's CSI (a one-byte
# ESC [), DEL and more C0; then a tab and the line breaks the tables cut at.
CONTROL_ERROR = "\x1b]0;pwned\x07 \x9b2J \x01\x7f\x08 \x1b[31mred\tend\nsecond \x1b]8;;http://evil.example\x07"
ERRORS = (PATH_ERROR, LINK_ERROR, STYLE_ERROR, CONTROL_ERROR)
LITERALS = (JOB, OWNER, PATH_ERROR, LINK_ERROR, STYLE_ERROR)
#: How the tables and lines show CONTROL_ERROR's first line.
CONTROL_SHOWN = "\\x1b]0;pwned\\x07 \\x9b2J \\x01\\x7f\\x08 \\x1b[31mred\\tend"
TIMEOUT = 30.0


def assert_safe(out: bytes) -> str:
    """``out`` is UTF-8 with no control character but newline: no ESC, BEL, C1, no OSC 8 hyperlink."""
    text = out.decode("utf-8")  # strict: a lone 0x9b byte would be C1 in a terminal not in UTF-8
    assert b"\x1b" not in out and b"\x07" not in out, out
    assert b"\x1b]8;" not in out and "\x9d" not in text, out
    assert re.search(rb"\xc2[\x80-\x9f]", out) is None, out  # C1, UTF-8 encoded
    controls = sorted({char for char in text if (ord(char) < 0x20 and char != "\n") or 0x7f <= ord(char) <= 0x9f})
    assert not controls, (controls, out)
    return text


def run_bytes(*args: str, dsn: str, expect: int = 0) -> str:
    """``jobledger ARGS``, its stdout as bytes made sure to be safe; the decoded text."""
    result = subprocess.run([*JOBLEDGER, *args], env=environment(dsn), capture_output=True, timeout=60)
    assert result.returncode == expect, (args, result.returncode, result.stderr.decode(errors="replace"))
    assert b"Traceback" not in result.stderr and b"MarkupError" not in result.stderr, result.stderr
    assert_safe(result.stderr)
    return assert_safe(result.stdout)


def json_of(*args: str, dsn: str, expect: int = 0) -> object:
    return json.loads(run_bytes(*args, dsn=dsn, expect=expect))


def start_run(db: psycopg.Connection, job: str, owner: str = OWNER) -> tuple[int, int]:
    row = db.execute("SELECT run_id, token FROM ledger.start_run(job => %s, owner => %s, ttl => '1 hour')",
                     (job, owner)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.fixture
def seeded(dsn: str, db: psycopg.Connection) -> str:
    """JOB (scheduled, healthy: its newest run a success) with a failed run for each of ERRORS and one
    cancelled with CONTROL_ERROR, all by OWNER; ALERTING failed three times in a row (failing: one alert) and holds a lease; the
    run events recorded and the alerts synced (alert events)."""
    db.execute("SELECT ledger.configure_events(run_events => true)")
    db.execute("SELECT ledger.register_job(job => %s, schedule => '1 hour', ttl => '10 minutes')", (JOB,))
    for error in ERRORS:
        run_id, token = start_run(db, JOB)
        db.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => %s)", (run_id, token, error))
    run_id, token = start_run(db, JOB)
    db.execute("SELECT ledger.cancel_run(run_id => %s, token => %s, error => %s)", (run_id, token, CONTROL_ERROR))
    run_id, token = start_run(db, JOB)
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    for error in (STYLE_ERROR, LINK_ERROR, CONTROL_ERROR):
        run_id, token = start_run(db, ALERTING)
        db.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => %s)", (run_id, token, error))
    # a lease, no run: its holder, OWNER, in the status table; the job stays failing (a live run would
    # make it running, which raises no alert)
    db.execute("SELECT ledger.acquire(job => %s, owner => %s, ttl => '1 hour')", (ALERTING, OWNER))
    db.execute("SELECT ledger.sync_alerts()")
    return dsn


def assert_literals(text: str, *expected: str) -> None:
    for literal in expected or LITERALS:
        assert literal in text, (literal, text)


def assert_control_error_in(rows: Sequence[dict[str, object]], key: str = "error") -> None:
    """The JSON rows carry CONTROL_ERROR and every bracketed text exactly."""
    values = {row.get(key) for row in rows}
    assert CONTROL_ERROR in values and PATH_ERROR in values and LINK_ERROR in values, values


# -- the helpers -------------------------------------------------------------------------

def test_visible_escapes_every_control_character_and_nothing_else():
    assert visible("a\x1b]0;t\x07b") == "a\\x1b]0;t\\x07b"
    assert visible("\n\t\r\x00\x7f\x80\x9b\x9f") == "\\n\\t\\r\\x00\\x7f\\x80\\x9b\\x9f"
    assert visible("[link=x]é ⚠ \\x1b C:\\path[/]\xa0") == "[link=x]é ⚠ \\x1b C:\\path[/]\xa0"
    assert visible("\x1b" * 10, limit=5) == "\\x1b…"
    assert visible(first_line(CONTROL_ERROR)) == CONTROL_SHOWN  # what the tables show of it
    text = "".join(map(chr, range(0x00, 0x100)))
    assert not any(ord(char) < 0x20 or 0x7f <= ord(char) <= 0x9f for char in visible(text))


def test_json_escapes_c0_del_and_c1_and_reads_back_exactly():
    value = {"error": CONTROL_ERROR + "\x85\x9b\\\x9b é ⚠", "job": JOB}
    for dump in (render.to_json, lambda v: render.dumps(v, indent=2, default=str), lambda v: render.json_line(v)):
        text = dump(value)
        assert_safe(text.encode())
        assert "\\u001b" in text and "\\u009b" in text and "\\u007f" in text and "é ⚠" in text
        assert json.loads(text) == value
    assert "\n" not in render.json_line(value)


# -- the commands ------------------------------------------------------------------------

def test_status_shows_brackets_as_text(seeded):
    text = run_bytes("status", dsn=seeded)
    assert_literals(text, JOB, OWNER, ALERTING)
    alerts = text.split("ledger.alerts", 1)[1]
    assert "failing" in alerts and "consecutive_failures" not in alerts and ALERTING in alerts
    assert alerts.count(ALERTING) == 1  # one job, one cause, one alert
    only = run_bytes("status", JOB, dsn=seeded)
    assert JOB in only and "no alerts" in only


def test_runs_show_errors_as_text_their_control_characters_escaped(seeded):
    text = run_bytes("runs", JOB, dsn=seeded)
    assert_literals(text)
    assert CONTROL_SHOWN in text and "second" not in text  # the error's first line, escaped
    assert f"runs of {JOB}" in text
    alerting = run_bytes("runs", ALERTING, dsn=seeded)
    assert_literals(alerting, ALERTING, OWNER, STYLE_ERROR, LINK_ERROR, CONTROL_SHOWN)


def test_health_shows_brackets_as_text(seeded):
    text = run_bytes("health", JOB, dsn=seeded)
    assert JOB in text and "ok" in text
    everything = run_bytes("health", dsn=seeded, expect=1)  # ALERTING is failing: exit 1
    assert_literals(everything, JOB, ALERTING)


def test_events_lines_escape_a_run_errors_control_characters(seeded):
    text = run_bytes("events", "-n", "100", dsn=seeded)
    assert_literals(text)
    assert CONTROL_SHOWN in text
    assert len(text.splitlines()) == 19  # a line an event: 2 a run of 9 ended, and ALERTING's one alert


def test_json_outputs_carry_the_text_exactly_every_control_character_escaped(seeded):
    """`--json` is json.dumps with non-ASCII as it is: C0 is escaped by json itself, DEL and C1 by
    ``ledger.render.dumps`` (json.dumps(ensure_ascii=False) would write them raw)."""
    rows = json_of("runs", JOB, "--json", dsn=seeded)
    assert_control_error_in(rows)
    assert {row["owner"] for row in rows} == {OWNER} and {row["job"] for row in rows} == {JOB}
    events = json_of("events", "-n", "100", "--json", dsn=seeded)
    assert len(events) == 19
    details = [event["detail"] for event in events]
    assert_control_error_in(details)  # an event keeps 200 characters of the error: CONTROL_ERROR is shorter
    assert OWNER in {detail.get("owner") for detail in details}
    assert {"run_started", "run_ended", "run_cancelled", "alert_raised"} <= {event["kind"] for event in events}
    sql = "SELECT run_id, job, owner, error FROM ledger.job_execution_log ORDER BY run_id"
    reported = json_of("report", "--allow-superuser", "--format", "json", sql, dsn=seeded)
    assert_control_error_in(reported)
    assert {row["owner"] for row in reported} == {OWNER}
    document = json_of("status", "--json", dsn=seeded)
    assert {row["job"] for row in document["jobs"]} == {JOB, ALERTING}
    assert {row["holder"] for row in document["jobs"]} == {None, OWNER}
    assert ALERTING in {alert["job"] for alert in document["alerts"]}
    health = json_of("health", "--json", dsn=seeded, expect=1)  # ALERTING is failing
    assert {row["job"]: row["state"] for row in health} == {JOB: "ok", ALERTING: "failing"}
    assert {row["job"]: row["state"] for row in document["jobs"]} == {JOB: "ok", ALERTING: "failing"}  # one word
    slots = json_of("next", JOB, "-n", "3", "--json", dsn=seeded)
    assert slots["job"] == JOB and len(slots["slots"]) == 3


class Follow:
    """A following command (`watch`, `status --watch`), its stdout read as bytes as they come."""

    def __init__(self, *args: str, dsn: str) -> None:
        self.process = subprocess.Popen([*JOBLEDGER, *args], env=environment(dsn), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        self.out = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for chunk in iter(lambda: self.process.stdout.read1(65536), b""):  # type: ignore[union-attr]
            self.out.extend(chunk)

    def until(self, done: Callable[[bytes], bool]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not done(bytes(self.out)) and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> tuple[int, bytes, bytes]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=TIMEOUT)
        self._reader.join(TIMEOUT)
        assert self.process.stderr is not None
        stderr = self.process.stderr.read()
        self.process.stderr.close()
        return code, bytes(self.out), stderr


def test_watch_escapes_as_events_does(seeded, db):
    count = db.execute("SELECT count(*) FROM ledger.events").fetchone()[0]
    for json_flag in ((), ("--json",)):
        follow = Follow("watch", "--no-alerts", "-n", "100", *json_flag, dsn=seeded)
        follow.until(lambda out: out.count(b"\n") >= count)
        code, out, stderr = follow.stop()
        assert code == 0 and b"Traceback" not in stderr, stderr
        text = assert_safe(out)
        assert len(text.splitlines()) == count, text
        if json_flag:
            assert_control_error_in([json.loads(line)["detail"] for line in text.splitlines()])
        else:
            assert_literals(text)
            assert CONTROL_SHOWN in text


def test_status_watch_shows_brackets_as_text(seeded):
    follow = Follow("status", "--watch", "--interval", "200ms", dsn=seeded)
    follow.until(lambda out: b"ledger.alerts" in out and out.count(b"jobledger status") >= 2)
    code, out, stderr = follow.stop()
    assert code == 0 and b"Traceback" not in stderr, stderr
    text = assert_safe(out)
    assert_literals(text, JOB, OWNER, ALERTING)
    follow = Follow("status", "--watch", "--json", "--interval", "200ms", dsn=seeded)
    follow.until(lambda out: out.count(b"\n") >= 2)
    code, out, stderr = follow.stop()
    assert code == 0, stderr
    frames = [json.loads(line) for line in assert_safe(out).splitlines()]
    assert frames and {row["job"] for row in frames[0]["jobs"]} == {JOB, ALERTING}


def test_report_shows_stored_text_as_text(seeded):
    sql = 'SELECT run_id, job, owner, error AS "error [/]" FROM ledger.job_execution_log ORDER BY run_id'
    text = run_bytes("report", "--allow-superuser", sql, dsn=seeded)
    assert_literals(text, *LITERALS, "error [/]")
    assert visible(CONTROL_ERROR) in text  # the whole error, on one line


def test_next_shows_a_bracketed_job_as_text(seeded):
    text = run_bytes("next", JOB, "-n", "3", dsn=seeded)
    assert f"job {JOB}: '1 hour' in UTC: every hour" in text


def test_the_job_commands_echo_a_bracketed_job_as_text(seeded):
    for args, said in [(("pause", JOB), f"paused {JOB}"), (("resume", JOB), f"resumed {JOB}"),
                       (("reap", JOB), f"reaped 0 runs of {JOB}"), (("release", ALERTING), f"released {ALERTING}")]:
        assert said in run_bytes(*args, dsn=seeded)
    registered = json_of("register", JOB, "--ttl", "5m", "--json", dsn=seeded)
    assert registered["job"] == JOB

