"""Tables for people (rich) and JSON for scripts, from the ledger's rows.

Times in tables are relative to the database's clock (``now``: the ledger's
only clock), as ``12s ago`` / ``in 3m``; JSON has ISO 8601 timestamps and
durations in seconds.

Data is shown as data: every cell and line made from the ledger's rows is a
``rich.text.Text`` (never markup, so ``[/]`` or ``[link=...]`` in an error is
printed as it is) with its control characters escaped (:func:`cell`,
``ledger.text.visible``); JSON escapes them too (:func:`dumps`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ledger.durations import format_duration
from ledger.models import EVENT_KINDS, Event, JobStatus, PoolStatus
from ledger.states import look
from ledger.text import first_line, visible

STATUS_STYLES = {"success": "green", "failure": "red", "running": "cyan"}
#: Characters of a run's error (its first line) in the runs table.
ERROR_WIDTH = 70


def console(*, stderr: bool = False) -> Console:
    """A console that does not wrap tables into a mess when piped (a wide page instead)."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    return Console(file=stream, width=width, soft_wrap=False)


def fitted(out: Console, build: Callable[[bool], Table]) -> Table:
    """The wide form of a table when it fits the console without wrapping, else the narrow one."""
    table = build(True)
    unbounded = out.options.update_width(10_000)  # measure the natural width, not the clamped one
    if Measurement.get(out, unbounded, table).maximum <= out.width:
        return table
    return build(False)


# -- JSON -----------------------------------------------------------------------

def plain(value: Any) -> Any:
    """``value`` as JSON-ready data: ISO timestamps, durations in seconds, dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    return value


#: DEL and C1, which json.dumps(ensure_ascii=False) leaves as they are (it escapes C0 only).
_JSON_CONTROL = re.compile("[\x7f-\x9f]")


def dumps(value: Any, indent: int | None = None, default: Callable[[Any], Any] | None = None) -> str:
    """``value`` (:func:`plain`) as JSON, non-ASCII text as it is, every control character escaped.

    json.dumps writes C0 (ESC, BEL, newline) as ``\\u001b``...; DEL and C1 (U+007F-U+009F)
    are written ``\\u009b`` here too, so no control character reaches the terminal raw. Outside
    its strings JSON is ASCII without them, so the escape changes no value: a parser reads the
    original text.
    """
    text = json.dumps(plain(value), indent=indent, ensure_ascii=False, default=default)
    return _JSON_CONTROL.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def to_json(value: Any) -> str:
    """Indented JSON (:func:`dumps`): a command's ``--json``."""
    return dumps(value, indent=2)


def json_line(value: Any) -> str:
    """JSON on one line (:func:`dumps`): a stream's object, as ``watch --json`` prints them."""
    return dumps(value)


# -- cells ------------------------------------------------------------------------

def cell(value: Any, style: str = "", limit: int | None = None) -> Text:
    """A cell made of data: ``str(value)`` as text, never markup, its control characters escaped
    (``ledger.text.visible``, cut to ``limit`` characters)."""
    return Text(visible(str(value), limit=limit), style=style)


def _title(title: str | Text | None, style: str) -> Text | None:
    return Text(visible(title), style=style) if isinstance(title, str) else title


def relative(moment: datetime | None, now: datetime) -> str:
    """``12s ago``, ``in 3m``, ``now``; ``-`` for None."""
    if moment is None:
        return "-"
    delta = moment - now
    if abs(delta) < timedelta(milliseconds=100):
        return "now"
    if delta > timedelta(0):
        return f"in {format_duration(delta)}"
    return f"{format_duration(-delta)} ago"


def timestamp(moment: datetime | None) -> str:
    """Local time, to the second (a tenth when the instant has a fraction, as fast demo slots do)."""
    if moment is None:
        return "-"
    local = moment.astimezone()
    if local.microsecond:
        return local.strftime("%Y-%m-%d %H:%M:%S.%f")[:-5]
    return local.strftime("%Y-%m-%d %H:%M:%S")


def _status(status: str | None, reason: str | None = None) -> Text:
    if status is None:
        return Text("-", style="dim")
    label = status if not reason else f"{status} ({reason})"
    return cell(label, style=STATUS_STYLES.get(status, ""))


# -- tables -----------------------------------------------------------------------

COUNTERS = ("runs_started", "successes", "failures", "skipped_overlap", "skipped_backfill", "leases_lost",
            "consecutive_failures")


