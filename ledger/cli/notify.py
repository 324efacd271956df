"""`jobledger notify --webhook URL`: every alert raised and cleared, POSTed to a webhook as it happens.

The URL: ``--webhook URL``, or ``--webhook-file PATH`` (the file holds it on
one line), else ``LEDGER_WEBHOOK_URL``; the last two keep it out of the
command line, which ``ps`` shows to every user. Both options at once is a
usage error; either wins over the variable (as ``--dsn`` over
``LEDGER_DSN``). Nothing prints more of it than its scheme, host and port.

The loop is the one `jobledger watch` follows the events with
(``ledger.tail.Follower``), over the alert events only; the POST and its
retries are ``ledger.webhook``'s. The cursor lives in the process: a
restart starts at the newest event again, unless given ``--after``, or
``--state-file`` (:class:`StateFile`), where the position is kept from one
run to the next.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ledger.cli._options import DURATION, connect, dsn_option
from ledger.cli._output import OneLineUsageError, say, stopped_by_signals
from ledger.durations import format_duration
from ledger.models import ALERT_KINDS
from ledger.tail import EventCursor, Follower, Gap
from ledger.webhook import deliver, shown_url, url_problem

MAX_RETRIES = 100


def _is_id(value: Any, least: int) -> bool:
    """An event id (or a transaction id) in a state file: an integer, not a boolean, of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _gap(item: Any, after: int) -> Gap | None:
    """A gap as a state file keeps it, or None when it is not one (ids from 1 to ``after``)."""
    if not isinstance(item, dict) or set(item) != {"first", "last", "seen_at", "horizon"}:
        return None
    first, last, seen_at, horizon = item["first"], item["last"], item["seen_at"], item["horizon"]
    if not (_is_id(first, 1) and _is_id(last, first) and last <= after and (horizon is None or _is_id(horizon, 0))):
        return None
    try:
        seen = datetime.fromisoformat(seen_at) if isinstance(seen_at, str) else None
    except ValueError:
        return None
    if seen is None or seen.tzinfo is None:
        return None
    return Gap(first, last, seen.timestamp(), horizon)


WEBHOOK_VARIABLE = "LEDGER_WEBHOOK_URL"


def _webhook_url(ctx: click.Context, url: str | None, webhook_file: Path | None) -> str:
    """The webhook's URL, from --webhook, --webhook-file or LEDGER_WEBHOOK_URL, checked; a usage error
    (exit 2, one line that shows no more of the URL than its scheme, host and port) when it cannot be one."""
    from_option = url is not None and ctx.get_parameter_source("url") is not ParameterSource.ENVIRONMENT
    if from_option and webhook_file is not None:
        raise OneLineUsageError("--webhook and --webhook-file both give the webhook: give one")
    if webhook_file is not None:
        url, subject = _read_webhook_file(webhook_file), f"the URL in the webhook file {webhook_file}"
    elif url is not None:
        subject = "the --webhook URL" if from_option else WEBHOOK_VARIABLE
    else:
        raise OneLineUsageError(f"Missing option '--webhook': give the URL as --webhook URL, --webhook-file PATH "
                                f"(the URL on one line) or {WEBHOOK_VARIABLE} (the last two keep it out of the "
                                "command line, which ps shows)")
    url = url.strip()
    shown = shown_url(url)
    problem = url_problem(url, f"{subject} ({shown})" if shown else subject)
    if problem is not None:
        raise OneLineUsageError(problem)
    return url


