"""`jobledger next`: when a schedule fires, in local time and in UTC, with the daylight-saving changes marked.

``jobledger next JOB`` previews a registered job (``ledger.next_slots``),
``jobledger next --schedule S [--tz ZONE]`` an expression before it is
registered (``ledger.preview_slots``): the same evaluator, so the slots are
the ones the ledger will run, its daylight-saving rules included. The
schedule is also said in words, by the ``cron-descriptor`` library for a cron
expression ("at 02:30"), and as "every 15 minutes" for an interval.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

import click
from cron_descriptor import CasingTypeEnum, ExpressionDescriptor, Options
from psycopg.rows import dict_row
from rich.table import Table

from ledger import queries, render
from ledger.cli._options import connect, dsn_option, instant, json_option
from ledger.cli._output import unknown_jobs

MAX_COUNT = 1000  # ledger._max_preview_slots()

# The macros the ledger reads (sql/15_schedule_eval.sql), for the words.
MACROS = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@weekly": "0 0 * * 0",
          "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *"}
# A five-field text is a cron expression when its fields are cron fields (the ledger tries cron first,
# then an interval: '1 day 2 hours 3' is an interval); names only in the month and weekday fields.
_NUMERIC_FIELD = re.compile(r"^[0-9*,/-]+$")
_NAMED_FIELD = re.compile(r"^[0-9a-z*,/-]+$")
_INTERVAL = re.compile(r"^\s*(\d+)\s*([a-z]+)\s*$")
_UNITS = {"ms": "millisecond", "msec": "millisecond", "msecs": "millisecond", "millisecond": "millisecond",
          "milliseconds": "millisecond", "s": "second", "sec": "second", "secs": "second", "second": "second",
          "seconds": "second", "m": "minute", "min": "minute", "mins": "minute", "minute": "minute",
          "minutes": "minute", "h": "hour", "hr": "hour", "hrs": "hour", "hour": "hour", "hours": "hour",
          "d": "day", "day": "day", "days": "day", "w": "week", "week": "week", "weeks": "week",
          "mon": "month", "mons": "month", "month": "month", "months": "month", "y": "year", "yr": "year",
          "yrs": "year", "year": "year", "years": "year"}


def is_cron(schedule: str) -> bool:
    """Whether the ledger reads ``schedule`` as a cron expression (or a macro), not as an interval."""
    text = schedule.strip().lower()
    if text in MACROS:
        return True
    fields = text.split()
    return (len(fields) == 5 and all(_NUMERIC_FIELD.match(field) for field in fields[:3])
            and all(_NAMED_FIELD.match(field) for field in fields[3:]))


def describe(schedule: str) -> str:
    """The schedule in plain words: ``at 02:30``, ``every 15 minutes``."""
    text = schedule.strip()
    if is_cron(text):
        options = Options()
        options.use_24hour_time_format = True
        options.casing_type = CasingTypeEnum.LowerCase
        expression = MACROS.get(text.lower(), text)
        try:
            words: str = ExpressionDescriptor(expression, options).get_description()
        except Exception:  # the library cannot say it: the expression itself, which the ledger accepted
            return f"cron {expression}"
        return words
    interval = _INTERVAL.match(text.lower())
    if interval is not None and interval.group(2) in _UNITS:
        number, unit = int(interval.group(1)), _UNITS[interval.group(2)]
        return f"every {unit}" if number == 1 else f"every {number} {unit}s"
    return f"every {text}"


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
