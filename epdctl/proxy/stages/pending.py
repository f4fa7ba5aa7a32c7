"""The proxy's pending marks (overlap): one per item in the store while any request relies on
an E encoding of it, and one E encoding per item however many overlapped requests share it.

A mark (epdctl.cache.store: an empty file whose mtime is its deadline) tells PD to wait for
the item's entry instead of encoding it. The first overlapped request for an item marks it
and sends it to E; one arriving while that E runs sends it to no encoder, and relies on the
same mark and the same E. Each relying request holds a count; the mark goes when the last
one lets go, which is when the E encoding it relied on is over (answered, failed, timed out
or cancelled): by then E has saved the entry, or none will come and PD encodes the item.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from epdctl.cache.store import Store
from epdctl.proxy.request.inflight import Request
from epdctl.proxy.stages.encode import Encoder, Looked


@dataclass
class Claim:
    """What one overlapped request holds: the items it has E encode, those it shares."""

    mine: list[str] = field(default_factory=list)
    """Items no E is encoding yet: this request sends them to E."""
    shared: set[asyncio.Future[Any]] = field(default_factory=set)
    """The E encodings already running for the request's other items."""
    held: list[str] = field(default_factory=list)
    """The marks this request holds a count of (released together)."""


class PendingMarks:
    """Marks and their counts, and which E encoding each item waits on (one event loop)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._counts: Counter[str] = Counter()
        self._flights: dict[str, asyncio.Future[Any]] = {}  # item -> its running E

    def claim(self, keys: Iterable[str], deadline: float) -> Claim:
        """Mark the items (deadline: epoch seconds) or join the E already encoding them."""
        claim = Claim()
        for key in keys:
            flight = self._flights.get(key)
            if flight is not None and not flight.done():
                claim.shared.add(flight)
            else:
                claim.mine.append(key)
                # (again when marked already: its E is over, and this one's deadline is later)
                if not self.store.mark_pending(key, deadline) and not self._counts[key]:
                    continue  # no mark (refused store): E still encodes it
            self._counts[key] += 1
            claim.held.append(key)
        return claim

    def fly(self, keys: list[str], encoding: asyncio.Future[Any]) -> None:
        """`encoding` is the E run for `keys`: later requests for them share it."""
        for key in keys:
            self._flights[key] = encoding
        encoding.add_done_callback(lambda done: self._landed(keys, done))

    def _landed(self, keys: list[str], done: asyncio.Future[Any]) -> None:
        for key in keys:
            if self._flights.get(key) is done:
                del self._flights[key]

    def release(self, keys: Iterable[str]) -> None:
        """The request no longer relies on these marks; the last one out removes each."""
        for key in keys:
            self._counts[key] -= 1
            if self._counts[key] <= 0:
                del self._counts[key]
                self.store.clear_pending(key)

    def count(self, key: str) -> int:
        """How many requests rely on `key`'s mark now."""
        return self._counts[key]


class Overlap:
    """The E stages running beside PD: each request's marks, its own E and those it shares."""

    def __init__(self, marks: PendingMarks, encoder: Encoder, encode_timeout_s: float) -> None:
        self.marks = marks
        self.encoder = encoder
        self.encode_timeout_s = encode_timeout_s
        self.tasks: set[asyncio.Task[None]] = set()  # kept referenced until done

    def start(self, body: dict[str, Any], looked: Looked, req: Request) -> None:
        """Mark E's items pending and start E beside PD (trace.encoding: until it is over);
        an item another overlapped request already has E encode goes to no encoder."""
        trace = req.trace
        claim = self.marks.claim(looked.unique, time.time() + self.encode_timeout_s)
        trace.notes.append("overlap=1")
        if len(claim.mine) < len(looked.unique):
            trace.notes.append(f"encode_shared={len(looked.unique) - len(claim.mine)}")
        mine = Looked(looked.hits, {k: looked.unique[k] for k in claim.mine}, looked.is_keyed,
                      looked.lookups, looked.skipped)
        own = asyncio.ensure_future(self.encoder.fan_out(body, mine, req))
        self.marks.fly(claim.mine, own)
        task = trace.encoding = asyncio.ensure_future(self._rely(own, claim))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _rely(self, own: asyncio.Future[Any], claim: Claim) -> None:
        """Until this request's own E and those it shares are over; then let go its marks."""
        try:
            await own  # cancelling this task cancels its own E too, never a shared one
            if claim.shared:
                await asyncio.wait(claim.shared)
        finally:
            self.marks.release(claim.held)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def settle(self) -> None:
        """Until every E stage beside PD is over (their requests' lines are logged by then:
        each line waits on its stage in a callback that runs before this wakes)."""
        while self.tasks:
            await asyncio.wait(set(self.tasks))