def _read_webhook_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise OneLineUsageError(f"cannot read the webhook file {path}: {why}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise OneLineUsageError(f"the webhook file {path} is empty: write the webhook's URL in it")
    if len(lines) > 1:
        raise OneLineUsageError(f"the webhook file {path} holds {len(lines)} lines: write the webhook's URL "
                                "in it on one line, alone")
    return lines[0]


class StateFile:
    """Where a notifier keeps its position from one run to the next:
    ``{"after": EVENT_ID, "gaps": [{"first", "last", "seen_at", "horizon"}, ...], "updated_at": ...}``.

    ``after``: every alert event up to it has been handled (delivered or given
    up), or was before the start, except those in ``gaps``: the ranges of ids
    at or below ``after`` the cursor still waited for (``ledger.tail``: taken
    by a transaction that had not committed yet), with when it first saw
    each and the snapshot bound it settles by (a transaction id). The next
    run starts after ``after`` and waits for the gaps again, for as long as
    the first run would have, so an alert event that commits late, even
    while no notifier runs, is still sent. Written whole each time (a
    temporary file in the same directory, fsync, ``os.replace``), so a crash
    leaves the old state or the new one, never half of one. A file without
    ``gaps`` (an older notifier's) has none.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.after: int | None = None
        """The position last written (or read), None before either."""
        self.gaps: list[Gap] = []
        """The ranges of ids at or below :attr:`after` still waited for, as last written (or read)."""

    def load(self) -> int | None:
        """The position the file holds; None when there is no file. One that cannot be read is a usage error."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as error:
            raise self._unreadable(str(error)) from None
        try:
            state: Any = json.loads(text)
        except ValueError as error:
            raise self._unreadable(f"not JSON ({error})") from None
        after = state.get("after") if isinstance(state, dict) else None
        if not isinstance(after, int) or not _is_id(after, 0):
            raise self._unreadable('not an object with "after": a non-negative event_id')
        kept = state.get("gaps", [])
        gaps = [_gap(item, after) for item in kept] if isinstance(kept, list) else [None]
        if None in gaps:
            raise self._unreadable(f'"gaps" is not a list of {{"first", "last", "seen_at", "horizon"}} objects, '
                                   f"ranges of event ids at or below {after}")
        self.after, self.gaps = after, [gap for gap in gaps if gap is not None]
        return after

    def _unreadable(self, why: str) -> OneLineUsageError:
        return OneLineUsageError(f"cannot read the state file {self.path}: {why}; fix it, or remove it to start at "
                                 "the newest event (or --after EVENT_ID)")

    def start(self, cursor: EventCursor) -> None:
        """Write where ``cursor`` starts (after its origin): the file exists from the start, and can be written."""
        try:
            self._write(cursor.origin, cursor.gap_ranges(cursor.origin))
        except OSError as error:
            raise OneLineUsageError(f"cannot write the state file {self.path}: {error}") from None

    def advance(self, handled: int, cursor: EventCursor) -> None:
        """Every alert event up to ``handled`` is handled but those ``cursor`` still waits for: write it when
        it moves the position on or a gap closed. A failed write is told, and the notifier goes on (a restart
        then sends again what came after the state the file holds)."""
        after = max(handled, self.after or 0)  # a late event of a gap: the position stays, the gap closes
        gaps = cursor.gap_ranges(after)
        if after == self.after and gaps == self.gaps:
            return
        try:
            self._write(after, gaps)
        except OSError as error:
            held = f"event {self.after}" if self.after is not None else "nothing"
            say(f"could not write the state file {self.path} ({error}); it still holds {held}")

    def _write(self, after: int, gaps: list[Gap]) -> None:
        kept = [{"first": gap.first, "last": gap.last, "horizon": gap.horizon,
                 "seen_at": datetime.fromtimestamp(gap.seen, timezone.utc).isoformat()} for gap in gaps]
        text = json.dumps({"after": after, "gaps": kept, "updated_at": datetime.now(timezone.utc).isoformat()}) + "\n"
        directory = self.path.parent
        fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self.path)
        except BaseException:  # Ctrl-C too: no temporary file left behind
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        self.after, self.gaps = after, gaps
        with contextlib.suppress(OSError):  # the rename itself, on disk (not every system opens a directory)
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


@click.command()
@click.option("--webhook", "url", envvar=WEBHOOK_VARIABLE, show_envvar=True, default=None, metavar="URL",
              help="Where each alert event is POSTed as JSON (http or https). The command line is shown by ps: "
                   "prefer --webhook-file, or the variable.")
@click.option("--webhook-file", "webhook_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="PATH",
              help=f"Read the webhook's URL from PATH (one line); it wins over {WEBHOOK_VARIABLE}, and "
                   "--webhook with it is a usage error.")
@click.option("--job", default=None, help="Only JOB's alerts.")
@click.option("--interval", type=DURATION, default="30s", show_default=True,
              help="How often it syncs the alerts (ledger.sync_alerts) and reads the new alert events.")
