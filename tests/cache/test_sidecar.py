"""E's metadata beside its entry: written atomically, read strictly, removed with the entry."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from epdctl.cache.janitor import clean, enforce
from epdctl.cache.sidecar import meta_path, read_meta, write_meta
from epdctl.cache.store import Miss, Store
from tests.cache.conftest import age, payload

ENTRY = {"modality": "image", "item_indices": [0], "metadata": {"image_grid_thw": [[1, 4, 4]]}}


def publish(store: Store, key: str) -> None:
    store.publish(key, payload(8), dtype="float32", shape=(8, 8))


def test_kept_metadata_round_trips_and_needs_its_entry(store: Store) -> None:
    assert write_meta(store, "k", ENTRY) is False  # no entry: nothing is written
    assert not os.path.exists(meta_path(store, "k"))
    publish(store, "k")
    assert write_meta(store, "k", ENTRY) is True
    assert read_meta(store, "k") == ENTRY
    assert os.listdir(store.tmp) == []  # written in tmp/, then renamed
    # A client-chosen key with characters a file name cannot hold gets a hashed name.
    publish(store, "lora:a/b")
    assert write_meta(store, "lora:a/b", ENTRY) and read_meta(store, "lora:a/b") == ENTRY


def test_foreign_or_damaged_metadata_reads_as_none(store: Store, store_root: Path) -> None:
    publish(store, "k")
    path = Path(meta_path(store, "k"))
    for text in ("{not json", "[]", json.dumps({"key": "other", "namespace": "ns-test",
                                                "entry": ENTRY}),
                 json.dumps({"key": "k", "namespace": "ns-other", "entry": ENTRY}),
                 json.dumps({"key": "k", "namespace": "ns-test",
                             "entry": {**ENTRY, "metadata": {}}})):
        path.write_text(text)
        assert read_meta(store, "k") is None, text
    assert read_meta(Store(store_root, "ns-test"), "absent") is None


def test_check_validates_like_a_consumer_without_pinning(store: Store) -> None:
    assert store.check("k") == Miss("missing")
    publish(store, "k")
    header = store.check("k")
    assert not isinstance(header, Miss) and header.shape == (8, 8)
    assert os.listdir(store.pins) == [] and os.stat(store.entry_path("k")).st_nlink == 1
    os.truncate(store.entry_path("k"), os.path.getsize(store.entry_path("k")) - 4)
    assert isinstance(store.check("k"), Miss)


def test_the_janitor_removes_metadata_with_its_entry(store_root: Path, store: Store) -> None:
    now = time.time()
    for key, idle_s in (("old", 300), ("new", 100)):
        publish(store, key)
        write_meta(store, key, ENTRY)
        age(store.entry_path(key), idle_s, now)
    size = os.path.getsize(store.entry_path("new"))
    report = enforce(store_root, capacity_bytes=size, ttl_s=1e6, grace_s=10, now=now)
    assert [os.path.basename(r.path) for r in report.removed] == ["old.ec"]
    assert sorted(os.listdir(store.entries)) == ["new.ec", "new.meta.json"]


def test_orphaned_metadata_goes_after_the_grace(store_root: Path, store: Store) -> None:
    now = time.time()
    publish(store, "k")
    write_meta(store, "k", ENTRY)
    os.unlink(store.entry_path("k"))  # evicted while the proxy wrote
    assert enforce(store_root, capacity_bytes=None, ttl_s=1e6, grace_s=60,
                   now=now).count("orphan-meta") == 0
    report = enforce(store_root, capacity_bytes=None, ttl_s=1e6, grace_s=60, now=now + 61)
    assert report.count("orphan-meta") == 1 and os.listdir(store.entries) == []


def test_clean_all_takes_metadata_and_the_namespace(store_root: Path, store: Store) -> None:
    publish(store, "k")
    write_meta(store, "k", ENTRY)
    dry = clean(store_root, all=True, dry_run=True)
    assert dry.count("all") == 1 and dry.count("empty-namespace") == 1
    assert os.path.exists(meta_path(store, "k"))
    report = clean(store_root, all=True)
    assert report.count("all") == 1 and report.count("empty-namespace") == 1
    assert not store.root.exists()
