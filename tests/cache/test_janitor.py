"""Eviction by TTL and budget, grace, pins, tmp files, namespaces; `clean` options."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from epdctl.cache.janitor import PIN_TTL_S, clean, enforce
from epdctl.cache.store import Pin, Store
from tests.cache.conftest import age, payload


@pytest.fixture
def now() -> float:
    return time.time()


def fill(store: Store, ages_s: dict[str, float], now: float) -> int:
    """Publish one 8x8 float32 entry per key, last used `age` seconds before `now`."""
    for key, seconds in ages_s.items():
        store.publish(key, payload(8), dtype="float32", shape=(8, 8))
        age(store.entry_path(key), seconds, now)
    return os.stat(store.entry_path(next(iter(ages_s)))).st_size


def keys(store: Store) -> set[str]:
    return {n.removesuffix(".ec") for n in os.listdir(store.entries)}


def test_lru_down_to_the_budget(store_root: Path, store: Store, now: float) -> None:
    size = fill(store, {"old": 300, "mid": 200, "new": 100}, now)
    report = enforce(store_root, capacity_bytes=2 * size, ttl_s=1e6, grace_s=10, now=now)
    assert keys(store) == {"mid", "new"}
    assert [(os.path.basename(r.path), r.reason) for r in report.removed] == [("old.ec", "budget")]
    assert (report.bytes_before, report.bytes_after) == (3 * size, 2 * size)


def test_ttl_grace_and_pins(store_root: Path, store: Store, now: float) -> None:
    fill(store, {"expired": 1000, "fresh": 50, "young": 1, "pinned": 5000}, now)
    p = store.pin("pinned", engine="e", request="r", index=0)
    assert isinstance(p, Pin)
    report = enforce(store_root, capacity_bytes=0, ttl_s=500, grace_s=10, now=now)
    # Over budget, so everything evictable goes; the young and the pinned stay.
    assert keys(store) == {"young", "pinned"}
    assert {os.path.basename(r.path): r.reason for r in report.removed} == {
        "expired.ec": "ttl",
        "fresh.ec": "budget",
    }
    assert (report.kept_pinned, report.kept_young) == (1, 1)
    report = enforce(store_root, capacity_bytes=1 << 30, ttl_s=500, grace_s=10, now=now)
    assert report.removed == [] and keys(store) == {"young", "pinned"}


def test_stale_pins_go_young_pins_stay(store_root: Path, store: Store, now: float) -> None:
    fill(store, {"k": 0}, now)
    p = store.pin("k", engine="e", request="r", index=0, ranks=2)
    assert isinstance(p, Pin)
    assert (
        enforce(store_root, capacity_bytes=0, ttl_s=0, grace_s=0, now=now).count("stale-pin") == 0
    )
    assert len(os.listdir(store.pins)) == 2 and keys(store) == {"k"}
    later = now + PIN_TTL_S + 60
    report = enforce(store_root, capacity_bytes=0, ttl_s=0, grace_s=0, now=later)
    assert report.count("stale-pin") == 2 and os.listdir(store.pins) == []
    # The next pass may evict the entry the stale pins held.
    enforce(store_root, capacity_bytes=0, ttl_s=0, grace_s=0, now=later)
    assert keys(store) == set()


def test_orphaned_tmp_files(store_root: Path, store: Store, now: float) -> None:
    dead = store.tmp / "k.999999999.abcd"  # no such pid
    live = store.tmp / f"k.{os.getpid()}.abcd"  # a writer still at work
    stuck = store.tmp / f"k.{os.getpid()}.ef01"
    for path in (dead, live, stuck):
        path.write_bytes(b"x" * 10)
    age(stuck, 3600, now)
    report = enforce(store_root, capacity_bytes=1 << 30, ttl_s=1e6, grace_s=0, now=now)
    assert sorted(os.path.basename(r.path) for r in report.removed) == sorted(
        [dead.name, stuck.name]
    )
    assert os.listdir(store.tmp) == [live.name]


def test_foreign_namespaces_are_emptied_and_removed(
    store_root: Path, store: Store, now: float
) -> None:
    fill(store, {"ours": 100}, now)
    other = Store(store_root, "ns-old").create()
    held = Store(store_root, "ns-held").create()
    fill(other, {"a": 100, "b": 100}, now)
    fill(held, {"c": 100}, now)
    assert isinstance(held.pin("c", engine="e", request="r", index=0), Pin)
    report = enforce(
        store_root,
        capacity_bytes=1 << 30,
        ttl_s=1e6,
        grace_s=10,
        keep_namespaces={"ns-test"},
        now=now,
    )
    assert report.count("namespace") == 2 and report.count("empty-namespace") == 1
    assert sorted(os.listdir(store_root)) == ["ns-held", "ns-test"]
    assert keys(store) == {"ours"} and keys(held) == {"c"}


def test_enforce_accepts_a_namespace_dir(store: Store, now: float) -> None:
    fill(store, {"k": 100}, now)
    enforce(store.root, capacity_bytes=0, ttl_s=1e6, grace_s=0, now=now)
    assert keys(store) == set()


def test_clean_options(store_root: Path, store: Store, now: float) -> None:
    size = fill(store, {"a": 4000, "b": 3000, "c": 20, "d": 10}, now)
    other = Store(store_root, "ns-other").create()
    fill(other, {"x": 5000}, now)
    p = store.pin("a", engine="e", request="r", index=0)
    assert isinstance(p, Pin)

    report = clean(store_root, older_than_s=600, dry_run=True, now=now)
    assert report.count("older-than") == 2 and keys(store) == {"a", "b", "c", "d"}
    assert report.kept_pinned == 1

    clean(store_root, older_than_s=600, namespace="ns-test", now=now)
    assert keys(store) == {"a", "c", "d"} and keys(other) == {"x"}

    clean(store_root, max_bytes=2 * size, namespace="ns-test", now=now)
    assert keys(store) == {"a", "d"}  # c was the least recently used unpinned one

    report = clean(store_root, all=True, keep_namespaces={"ns-test"}, now=now)
    assert keys(store) == {"a"} and sorted(os.listdir(store_root)) == ["ns-test"]
    assert report.count("empty-namespace") == 1


def test_clean_without_options_only_tidies(store_root: Path, store: Store, now: float) -> None:
    fill(store, {"a": 1e5}, now)
    (store.tmp / "a.999999999.beef").write_bytes(b"x")
    report = clean(store_root, now=now)
    assert [r.reason for r in report.removed] == ["orphan-tmp"] and keys(store) == {"a"}


def test_missing_store_is_empty(store_root: Path) -> None:
    report = enforce(store_root / "nothing", capacity_bytes=0, ttl_s=0, grace_s=0)
    assert report.removed == [] and report.bytes_before == 0
