"""The wait between two attempts: ``--backoff`` doubled after each one, at most 10 minutes.

``jobledger run --retries`` (``ledger.wrapper``) waits it between two runs of
a failed slot, ``jobledger notify`` (``ledger.webhook``) between two POSTs of
an event: one rule, so both options say the same thing.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["BACKOFF_CAP", "backoff_delay"]

BACKOFF_CAP = timedelta(minutes=10)
"""The longest wait between two attempts (unless the backoff itself is longer)."""


def backoff_delay(backoff: timedelta, retry: int) -> timedelta:
    """The wait before retry number ``retry`` (1 = the first): ``backoff`` doubled each time, at most
    :data:`BACKOFF_CAP`, or ``backoff`` itself when that is longer."""
    return min(backoff * (1 << min(retry - 1, 30)), max(BACKOFF_CAP, backoff))
