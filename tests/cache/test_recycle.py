"""Evicted entry files are reused for new entries, and never while a pin holds them."""

from __future__ import annotations

import os
import time
from pathlib import Path

from epdctl.cache import _recycle
from epdctl.cache.janitor import clean, enforce
from epdctl.cache.store import Pin, Store, read_into, unpin
from tests.cache.conftest import payload


def ino(store: Store, key: str) -> int:
    return os.stat(store.entry_path(key)).st_ino


def read(store: Store, key: str) -> bytes:
    p = store.pin(key, engine="e", request="r", index=0)
    assert isinstance(p, Pin), p
    out = bytearray(p.header.nbytes)
    read_into(p.paths[0], p.header, out)
    unpin(p.paths)
    return bytes(out)


def test_an_evicted_file_is_reused_and_trimmed(store_root: Path, store: Store) -> None:
    store.publish("old", payload(64), dtype="float32", shape=(64, 8))
    old = ino(store, "old")
    report = enforce(store_root, capacity_bytes=1 << 30, ttl_s=0, grace_s=0)
    assert report.count("ttl") == 1 and len(os.listdir(store.free)) == 1
    store.publish("new", payload(16, seed=3), dtype="float32", shape=(16, 8))
    assert ino(store, "new") == old and os.listdir(store.free) == []
    assert read(store, "new") == payload(16, seed=3)  # the larger file was truncated


def test_republishing_recycles_the_replaced_file(store: Store) -> None:
    store.publish("k", payload(8, seed=1), dtype="float32", shape=(8, 8))
    first = ino(store, "k")
    store.publish("k", payload(8, seed=2), dtype="float32", shape=(8, 8))
    store.publish("k", payload(8, seed=3), dtype="float32", shape=(8, 8))
    assert ino(store, "k") == first and read(store, "k") == payload(8, seed=3)


def test_a_pinned_file_is_never_recycled(store: Store) -> None:
    store.publish("k", payload(8, seed=1), dtype="float32", shape=(8, 8))
    p = store.pin("k", engine="e", request="r", index=0)
    assert isinstance(p, Pin)
    for seed in (2, 3, 4):  # each republish would like to reuse the pinned file
        store.publish("k", payload(8, seed=seed), dtype="float32", shape=(8, 8))
    out = bytearray(p.header.nbytes)
    read_into(p.paths[0], p.header, out)
    assert bytes(out) == payload(8, seed=1)
    assert os.stat(p.paths[0]).st_ino not in {os.stat(f).st_ino for f in store.free.iterdir()} | {
        ino(store, "k")
    }


def test_a_pin_taken_during_eviction_keeps_the_file_out_of_the_pool(store: Store) -> None:
    store.publish("k", payload(8), dtype="float32", shape=(8, 8))
    pin_path = f"{store.pins}/late-pin"
    os.link(store.entry_path("k"), pin_path)  # the consumer won the race
    size = os.stat(store.entry_path("k")).st_size
    assert _recycle.retire(store.entry_path("k"), store.free, size)
    assert os.listdir(store.free) == [] and not store.has_entry("k")
    assert os.stat(pin_path).st_nlink == 1  # the pin alone holds the bytes now


def test_a_linked_pool_file_is_not_claimed(store: Store) -> None:
    store.publish("k", payload(8), dtype="float32", shape=(8, 8))
    _recycle.retire(store.entry_path("k"), store.free, os.stat(store.entry_path("k")).st_size)
    (pooled,) = store.free.iterdir()
    os.link(pooled, store.root / "someone-else")
    held = os.stat(pooled).st_ino
    store.publish("n", payload(8), dtype="float32", shape=(8, 8))
    assert ino(store, "n") != held and list(store.free.iterdir()) == []


def test_the_pool_expires_and_stays_small(store_root: Path, store: Store) -> None:
    for i in range(_recycle.FREE_MAX_FILES + 3):
        store.publish(f"k{i}", payload(8), dtype="float32", shape=(8, 8))
    enforce(store_root, capacity_bytes=1 << 30, ttl_s=0, grace_s=0)
    assert len(os.listdir(store.free)) == _recycle.FREE_MAX_FILES
    size = os.stat(next(store.free.iterdir())).st_size
    assert _recycle.expire(store.free, max_bytes=2 * size) == (_recycle.FREE_MAX_FILES - 2) * size
    assert _recycle.expire(store.free, time.time() + _recycle.FREE_TTL_S + 1) == 2 * size
    assert os.listdir(store.free) == []


def test_a_full_store_keeps_no_pool(store_root: Path, store: Store) -> None:
    store.publish("k", payload(8), dtype="float32", shape=(8, 8))
    enforce(store_root, capacity_bytes=0, ttl_s=0, grace_s=0)  # pool limit: capacity / 8
    assert os.listdir(store.free) == []


def test_clean_empties_the_pool(store_root: Path, store: Store) -> None:
    store.publish("k", payload(8), dtype="float32", shape=(8, 8))
    enforce(store_root, capacity_bytes=1 << 30, ttl_s=0, grace_s=0)
    assert len(os.listdir(store.free)) == 1
    report = clean(store_root)
    assert report.count("pooled") == 1 and os.listdir(store.free) == []
