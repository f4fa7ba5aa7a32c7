"""Overlap on the consumer: an item the proxy marked pending (E is computing it) defers the
request until its entry lands, and never forever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from epdctl.cache.stats import read_stats  # noqa: E402
from epdctl.cache.store import Store  # noqa: E402
from tests.connector.driving import (  # noqa: E402
    NS,
    SCHED,
    WORKER,
    feature,
    make,
    produce,
    request,
    step,
)


def test_a_pending_item_defers_until_its_entry_lands(store_root: Path) -> None:
    """Overlap: the proxy marked the item pending (E is computing it), so PD waits for the
    entry instead of encoding; then it loads it like any other entry."""
    t = torch.randn(6, 16)
    sched, worker = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    store = Store(store_root, NS).create()
    assert store.mark_pending("img", time.time() + 60)
    req = request("r1", feature("img", 6))
    for _ in range(3):  # asked again every step while E works
        assert sched.ensure_cache_available(req, 0) is False
        assert sched.has_cache_item("img") is False
    produce(store_root, "img", t)
    store.clear_pending("img")  # the proxy, once E answered
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
    store = Store(store_root, NS).create()
    produce(store_root, "other", torch.randn(6, 16))
    assert store.mark_pending("img", time.time() + (60 if how == "cleared" else 0.05))
    waiting = request("r1", feature("img", 6))
    assert sched.ensure_cache_available(waiting, 0) is False
    # Another request on the same PD is scheduled meanwhile.
    other = request("r2", feature("other", 6))
    assert sched.ensure_cache_available(other, 0) is True and sched.has_cache_item("other")
    if how == "cleared":
        store.clear_pending("img")
    else:
        deadline = store.pending_until("img")
        assert deadline is not None
        while time.time() <= deadline:  # the mark's own deadline, an observed event
            time.sleep(0.01)
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
    store = Store(store_root, NS).create()
    store.mark_pending("img", time.time() + 60)
    req = request("r1", feature("img", 6, media=False))
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.take_unavailable_requests() == set()  # waiting, not failed
    store.clear_pending("img")
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.take_unavailable_requests() == {"r1"}
    sched.shutdown()
