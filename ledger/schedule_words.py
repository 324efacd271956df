"""A schedule in plain words: "at 02:30", "every 15 minutes", "at 02:30, only on Monday".

A cron expression (or a macro: ``@hourly``, ...) is said by the
``cron-descriptor`` library; an interval (``15 minutes``, ``1 day``) as
"every 15 minutes". ``jobledger next`` and the dashboard say a schedule with
:func:`describe`, so both say the same thing.
"""

from __future__ import annotations

import re

from cron_descriptor import CasingTypeEnum, ExpressionDescriptor, Options

__all__ = ["MACROS", "describe", "is_cron"]

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