@click.option("--retries", type=click.IntRange(0, MAX_RETRIES), default=5, show_default=True, metavar="N",
              help="Try a failed POST again up to N times (no answer, a timeout, 5xx, 408, 429; any other "
                   "4xx and a redirect are not retried).")
@click.option("--backoff", type=DURATION, default="2s", show_default=True,
              help="Wait before the first retry; doubled after each one, at most 10m (or --backoff when longer).")
@click.option("--timeout", type=DURATION, default="10s", show_default=True,
              help="How long one attempt may take in all: connecting, sending, and the whole answer; past it "
                   "the attempt is a timeout, tried again.")
@click.option("--after", type=click.IntRange(min=0), default=None, metavar="EVENT_ID",
              help="Deliver the alert events after this one first; default: only those after the newest event "
                   "at start, or after the position in --state-file.")
@click.option("--state-file", "state_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              metavar="PATH",
              help='Keep the position in PATH (JSON: {"after": EVENT_ID, "gaps": [...], "updated_at": TIME}; '
                   "gaps: ids below it still waited for), written at start and after each event delivered or "
                   "given up: a restart, or the next --once, sends what came since, and what commits late in a "
                   "gap. When PATH exists it starts after its event (--after with it is a usage error); one "
                   "that cannot be read: exit 2.")
@click.option("--once", is_flag=True,
              help="One poll: sync the alerts, deliver what is new, exit; exit code 1 when a delivery was given up.")
@dsn_option
@click.pass_context
def notify(ctx: click.Context, url: str | None, webhook_file: Path | None, job: str | None, interval: timedelta,
           retries: int, backoff: timedelta, timeout: timedelta, after: int | None, state_path: Path | None,
           once: bool, dsn: str) -> None:
    """POST every alert raised and cleared (the alert_raised and alert_cleared events) to a
    webhook, as it happens, until Ctrl-C or SIGTERM (exit 0).

    Each --interval it records the alerts raised and cleared since the last poll
    (`ledger.sync_alerts`) and POSTs each new alert event, oldest first, as JSON
    (Content-Type: application/json): {"event_id", "at", "kind", "job", "run_id",
    "alert", "message", "since", "detail"}. An event is delivered by a 2xx answer,
    or given up after --retries; then the next one goes, so a receiver that does not
    answer holds the next alerts back at most (--retries + 1) × --timeout plus the
    backoffs. One line on stderr per attempt, the URL shown as its scheme, host and
    port only (a user and password in it are sent as basic authentication).
    Delivery is at least once: an event may come twice (an answer lost on its way
    back, a restart with --after, a stop during its delivery), so the receiver
    deduplicates by event_id.
    """
    url = _webhook_url(ctx, url, webhook_file)
    state = StateFile(state_path) if state_path is not None else None
    saved = state.load() if state is not None else None
    if saved is not None and after is not None:
        raise OneLineUsageError(f"--after {after} and the state file {state_path} (after event {saved}) both say "
                                f"where to start: drop --after to go on after event {saved}, or remove the file "
                                f"to start after event {after}")
    start = saved if saved is not None else after
    cursor = EventCursor(start or 0, job=job, kinds=ALERT_KINDS, gaps=state.gaps if state is not None else ())
    follower = Follower(lambda: connect(dsn), cursor, interval=interval.total_seconds(), sync_alerts=True, say=say)
    given_up = 0
    with stopped_by_signals():
        try:
            conn = follower.open()
            if start is None:
                cursor.start_at_newest(conn)
            if state is not None:
                state.start(cursor)
            what = f" of job {job}" if job is not None else ""
            how = "once" if once else f"every {format_duration(interval)}; Ctrl-C to stop"
            kept = f"position kept in {state_path}; " if state is not None else ""
            say(f"notifying {shown_url(url)} of the alert events{what} after event {cursor.origin} ({kept}{how})")
            for batch in [follower.poll()] if once else follower.batches():
                for event in batch:
                    delivery = deliver(url, event, retries=retries, backoff=backoff, timeout=timeout, log=say)
                    if not delivery.delivered:
                        given_up += 1
                    if state is not None:
                        state.advance(event.event_id, cursor)
                if state is not None:  # every alert event the reads got so far is handled
                    state.advance(cursor.position, cursor)
        finally:
            follower.close()
    if once and given_up:
        ctx.exit(1)


COMMANDS = (notify,)
