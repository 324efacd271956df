"""Giving up a call that gets no answer, and the lease deadline's alarm: one watchdog per context.

``Watchdog`` is a thread (the sync client); ``AsyncWatchdog`` does the same
with event-loop timers (the asyncio client). Same methods, so the client's
code that uses them is generated from one source (``ledger/_acompat.py``).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from ledger._acompat import Worker, spawn

__all__ = ["AsyncWatchdog", "Watchdog"]

log = logging.getLogger("ledger")


class Watchdog:
    """Runs an action when a call is still going at its bound; also one alarm. One thread, started on first use.

    ``arm(at, action)`` returns a key; ``disarm(key)`` returns True when the
    action ran (the call was given up). Such an action (:func:`abort`) runs
    under the watchdog's lock, so once ``disarm`` returned it cannot run any
    more (a connection closed after the call is never touched). ``fire()``
    runs the armed actions now. ``alarm(at, action)`` sets the one alarm
    (replacing the previous one; None clears it); it runs outside the lock,
    in the watchdog's thread (a context's lease deadline: it marks the lease
    lost on time even while a heartbeat is stuck). ``close()`` stops the
    thread.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._actions: dict[int, Callable[[], object]] = {}
        self._fired: set[int] = set()
        self._alarm: int | None = None
        self._keys = itertools.count()
        self._thread: Worker | None = None
        self._closed = False

    def arm(self, at: float, action: Callable[[], object]) -> int:
        with self._cond:
            return self._arm(at, action)

    def _arm(self, at: float, action: Callable[[], object]) -> int:
        key = next(self._keys)
        self._actions[key] = action
        heapq.heappush(self._heap, (at, key))
        if self._thread is None and not self._closed:
            self._thread = spawn(self._run, self._name)
        if self._heap[0][1] == key:
            self._cond.notify()  # sooner than what the thread sleeps for; else it need not wake
        return key

    def disarm(self, key: int) -> bool:
        with self._cond:
            self._actions.pop(key, None)
            if key in self._fired:
                self._fired.discard(key)
                return True
            return False

    def alarm(self, at: float | None, action: Callable[[], object] | None = None) -> None:
        with self._cond:
            if self._alarm is not None:
                self._actions.pop(self._alarm, None)
                self._alarm = None
            if at is not None and action is not None and not self._closed:
                self._alarm = self._arm(at, action)

    def fire(self) -> None:
        """Run the actions of the armed calls now (not the alarm)."""
        with self._cond:
            for key in [key for key in self._actions if key != self._alarm]:
                self._run_action(key)

    def close(self) -> None:
        # Not joined: once the actions are cleared under the lock the thread runs
        # none of them, and it ends by itself when it wakes (no wait for it here).
        with self._cond:
            self._closed = True
            self._actions.clear()
            self._alarm = None
            self._cond.notify()

    def _run_action(self, key: int) -> None:
        _give_up(self._actions, self._fired, key)

    def _run(self) -> None:
        while True:
            alarm: Callable[[], object] | None = None
            with self._cond:
                while alarm is None and not self._closed:
                    while self._heap and self._heap[0][1] not in self._actions:
                        heapq.heappop(self._heap)  # disarmed
                    if not self._heap:
                        self._cond.wait()
                        continue
                    at, key = self._heap[0]
                    remaining = at - time.monotonic()
                    if remaining > 0:
                        self._cond.wait(remaining)
                        continue
                    heapq.heappop(self._heap)
                    if key == self._alarm:
                        self._alarm = None
                        alarm = self._actions.pop(key, None)
                    else:
                        self._run_action(key)
                if self._closed:
                    return
            if alarm is not None:
                try:
                    alarm()
                except Exception:
                    log.exception("a lease deadline alarm failed")


class AsyncWatchdog:
    """The event-loop twin of :class:`Watchdog`: the same methods, on timers of the running loop (no thread)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._actions: dict[int, Callable[[], object]] = {}
        self._fired: set[int] = set()
        self._alarm: asyncio.TimerHandle | None = None
        self._keys = itertools.count()

    def arm(self, at: float, action: Callable[[], object]) -> int:
        key = next(self._keys)
        self._actions[key] = action
        delay = max(0.0, at - time.monotonic())
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._run_action, key)
        return key

    def disarm(self, key: int) -> bool:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._actions.pop(key, None)
        if key in self._fired:
            self._fired.discard(key)
            return True
        return False

    def alarm(self, at: float | None, action: Callable[[], object] | None = None) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        if at is not None and action is not None:
            delay = max(0.0, at - time.monotonic())
            self._alarm = asyncio.get_running_loop().call_later(delay, _run_alarm, action)

    def fire(self) -> None:
        """Run the actions of the armed calls now (not the alarm)."""
        for key in list(self._actions):
            self._run_action(key)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._actions.clear()
        self.alarm(None)

    def _run_action(self, key: int) -> None:
        self._timers.pop(key, None)
        _give_up(self._actions, self._fired, key)


def _give_up(actions: dict[int, Callable[[], object]], fired: set[int], key: int) -> None:
    """Run the armed action ``key`` once (a call given up), and remember that it ran."""
    action = actions.pop(key, None)
    if action is None:
        return
    fired.add(key)
    try:
        action()
    except Exception:  # the call ends anyway, by its own error
        log.debug("giving up a call failed", exc_info=True)


def _run_alarm(action: Callable[[], object]) -> None:
    try:
        action()
    except Exception:
        log.exception("a lease deadline alarm failed")
