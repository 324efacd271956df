"""The one way the tests wait: poll a condition until it holds.

No test asserts how long something took, only that it happened: on a busy
machine (the suite runs in parallel, CI shares its cores) everything takes
longer, so the deadline is generous and polling is short. A wait that runs out
fails with what it waited for and the last value the condition returned.

    wait_for(lambda: running_run(db, "nightly"), what="the run to start")

Domain helpers (test_health.wait_state, autofailover's Formation.wait, the
chaos driver's wait_for) are thin wrappers that add what to say on a timeout
(``explain``) or what to do between two polls (``pause``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT = 60.0    # seconds: a condition not reached by then is a hang, not a slow machine
INTERVAL = 0.05   # seconds between two polls


def wait_for(condition: Callable[[], T], timeout: float = TIMEOUT, what: str = "the condition", *,
             interval: float = INTERVAL, explain: Callable[[], str] | None = None,
             pause: Callable[[], object] | None = None) -> T:
    """Call ``condition`` until it returns something true, and return that.

    After ``timeout`` seconds: AssertionError naming ``what``, the last value,
    and ``explain()`` when given. Between two calls: ``pause()`` when given,
    else a sleep of ``interval``. An exception of ``condition`` propagates (a
    condition that may fail while waiting catches its own errors).
    """
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() >= deadline:
            message = f"timed out after {timeout:g} s waiting for {what} (last value: {last!r})"
            if explain is not None:
                message += f"\n{explain()}"
            raise AssertionError(message)
        if pause is not None:
            pause()
        else:
            time.sleep(interval)
