"""The few primitives where the asyncio client and the threaded client differ, side by side.

``ledger/aio.py`` is the one source of the Python client; ``tools/async_to_sync.py``
writes ``ledger/client.py`` from it (``make sync``), removing ``async`` and
``await`` and renaming each async name below to its sync twin: ``ALock`` to
``Lock``, ``aspawn`` to ``spawn``, and so on (the table is
``tools/async_to_sync.py``'s ``NAMES``). Each pair has the same signature, so
the code that uses them is the same code. In the source, ``if ASYNC:`` blocks
hold what only the async client does (their ``else:`` is the sync code, taken
by the generator); mypy takes ``ASYNC`` as always true (pyproject.toml).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final, TypeVar

__all__ = [
    "ASYNC",
    "ADeferred",
    "AEvent",
    "ALock",
    "Deferred",
    "Event",
    "Lock",
    "TIMER",
    "adefer",
    "ajoin",
    "ashield",
    "aspawn",
    "await_event",
    "defer",
    "in_task",
    "in_thread",
    "join",
    "keep_result",
    "keep_result_async",
    "spawn",
    "parked",
    "wait_event",
    "Worker",
]

log = logging.getLogger("ledger")

T = TypeVar("T")

ASYNC: Final = True
"""True in the source; the generator resolves ``if ASYNC:`` blocks, so the sync client never reads it."""

ALock = asyncio.Lock
Lock = threading.Lock
AEvent = asyncio.Event
Event = threading.Event


async def await_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True when it is set."""
    try:
        await asyncio.wait_for(event.wait(), max(0.0, timeout))
    except asyncio.TimeoutError:
        return False
    return True


def wait_event(event: threading.Event, timeout: float) -> bool:
    return event.wait(max(0.0, timeout))


def aspawn(target: Callable[[], Coroutine[Any, Any, None]], name: str) -> asyncio.Task[None]:
    """Run ``target`` beside the caller: a task of the running loop."""
    return asyncio.get_running_loop().create_task(target(), name=name)


class Worker:
    """What :func:`spawn` hands back: the target running on a daemon thread; :func:`join` waits for it."""

    def __init__(self, target: Callable[[], None], name: str) -> None:
        self.target = target
        self.name = name
        self.done = threading.Event()
        self.thread: threading.Thread | None = None


_IDLE_SECONDS = 30.0  # how long an idle thread waits for the next target before it exits
_idle: list[tuple[threading.Event, list[Worker]]] = []  # parked threads: (wake-up, mailbox)
_idle_lock = threading.Lock()


def spawn(target: Callable[[], None], name: str) -> Worker:
    """Run ``target`` beside the caller on a daemon thread (it never keeps a process alive).

    Threads are reused: one whose target returned waits a while for the next
    one, so a context (its heartbeat, its watchdog) costs no new thread once
    the process has had as many at once before. Starting a thread costs
    about a millisecond on a busy machine, as much as a ledger call.
    """
    worker = Worker(target, name)
    with _idle_lock:
        parked = _idle.pop() if _idle else None
    if parked is not None:
        wake, mailbox = parked
        mailbox.append(worker)
        wake.set()
    else:
        threading.Thread(target=_serve, args=(worker,), name=name, daemon=True).start()
    return worker


def parked() -> int:
    """How many reusable threads wait for a target (they are alive, but hold nothing); the shared
    :data:`TIMER` counts among them while nothing is set on it."""
    with _idle_lock:
        return len(_idle) + TIMER.idle()


def _serve(worker: Worker | None) -> None:
    wake = threading.Event()
    mailbox: list[Worker] = []
    while worker is not None:
        current = threading.current_thread()
        current.name = worker.name
        worker.thread = current
        try:
            worker.target()
        except BaseException:  # a target's own error handling failed: say so, keep the thread
            log.exception("a background task of the ledger failed")
        finally:
            worker.thread = None
            worker.done.set()
        worker = None
        wake.clear()
        with _idle_lock:
            _idle.append((wake, mailbox))
        if wake.wait(_IDLE_SECONDS):
            worker = mailbox.pop()
        else:
            with _idle_lock:
                if (wake, mailbox) in _idle:
                    _idle.remove((wake, mailbox))
                    return
            wake.wait()  # handed a target just as the wait ended
            worker = mailbox.pop()


