"""A job's schedule in plain words: "every 5 minutes", "at 02:30, only on Monday".

The words are ``jobledger next``'s (:func:`ledger.cli.next.describe`: the
``cron-descriptor`` library for a cron expression, "every 15 minutes" for an
interval), so the dashboard and the command line say the same thing.
"""

from __future__ import annotations

from ledger.cli.next import describe


def in_words(schedule: str | None) -> str:
    """The schedule in words; "no schedule" for a job started only by hand."""
    if schedule is None:
        return "no schedule: started on demand"
    return describe(schedule)
