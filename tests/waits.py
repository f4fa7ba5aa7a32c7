"""Waiting in a test: on an observed event, with a deadline, never a fixed duration."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 10.0
"""Long enough for an event on a loaded 2-core machine; a test that waits longer is broken."""


async def until(predicate: Callable[[], object], what: str, timeout_s: float = WAIT_S,
                poll_s: float = 0.005) -> None:
    """Until `predicate()` is true, polling on the running loop; fails naming `what` once
    `timeout_s` has gone by (a regression then fails in seconds instead of hanging CI)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s:g}s: {what}")
        await asyncio.sleep(poll_s)


def until_sync(predicate: Callable[[], object], what: str, timeout_s: float = WAIT_S,
               poll_s: float = 0.005) -> None:
    """until(), for a test with no event loop (a background thread's effect on files)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened within {timeout_s:g}s: {what}")
        time.sleep(poll_s)


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0,
             interval_s: float = 0.1) -> Any:
    """Poll until predicate() is truthy; its last value (falsy at the deadline), for a test
    that asserts on it (the EC store's counters flush once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
