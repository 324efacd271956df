"""`jobledger notify --webhook URL`: every alert raised and cleared, POSTed to a webhook as it happens.

The loop is the one `jobledger watch` follows the events with
(``ledger.tail.Follower``), over the alert events only; the POST and its
retries are ``ledger.webhook``'s. The cursor lives in the process: a
restart starts at the newest event again, unless given ``--after``.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

import click

from ledger.cli._options import DURATION, connect, dsn_option
from ledger.cli._output import say, stopped_by_signals
from ledger.durations import format_duration
from ledger.models import ALERT_KINDS
from ledger.tail import EventCursor, Follower
from ledger.webhook import deliver, shown_url

MAX_RETRIES = 100


def _webhook(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """The option's callback: an http or https URL with a host."""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as error:
        raise click.BadParameter(f"cannot read {value!r} as a URL: {error}", ctx, param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter(f"{value!r} is not an http or https URL with a host "
                                 "(https://hooks.example.com/ledger)", ctx, param)
    return value


@click.command()
@click.option("--webhook", "url", required=True, callback=_webhook, metavar="URL",
              help="Where each alert event is POSTed as JSON (http or https).")
@click.option("--job", default=None, help="Only JOB's alerts.")
@click.option("--interval", type=DURATION, default="30s", show_default=True,
              help="How often it syncs the alerts (ledger.sync_alerts) and reads the new alert events.")
@click.option("--retries", type=click.IntRange(0, MAX_RETRIES), default=5, show_default=True, metavar="N",
              help="Try a failed POST again up to N times (no answer, a timeout, 5xx, 408, 429; any other "
                   "4xx and a redirect are not retried).")
@click.option("--backoff", type=DURATION, default="2s", show_default=True,
              help="Wait before the first retry; doubled after each one, at most 10m (or --backoff when longer).")
@click.option("--timeout", type=DURATION, default="10s", show_default=True,
              help="How long a POST may wait for the connection, and for each read of the answer.")
@click.option("--after", type=click.IntRange(min=0), default=None, metavar="EVENT_ID",
              help="Deliver the alert events after this one first; default: only those after the newest event "
                   "at start.")
@click.option("--once", is_flag=True,
              help="One poll: sync the alerts, deliver what is new, exit; exit code 1 when a delivery was given up.")
@dsn_option
@click.pass_context
def notify(ctx: click.Context, url: str, job: str | None, interval: timedelta, retries: int, backoff: timedelta,
           timeout: timedelta, after: int | None, once: bool, dsn: str) -> None:
    """POST every alert raised and cleared (the alert_raised and alert_cleared events) to a
    webhook, as it happens, until Ctrl-C or SIGTERM (exit 0).

    Each --interval it records the alerts raised and cleared since the last poll
    (`ledger.sync_alerts`) and POSTs each new alert event, oldest first, as JSON
    (Content-Type: application/json): {"event_id", "at", "kind", "job", "run_id",
    "alert", "message", "since", "detail"}. An event is delivered by a 2xx answer,
    or given up after --retries; then the next one goes. One line on stderr per
    attempt. Delivery is at least once: an event may come twice (an answer lost on
    its way back, a restart with --after), so the receiver deduplicates by
    event_id.
    """
    cursor = EventCursor(after or 0, job=job, kinds=ALERT_KINDS)
    follower = Follower(lambda: connect(dsn), cursor, interval=interval.total_seconds(), sync_alerts=True, say=say)
    given_up = 0
    with stopped_by_signals():
        try:
            conn = follower.open()
            if after is None:
                cursor.start_at_newest(conn)
            what = f" of job {job}" if job is not None else ""
            how = "once" if once else f"every {format_duration(interval)}; Ctrl-C to stop"
            say(f"notifying {shown_url(url)} of the alert events{what} after event {cursor.origin} ({how})")
            for batch in [follower.poll()] if once else follower.batches():
                for event in batch:
                    delivery = deliver(url, event, retries=retries, backoff=backoff, timeout=timeout, log=say)
                    if not delivery.delivered:
                        given_up += 1
        finally:
            follower.close()
    if once and given_up:
        ctx.exit(1)


COMMANDS = (notify,)
