"""Deadlines by the thousand on one loop timer: what a request's stages and replies are bound
by (seconds to minutes), none of which needs the millisecond.

A loop timer per deadline is dear under uvloop (each is a libuv handle, made, started,
stopped and closed: a fifth of an image request's proxy CPU went to four of them). Here a
deadline is an entry in a bucket of `GRAIN` seconds; one loop timer is armed for the earliest
bucket, and a cancelled deadline only leaves its bucket. A deadline fires at most `GRAIN`
late, never early.

`deadline(seconds)` is `asyncio.timeout(seconds)` on the wheel, as a plain `with`: the block
is cancelled when it runs past, and TimeoutError leaves the block instead of the cancel; a
cancel from elsewhere passes through as CancelledError.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import weakref
from collections.abc import Callable
from types import TracebackType

GRAIN = 0.02
"""Seconds a deadline may fire late (one bucket)."""


class Entry:
    """One deadline on the wheel; `cancel` takes it off."""

    __slots__ = ("when", "_callback", "_bucket")

    def __init__(self, when: float, callback: Callable[[], object],
                 bucket: dict[Entry, None]) -> None:
        self.when = when
        self._callback = callback
        self._bucket: dict[Entry, None] | None = bucket

    def cancel(self) -> None:
        bucket, self._bucket = self._bucket, None
        if bucket is not None:
            bucket.pop(self, None)


class Wheel:
    """A loop's deadlines, in buckets of GRAIN seconds, on one loop timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._buckets: dict[int, dict[Entry, None]] = {}
        self._order: list[int] = []  # a heap of the bucket numbers in _buckets
        self._timer: asyncio.TimerHandle | None = None
        self._armed = math.inf  # the bucket the timer fires for

    def at(self, when: float, callback: Callable[[], object]) -> Entry:
        """Call `callback` at loop time `when` (up to GRAIN later) unless cancelled first."""
        number = math.ceil(when / GRAIN)
        bucket = self._buckets.get(number)
        if bucket is None:
            bucket = self._buckets[number] = {}
            heapq.heappush(self._order, number)
            if number < self._armed:
                self._arm(number)
        entry = Entry(when, callback, bucket)
        bucket[entry] = None
        return entry

    def _arm(self, number: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = number
        self._timer = self._loop.call_at(number * GRAIN, self._fire)

    def _fire(self) -> None:
        self._timer, self._armed = None, math.inf
        now = self._loop.time()
        order = self._order
        while order and order[0] * GRAIN <= now:
            for entry in self._buckets.pop(heapq.heappop(order)):
                entry._bucket = None
                try:
                    entry._callback()
                except Exception as exc:  # one deadline's failure never skips the others
                    self._loop.call_exception_handler(
                        {"message": "deadline callback failed", "exception": exc})
        if order:
            self._arm(order[0])


_wheels: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Wheel] = \
    weakref.WeakKeyDictionary()


_last: Wheel | None = None  # the proxy has one loop: its wheel without a look-up


def wheel(loop: asyncio.AbstractEventLoop | None = None) -> Wheel:
    """The running (or given) loop's wheel."""
    global _last
    loop = loop or asyncio.get_running_loop()
    last = _last
    if last is not None and last._loop is loop:
        return last
    found = _wheels.get(loop)
    if found is None:
        found = _wheels[loop] = Wheel(loop)
    _last = found
    return found


class deadline:  # noqa: N801 (used as asyncio.timeout is)
    """`with deadline(seconds):` inside a task: TimeoutError once the block has run
    `seconds` (to GRAIN later), the block cancelled at that point."""

    __slots__ = ("_seconds", "_task", "_entry", "_cancelling", "_is_expired")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._is_expired = False

    def __enter__(self) -> deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("deadline() should be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        loop = task.get_loop()
        self._entry: Entry | None = wheel(loop).at(loop.time() + self._seconds, self._expire)
        return self

    def _expire(self) -> None:
        self._entry = None
        self._is_expired = True
        self._task.cancel()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        entry = self._entry
        if entry is not None:
            entry.cancel()
            self._entry = None
        # As asyncio.timeout (3.12): ours was the cancel, and no other is pending.
        if self._is_expired and self._task.uncancel() <= self._cancelling \
                and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def expired(self) -> bool:
        """Whether the deadline passed while the block ran."""
        return self._is_expired
