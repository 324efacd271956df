"""Durations on the command line: ``90d``, ``10s``, ``1h30m``, or PostgreSQL interval text.

One parser for every option that takes a duration (``--ttl``, ``--grace``,
``--older-than``), so they all accept the same spellings:

- compact: a number and a unit, repeated: ``500ms``, ``10s``, ``80m``,
  ``1h30m``, ``1.5h``, ``90d``, ``2w``; a bare number is seconds;
- PostgreSQL interval text: ``80 minutes``, ``1 day 2 hours``, ``2 hours 30 mins``,
  ``01:30:00``, ``3 days 04:05:06.5``, ``@ 1 hour``.

Months and years are refused: they have no fixed length (say ``90d``).
"""

from __future__ import annotations

import re
from datetime import timedelta

_SECONDS = {
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6, "microsecond": 1e-6, "microseconds": 1e-6,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3, "millisecond": 1e-3, "milliseconds": 1e-3,
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
    "w": 604800, "week": 604800, "weeks": 604800,
}
_CALENDAR = {"mon", "mons", "month", "months", "y", "yr", "yrs", "year", "years",
             "decade", "decades", "century", "centuries", "millennium", "millennia"}

_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)"
_TERM = re.compile(rf"\s*({_NUMBER})\s*([a-z]*)\s*")
_CLOCK = re.compile(r"\s*([+-]?)(\d+):(\d{1,2})(?::(\d{1,2}(?:\.\d*)?))?\s*$")


def parse_duration(text: str) -> timedelta:
    """The timedelta that ``text`` spells; ValueError with the reason otherwise."""
    source = text.strip().lower()
    if source.startswith("@"):
        source = source[1:]
    if not source:
        raise ValueError("empty duration")
    total = 0.0
    clock = None
    # PostgreSQL allows a trailing hh:mm[:ss] after the unit terms ("3 days 04:05:06").
    parts = source.rsplit(None, 1) if ":" in source else [source]
    if ":" in parts[-1]:
        clock = _CLOCK.match(parts[-1])
        if clock is None:
            raise ValueError(f"cannot read {text!r} as a duration")
        source = parts[0] if len(parts) == 2 else ""
    position = 0
    while position < len(source):
        term = _TERM.match(source, position)
        if term is None or term.end() == position:
            raise ValueError(f"cannot read {text!r} as a duration (try 90d, 10s, 1h30m or '80 minutes')")
        number, unit = float(term.group(1)), term.group(2) or "s"
        if unit in _CALENDAR:
            raise ValueError(f"{text!r}: months and years have no fixed length; give days (e.g. 90d)")
        if unit not in _SECONDS:
            raise ValueError(f"{text!r}: unknown unit {unit!r} (use ms, s, m, h, d, w or their names)")
        total += number * _SECONDS[unit]
        position = term.end()
    if clock is not None:
        sign = -1 if clock.group(1) == "-" else 1
        hours, minutes, seconds = int(clock.group(2)), int(clock.group(3)), float(clock.group(4) or 0)
        total += sign * (hours * 3600 + minutes * 60 + seconds)
    return timedelta(seconds=total)


def positive_duration(text: str) -> timedelta:
    """Like :func:`parse_duration`, and above zero."""
    value = parse_duration(text)
    if value <= timedelta(0):
        raise ValueError(f"{text!r}: the duration must be positive")
    return value


def format_duration(value: timedelta | None) -> str:
    """A short human form: ``45m``, ``1h 20m``, ``2d 3h``, ``1.5s``, ``120ms``; ``""`` for None."""
    if value is None:
        return ""
    seconds = value.total_seconds()
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    if seconds < 1:
        return f"{sign}{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{sign}{seconds:.1f}s".replace(".0s", "s")
    whole = int(round(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    units = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{amount}{unit}" for amount, unit in units if amount][:2]
    return sign + " ".join(shown)