def with_counters(row: JobStatus) -> JobStatus:
    """The row with its counters at 0 where the view has NULL (a job that never ran has no counter row)."""
    missing = {name: 0 for name in COUNTERS if getattr(row, name) is None}
    return dataclasses.replace(row, **missing) if missing else row  # type: ignore[arg-type]


def _count(value: int | None) -> int:
    return value or 0


def state_text(state: str | None) -> Text:
    """The ledger's state word with its symbol, in its style (:mod:`ledger.states`)."""
    if state is None:
        return Text("-", style="dim")
    found = look(state)
    return Text(f"{found.symbol} {state}", style=found.terminal)


def _state(row: JobStatus) -> Text:
    """The job's state as the ledger says it (``job_status.state``), how long its run has run,
    and who holds its lease."""
    state = state_text(row.state)
    if row.running_run_id is not None and row.running_for is not None:
        state.append(f" {format_duration(row.running_for)}", style=look(row.state).terminal)
    if row.holder is not None:
        token = f" ({row.token})" if row.token is not None else ""
        state.append("\n" + visible(f"{row.holder}{token}"), style="dim")
    return state


def status_table(statuses: Sequence[JobStatus], alerts: Iterable[Mapping[str, Any]], now: datetime,
                 title: str | None = "ledger.job_status", wide: bool = True) -> Table:
    """One row per job; a job with a live alert is marked ⚠ in bold red (the alerts table says which).

    Not ``wide``: without the counters (``--json`` has them all), times under their status.
    Any column but ``job`` may be NULL (a job known only by its lease, one that never ran): ``-`` or 0.
    """
    alerting = {str(alert["job"]) for alert in alerts}
    table = Table(title=_title(title, "bold"), box=box.SIMPLE_HEAVY, title_justify="left",
                  padding=(0, 1), pad_edge=False)
    table.add_column("job", no_wrap=wide, overflow="fold")
    table.add_column("schedule", max_width=28)
    table.add_column("state", min_width=12)
    table.add_column("last run", min_width=9)
    table.add_column("next slot", min_width=7)
    # A job's pool, and the starts its pool refused, only in a ledger that uses pools.
    pools = any(row.pool is not None or _count(row.skipped_pool_full) for row in statuses)
    if pools:
        table.add_column("pool", max_width=20)
    counters: tuple[str, ...] = ("fails", "runs", "ok", "failed", "skipped", "lost") if wide else ("fails",)
    if pools and wide:
        counters += ("pool full",)
    for name in counters:
        table.add_column(name, justify="right", no_wrap=True)
    for row in statuses:
        job = cell(f"⚠ {row.job}", style="bold red") if row.job in alerting else cell(row.job, style="bold")
        schedule = row.schedule or "-"
        if row.schedule and row.time_zone and row.time_zone != "UTC":
            schedule += f" {row.time_zone}"
        last = _status(row.last_status)
        if row.last_started_at is not None:
            last.append(f"{' ' if wide else chr(10)}{relative(row.last_started_at, now)}", style="dim")
        fails = _count(row.consecutive_failures)
        cells: list[Text | str] = [job, cell(schedule), _state(row), last, relative(row.next_slot, now)]
        if pools:
            cells.append(cell(row.pool) if row.pool is not None else Text("-", style="dim"))
        cells.append(Text(str(fails), style="bold red" if fails else ""))
        if wide:
            cells += [str(_count(row.runs_started)), str(_count(row.successes)), str(_count(row.failures)),
                      str(_count(row.skipped_overlap) + _count(row.skipped_backfill)),
                      str(_count(row.leases_lost))]
            if pools:
                cells.append(str(_count(row.skipped_pool_full)))
        table.add_row(*cells)
    return table


def alerts_table(alerts: Sequence[Mapping[str, Any]], now: datetime, title: str | None = "ledger.alerts") -> Table:
    table = Table(title=_title(title, "bold red"), box=box.SIMPLE_HEAVY, title_justify="left", style="red")
    for name in ("alert", "job", "run", "message", "since"):
        table.add_column(name)
    for alert in alerts:
        table.add_row(cell(alert["alert"], style="bold red"), cell(alert["job"]),
                      "-" if alert["run_id"] is None else str(alert["run_id"]), cell(alert["message"]),
                      relative(alert["since"], now))
    return table


