"""Following the events (issue 12, point 8): the cursor over ledger.events (ledger.tail), and
`jobledger events`, `watch`, `notify` and `configure-events` as real subprocesses on a real
database, `notify` against a real HTTP server on 127.0.0.1. The examples of docs/cli.md and
docs/operations.md that these commands run are run here; the client's events methods are tested
with the client (tests/client/test_client_async.py). Waits poll for a condition with a generous deadline;
nothing asserts on a duration."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from clihelp import JOBLEDGER, environment, jobledger, start
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ledger.cli import main
from ledger.client import Ledger
from ledger.models import EVENT_KINDS, Event
from ledger.tail import EventCursor
from repo import ROOT
from sqlhelp import value
from waiting import wait_for

TIMEOUT = 60.0  # seconds: a condition not reached by then is a hang
TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d)?Z?")


def run_once(db: psycopg.Connection, job: str, error: str | None = None) -> int:
    """One run of ``job`` through the SQL API, ended with success or (``error``) failure; its run_id."""
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'w', "
                               "ttl => '1 minute')", (job,)).fetchone()
    if error is None:
        db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    else:
        db.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => %s)", (run_id, token, error))
    return int(run_id)


def kinds_of(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.kind, e.job) if isinstance(e, Event) else (e["kind"], e["job"]) for e in events]


class Background:
    """A jobledger command in the background, its stdout and stderr read line by line as they come."""

    def __init__(self, *args: str, dsn: str) -> None:
        self.args = args
        self.process = start(*args, dsn=dsn)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.process.stdout, self.out), (self.process.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in iter(stream.readline, ""):
            lines.append(line.rstrip("\n"))

    def wait_out(self, condition: Callable[[list[str]], object], what: str) -> Any:
        return wait_for(lambda: condition(list(self.out)), timeout=TIMEOUT, what=f"{what} ({self.stderr()})")

    def wait_err(self, text: str) -> None:
        wait_for(lambda: any(text in line for line in list(self.err)), timeout=TIMEOUT,
                 what=f"{text!r} on stderr ({self.stderr()})")

    def stderr(self) -> str:
        return "\n".join(self.err)

    def interrupt(self) -> int:
        """Ctrl-C, and its exit code once it ended."""
        self.process.send_signal(signal.SIGINT)
        code = self.process.wait(timeout=TIMEOUT)
        for reader in self._readers:
            reader.join(5)
        return code

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def json_lines(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.startswith("{")]


# -- the kinds and the cursor (the client's events methods: tests/client/test_client_async.py) ------

def test_the_event_kinds_are_the_ones_the_table_accepts(db):
    check = value(db, "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'events_kind_valid'")
    assert set(re.findall(r"'(\w+)'", check)) == set(EVENT_KINDS)


def test_the_cursor_returns_an_event_whose_transaction_committed_after_a_later_one(db, connect):
    cursor = EventCursor()
    assert cursor.start_at_newest(db) == []
    slow = connect(autocommit=False)
    slow.execute("SELECT ledger.start_run(job => 'slow', owner => 'w', ttl => '1 minute')")  # takes an id
    run_once(db, "fast")  # takes the next ones, and commits first
    assert kinds_of(cursor.read(db)) == [("run_started", "fast"), ("run_ended", "fast")]
    assert cursor.gaps == 1  # the id of slow's event, not committed yet
    assert cursor.read(db) == []
    slow.commit()
    assert kinds_of(cursor.read(db)) == [("run_started", "slow")]
    assert cursor.gaps == 0 and cursor.read(db) == []


def test_a_rolled_back_event_leaves_a_gap_only_until_its_transaction_has_ended(db, connect):
    cursor = EventCursor()
    cursor.start_at_newest(db)
    undone = connect(autocommit=False)
    undone.execute("SELECT ledger.start_run(job => 'undone', owner => 'w', ttl => '1 minute')")
    undone.rollback()
    run_once(db, "done")
    assert kinds_of(cursor.read(db)) == [("run_started", "done"), ("run_ended", "done")]
    assert cursor.gaps == 1
    wait_for(lambda: cursor.read(db) == [] and cursor.gaps == 0, timeout=TIMEOUT, what="the gap to be dropped")


def test_the_cursor_started_at_the_newest_shows_the_newest_n_and_returns_only_what_comes_later(db):
    for _ in range(3):
        run_once(db, "old")
    cursor = EventCursor(job="old", kinds=["run_ended"])
    shown = cursor.start_at_newest(db, show=2)
    assert kinds_of(shown) == [("run_ended", "old")] * 2 and cursor.origin == shown[-1].event_id
    run_once(db, "other")
    run_once(db, "old")
    assert kinds_of(cursor.read(db)) == [("run_ended", "old")]


# -- jobledger events ------------------------------------------------------------------------------

def test_events_lists_the_start_and_end_of_a_run_done_through_the_cli_and_json_parses(dsn):
    done = jobledger("run", "backup", "--ttl", "1m", "--owner", "host-1", "--", "true", dsn=dsn)
    assert done.returncode == 0, done.stderr
    listed = jobledger("events", dsn=dsn)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert len(lines) == 2
    assert re.match(r"#1  \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ  run_started +backup  run 1 by host-1, token 1$", lines[0])
    assert re.match(r"#2  .*Z  run_ended +backup  run 1 success \S+$", lines[1])
    rows = json.loads(jobledger("events", "--json", dsn=dsn).stdout)
    assert [(r["event_id"], r["kind"], r["job"], r["run_id"]) for r in rows] == \
        [(1, "run_started", "backup", 1), (2, "run_ended", "backup", 1)]
    assert rows[1]["detail"]["status"] == "success" and rows[0]["at"].endswith("+00:00")


def test_events_filters_by_job_and_kind_pages_with_after_and_says_when_nothing_matches(dsn, db):
    run_once(db, "backup")
    run_once(db, "report", error="disk full\nand more")
    db.execute("SELECT ledger.register_job('report')")
    db.execute("SELECT ledger.pause_job('report')")

    def listed(*args: str) -> list[tuple[int, str, str]]:
        result = jobledger("events", "--json", *args, dsn=dsn)
        assert result.returncode == 0, result.stderr
        return [(r["event_id"], r["kind"], r["job"]) for r in json.loads(result.stdout)]

    assert [kind for _, kind, _ in listed("--job", "report")] == ["run_started", "run_ended", "job_paused"]
    assert listed("--kind", "run_ended", "--kind", "job_paused") == [(2, "run_ended", "backup"),
                                                                      (4, "run_ended", "report"),
                                                                      (5, "job_paused", "report")]
    assert [event_id for event_id, _, _ in listed("-n", "2")] == [4, 5]
    assert [event_id for event_id, _, _ in listed("--after", "1", "-n", "2")] == [2, 3]
    text = jobledger("events", "--job", "report", dsn=dsn).stdout
    assert "run 2 failure" in text and ": disk full" in text and "and more" not in text  # the first line
    assert "paused (operator)" in text
    assert jobledger("events", "--job", "nobody", "--after", "3", dsn=dsn).stdout == \
        "no events of job nobody after event 3\n"


def test_events_tells_every_kind_in_a_line_of_its_own(dsn, db):
    db.execute("SELECT ledger.register_job('j', ttl => '1 minute')")
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(job => 'j', owner => 'host-1', "
                               "ttl => '1 minute', idempotency_key => 'k1')").fetchone()
    db.execute("SELECT ledger.request_cancel(%s)", (run_id,))
    db.execute("SELECT ledger.cancel_run(%s, %s, 'stopped by hand')", (run_id, token))
    db.execute("SELECT ledger.start_run(job => 'j', owner => 'host-2', ttl => '1 minute')")
    db.execute("SELECT ledger.force_release('j')")
    db.execute("SELECT ledger.pause_job('j')")
    db.execute("SELECT ledger.resume_job('j')")
    run_once(db, "j", error="boom")
    Ledger(db).sync_alerts()
    run_once(db, "j")
    Ledger(db).sync_alerts()
    # two jobs files that disagree about j: the second one's sync overrides the first's
    db.execute("""SELECT * FROM ledger.sync_jobs('{"j": {"ttl": "1 minute"}}', 'a.toml')""")
    db.execute("""SELECT * FROM ledger.sync_jobs('{"j": {"ttl": "2 minutes"}}', 'b.toml')""")
    result = jobledger("events", "-n", "100", dsn=dsn)
    assert result.returncode == 0, result.stderr
    told: dict[str, list[str]] = {}  # each kind's lines, what follows the job
    for line in result.stdout.splitlines():
        told.setdefault(line.split()[3], []).append(line.split("  j  ", 1)[1])
    assert set(told) == set(EVENT_KINDS)
    said = {kind: lines[0] for kind, lines in told.items()}
    assert said["run_started"] == "run 1 by host-1, token 1, key k1"
    assert said["cancel_requested"] == "run 1 asked to stop (held by host-1, token 1)"
    assert re.fullmatch(r"run 1 cancelled \S+: stopped by hand", said["run_cancelled"])
    assert re.fullmatch(r"run 2 lost \(superseded\) \S+: lease superseded by a newer token", said["run_lost"])
    assert said["job_paused"] == "paused (operator)"
    assert said["job_resumed"] == "resumed (had been paused: operator)"
    assert said["job_redefined"] == "definition from b.toml overrode the one from a.toml"
    # the supersession was a failure too, the cancel no failure: two in a row
    assert "alert failing: 2 failures in a row" in told["alert_raised"]
    assert "alert failing cleared: 2 failures in a row" in told["alert_cleared"]
    widths = {len(line.split("  j  ", 1)[0]) for line in result.stdout.splitlines()}
    assert len(widths) == 1  # aligned: the id, time and kind columns end at the same place


# -- jobledger configure-events --------------------------------------------------------------------

def test_configure_events_toggles_the_options_given_and_prints_the_settings(dsn, db):
    shown = jobledger("configure-events", dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("events: run events on, notify off, retention 7d, max events 1000000 (changed ")
    changed = jobledger("configure-events", "--notify", "on", "--run-events", "off", "--max-events", "5000",
                        "--json", dsn=dsn)
    assert changed.returncode == 0, changed.stderr
    settings = json.loads(changed.stdout)
    assert (settings["run_events"], settings["notify"], settings["retention"], settings["max_events"]) == \
        (False, True, 604800.0, 5000)
    assert value(db, "SELECT notify AND NOT run_events FROM ledger.event_settings") is True
    back = jobledger("configure-events", "--run-events", "on", dsn=dsn)
    assert back.stdout.startswith("events: run events on, notify on, retention 7d, max events 5000"), back.stderr


def test_the_cli_page_examples_of_events_and_configure_events_print_what_they_show(dsn, tmp_path):
    page = (ROOT / "docs" / "cli.md").read_text()
    section = page.split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(
        r"<!-- executed by tests/cli/test_cli_events\.py \(the output shown[^>]*-->\n```console\n(.*?)```",
        section, re.S)
    assert len(blocks) == 2
    script = tmp_path / "backup.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    for block in blocks:
        steps: list[tuple[str, list[str]]] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
        for command, shown in steps:
            words = shlex.split(command)
            assert words[0] == "jobledger"
            result = subprocess.run([*JOBLEDGER, *words[1:]], cwd=tmp_path, env=environment(dsn),
                                    capture_output=True, text=True, timeout=TIMEOUT)
            assert result.returncode == 0, (command, result.stderr)
            if "--json" in words:  # the newest run_ended: an array of one
                [row] = json.loads(result.stdout)
                assert (row["kind"], row["job"], row["detail"]["status"]) == ("run_ended", "backup", "success")
                continue

            def plain(line: str) -> str:  # times and durations differ from run to run
                return re.sub(r"success \S+$", "success D", TIME.sub("TIME", line.rstrip()))

            assert [plain(line) for line in result.stdout.splitlines()] == [plain(line) for line in shown], command


# -- jobledger watch -------------------------------------------------------------------------------

def test_the_cli_page_watch_shows_the_newest_event_then_a_new_one_until_ctrl_c(dsn, db):
    page = (ROOT / "docs" / "cli.md").read_text()
    section = page.split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    [command] = [line for block in re.findall(r"```sh\n(.*?)```", section, re.S) for line in block.splitlines()
                 if line.startswith("jobledger watch")]
    run_once(db, "backup")
    with Background(*shlex.split(command)[1:], dsn=dsn) as watch:
        watch.wait_out(lambda lines: lines, "the newest event")
        run_once(db, "other")  # not shown: --job backup
        run_once(db, "backup")
        watch.wait_out(lambda lines: len(lines) >= 3, "the new run's start and end")
        code = watch.interrupt()
    assert code == 0, watch.stderr()  # Ctrl-C is how a watch ends: no "Aborted!", no traceback
    assert "Traceback" not in watch.stderr() and "Aborted" not in watch.stderr()
    assert len(watch.out) == 3, watch.out
    for line, shown in zip(watch.out, [r"#2  .*Z  run_ended +backup  run 1 success \S+",
                                       r"#5  .*Z  run_started +backup  run 3 by w, token 2",
                                       r"#6  .*Z  run_ended +backup  run 3 success \S+"]):
        assert re.fullmatch(shown, line), line


def _waiting(db: psycopg.Connection, seconds: float) -> bool:
    """Whether the command's connection has been idle after a read of the tail for ``seconds``: waiting."""
    return bool(value(db, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'jobledger' "
                          "AND datname = current_database() AND state = 'idle' "
                          "AND query LIKE '%%pg_current_snapshot%%' "
                          "AND clock_timestamp() - state_change > make_interval(secs => %s)", (seconds,)))


