"""`jobledger notify` against receivers that misbehave, and with URLs that hold a secret.

A receiver that drips its answer a byte at a time never trips a socket's
timeout: an attempt has a total deadline (--timeout), so the notifier ends
the attempt, retries, gives up and goes on to the next alert. A webhook's
secret (in its path, query, user or password) is never printed, only the
URL's scheme, host and port; the URL can come from a file or the
environment instead of the command line, where ``ps`` shows it.

Real subprocesses on a real database; the receivers listen on 127.0.0.1.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import threading
import uuid
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psycopg
import pytest
from clihelp import environment, jobledger, start
from waiting import wait_for

from ledger.client import Ledger
from ledger.models import Event
from ledger.webhook import deliver, shown_url

TIMEOUT = 60.0  # seconds: a condition not reached by then is a hang
SECRET = "SECRETSECRET"
DRIP_FOR = 60.0  # seconds a dripping receiver goes on by itself, far past any bound a notifier may take
EXITED_WITHIN = 30.0  # seconds a `--timeout 1s --retries 1` notifier is given to end, while the drip goes on


def alert_events(db: psycopg.Connection, job: str = "backup") -> list[int]:
    """An alert raised then cleared for ``job`` (two alert events, recorded now); their event ids."""
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'w', "
                               "ttl => '1 minute')", (job,)).fetchone()
    db.execute("SELECT ledger.fail_run(run_id => %s, token => %s, error => 'boom')", (run_id, token))
    Ledger(db).sync_alerts()
    run_id, token = db.execute("SELECT run_id, token FROM ledger.start_run(job => %s, owner => 'w', "
                               "ttl => '1 minute')", (job,)).fetchone()
    db.execute("SELECT ledger.complete_run(run_id => %s, token => %s)", (run_id, token))
    Ledger(db).sync_alerts()
    ids = [row[0] for row in db.execute("SELECT event_id FROM ledger.events WHERE kind LIKE 'alert%%' "
                                        "ORDER BY event_id").fetchall()]
    assert len(ids) == 2
    return ids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- receivers --------------------------------------------------------------------------------------

class Receiver:
    """A webhook on 127.0.0.1 that records each POST and answers ``status``."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.requests.append({"path": self.path, "headers": dict(self.headers),
                                              "body": json.loads(body)})
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self) -> list[dict[str, Any]]:
        with self.lock:
            return [request["body"] for request in self.requests]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    good = Receiver()
    try:
        yield good
    finally:
        good.close()


@pytest.fixture
def failing() -> Iterator[Receiver]:
    bad = Receiver(500)
    try:
        yield bad
    finally:
        bad.close()


