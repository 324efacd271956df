"""The ledger's state changes (`ledger.events`): `events` (the recent ones), `watch` (a live tail) and
`configure-events` (what is recorded, notified and kept). `notify`, the webhook, is ``ledger.cli.notify``.

A human line per event (``ledger.render.EventLines``), or JSON: `events --json`
an array, as `runs --json`; `watch --json` one object a line, as
`status --watch --json`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import click

from ledger import render
from ledger.cli._options import DURATION, connect, dsn_option, json_option
from ledger.cli._output import say, stopped_by_signals
from ledger.client import Ledger
from ledger.durations import format_duration
from ledger.models import EVENT_KINDS, Event, EventSettings
from ledger.tail import EventCursor, Follower

MIN_INTERVAL = timedelta(milliseconds=100)  # watch never polls the database faster than this

KIND = click.Choice(EVENT_KINDS)


def job_option(what: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    return click.option("--job", default=None, help=f"Only JOB's {what}.")


def kind_option(command: Callable[..., None]) -> Callable[..., None]:
    return click.option("--kind", "kinds", type=KIND, multiple=True, metavar="KIND",
                        help=f"Only events of this kind; repeat it for more ({', '.join(EVENT_KINDS)}).")(command)


def _nothing(after: int | None, job: str | None, kinds: tuple[str, ...]) -> str:
    """``no events``, with what was asked for: ``no events of job backup after event 12``."""
    words = "no events"
    if kinds:
        words += f" of kind {', '.join(kinds)}"
    if job is not None:
        words += f" of job {job}"
    if after is not None:
        words += f" after event {after}"
    return words


@click.command()
@job_option("events")
@kind_option
@click.option("-n", "--last", "count", type=click.IntRange(min=1), default=20, show_default=True, metavar="N",
              help="How many: the newest N, or with --after the first N after it.")
@click.option("--after", type=click.IntRange(min=0), default=None, metavar="EVENT_ID",
              help="The events after this one, oldest first (to page on: the last id shown).")
@json_option
@dsn_option
def events(job: str | None, kinds: tuple[str, ...], count: int, after: int | None, as_json: bool, dsn: str) -> None:
    """The ledger's recent events (`ledger.events`), oldest first: runs started, ended, lost and
    cancelled, cancels asked for, jobs paused and resumed, alerts raised and cleared.

    `jobledger events --job backup -n 50`; `jobledger watch` follows them live.
    """
    with connect(dsn) as conn:
        rows = Ledger(conn).events(after, job=job, kinds=kinds, limit=count)
    if as_json:
        click.echo(render.to_json(rows))
        return
    if not rows:
        click.echo(_nothing(after, job, kinds))
        return
    lines = render.EventLines(rows)
    for event in rows:
        click.echo(lines.line(event))


@click.command()
@job_option("events")
@kind_option
@click.option("-n", "--last", "count", type=click.IntRange(min=0), default=10, show_default=True, metavar="N",
              help="Start with the newest N events, as tail does (0: only new ones).")
@click.option("--interval", type=DURATION, default="1s", show_default=True,
              help="How often it reads (and syncs the alerts); a notification wakes it sooner.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object a line instead of text.")
@click.option("--no-alerts", is_flag=True,
              help="Do not record the alert events (ledger.sync_alerts); show those that others record.")
@dsn_option
def watch(job: str | None, kinds: tuple[str, ...], count: int, interval: timedelta, as_json: bool, no_alerts: bool,
          dsn: str) -> None:
    """Follow the ledger's events live, as `tail -f` does: the newest --last first, then each new
    one as it is recorded, until Ctrl-C (exit 0).

    Every --interval it records the alerts raised and cleared (`ledger.sync_alerts`: alerts change
    with the clock too; not with --no-alerts, or when the role may not) and reads what is new. While
    events are notified (`jobledger configure-events --notify on`) it LISTENs on `ledger_events` and
    wakes at each event. A connection lost (a restart, a failover) is opened again, and it goes on
    after the last event it read. An event whose transaction committed after a later one's comes
    when it commits: none is skipped.
    """
    if interval < MIN_INTERVAL:
        raise click.BadParameter(f"at least {format_duration(MIN_INTERVAL)}", param_hint="--interval")
    cursor = EventCursor(job=job, kinds=kinds)
    follower = Follower(lambda: connect(dsn), cursor, interval=interval.total_seconds(),
                        sync_alerts=not no_alerts, say=say)
    with stopped_by_signals():
        try:
            newest = cursor.start_at_newest(follower.open(), count)
            lines = render.EventLines(newest)  # as wide as the first screenful, wider when needed

            def show(batch: list[Event]) -> None:
                for event in batch:  # click.echo flushes each line: a pipe gets it at once
                    click.echo(render.json_line(event) if as_json else lines.line(event))

            show(newest)
            for batch in follower.batches():
                show(batch)
        finally:
            follower.close()


def _settings_line(settings: EventSettings) -> str:
    def on(flag: bool) -> str:
        return "on" if flag else "off"

    return (f"events: run events {on(settings.run_events)}, notify {on(settings.notify)}, retention "
            f"{format_duration(settings.retention)}, max events {settings.max_events} "
            f"(changed {render.timestamp(settings.updated_at)})")


@click.command("configure-events")
@click.option("--run-events", type=click.BOOL, default=None, metavar="on|off",
              help="Record run_started and run_ended, two rows a run (the other events are always recorded).")
@click.option("--notify", type=click.BOOL, default=None, metavar="on|off",
              help="Send pg_notify('ledger_events', ...) for every event, so that `watch` and `notify` wake at once.")
@click.option("--retention", type=DURATION, default=None,
              help="Delete events older than this (7d, 30d, ...; at most 36500d).")
@click.option("--max-events", type=int, default=None, metavar="N",
              help="Keep at most the newest N events (1000 to 1000000000).")
@json_option
@dsn_option
def configure_events(run_events: bool | None, notify: bool | None, retention: timedelta | None,
                     max_events: int | None, as_json: bool, dsn: str) -> None:
    """Set what the ledger records as events, whether it notifies them, how long it keeps them
    (`ledger.configure_events`): the options given only. Prints the settings after the change;
    with no option, as they are."""
    with connect(dsn) as conn:
        ledger = Ledger(conn)
        if all(value is None for value in (run_events, notify, retention, max_events)):
            settings = ledger.event_settings()  # a read: no EXECUTE needed, no trigger touched
        else:
            settings = ledger.configure_events(run_events=run_events, notify=notify, retention=retention,
                                               max_events=max_events)
    click.echo(render.to_json(settings) if as_json else _settings_line(settings))


COMMANDS = (events, watch, configure_events)
