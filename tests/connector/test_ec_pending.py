"""Overlap on the consumer: an item the proxy marked pending (E is computing it) defers the
request until its entry lands, and never past the mark's deadline. Time is the scheduler's
clock seam, moved by hand: nothing here depends on how fast the machine runs."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from epdctl.cache.stats import read_stats  # noqa: E402
from epdctl.cache.store import Store  # noqa: E402
from epdctl.connector._scheduler import FIRST_LOOK_S, LAST_LOOK_S  # noqa: E402
from tests.connector.driving import (  # noqa: E402
    NS,
    SCHED,
    WORKER,
    feature,
    make,
    manual_clock,
    produce,
    request,
    step,
)

ENGINE_STEP_S = 0.001  # how often a waiting vLLM engine steps (and asks again)
# Every os call the store's paths may make (counted on the calling thread only: the stats
# writer's own thread flushes when it likes).
STORE_CALLS = ("stat", "lstat", "fstat", "link", "open", "close", "pread", "listdir",
               "scandir", "utime", "unlink", "rename")


def count_store_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    me = threading.get_ident()

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:
                calls[name] += 1
            return real(*args, **kwargs)

        return call

    for name in STORE_CALLS:
        monkeypatch.setattr(os, name, counted(name, getattr(os, name)))
    return calls


def test_a_pending_item_defers_until_its_entry_lands(store_root: Path) -> None:
    """Overlap: the proxy marked the item pending (E is computing it), so PD waits for the
    entry instead of encoding; then it loads it like any other entry."""
    t = torch.randn(6, 16)
    sched, worker = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    clock = manual_clock(sched)
    store = Store(store_root, NS).create()
    assert store.mark_pending("img", clock.wall() + 60)
    req = request("r1", feature("img", 6))
    for _ in range(100):  # asked again every step while E works
        assert sched.ensure_cache_available(req, 0) is False
        assert sched.has_cache_item("img") is False
        clock.advance(ENGINE_STEP_S)
    produce(store_root, "img", t)
    store.clear_pending("img")  # the proxy, once E answered
    clock.advance(LAST_LOOK_S)  # the next look is due within this
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("img") is True
    sched.update_state_after_alloc(req, 0)
    cache: dict = {}
    step(sched, worker, cache)
    assert torch.equal(cache["img"], t)
    sched.request_finished(req)
    sched.shutdown()
    worker.shutdown()
    counts, _ = read_stats(store_root / NS)
    assert (counts["waits"], counts["expired"], counts["hits"], counts["misses"]) == (1, 0, 1, 0)
    assert counts["wait_s"] > 0


def test_an_entry_that_lands_between_the_pin_and_the_mark_is_a_hit(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the overlap opens: PD's pin misses, then E saves and the proxy clears the mark
    before PD looks at it. The entry is there: PD loads it (a hit), it encodes nothing."""
    sched = make(store_root, SCHED, "ec_consumer")
    store = Store(store_root, NS).create()
    assert store.mark_pending("img", time.time() + 60)
    looked = Store.pending_until

    def e_answers_first(self: Store, key: str) -> float | None:
        if not self.has_entry(key):
            produce(store_root, key, torch.randn(6, 16))
            store.clear_pending(key)
        return looked(self, key)

    monkeypatch.setattr(Store, "pending_until", e_answers_first)
    req = request("r1", feature("img", 6))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("img") is True  # loaded from the store, not encoded
    sched.request_finished(req)
    sched.shutdown()
    counts, _ = read_stats(store_root / NS)
    assert (counts["hits"], counts["misses"], counts["expired"]) == (1, 0, 0)