@pytest.mark.parametrize("notify", [False, True], ids=["polling", "notified"])
def test_watch_prints_an_event_recorded_after_it_started(dsn, db, notify):
    Ledger(db).configure_events(notify=notify)
    run_once(db, "before")
    # Notified: an interval far beyond any wait here, so that only the notification can wake it
    # once it waits (idle a while after a read: its first poll is done, and it LISTENs).
    interval = "10m" if notify else "200ms"
    with Background("watch", "--json", "-n", "1", "--interval", interval, "--no-alerts", dsn=dsn) as watch:
        watch.wait_out(lambda lines: json_lines(lines), "the newest event")
        if notify:
            wait_for(lambda: _waiting(db, 0.5), timeout=TIMEOUT, what="the watch to wait")
        run_id = run_once(db, "after")
        events = watch.wait_out(lambda lines: len(json_lines(lines)) >= 3 and json_lines(lines), "two new events")
        code = watch.interrupt()
    assert code == 0, watch.stderr()
    assert [(e["kind"], e["job"], e["run_id"]) for e in events] == [
        ("run_ended", "before", 1), ("run_started", "after", run_id), ("run_ended", "after", run_id)]
    assert events[2]["detail"]["status"] == "success" and events[1]["event_id"] < events[2]["event_id"]


