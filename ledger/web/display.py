"""Times and durations as the pages write them (UTC clocks, relative times, short durations).

Times are the database's (``now`` is the transaction's clock), written in
UTC, except a job's slots, which are also written in the job's time zone.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from ledger.durations import format_duration


def clock(when: datetime | None, now: datetime | None = None) -> str:
    """``12:00:03`` on the day of ``now``, else ``2026-11-30 12:00``; UTC."""
    if when is None:
        return ""
    utc = when.astimezone(timezone.utc)
    if now is not None and utc.date() == now.astimezone(timezone.utc).date():
        return utc.strftime("%H:%M:%S")
    return utc.strftime("%Y-%m-%d %H:%M")


def stamp(when: datetime | None) -> str:
    """The full instant, for titles and machine-readable attributes: ``2026-11-30T12:00:03.123456+00:00``."""
    return "" if when is None else when.astimezone(timezone.utc).isoformat()


def relative(when: datetime | None, now: datetime) -> str:
    """``3m ago`` or ``in 4m 10s`` (``now`` within a second: ``now``)."""
    if when is None:
        return ""
    delta = when - now
    if abs(delta) < timedelta(seconds=1):
        return "now"
    words = format_duration(abs(delta))
    return f"in {words}" if delta > timedelta(0) else f"{words} ago"


def duration(value: timedelta | float | None) -> str:
    """``4.2s``, ``1h 20m``; a float is seconds."""
    if value is None:
        return ""
    if isinstance(value, (int, float)):
        value = timedelta(seconds=value)
    return format_duration(value)


def offset(value: timedelta | None) -> str:
    """A UTC offset: ``+02:00``."""
    if value is None:
        return ""
    minutes = int(value.total_seconds()) // 60
    sign = "-" if minutes < 0 else "+"
    hours, rest = divmod(abs(minutes), 60)
    return f"{sign}{hours:02d}:{rest:02d}"


def percent(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio * 100:.0f}%"