def pools_table(rows: Sequence[PoolStatus], now: datetime, title: str | None = "ledger.pool_status") -> Table:
    """One row per pool: size, used (live leases; bold red when at its size: a start now is skipped),
    running, jobs, waiting (jobs a scheduler keeps waiting a place), skipped_pool_full."""
    table = Table(title=_title(title, "bold"), box=box.SIMPLE_HEAVY, title_justify="left",
                  padding=(0, 1), pad_edge=False)
    table.add_column("pool", overflow="fold")
    for name in ("size", "used", "running", "jobs", "waiting", "pool full"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("updated", min_width=8)
    for row in rows:
        full = row.used >= row.size
        table.add_row(cell(row.pool, style="bold"), str(row.size),
                      Text(str(row.used), style="bold red" if full else ""), str(row.running), str(row.jobs),
                      Text(str(row.waiting), style="yellow" if row.waiting else ""), str(row.skipped_pool_full),
                      relative(row.updated_at, now))
    return table


#: A scheduler's status (``lookups.schedulers``): live, stopping (SIGTERM: it starts no run), expired (it died).
SCHEDULER_STYLES = {"live": "green", "stopping": "yellow", "expired": "bold red"}


def schedulers_table(rows: Sequence[Mapping[str, Any]], now: datetime,
                     title: str | None = "ledger.schedulers") -> Table:
    """One row per scheduler (``lookups.schedulers``): live, stopping or expired, the upkeep leader marked."""
    table = Table(title=_title(title, "bold"), box=box.SIMPLE_HEAVY, title_justify="left",
                  padding=(0, 1), pad_edge=False)
    for name, justify in [("scheduler", "left"), ("host", "left"), ("pid", "right"), ("version", "left"),
                          ("jobs", "right"), ("status", "left"), ("upkeep", "left"), ("heartbeat", "left"),
                          ("expires", "left"), ("started", "left")]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        status = str(row["status"])
        table.add_row(cell(row["scheduler"]), cell(row["host"]), str(row["pid"]), cell(row["version"]),
                      str(row["job_count"]), Text(status, style=SCHEDULER_STYLES[status]),
                      Text("leader", style="bold") if row["leader"] else "-",
                      relative(row["heartbeat_at"], now), relative(row["expires_at"], now),
                      relative(row["started_at"], now))
    return table


def runs_table(runs: Sequence[Mapping[str, Any]], now: datetime, title: str | None = None,
               wide: bool = True) -> Table:
    """Runs, newest first; the slot column only when a run has a slot, dates only when ``wide``."""
    slots = any(run["slot"] is not None for run in runs)
    table = Table(title=_title(title, "bold"), box=box.SIMPLE_HEAVY, title_justify="left",
                  padding=(0, 1), pad_edge=False)
    table.add_column("run", justify="right", no_wrap=True)
    table.add_column("status", min_width=7)
    table.add_column("owner", overflow="fold")
    table.add_column("token", justify="right", no_wrap=True)
    if slots:
        table.add_column("slot", min_width=8)
    table.add_column("started", min_width=8)
    table.add_column("took", justify="right", no_wrap=True)
    table.add_column("error", min_width=10)
    for run in runs:
        took = Text(format_duration(run["duration"]))
        if run["status"] == "running":
            took = Text(f"{took}…", style="cyan")
        started = relative(run["started_at"], now)
        if wide:
            started = f"{timestamp(run['started_at'])} ({started})"
        cells: list[Text | str] = [str(run["run_id"]), _status(run["status"], run["failure_reason"]),
                                   cell(run["owner"]), str(run["token"])]
        if slots:
            cells.append(timestamp(run["slot"]))
        cells += [started, took, cell(first_line(run["error"]), limit=ERROR_WIDTH)]
        table.add_row(*cells)
    return table


def skipped_slots_table(rows: Sequence[Mapping[str, Any]], title: str | None = "ledger.skipped_slots") -> Table:
    table = Table(title=_title(title, "bold"), box=box.SIMPLE_HEAVY, title_justify="left")
    for name, justify in [("job", "left"), ("first slot", "left"), ("last slot", "left"),
                          ("slots", "right"), ("reason", "left")]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(cell(row["job"]), timestamp(row["first_slot"]), timestamp(row["last_slot"]),
                      str(row["slot_count"]), cell(row["reason"]))
    return table


# -- events (`jobledger events`, `jobledger watch`) ---------------------------------

KIND_WIDTH = max(len(kind) for kind in EVENT_KINDS)
#: Characters a job's name is padded to at most (a longer name pushes its line's rest right).
JOB_WIDTH = 24


def utc(moment: datetime) -> str:
    """``2026-12-01 14:00:01Z``: an event's time, to the second, in UTC (streams from many hosts agree)."""
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def event_summary(event: Event) -> str:
    """What happened, in a few words after the job: ``run 7 success 3.2s``, ``alert failing: 1 failure in a row``."""
    detail = event.detail
    run = f"run {event.run_id}"
    took = f" {format_duration(timedelta(seconds=float(detail['seconds'])))}" if "seconds" in detail else ""
    error = f": {visible(first_line(str(detail['error'])), limit=ERROR_WIDTH)}" if detail.get("error") else ""
    if event.kind == "run_started":
        words = f"{run} by {detail.get('owner')}, token {detail.get('token')}"
        if detail.get("slot") is not None:
            words += f", slot {utc(datetime.fromisoformat(str(detail['slot'])))}"
        if detail.get("idempotency_key") is not None:
            words += f", key {detail['idempotency_key']}"
        return words
    if event.kind == "run_ended":
        return f"{run} {detail.get('status')}{took}{error}"
    if event.kind == "run_lost":
        return f"{run} lost ({detail.get('reason')}){took}{error}"
    if event.kind == "run_cancelled":
        return f"{run} cancelled{took}{error}"
    if event.kind == "cancel_requested":
        return f"{run} asked to stop (held by {detail.get('owner')}, token {detail.get('token')})"
    if event.kind == "job_paused":
        return f"paused ({detail['reason']})" if detail.get("reason") else "paused"
    if event.kind == "job_resumed":
        return f"resumed (had been paused: {detail['pause_reason']})" if detail.get("pause_reason") else "resumed"
    if event.kind in ("alert_raised", "alert_cleared"):
        about = f" ({run})" if event.run_id is not None else ""
        state = "" if event.kind == "alert_raised" else " cleared"
        return f"alert {detail.get('alert')}{state}{about}: {detail.get('message')}"
    if event.kind == "job_redefined":
        return f"definition from {detail.get('source')} overrode the one from {detail.get('previous_source')}"
    return json.dumps(detail, ensure_ascii=False, default=str)  # a kind added later: its detail as it is


class EventLines:
    """One line per event, ``#12  2026-12-01 14:00:01Z  run_ended  backup  run 7 success 3.2s``.

    The columns are as wide as the widest id and job (up to :data:`JOB_WIDTH`)
    of the events it was made with, and widen, never narrow, as later ones
    come: a stream stays aligned without knowing its end.
    """

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._id_width = 0
        self._job_width = 0
        for event in events:
            self._widen(event)

    def _widen(self, event: Event) -> None:
        self._id_width = max(self._id_width, len(str(event.event_id)))
        self._job_width = min(max(self._job_width, len(event.job)), JOB_WIDTH)

    def line(self, event: Event) -> str:
        """The event's line, its control characters escaped (``ledger.text.visible``): one line, plain text."""
        self._widen(event)
        return visible(f"#{event.event_id:<{self._id_width}}  {utc(event.at)}  {event.kind:<{KIND_WIDTH}}  "
                       f"{event.job:<{self._job_width}}  {event_summary(event)}")


# -- report rows (`jobledger report`) ----------------------------------------------

def cell_text(value: Any) -> str:
    """A cell for people: ISO timestamps, intervals as [d day[s], ]h:mm:ss[.ffffff], JSON for jsonb."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, default=str)
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    return str(value)


def csv_cell(value: Any) -> Any:
    """A CSV cell: empty for NULL, intervals in seconds, else as :func:`cell_text`."""
    if value is None:
        return ""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return cell_text(value)


def rows_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str) -> Table:
    """A query's rows; a column is right-aligned when all its values are numbers, NULL shows dim."""
    table = Table(box=box.SIMPLE_HEAVY, caption=caption, caption_justify="left", min_width=len(caption))
    numeric = [bool(rows) and all(isinstance(row[i], (int, float, Decimal)) and not isinstance(row[i], bool)
                                  for row in rows if row[i] is not None)
               for i in range(len(columns))]
    for name, right in zip(columns, numeric):
        table.add_column(cell(name), justify="right" if right else "left")  # a column's name is the query's
    for row in rows:
        table.add_row(*(Text("null", style="dim") if value is None else cell(cell_text(value)) for value in row))
    return table