class Drip:
    """A receiver that answers its first ``drips`` connections one byte every 0.3 s, for ``drip_for``
    seconds (then it stops by itself), and the later ones at once with 200.

    ``where``: "body", a 200 status line and headers at once, then the body a byte at a time; "headers",
    the status line, then a header that never ends."""

    def __init__(self, where: str, drips: int, drip_for: float = DRIP_FOR) -> None:
        self.where = where
        self.drips = drips
        self.drip_for = drip_for
        self.connections = 0
        self.delivered: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        # Its own path: a notifier of another test still retrying to a port that was closed and
        # handed to this server again must not count as one of this server's attempts.
        self.path = f"/drip/{uuid.uuid4().hex}"
        self.url = f"http://127.0.0.1:{self.port}{self.path}"
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def dripping(self) -> bool:
        """Whether a connection that began at the start would still be dripping now."""
        return time.monotonic() - self.started < self.drip_for

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _request(conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return data
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        return body

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(self.drip_for)
                # Counted only when it is a delivery: a test in another worker that connects to a
                # port it believes dead (and the OS gave this one that number) is no attempt.
                try:
                    expected = f"POST {self.path} ".encode()
                    first_line = conn.recv(len(expected), socket.MSG_PEEK)
                    while first_line and len(first_line) < len(expected) and expected.startswith(first_line):
                        time.sleep(0.01)  # the request line in pieces: peek again
                        first_line = conn.recv(len(expected), socket.MSG_PEEK)
                    if first_line != expected:
                        return
                    body = self._request(conn)
                    if "event_id" not in json.loads(body):
                        return
                except (ValueError, StopIteration):
                    return
                with self.lock:
                    self.connections += 1
                    number = self.connections
                if number > self.drips:
                    with self.lock:
                        self.delivered.append(json.loads(body))
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                if self.where == "body":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000000\r\n\r\n")
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Drip: ")
                begun = time.monotonic()
                while time.monotonic() - begun < self.drip_for:
                    conn.sendall(b"x")
                    time.sleep(0.3)
            except OSError:  # the notifier hung up: the drip ends
                return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def drip(request: pytest.FixtureRequest) -> Iterator[Drip]:
    dripping = Drip(request.param, drips=2)
    try:
        yield dripping
    finally:
        dripping.close()


def _ended(process: subprocess.Popen[str], within: float) -> tuple[int | None, str, str]:
    """The exit code and output of ``process`` if it ends within ``within`` seconds; else it is killed and
    the exit code is None."""
    try:
        out, err = process.communicate(timeout=within)
        return process.returncode, out, err
    except subprocess.TimeoutExpired:  # a hang, told by the caller
        process.kill()
        out, err = process.communicate()
        return None, out, err


# -- item 6: a dripping receiver --------------------------------------------------------------------

@pytest.mark.parametrize("drip", ["body", "headers"], indirect=True)
def test_a_dripping_webhook_ends_each_attempt_at_the_timeout_and_the_next_alert_is_delivered(dsn, db, drip):
    raised, cleared = alert_events(db)
    process = start("notify", "--webhook", drip.url, "--once", "--after", "0",
                    "--timeout", "1s", "--retries", "1", "--backoff", "100ms", dsn=dsn)
    code, out, err = _ended(process, EXITED_WITHIN)
    assert drip.dripping, "the receiver stopped dripping before the notifier ended: nothing was shown"
    assert code is not None, f"notify still ran after {EXITED_WITHIN}s against a dripping receiver:\n{err}"
    assert code == 1, err  # --once: a delivery was given up
    lines = err.splitlines()
    first = f"event {raised} alert_raised backup failing: timed out after 1s"
    assert any(first in line and "(attempt 1 of 2), retrying in 100ms" in line for line in lines), err
    assert any(first in line and "(attempt 2 of 2): given up" in line for line in lines), err
    assert any(f"event {cleared} alert_cleared backup failing: delivered, HTTP 200 (attempt 1 of 2)" in line
               for line in lines), err
    assert drip.connections == 3  # two attempts of the first event, one of the next
    assert [body["event_id"] for body in drip.delivered] == [cleared]
    assert "Traceback" not in err


def test_deliver_bounds_an_attempt_by_its_timeout_and_tells_each_one():
    dripping = Drip("body", drips=10, drip_for=20.0)  # three attempts of 500ms: far less
    event = Event(event_id=7, at=_now(), kind="alert_raised", job="backup", run_id=None,
                  detail={"alert": "failing", "message": "1 failure in a row"})
    lines: list[str] = []
    waits: list[float] = []
    try:
        delivery = deliver(dripping.url, event, retries=2, backoff=timedelta(seconds=1),
                           timeout=timedelta(milliseconds=500), log=lines.append, sleep=waits.append)
        assert dripping.dripping
    finally:
        dripping.close()
    assert (delivery.delivered, delivery.attempts, delivery.outcome) == (False, 3, "timed out after 500ms")
    assert waits == [1.0, 2.0]  # the backoff between the attempts, nothing more
    assert len(lines) == 3 and lines[-1].endswith("(attempt 3 of 3): given up")


def _now() -> datetime:
    return datetime.now(timezone.utc)


# -- item 7: secrets -----------------------------------------------------------------------------------

SECRET_URLS = {
    "path": "http://127.0.0.1:{port}/services/T000/B000/" + SECRET,
    "query": "http://127.0.0.1:{port}/ledger?token=" + SECRET,
    "userinfo": "http://user:" + SECRET + "@127.0.0.1:{port}/ledger",
    "fragment": "http://127.0.0.1:{port}/ledger#" + SECRET,
}


@pytest.mark.parametrize("form", SECRET_URLS)
@pytest.mark.parametrize("answer", ["refused", "500"])
def test_no_secret_of_the_url_is_printed_when_the_delivery_fails(dsn, db, failing, form, answer):
    alert_events(db)
    port = failing.port if answer == "500" else free_port()
    url = SECRET_URLS[form].format(port=port)
    done = jobledger("notify", "--webhook", url, "--once", "--after", "0", "--retries", "1", "--backoff", "50ms",
                     dsn=dsn)
    assert done.returncode == 1, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "/services" not in done.stderr and "/ledger" not in done.stderr and "user" not in done.stderr
    assert f"notifying http://127.0.0.1:{port} of the alert events after event 0" in done.stderr
    said = "HTTP 500 Internal Server Error" if answer == "500" else "refused"
    assert sum(said in line and "(attempt 2 of 2): given up" in line for line in done.stderr.splitlines()) == 2
    if answer == "500":
        assert len(failing.requests) == 4  # each of the two events, twice: the URL was used whole


def test_a_user_and_password_in_the_url_are_sent_as_basic_authentication(dsn, db, receiver):
    alert_events(db)
    url = f"http://hook%40ops:{SECRET}@127.0.0.1:{receiver.port}/ledger"
    done = jobledger("notify", "--webhook", url, "--once", "--after", "0", dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stderr and "hook" not in done.stderr
    assert len(receiver.requests) == 2
    request = receiver.requests[0]
    assert request["path"] == "/ledger"
    assert request["headers"]["Authorization"] == "Basic " + base64.b64encode(f"hook@ops:{SECRET}".encode()).decode()
    assert request["headers"]["Host"] == f"127.0.0.1:{receiver.port}"


@pytest.mark.parametrize(("url", "said"), [
    ("http://127.0.0.1:{port}/ledger?token=" + SECRET + " and more",
     "the --webhook URL (http://127.0.0.1:{port}) holds a space or a control character"),
    ("http://127.0.0.1:{port}/ledger?token=" + SECRET + "\t", None),  # stripped: delivered
    ("ftp://user:" + SECRET + "@example.com/" + SECRET, "the --webhook URL (ftp://example.com) is not an http"),
    ("http://example.com:" + SECRET + "/x", "cannot read the --webhook URL"),
    ("http:///" + SECRET, "the --webhook URL is not an http or https URL with a host"),
    ("http://127.0.0.1:{port}/caf\u00e9/" + SECRET, "holds a character that is not ASCII"),
], ids=["space-in-query", "tab-at-end", "ftp", "port-not-a-number", "no-host", "not-ascii"])
def test_a_url_that_cannot_be_used_is_refused_without_printing_its_secret(dsn, db, receiver, url, said):
    alert_events(db)
    url = url.format(port=receiver.port)
    done = jobledger("notify", "--webhook", url, "--once", "--after", "0", "--retries", "0", dsn=dsn)
    assert SECRET not in done.stdout + done.stderr
    if said is None:
        assert done.returncode == 0, done.stderr
        assert len(receiver.requests) == 2
        return
    assert done.returncode == 2, done.stderr
    assert said.format(port=receiver.port) in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and receiver.requests == []


def test_the_library_never_logs_more_of_a_url_than_its_scheme_host_and_port():
    port = free_port()
    event = Event(event_id=7, at=_now(), kind="alert_raised", job="backup", run_id=None, detail={"alert": "failing"})
    for url in (f"http://127.0.0.1:{port}/x?token={SECRET} and more", f"http://127.0.0.1:{port}/caf\u00e9/{SECRET}",
                f"http://127.0.0.1:{port}/x\x7f{SECRET}", f"https://u:{SECRET}@127.0.0.1:{port}/{SECRET}"):
        lines: list[str] = []
        delivery = deliver(url, event, retries=0, backoff=timedelta(0), timeout=timedelta(seconds=2),
                           log=lines.append)
        assert not delivery.delivered
        assert len(lines) == 1 and SECRET not in lines[0] and SECRET not in delivery.outcome, lines
        assert shown_url(url) == ("https" if url.startswith("https") else "http") + f"://127.0.0.1:{port}"
    assert shown_url(f"https://[::1]:8443/services/{SECRET}") == "https://[::1]:8443"
    assert shown_url(f"https://hooks.slack.com/services/T000/B000/{SECRET}") == "https://hooks.slack.com"


# -- item 7: the URL from a file or the environment -----------------------------------------------------

def _url(receiver: Receiver) -> str:
    return f"http://127.0.0.1:{receiver.port}/services/T000/B000/{SECRET}"


def test_the_webhook_file_delivers_and_the_url_is_not_in_the_command_line(dsn, db, receiver, tmp_path):
    alert_events(db)
    hook_file = tmp_path / "webhook"
    hook_file.write_text(f"{_url(receiver)}\n")
    args = ("notify", "--webhook-file", str(hook_file), "--once", "--after", "0")
    assert not any(SECRET in arg or str(receiver.port) in arg for arg in args)
    done = jobledger(*args, dsn=dsn)
    assert done.returncode == 0, done.stderr
    assert [request["path"] for request in receiver.requests] == [f"/services/T000/B000/{SECRET}"] * 2
    assert SECRET not in done.stdout + done.stderr


def test_the_environment_variable_delivers(dsn, db, receiver):
    alert_events(db)
    done = jobledger("notify", "--once", "--after", "0", env=environment(dsn, LEDGER_WEBHOOK_URL=_url(receiver)))
    assert done.returncode == 0, done.stderr
    assert len(receiver.requests) == 2 and SECRET not in done.stdout + done.stderr


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc (Linux): it reads /proc/PID/cmdline, what ps shows")
def test_a_running_notifier_given_a_file_or_the_environment_shows_no_url_to_ps(dsn, receiver, tmp_path):
    hook_file = tmp_path / "webhook"
    hook_file.write_text(_url(receiver))
    for args, env in ((("--webhook-file", str(hook_file)), environment(dsn)),
                      ((), environment(dsn, LEDGER_WEBHOOK_URL=_url(receiver)))):
        process = start("notify", *args, "--interval", "200ms", env=env)
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(iter(process.stderr.readline, "")), daemon=True)
        reader.start()
        try:
            shown = f"notifying http://127.0.0.1:{receiver.port} of the alert events"
            wait_for(lambda: any(shown in line for line in list(err)) or process.poll() is not None,
                     timeout=TIMEOUT, what="notify to start")
            assert process.poll() is None, "".join(err)
            cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()  # what ps shows
            assert "notify" in cmdline and SECRET not in cmdline and f"127.0.0.1:{receiver.port}" not in cmdline
        finally:
            process.terminate()
            process.wait(timeout=TIMEOUT)
            reader.join(5)
        assert process.returncode == 0, "".join(err)
        assert SECRET not in "".join(err)


def test_the_command_line_wins_over_the_environment_and_two_on_the_command_line_are_refused(
        dsn, db, receiver, failing, tmp_path):
    alert_events(db)
    hook_file = tmp_path / "webhook"
    hook_file.write_text(_url(receiver))
    elsewhere = environment(dsn, LEDGER_WEBHOOK_URL=f"http://127.0.0.1:{failing.port}/{SECRET}")
    from_file = jobledger("notify", "--webhook-file", str(hook_file), "--once", "--after", "0", env=elsewhere)
    assert from_file.returncode == 0, from_file.stderr
    from_option = jobledger("notify", "--webhook", _url(receiver), "--once", "--after", "0", env=elsewhere)
    assert from_option.returncode == 0, from_option.stderr
    assert len(receiver.requests) == 4 and failing.requests == []
    both = jobledger("notify", "--webhook", _url(receiver), "--webhook-file", str(hook_file), "--once", dsn=dsn)
    assert both.returncode == 2 and "--webhook and --webhook-file" in both.stderr, both.stderr
    assert SECRET not in both.stderr and len(receiver.requests) == 4


@pytest.mark.parametrize(("contents", "said"), [
    (None, "cannot read the webhook file {path}: No such file or directory"),
    ("", "the webhook file {path} is empty"),
    ("\n  \n", "the webhook file {path} is empty"),
    (f"http://127.0.0.1:9/{SECRET}\nhttp://127.0.0.1:9/{SECRET}\n", "the webhook file {path} holds 2 lines"),
    (f"hooks.example.com/{SECRET}\n", "the URL in the webhook file {path} is not an http or https URL with a host"),
])
def test_a_webhook_file_that_cannot_be_used_is_refused_in_one_line(dsn, tmp_path, contents, said):
    path = tmp_path / "webhook"
    if contents is not None:
        path.write_text(contents)
    done = jobledger("notify", "--webhook-file", str(path), "--once", dsn=dsn)
    assert done.returncode == 2, done.stderr
    assert said.format(path=path) in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert SECRET not in done.stderr


def test_no_webhook_at_all_is_a_usage_error_naming_the_three_ways(dsn):
    done = jobledger("notify", "--once", dsn=dsn)
    assert done.returncode == 2
    assert "Missing option '--webhook'" in done.stderr
    assert "--webhook-file" in done.stderr and "LEDGER_WEBHOOK_URL" in done.stderr


def test_the_help_tells_the_file_the_variable_and_the_deadline():
    done = jobledger("notify", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "--webhook-file PATH" in text and "LEDGER_WEBHOOK_URL" in text
    assert "(--retries + 1) × --timeout" in text
