"""`jobledger next`: when a schedule fires, in local time and in UTC, with the daylight-saving changes marked.

``jobledger next JOB`` previews a registered job (``ledger.next_slots``),
``jobledger next --schedule S [--tz ZONE]`` an expression before it is
registered (``ledger.preview_slots``): the same evaluator, so the slots are
the ones the ledger will run, its daylight-saving rules included. The
schedule is also said in words (:func:`ledger.schedule_words.describe`, as the
dashboard says it): "at 02:30" for a cron expression, "every 15 minutes" for
an interval.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import click
from psycopg.rows import dict_row
from rich.table import Table

from ledger import queries, render
from ledger.cli._options import connect, dsn_option, instant, json_option
from ledger.cli._output import unknown_jobs
from ledger.schedule_words import describe

MAX_COUNT = 1000  # ledger._max_preview_slots()


def _offset(value: timedelta) -> str:
    """``+02:00``, ``-03:30``, ``+05:45``."""
    minutes = int(value.total_seconds()) // 60
    sign = "-" if minutes < 0 else "+"
    hours, rest = divmod(abs(minutes), 60)
    return f"{sign}{hours:02d}:{rest:02d}"


def _table(slots: list[dict[str, Any]], time_zone: str) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column(render.cell(f"local time ({time_zone})"), no_wrap=True)
    table.add_column("UTC", no_wrap=True)
    table.add_column("daylight saving")
    for number, row in enumerate(slots, 1):
        local: datetime = row["local_time"]
        slot: datetime = row["slot"]
        note = row["dst_change"]
        table.add_row(str(number),
                      f"{local:%a %Y-%m-%d %H:%M}{':%02d' % local.second if local.second else ''} "
                      f"{_offset(row['utc_offset'])}",
                      f"{slot.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S}Z"
                      if slot.second or slot.microsecond else f"{slot.astimezone(timezone.utc):%Y-%m-%d %H:%M}Z",
                      render.cell(note, style="yellow") if note else "")
    return table


@click.command("next")
@click.argument("job", required=False)
@click.option("--schedule", help="A schedule not registered yet (cron or interval, as `jobledger register` takes).")
@click.option("--tz", "time_zone", default=None, help="With --schedule: its time zone.  [default: UTC]")
@click.option("-n", "--count", type=click.IntRange(1, MAX_COUNT), default=10, show_default=True,
              help="How many slots.")
@click.option("--after", callback=instant, metavar="TIME",
              help="The slots after TIME (ISO 8601, UTC without an offset); default: now.")
@json_option
@dsn_option
def next_slots(job: str | None, schedule: str | None, time_zone: str | None, count: int, after: datetime | None,
               as_json: bool, dsn: str) -> None:
    """The next slots of JOB, or of --schedule (in --tz), in local time and UTC, with the
    daylight-saving changes marked, and the schedule in words.

    `jobledger next nightly`, `jobledger next --schedule '30 2 * * *' --tz Europe/Berlin -n 10`.
    A time that the clock skips or repeats runs as the ledger runs it (docs: Daylight saving).
    """
    if (job is None) == (schedule is None):
        raise click.UsageError("give JOB or --schedule, not both" if job is not None else "give JOB or --schedule")
    if job is not None and time_zone is not None:
        raise click.UsageError(f"--tz goes with --schedule: job {job} has its own time zone")
    paused = False
    with connect(dsn) as conn:
        if job is not None:
            registered = conn.execute(queries.JOB_SCHEDULE, {"job": job}).fetchone()
            if registered is None:
                raise unknown_jobs([job])
            schedule, time_zone, paused = registered
            if schedule is None:
                raise click.ClickException(f"job {job} has no schedule (`jobledger register {job} --schedule ...`)")
            query, params = queries.NEXT_SLOTS, {"job": job, "count": count, "after": after}
        else:
            time_zone = time_zone if time_zone is not None else "UTC"
            query = queries.PREVIEW_SLOTS
            params = {"schedule": schedule, "time_zone": time_zone, "count": count, "after": after}
        with conn.cursor(row_factory=dict_row) as cur:
            slots = cur.execute(query, params).fetchall()
    assert schedule is not None and time_zone is not None
    words = describe(schedule)
    if as_json:
        click.echo(render.to_json({"job": job, "schedule": schedule, "time_zone": time_zone, "paused": paused,
                                   "description": words, "slots": slots}))
        return
    out = render.console()
    what = f"job {job}: " if job is not None else ""
    out.print(render.cell(f"{what}{schedule!r} in {time_zone}: {words}"))
    if paused:
        out.print(f"paused: none of these runs until `jobledger resume {job}`", markup=False, highlight=False)
    if not slots:
        out.print("no slot before 2200-01-01 UTC", markup=False, highlight=False)
        return
    out.print(_table(slots, time_zone))


COMMANDS = (next_slots,)
