"""Giving up a call that gets no answer, and the lease deadline's alarm: one watchdog per context.

``Watchdog`` keeps its times on the process's one timer thread (the sync
client); ``AsyncWatchdog`` does the same with event-loop timers (the asyncio
client). Same methods, so the client's code that uses them is generated
from one source (``ledger/_acompat.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable

from ledger._acompat import TIMER, spawn

__all__ = ["AsyncWatchdog", "Watchdog"]

log = logging.getLogger("ledger")


class Watchdog:
    """Runs an action when a call is still going at its bound; also one alarm. Its times are kept by the
    process's one timer thread (:data:`ledger._acompat.TIMER`), so a context has no thread of its own.

    ``arm(at, action)`` returns a key; ``disarm(key)`` returns True when the
    action ran (the call was given up). Such an action (:func:`abort`) runs
    under the watchdog's lock, so once ``disarm`` returned it cannot run any
    more (a connection closed after the call is never touched); it only
    shuts a socket down, so the timer's thread can run it. ``fire()`` runs
    the armed actions now. ``alarm(at, action)`` sets the one alarm
    (replacing the previous one; None clears it); it runs on a thread of its
    own (:func:`spawn`), never the timer's: a context's lease deadline, which
    marks the lease lost on time even while a heartbeat is stuck, and calls
    the caller's ``on_lost``. ``close()`` clears them all.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._timers: dict[int, int] = {}  # armed key -> the timer's key
        self._actions: dict[int, Callable[[], object]] = {}
        self._fired: set[int] = set()
        self._alarm: int | None = None  # the timer's key
        self._keys = itertools.count()
        self._closed = False

    def arm(self, at: float, action: Callable[[], object]) -> int:
        with self._lock:
            key = next(self._keys)
            self._actions[key] = action
            self._timers[key] = TIMER.call_at(at, lambda: self._run_action(key))
            return key

    def disarm(self, key: int) -> bool:
        with self._lock:
            timer = self._timers.pop(key, None)
            if timer is not None:
                TIMER.cancel(timer)
            self._actions.pop(key, None)
            if key in self._fired:
                self._fired.discard(key)
                return True
            return False

    def alarm(self, at: float | None, action: Callable[[], object] | None = None) -> None:
        with self._lock:
            if self._alarm is not None:
                TIMER.cancel(self._alarm)
                self._alarm = None
            if at is not None and action is not None and not self._closed:
                name = f"{self._name}:alarm"
                self._alarm = TIMER.call_at(at, lambda: spawn(lambda: _run_alarm(action), name))

    def fire(self) -> None:
        """Run the actions of the armed calls now (not the alarm)."""
        with self._lock:
            for key in list(self._actions):
                self._give_up(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for timer in self._timers.values():
                TIMER.cancel(timer)
            self._timers.clear()
            self._actions.clear()
            if self._alarm is not None:
                TIMER.cancel(self._alarm)
                self._alarm = None

    def _run_action(self, key: int) -> None:
        with self._lock:
            self._give_up(key)

    def _give_up(self, key: int) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            TIMER.cancel(timer)  # run now (fire): not again at its time
        _give_up(self._actions, self._fired, key)


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