def test_watch_records_the_alerts_and_prints_their_events(dsn, db):
    db.execute("SELECT ledger.register_job('backup', ttl => '1 minute')")
    with Background("watch", "--kind", "alert_raised", "--kind", "alert_cleared", "--interval", "200ms",
                    dsn=dsn) as watch:
        run_once(db, "backup", error="boom")
        watch.wait_out(lambda lines: any("alert failing: 1 failure in a row" in line for line in lines),
                       "the alert raised")
        run_once(db, "backup")
        watch.wait_out(lambda lines: any("alert failing cleared" in line for line in lines), "the alert cleared")
        assert watch.interrupt() == 0
    assert [line.split()[3] for line in watch.out] == ["alert_raised", "alert_cleared"]
    assert watch.err == []


@pytest.mark.parametrize("notify", [False, True], ids=["polling", "listening"])
def test_watch_goes_on_after_its_connection_is_broken(dsn, db, notify):
    Ledger(db).configure_events(notify=notify)  # listening: the break is met in the wait for a notification
    run_once(db, "before")
    with Background("watch", "--json", "-n", "2", "--interval", "200ms", "--no-alerts", dsn=dsn) as watch:
        watch.wait_out(lambda lines: len(json_lines(lines)) >= 2, "the first run's events")
        killed = value(db, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE application_name = 'jobledger' AND datname = current_database()")
        assert killed == 1
        watch.wait_err("lost the connection to the database")
        run_once(db, "after")
        watch.wait_out(lambda lines: len(json_lines(lines)) >= 4, "the second run's events")
        watch.wait_err("reconnected; going on after event 2")
        assert watch.interrupt() == 0
    assert [(e["kind"], e["job"]) for e in json_lines(watch.out)] == [
        ("run_started", "before"), ("run_ended", "before"), ("run_started", "after"), ("run_ended", "after")]


@pytest.fixture
def reader_dsn(dsn, db) -> Iterator[str]:
    """A login whose only privileges come from ledger_reader (roles are cluster-wide: a unique name)."""
    name = f"test_watcher_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    db.execute(f'CREATE ROLE "{name}" LOGIN IN ROLE ledger_reader')
    try:
        yield make_conninfo(**{**conninfo_to_dict(dsn), "user": name})
    finally:
        db.execute(f'DROP ROLE "{name}"')


def test_a_reader_lists_and_watches_the_events_and_is_told_once_that_alerts_are_not_synced(reader_dsn, db):
    run_once(db, "backup", error="boom")
    assert len(json.loads(jobledger("events", "--json", dsn=reader_dsn).stdout)) == 2
    assert "notify off" in jobledger("configure-events", dsn=reader_dsn).stdout  # a read needs no EXECUTE
    refused = jobledger("configure-events", "--notify", "on", dsn=reader_dsn)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    with Background("watch", "-n", "0", "--interval", "200ms", dsn=reader_dsn) as watch:
        watch.wait_err("alert events are not synced here")
        run_once(db, "backup")
        watch.wait_out(lambda lines: len(lines) >= 2, "the run's events")
        assert watch.interrupt() == 0
    assert sum("not synced" in line for line in watch.err) == 1
    assert "may not execute ledger.sync_alerts" in watch.stderr()
    assert value(db, "SELECT count(*) FROM ledger.events WHERE kind = 'alert_raised'") == 0


# -- jobledger notify ------------------------------------------------------------------------------

class Hook:
    """A webhook on 127.0.0.1: it records each POST and answers the statuses of ``answers`` in turn, then 200."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: list[int] = []
        self.lock = threading.Lock()
        self.url = ""

    def bodies(self) -> list[dict[str, Any]]:
        with self.lock:
            return [request["body"] for request in self.requests]


@pytest.fixture
def hook() -> Iterator[Hook]:
    received = Hook()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with received.lock:
                received.requests.append({"path": self.path, "headers": dict(self.headers),
                                          "body": json.loads(body)})
                status = received.answers.pop(0) if received.answers else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    received.url = f"http://127.0.0.1:{server.server_address[1]}/ledger?token=s3cret"
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_notify_posts_an_alert_raised_then_cleared_as_json_until_ctrl_c(dsn, db, hook):
    db.execute("SELECT ledger.register_job('backup', ttl => '1 minute', pause_after_failures => 1)")
    with Background("notify", "--webhook", hook.url, "--interval", "200ms", dsn=dsn) as notifier:
        notifier.wait_err("notifying http://127.0.0.1:")
        run_once(db, "backup", error="boom")  # pauses the job: a "paused" alert
        wait_for(lambda: len(hook.bodies()) >= 1, timeout=TIMEOUT, what=f"the first POST ({notifier.stderr()})")
        db.execute("SELECT ledger.resume_job('backup')")  # paused cleared; failing raised
        wait_for(lambda: len(hook.bodies()) >= 3, timeout=TIMEOUT, what=f"three POSTs ({notifier.stderr()})")
        # the hook has the third body before the notifier has its answer and says so: wait for that line
        wait_for(lambda: notifier.stderr().count("delivered, HTTP 200 (attempt 1 of 6)") >= 3, timeout=TIMEOUT,
                 what=f"three deliveries told ({notifier.stderr()})")
        assert notifier.interrupt() == 0, notifier.stderr()
    bodies = hook.bodies()
    assert [(b["kind"], b["job"], b["alert"]) for b in bodies] == [
        ("alert_raised", "backup", "paused"), ("alert_cleared", "backup", "paused"),
        ("alert_raised", "backup", "failing")]
    raised, cleared, _ = bodies
    assert set(raised) == {"event_id", "at", "kind", "job", "run_id", "alert", "message", "since", "detail"}
    assert raised["message"] == raised["detail"]["message"] and raised["since"] == raised["detail"]["since"]
    assert raised["run_id"] is None and raised["at"].endswith("+00:00")
    assert cleared["detail"]["raised_event"] == raised["event_id"] and cleared["event_id"] > raised["event_id"]
    stored = value(db, "SELECT jsonb_agg(event_id ORDER BY event_id) FROM ledger.events WHERE kind LIKE 'alert%'")
    assert [b["event_id"] for b in bodies] == stored
    request = hook.requests[0]
    assert request["path"] == "/ledger?token=s3cret" and request["headers"]["Content-Type"] == "application/json"
    assert request["headers"]["User-Agent"].startswith("jobledger/")
    assert "s3cret" not in notifier.stderr()  # the URL is logged without its query
    assert sum("delivered, HTTP 200 (attempt 1 of 6)" in line for line in notifier.err) == 3


def test_notify_stops_on_sigterm_with_exit_0_as_a_service_manager_stops_it(dsn, hook):
    with Background("notify", "--webhook", hook.url, "--interval", "200ms", dsn=dsn) as notifier:
        notifier.wait_err("notifying http://127.0.0.1:")
        notifier.process.send_signal(signal.SIGTERM)
        assert notifier.process.wait(timeout=TIMEOUT) == 0
    assert "Traceback" not in notifier.stderr()


def test_notify_retries_a_server_error_and_delivers_once(dsn, db, hook):
    run_once(db, "backup", error="boom")  # a failing alert, not recorded yet: notify's sync records it
    hook.answers = [500, 500]
    done = jobledger("notify", "--webhook", hook.url, "--once", "--backoff", "50ms", dsn=dsn)
    assert done.returncode == 0, done.stderr
    bodies = hook.bodies()
    assert len(bodies) == 3 and len({b["event_id"] for b in bodies}) == 1  # three attempts of one event
    assert (bodies[0]["kind"], bodies[0]["alert"]) == ("alert_raised", "failing")
    lines = done.stderr.splitlines()
    assert sum("HTTP 500" in line and "retrying in" in line for line in lines) == 2
    assert sum("delivered, HTTP 200 (attempt 3 of 6)" in line for line in lines) == 1
    assert f"event {bodies[0]['event_id']} alert_raised backup failing" in done.stderr


@pytest.mark.parametrize(("status", "said"), [(400, "HTTP 400 Bad Request"), (301, "HTTP 301 Moved Permanently")])
def test_notify_does_not_retry_a_client_error_or_a_redirect_and_once_exits_1(dsn, db, hook, status, said):
    run_once(db, "backup", error="boom")
    hook.answers = [status]
    done = jobledger("notify", "--webhook", hook.url, "--once", "--backoff", "50ms", dsn=dsn)
    assert done.returncode == 1
    assert len(hook.bodies()) == 1
    assert f"{said} (attempt 1 of 6), not retried: given up" in done.stderr


def test_notify_retries_a_429_and_a_refused_connection_up_to_retries(dsn, db, hook):
    run_once(db, "backup", error="boom")
    hook.answers = [429, 200]
    assert jobledger("notify", "--webhook", hook.url, "--once", "--backoff", "50ms", dsn=dsn).returncode == 0
    assert len(hook.bodies()) == 2
    run_once(db, "backup")  # cleared: the next delivery goes to a port nobody listens on
    nobody = f"http://127.0.0.1:{_free_port()}/"
    done = jobledger("notify", "--webhook", nobody, "--once", "--retries", "1", "--backoff", "50ms", dsn=dsn)
    assert done.returncode == 1
    assert "alert_cleared backup failing" in done.stderr and "(attempt 2 of 2): given up" in done.stderr
    assert "refused" in done.stderr.lower()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_notify_once_starts_at_the_newest_event_or_after_the_one_given_and_filters_by_job(dsn, db, hook):
    run_once(db, "early", error="boom")
    Ledger(db).sync_alerts()  # recorded before notify starts: not sent without --after
    run_once(db, "late", error="boom")
    run_once(db, "other", error="boom")
    done = jobledger("notify", "--webhook", hook.url, "--once", "--job", "late", dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert [(b["job"], b["alert"]) for b in hook.bodies()] == [("late", "failing")]
    again = jobledger("notify", "--webhook", hook.url, "--once", "--after", "0", dsn=dsn)
    assert again.returncode == 0, again.stderr
    resent = hook.bodies()[1:]
    assert [b["event_id"] for b in resent] == sorted(b["event_id"] for b in resent)  # oldest first
    assert resent[0]["job"] == "early" and {b["job"] for b in resent[1:]} == {"late", "other"}


def _alert_ids(db: psycopg.Connection, after: int = 0) -> list[int]:
    """The ids of the alert events after ``after``, oldest first."""
    return value(db, "SELECT coalesce(jsonb_agg(event_id ORDER BY event_id), '[]') FROM ledger.events "
                     "WHERE kind LIKE 'alert%%' AND event_id > %s", (after,))


def _saved(path: Path) -> int | None:
    """The position a notifier's state file holds (None before it exists)."""
    return int(json.loads(path.read_text())["after"]) if path.exists() else None


def test_notify_with_a_state_file_sends_after_a_restart_what_was_raised_and_cleared_while_it_was_down(
        dsn, db, hook, tmp_path):
    state = tmp_path / "notify.json"
    args = ("notify", "--webhook", hook.url, "--interval", "200ms", "--state-file", str(state))
    run_once(db, "backup", error="boom")
    Ledger(db).sync_alerts()  # before the first start: not sent (it starts at the newest event)
    newest = value(db, "SELECT max(event_id) FROM ledger.events")
    with Background(*args, dsn=dsn) as first:
        first.wait_err(f"after event {newest} (position kept in {state}; every 200ms")
        assert _saved(state) == newest  # written at the start, before any alert
        run_once(db, "other", error="boom")
        wait_for(lambda: len(hook.bodies()) >= 1, timeout=TIMEOUT, what=f"the first POST ({first.stderr()})")
        delivered = hook.bodies()[0]["event_id"]
        wait_for(lambda: _saved(state) == delivered, timeout=TIMEOUT, what="the delivery saved")
        assert first.interrupt() == 0, first.stderr()
    assert [(b["kind"], b["job"]) for b in hook.bodies()] == [("alert_raised", "other")]
    # While it is down, others record the alerts (pg_cron, a watch): one cleared, one raised and cleared.
    run_once(db, "other")
    Ledger(db).sync_alerts()
    run_once(db, "third", error="boom")
    Ledger(db).sync_alerts()
    run_once(db, "third")
    Ledger(db).sync_alerts()
    missed = _alert_ids(db, after=delivered)
    assert len(missed) == 3
    with Background(*args, dsn=dsn) as second:
        second.wait_err(f"after event {delivered} (position kept in {state};")
        wait_for(lambda: len(hook.bodies()) >= 4 and _saved(state) == missed[-1], timeout=TIMEOUT,
                 what=f"the three missed POSTs, saved ({second.stderr()})")
        assert second.interrupt() == 0, second.stderr()
    resent = hook.bodies()[1:]
    assert [b["event_id"] for b in resent] == missed  # exactly those, oldest first: none of the first run's again
    assert [(b["kind"], b["job"]) for b in resent] == [
        ("alert_cleared", "other"), ("alert_raised", "third"), ("alert_cleared", "third")]
    saved = json.loads(state.read_text())
    assert set(saved) == {"after", "gaps", "updated_at"} and saved["after"] == missed[-1] == resent[-1]["event_id"]
    assert saved["gaps"] == []
    assert datetime.fromisoformat(saved["updated_at"]).tzinfo is not None
    assert list(tmp_path.iterdir()) == [state]  # no temporary file left behind


def test_the_operations_page_cron_notify_with_a_state_file_sends_each_event_once_run_after_run(
        dsn, db, hook, tmp_path):
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("\n## Events and webhooks\n", 1)[1].split("\n## ", 1)[0]
    [line] = re.findall(r"<!-- executed by tests/cli/test_cli_events\.py[^>]*-->\n```crontab\n(.*?)\n```",
                        section, re.S)
    words = shlex.split(line)[5:]  # after the five time fields
    assert words[:3] == ["jobledger", "notify", "--once"] and "--state-file" in words and "--webhook" in words
    state = tmp_path / "notify.json"
    swapped = {"--state-file": str(state), "--webhook": hook.url}
    once = [swapped.get(before, word) for before, word in zip(["", *words], words)][1:]
    run_once(db, "backup", error="boom")  # recorded by the first run's sync: after its start, so sent
    first = jobledger(*once, dsn=dsn)
    assert first.returncode == 0, first.stderr
    assert [(b["kind"], b["job"]) for b in hook.bodies()] == [("alert_raised", "backup")]
    assert _saved(state) == hook.bodies()[0]["event_id"]
    run_once(db, "backup")  # cleared, and another raised, both recorded by someone else between the
    run_once(db, "other", error="boom")  # runs (pg_cron, a watch): sent all the same
    Ledger(db).sync_alerts()
    second = jobledger(*once, dsn=dsn)
    assert second.returncode == 0, second.stderr
    assert f"after event {hook.bodies()[0]['event_id']} (position kept in {state}; once)" in second.stderr
    run_once(db, "quiet")  # events, but no alert: nothing to send, and the file goes past them
    third = jobledger(*once, dsn=dsn)
    assert third.returncode == 0, third.stderr
    ids = [b["event_id"] for b in hook.bodies()]
    assert ids == _alert_ids(db) and len(ids) == 3  # each alert event once, in order
    assert sorted((b["kind"], b["job"]) for b in hook.bodies()[1:]) == [("alert_cleared", "backup"),
                                                                         ("alert_raised", "other")]
    assert _saved(state) == value(db, "SELECT max(event_id) FROM ledger.events")


def _gaps(path: Path) -> list[tuple[int, int]]:
    """The id ranges a notifier's state file says are still waited for."""
    return [(gap["first"], gap["last"]) for gap in json.loads(path.read_text())["gaps"]]


def test_notify_with_a_state_file_sends_an_alert_that_commits_late_even_when_no_notifier_ran_meanwhile(
        dsn, db, connect, hook, tmp_path):
    """An alert recorded by a transaction that commits after later events were read (a sync_alerts from
    pg_cron in a slow transaction): the state file keeps its ids as a gap, and the next --once sends it."""
    state = tmp_path / "notify.json"
    once = ("notify", "--webhook", hook.url, "--once", "--state-file", str(state))
    assert jobledger(*once, dsn=dsn).returncode == 0  # the file, at the newest event
    slow = connect(autocommit=False)
    run_once(slow, "backup", error="boom")
    [raised] = Ledger(slow).sync_alerts()  # its events' ids are taken, not committed
    run_once(db, "quiet")  # later ids, committed
    first = jobledger(*once, dsn=dsn)
    assert first.returncode == 0, first.stderr
    assert hook.bodies() == []  # nothing to send yet; its own sync found the other at work
    assert _saved(state) == value(db, "SELECT max(event_id) FROM ledger.events") > raised.event_id
    assert any(first <= raised.event_id <= last for first, last in _gaps(state)), state.read_text()
    slow.commit()
    second = jobledger(*once, dsn=dsn)
    assert second.returncode == 0, second.stderr
    assert [(b["event_id"], b["kind"], b["job"]) for b in hook.bodies()] == [
        (raised.event_id, "alert_raised", "backup")]
    assert _gaps(state) == []  # every id of the slow transaction turned up


def test_notify_with_a_state_file_stops_waiting_for_a_gap_whose_transaction_rolled_back(
        dsn, db, connect, hook, tmp_path):
    state = tmp_path / "notify.json"
    once = ("notify", "--webhook", hook.url, "--once", "--state-file", str(state))
    assert jobledger(*once, dsn=dsn).returncode == 0
    doomed = connect(autocommit=False)
    run_once(doomed, "backup", error="boom")  # ids taken, then rolled back
    run_once(db, "quiet")
    assert jobledger(*once, dsn=dsn).returncode == 0
    assert _gaps(state) != []
    doomed.rollback()
    # Run after run (cron), the gap settles: a snapshot bound taken once it is a second old, then passed.
    wait_for(lambda: jobledger(*once, dsn=dsn).returncode == 0 and _gaps(state) == [], timeout=TIMEOUT,
             what=f"the gap given up ({state.read_text()})")
    assert hook.bodies() == []


def test_notify_once_saves_a_given_up_event_as_handled(dsn, db, hook, tmp_path):
    state = tmp_path / "notify.json"
    once = ("notify", "--webhook", hook.url, "--once", "--state-file", str(state))
    run_once(db, "backup", error="boom")
    hook.answers = [400]
    assert jobledger(*once, dsn=dsn).returncode == 1  # given up
    [given_up] = hook.bodies()
    assert _saved(state) == given_up["event_id"]
    again = jobledger(*once, dsn=dsn)
    assert again.returncode == 0, again.stderr
    assert len(hook.bodies()) == 1  # not sent again: the next run goes on after it


@pytest.mark.parametrize("contents", [
    "{not json", "", '{"after": "12"}', '{"after": -1}', "[12]", '{"position": 3}', '{"after": 5, "gaps": [[1, 2]]}',
    '{"after": 5, "gaps": [{"first": 6, "last": 7, "seen_at": "2026-12-01T00:00:00+00:00", "horizon": null}]}',
    '{"after": 5, "gaps": [{"first": 2, "last": 3, "seen_at": "yesterday", "horizon": null}]}',
], ids=["not-json", "empty", "a-string", "negative", "a-list", "no-after", "gap-a-pair", "gap-above-after",
        "gap-seen-not-a-time"])
def test_notify_refuses_a_state_file_it_cannot_read_with_exit_2_and_sends_nothing(dsn, db, hook, tmp_path,
                                                                                  contents):
    state = tmp_path / "notify.json"
    state.write_text(contents)
    run_once(db, "backup", error="boom")  # an alert a notifier started anyway would record and send
    # Not --once: a notifier that started anyway would run until the timeout and fail the test.
    done = jobledger("notify", "--webhook", hook.url, "--interval", "200ms", "--state-file", str(state), dsn=dsn)
    assert done.returncode == 2, done.stderr
    assert f"cannot read the state file {state}: " in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "remove it to start at the newest event" in done.stderr
    assert hook.bodies() == [] and state.read_text() == contents
    assert _alert_ids(db) == []  # it did not even sync


def test_notify_after_with_a_state_file_starts_there_once_and_then_is_refused(dsn, db, hook, tmp_path):
    state = tmp_path / "notify.json"
    run_once(db, "backup", error="boom")
    Ledger(db).sync_alerts()
    given = ("notify", "--webhook", hook.url, "--once", "--after", "0", "--state-file", str(state))
    first = jobledger(*given, dsn=dsn)  # no file yet: --after says where to start, and the file is created
    assert first.returncode == 0, first.stderr
    assert [b["event_id"] for b in hook.bodies()] == _alert_ids(db) != []
    assert _saved(state) == hook.bodies()[-1]["event_id"]
    again = jobledger(*given, dsn=dsn)
    assert again.returncode == 2
    assert f"--after 0 and the state file {state} (after event {_saved(state)}) both say where to start" \
        in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert len(hook.bodies()) == 1


def test_the_operations_page_payload_has_the_keys_of_a_real_delivery_and_its_cron_command_runs(dsn, db, hook):
    page = (ROOT / "docs" / "operations.md").read_text()
    section = page.split("\n## Events and webhooks\n", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"<!-- executed by tests/cli/test_cli_events\.py[^>]*-->\n```json\n(.*?)```", section, re.S)
    [cron] = re.findall(r"<!-- executed by tests/cli/test_cli_events\.py[^>]*-->\n```sql\n(.*?)```", section, re.S)
    run_once(db, "backup", error="boom")
    command = re.fullmatch(r"SELECT cron\.schedule\('ledger-alerts', '\* \* \* \* \*', '(.*)'\);\n", cron)
    assert command is not None
    assert value(db, command.group(1)) == 1  # what pg_cron would run each minute: the alert raised
    done = jobledger("notify", "--webhook", hook.url, "--once", "--after", "0", dsn=dsn)
    assert done.returncode == 0, done.stderr
    [body] = hook.bodies()
    shown = json.loads(example)
    assert set(shown) == set(body) and set(shown["detail"]) == set(body["detail"])
    assert (shown["kind"], shown["alert"], shown["message"]) == (body["kind"], body["alert"], body["message"])


# -- options and help ------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "code", "message"), [
    (["watch", "--interval", "10ms"], 2, "at least 100ms"),
    (["events", "--kind", "run_exploded"], 2, "'run_exploded' is not one of"),
    (["events", "-n", "0"], 2, "0 is not in the range x>=1"),
    (["notify", "--webhook", "ftp://example.com/x"], 2, "not an http or https URL"),
    (["notify", "--webhook", "http://example.com:port/"], 2, "cannot read"),
    (["notify"], 2, "Missing option '--webhook'"),
    (["notify", "--webhook", "http://127.0.0.1:9/", "--state-file", "/nonexistent-directory/notify.json"], 2,
     "cannot write the state file /nonexistent-directory/notify.json: "),
    (["configure-events", "--notify", "maybe"], 2, "'maybe' is not a valid boolean"),
    (["configure-events", "--retention", "1 month"], 2, "no fixed length"),
    (["configure-events", "--max-events", "5"], 1, "argument max_events must be between 1000 and 1000000000"),
    (["configure-events", "--retention", "40000d"], 1, "argument retention must be"),
])
def test_bad_input_is_refused_in_clear_words_and_changes_nothing(dsn, db, args, code, message):
    before = value(db, "SELECT to_jsonb(s) - 'updated_at' FROM ledger.event_settings s")
    result = jobledger(*args, dsn=dsn)
    assert result.returncode == code, result.stderr
    assert message in result.stderr, result.stderr
    if code == 1:
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("Error: ")
    assert value(db, "SELECT to_jsonb(s) - 'updated_at' FROM ledger.event_settings s") == before


def test_every_events_command_has_help_that_says_what_it_does():
    runner = CliRunner()
    summaries = {
        "events": "The ledger's recent events",
        "watch": "Follow the ledger's events live",
        "notify": "POST every alert raised and cleared",
        "configure-events": "Set what the ledger records as events",
    }
    for name, summary in summaries.items():
        result = runner.invoke(main, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert summary in " ".join(result.output.split()), name
    notify_help = " ".join(runner.invoke(main, ["notify", "--help"]).output.split())
    assert "at least once" in notify_help and "deduplicates by event_id" in notify_help
    assert ('--state-file PATH Keep the position in PATH (JSON: {"after": EVENT_ID, "gaps": [...], "updated_at": '
            'TIME}; gaps: ids below it still waited for)') in notify_help