@pytest.mark.parametrize("how", ["cleared", "past-deadline"])
def test_a_pending_item_whose_entry_never_comes_is_encoded_locally(
    store_root: Path, how: str
) -> None:
    """E failed (the proxy cleared the mark without an entry) or the mark's deadline passed
    (the proxy died): PD encodes the item itself, and other requests were never held."""
    sched = make(store_root, SCHED, "ec_consumer")
    clock = manual_clock(sched)
    store = Store(store_root, NS).create()
    produce(store_root, "other", torch.randn(6, 16))
    assert store.mark_pending("img", clock.wall() + (60 if how == "cleared" else 0.05))
    waiting = request("r1", feature("img", 6))
    assert sched.ensure_cache_available(waiting, 0) is False
    # Another request on the same PD is scheduled meanwhile.
    other = request("r2", feature("other", 6))
    assert sched.ensure_cache_available(other, 0) is True and sched.has_cache_item("other")
    clock.advance(0.049)
    assert sched.ensure_cache_available(waiting, 0) is False  # still ahead of the deadline
    if how == "cleared":
        store.clear_pending("img")
        clock.advance(LAST_LOOK_S)
    else:
        clock.advance(0.002)  # just past the mark's deadline
    assert sched.ensure_cache_available(waiting, 0) is True
    assert sched.has_cache_item("img") is False  # encoded locally
    assert sched.take_unavailable_requests() == set()
    sched.shutdown()
    counts, _ = read_stats(store_root / NS)
    assert (counts["waits"], counts["expired"], counts["misses"]) == (1, 1, 1)


def test_a_metadata_only_request_waits_too_and_fails_only_when_nothing_comes(
    store_root: Path,
) -> None:
    sched = make(store_root, SCHED, "ec_consumer")
    clock = manual_clock(sched)
    store = Store(store_root, NS).create()
    store.mark_pending("img", clock.wall() + 60)
    req = request("r1", feature("img", 6, media=False))
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.take_unavailable_requests() == set()  # waiting, not failed
    store.clear_pending("img")
    clock.advance(LAST_LOOK_S)
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.take_unavailable_requests() == {"r1"}
    sched.shutdown()


def test_a_deferred_request_makes_a_bounded_number_of_store_calls_per_second(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiting engine steps every millisecond; the request looks at the store after 1, 2,
    4 ... ms, then every LAST_LOOK_S: a few dozen calls a second, not thousands."""
    sched = make(store_root, SCHED, "ec_consumer")
    clock = manual_clock(sched)
    store = Store(store_root, NS).create()
    assert store.mark_pending("img", clock.wall() + 60)
    req = request("r1", feature("img", 6))
    assert sched.ensure_cache_available(req, 0) is False  # the first look: now waiting
    calls = count_store_calls(monkeypatch)
    looks, total = [], []  # per simulated second
    for _ in range(3):
        calls.clear()
        for _ in range(round(1 / ENGINE_STEP_S)):
            clock.advance(ENGINE_STEP_S)
            assert sched.ensure_cache_available(req, 0) is False
        looks.append(calls["link"])  # one failed pin per look
        total.append(sum(calls.values()))
        assert calls["stat"] >= calls["link"]  # and the mark's stat each time
    steady = round(1 / LAST_LOOK_S)
    ramp = 6  # the looks after 1, 2, 4, 8, 16 and 32 ms
    assert steady - 1 <= looks[0] <= steady + ramp + 1
    assert all(steady - 1 <= n <= steady + 1 for n in looks[1:])
    # At most a link and two stats (the pins dir, the mark) a look: ~60 calls a second,
    # where looking every step made some 3000.
    assert all(t <= 3 * n for t, n in zip(total, looks, strict=True))
    monkeypatch.undo()
    sched.request_finished(req)
    sched.shutdown()


def test_the_wait_ends_at_the_marks_deadline_however_far(store_root: Path) -> None:
    """No cap of the connector's own: the deadline is the mark's (the proxy's encode
    timeout), here 10 minutes; past it, and not before, PD encodes the item itself."""
    sched = make(store_root, SCHED, "ec_consumer")
    clock = manual_clock(sched)
    store = Store(store_root, NS).create()
    wait_s = 600.0
    assert store.mark_pending("img", clock.wall() + wait_s)
    req = request("r1", feature("img", 6))
    started = clock.now
    while not sched.ensure_cache_available(req, 0):
        clock.advance(LAST_LOOK_S / 5)
    waited = clock.now - started
    # (an mtime holds the deadline to the nanosecond, an epoch float to a few hundred)
    assert wait_s - 1e-6 <= waited <= wait_s + LAST_LOOK_S / 5 + FIRST_LOOK_S
    assert sched.has_cache_item("img") is False  # encoded locally
    sched.request_finished(req)
    sched.shutdown()
    counts, _ = read_stats(store_root / NS)
    assert (counts["waits"], counts["expired"]) == (1, 1)
