"""The wait between two attempts, shared by `jobledger run --retries` (``ledger.wrapper``) and
`jobledger notify` (``ledger.webhook``): a backoff doubled after each attempt, with a cap.

It imports nothing of the ledger, so any module may import it.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["BACKOFF_CAP", "backoff_delay"]

BACKOFF_CAP = timedelta(minutes=10)  # the longest wait between two attempts (unless the backoff is longer)


def backoff_delay(backoff: timedelta, retry: int) -> timedelta:
    """The wait before retry number ``retry`` (1 = the first): ``backoff`` doubled each time, at most
    :data:`BACKOFF_CAP`, or ``backoff`` itself when that is longer."""
    return min(backoff * (1 << min(retry - 1, 30)), max(BACKOFF_CAP, backoff))