class Timer:
    """One thread for the whole process that runs short callbacks at their (monotonic) time: the threaded
    client's watchdogs and deferred heartbeat starts all share it, so a context costs no thread of its own
    until a heartbeat is due (the asyncio client has the loop's timers).

    ``call_at`` returns a key; ``cancel(key)`` returns True when the callback had not run, and then it never
    will. A callback must not block: it shuts a socket down, or hands work to :func:`spawn`. A cancelled
    entry stays in the heap until its time (a pop), so a new one rarely wakes the thread: only one sooner
    than everything else set. The thread starts on first use and ends after ``_IDLE_SECONDS`` with nothing set.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Nothing set and no thread: at first, and in the child of a fork (the thread was not copied)."""
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], object]] = {}
        self._keys = itertools.count()
        self._running = False

    def call_at(self, at: float, callback: Callable[[], object]) -> int:
        with self._cond:
            key = next(self._keys)
            self._live[key] = callback
            heapq.heappush(self._heap, (at, key))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="ledger-timer", daemon=True).start()
            elif self._heap[0][1] == key:
                self._cond.notify()  # sooner than what the thread sleeps for; else it need not wake
            return key

    def cancel(self, key: int) -> bool:
        with self._cond:
            return self._live.pop(key, None) is not None

    def idle(self) -> int:
        """1 while the thread runs with nothing set (it holds nothing), else 0."""
        with self._cond:
            return int(self._running and not self._live)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)  # cancelled
                    if not self._heap:
                        if not self._cond.wait(_IDLE_SECONDS) and not self._heap:
                            self._running = False
                            return
                        continue
                    at, key = self._heap[0]
                    remaining = at - time.monotonic()
                    if remaining > 0:
                        self._cond.wait(remaining)
                        continue
                    heapq.heappop(self._heap)
                    callback = self._live.pop(key)
                    break
            try:
                callback()
            except Exception:
                log.exception("a timer callback of the ledger failed")


TIMER = Timer()
"""The process's one :class:`Timer`."""


def _after_fork_in_child() -> None:
    # A forked child (a prefork server: gunicorn, celery) has none of the parent's threads: without this
    # its spawn would hand targets to parked threads that do not exist, and its timer would never fire.
    # What the parent had set belongs to the parent's contexts.
    global _idle_lock
    _idle_lock = threading.Lock()
    _idle.clear()
    TIMER._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ADeferred:
    """What :func:`adefer` hands back: ``target`` started as a task once its delay is over, unless cancelled."""

    def __init__(self, target: Callable[[], Coroutine[Any, Any, None]], name: str, delay: float) -> None:
        self._target, self._name = target, name
        self.worker: asyncio.Task[None] | None = None
        self._handle = asyncio.get_running_loop().call_later(max(0.0, delay), self._start)

    def _start(self) -> None:
        self.worker = aspawn(self._target, self._name)

    def cancel(self) -> asyncio.Task[None] | None:
        """It will not start any more; the task when it had started already."""
        self._handle.cancel()
        return self.worker


class Deferred:
    """What :func:`defer` hands back: ``target`` run by :func:`spawn` once its delay is over, unless cancelled."""

    def __init__(self, target: Callable[[], None], name: str, delay: float) -> None:
        self._target, self._name = target, name
        self._lock = threading.Lock()
        self._cancelled = False
        self.worker: Worker | None = None
        self._key = TIMER.call_at(time.monotonic() + max(0.0, delay), self._start)

    def _start(self) -> None:
        with self._lock:
            if not self._cancelled:
                self.worker = spawn(self._target, self._name)

    def cancel(self) -> Worker | None:
        with self._lock:
            self._cancelled = True
            TIMER.cancel(self._key)
            return self.worker


def adefer(target: Callable[[], Coroutine[Any, Any, None]], name: str, delay: float) -> ADeferred:
    """Run ``target`` beside the caller in ``delay`` seconds (a task then), unless cancelled first."""
    return ADeferred(target, name, delay)


def defer(target: Callable[[], None], name: str, delay: float) -> Deferred:
    return Deferred(target, name, delay)


def in_task(task: asyncio.Task[None]) -> bool:
    """Whether the caller is ``task`` itself."""
    return task is asyncio.current_task()


def in_thread(worker: Worker) -> bool:
    return worker.thread is threading.current_thread()


async def ajoin(task: asyncio.Task[None]) -> None:
    """Wait for ``task`` to end, unless it is the caller itself."""
    if task is not asyncio.current_task():
        await task


def join(worker: Worker) -> None:
    if worker.thread is not threading.current_thread():
        worker.done.wait()


async def ashield(end: Awaitable[T]) -> T:
    """Finish ``end`` even when the caller is cancelled meanwhile (the end goes on in the background).

    The sync code has no twin: ``ashield(end)`` is just ``end`` there (a
    thread is not cancelled between two statements)."""
    return await asyncio.shield(end)


def keep_result_async(result: object, pending: set[asyncio.Future[Any]]) -> None:
    """An ``on_lost`` callback's result: an awaitable is run in the loop, referenced in ``pending`` until done."""
    if inspect.isawaitable(result):
        future = asyncio.ensure_future(result)
        pending.add(future)
        future.add_done_callback(pending.discard)


def keep_result(result: object, pending: set[Any]) -> None:
    if inspect.isawaitable(result):  # an async callback given to the sync client: it cannot be awaited here
        log.warning("an on_lost callback of the sync client returned an awaitable; it is not awaited")
        close = getattr(result, "close", None)
        if callable(close):
            close()
