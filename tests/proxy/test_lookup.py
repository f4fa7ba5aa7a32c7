"""The store index and hit checks (epdctl.proxy.stages.lookup) off the event loop: the scan and a
hit's file-system calls run in a worker thread, a miss costs the loop a set lookup, and the
answers stay right (a hit is found, a vanished entry is a miss, E's keys stay indexed)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epdctl.cache.sidecar import read_meta
from epdctl.cache.store import Store
from epdctl.proxy.request.parse import MediaItem
from epdctl.proxy.stages import lookup as lookup_module
from epdctl.proxy.stages.lookup import StoreLookup

pytestmark = pytest.mark.anyio
NAMESPACE = "demo-0123456789ab"
GRID = {"image_grid_thw": [1, 4, 4]}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path, NAMESPACE).create()


def publish(store: Store, key: str) -> None:
    store.publish(key, bytes(16 * 4 * 4), dtype="float32", shape=(16, 4))


def item(uuid: str) -> MediaItem:
    return MediaItem(0, 0, "image_url", "image", "data:image/png;base64,AA==", uuid)


def threads_of(obj: Any, name: str) -> list[int]:
    """Wrap obj.name to note the thread of every call; the list of thread ids."""
    seen: list[int] = []
    real: Callable[..., Any] = getattr(obj, name)

    def noting(*args: Any, **kwargs: Any) -> Any:
        seen.append(threading.get_ident())
        return real(*args, **kwargs)

    setattr(obj, name, noting)
    return seen


async def test_a_hit_is_found_with_its_checks_in_a_worker_thread(store):
    publish(store, "k1")
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)
    checks = threads_of(lookup.store, "check")
    touches = threads_of(lookup.store, "touch")
    hits = await lookup.find_off_loop({"k1": item("k1")}, needs_metadata=False)
    assert list(hits) == ["k1"] and hits["k1"].key == "k1"
    loop_thread = threading.get_ident()
    assert len(checks) == 1 and checks[0] != loop_thread
    assert len(touches) == 1 and touches[0] != loop_thread


async def test_a_vanished_entry_is_a_miss_and_leaves_the_index(store):
    publish(store, "k1")
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)
    os.unlink(store.entry_path("k1"))
    assert await lookup.find_off_loop({"k1": item("k1")}, needs_metadata=False) == {}
    checks = threads_of(lookup.store, "check")
    assert await lookup.find_off_loop({"k1": item("k1")}, needs_metadata=False) == {}
    assert checks == []  # dropped from the index: no second look on disk


async def test_a_miss_of_the_index_starts_no_thread(store, monkeypatch):
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)

    def no_thread(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a miss of the index went to a thread")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    checks = threads_of(lookup.store, "check")
    assert await lookup.find_off_loop({"k9": item("k9")}, needs_metadata=False) == {}
    assert checks == []


async def test_the_scan_lists_entries_in_a_worker_thread_and_indexes_them(store, monkeypatch):
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)
    publish(store, "k2")  # after the first scan: not indexed yet
    assert await lookup.find_off_loop({"k2": item("k2")}, needs_metadata=False) == {}
    monkeypatch.setattr(lookup_module, "SCAN_INTERVAL_S", 0.0)
    listed = asyncio.Event()
    loop = asyncio.get_running_loop()
    lists = threads_of(lookup.store, "entry_stems")
    real_apply = lookup._apply

    def applied(stems: set[str]) -> None:
        real_apply(stems)
        loop.call_soon(listed.set)

    monkeypatch.setattr(lookup, "_apply", applied)
    scans = asyncio.ensure_future(lookup.run_scans())
    try:
        await listed.wait()
    finally:
        scans.cancel()
    assert lists and threading.get_ident() not in lists
    assert list(await lookup.find_off_loop({"k2": item("k2")}, needs_metadata=False)) == ["k2"]


async def test_keys_e_answers_for_during_a_scan_stay_indexed(store, monkeypatch):
    """A scan's listing may predate E's answer: the key E answered for meanwhile is kept in
    the new index, and its metadata is still found before the scan writes it."""
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)
    monkeypatch.setattr(lookup_module, "SCAN_INTERVAL_S", 0.0)
    listing, release, applied = threading.Event(), threading.Event(), asyncio.Event()
    real_stems = lookup.store.entry_stems
    loop = asyncio.get_running_loop()

    def slow_stems() -> set[str]:
        stems = real_stems()  # before E's entry is in
        listing.set()
        release.wait(30)
        return stems

    real_apply = lookup._apply

    def noting_apply(stems: set[str]) -> None:
        real_apply(stems)
        loop.call_soon(applied.set)

    monkeypatch.setattr(lookup.store, "entry_stems", slow_stems)
    monkeypatch.setattr(lookup, "_apply", noting_apply)
    scans = asyncio.ensure_future(lookup.run_scans())
    try:
        await asyncio.to_thread(listing.wait, 30)
        publish(store, "k3")  # E saves, then answers
        entry = {"metadata": GRID, "item_indices": [0]}
        lookup.keep(item("k3"), "k3", entry)
        release.set()
        await applied.wait()
    finally:
        release.set()
        scans.cancel()
    hits = await lookup.find_off_loop({"k3": item("k3")}, needs_metadata=True)
    assert list(hits) == ["k3"] and hits["k3"].metadata == GRID
    lookup.close()  # waits for a scan still running, then keeps what is left
    assert read_meta(lookup.store, "k3") == entry


async def test_a_store_that_holds_still_is_listed_once(store):
    """10 000 entries or none, a scan costs a stat while `entries/` is unchanged; an entry
    written since (the directory changes) is in the next scan's index."""
    publish(store, "k1")
    past = 1e9
    os.utime(store.entries, (past, past))  # its last change long before any listing
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)
    lists = threads_of(lookup.store, "entry_stems")
    for _ in range(5):
        lookup.scan()
    assert len(lists) == 0  # the listing made at start is reused
    assert list(await lookup.find_off_loop({"k1": item("k1")}, needs_metadata=False)) == ["k1"]
    publish(store, "k2")
    lookup.scan()
    assert len(lists) == 1
    assert list(await lookup.find_off_loop({"k2": item("k2")}, needs_metadata=False)) == ["k2"]


async def test_a_listing_in_the_same_tick_as_a_change_is_not_trusted(store):
    """entries/ changed just before the listing (within SAME_TICK_NS): a change right
    after it might leave the mtime as it was, so the next scan lists again."""
    publish(store, "k1")
    soon = time.time_ns() + 10**10  # as a change in the listing's own tick reads, or later
    os.utime(store.entries, ns=(soon, soon))
    lookup = StoreLookup(str(store.root.parent), NAMESPACE)
    lists = threads_of(lookup.store, "entry_stems")
    lookup.scan()
    assert len(lists) == 1
