"""The running proxy's controls (its side: epdctl/proxy/server/admin.py). Drain before a stop
or a restart: the proxy told to send nothing new (to anyone, or to one instance) and waited on
until what it has in flight has ended or the drain's seconds have passed; and a live change's
instances added to its pools and removed from them."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from epdctl.launch.identity import still_ours
from epdctl.launch.state import RunState

DRAIN_S = 30.0
"""How long `down` (and Ctrl+C on a foreground `up`) lets the requests in flight finish."""
GRACE_S = 10.0
"""Seconds the proxy gets to answer past a drain's own (a loaded machine)."""
POLL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Drained:
    """What a drain saw: requests that ended within it, and those it left in flight."""

    finished: int
    in_flight: int

    def line(self, what: str) -> str:
        cut = f", {self.in_flight} still in flight were cut" if self.in_flight else ""
        return f"Drained {what}: {self.finished} request(s) finished{cut}."


def drain_proxy(state: RunState, seconds: float, grace_s: float = GRACE_S) -> Drained | None:
    """The whole proxy: it admits nothing new (a 503 with Retry-After) and answers what it
    has, once nothing is in flight or after `seconds` (0: at once, the count so far). None
    where no proxy of the run answered (not running)."""
    reply = _post(state, "/epdctl/drain", {"seconds": seconds}, seconds + grace_s)
    return None if reply is None else Drained(reply["finished"], reply["in_flight"])


class Drain:
    """The supervisor's drain on Ctrl+C: the proxy told once, then asked each tick how many
    are left, never waited on (the loop goes on watching the instances meanwhile)."""

    def __init__(self, state: RunState, seconds: float) -> None:
        self._state = state
        self._until = time.monotonic() + seconds
        first = drain_proxy(state, 0, POLL_TIMEOUT_S)
        self._before = self._left = first.in_flight if first is not None else 0
        self._is_over = not self._left
        if not self._is_over:
            print(f"epdctl: draining: {self._left} request(s) in flight finish first (up to "
                  f"{seconds:g}s); Ctrl+C again stops at once", file=sys.stderr, flush=True)

    def is_over(self) -> bool:
        if self._is_over:
            return True
        polled = drain_proxy(self._state, 0, POLL_TIMEOUT_S)
        self._left = polled.in_flight if polled is not None else self._left
        if polled is None or not self._left or time.monotonic() >= self._until:
            self._is_over = True
            done = Drained(max(self._before - self._left, 0), self._left)
            print(f"epdctl: {done.line(self._state.name)}", file=sys.stderr, flush=True)
        return self._is_over


def drain_instance(state: RunState, url: str, seconds: float) -> Drained | None:
    """One instance: its role's others take its new requests (or they wait for it)."""
    reply = _post(state, "/epdctl/instances/drain", {"url": url, "seconds": seconds},
                  seconds + GRACE_S)
    return None if reply is None else Drained(reply["finished"], reply["in_flight"])


def admit_instance(state: RunState, url: str) -> bool:
    """The instance takes requests again; False where no proxy answered."""
    return _post(state, "/epdctl/instances/admit", {"url": url}, GRACE_S) is not None


def add_instance(state: RunState, url: str, role: str) -> bool:
    """Route requests of `role` to the instance at `url` too; False where no proxy took it."""
    return _post(state, "/epdctl/instances/add", {"url": url, "role": role}, GRACE_S) \
        is not None


def remove_instance(state: RunState, url: str, seconds: float) -> Drained | None:
    """Drain the instance at `url` (as drain_instance), then route nothing more to it. None
    where no proxy answered or it refused (the last of its role)."""
    reply = _post(state, "/epdctl/instances/remove", {"url": url, "seconds": seconds},
                  seconds + GRACE_S)
    return None if reply is None else Drained(reply["finished"], reply["in_flight"])


def _post(state: RunState, path: str, body: dict[str, Any], timeout_s: float
          ) -> dict[str, Any] | None:
    import httpx

    record = state.records.get(state.proxy.name)
    if record is None or not still_ours(record):
        return None
    key = state.internal_key or state.proxy_api_key
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        reply = httpx.post(f"{state.proxy.url}{path}", json=body, headers=headers,
                           timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    data = reply.json()
    return data if isinstance(data, dict) else None
