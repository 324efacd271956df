"""A job's schedule in plain words: "every 5 minutes", "at 02:30, only on Monday".

The words are the library's (:func:`ledger.schedule_words.describe`), the
ones ``jobledger next`` prints, so the dashboard and the command line say the
same thing.
"""

from __future__ import annotations

from ledger.schedule_words import describe


def in_words(schedule: str | None) -> str:
    """The schedule in words; "no schedule" for a job started only by hand."""
    if schedule is None:
        return "no schedule: started on demand"
    return describe(schedule)
