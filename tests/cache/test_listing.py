"""Stats files and the read-only views behind `cache inspect`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from epdctl.cache.listing import inspect, list_entries
from epdctl.cache.stats import MAX_KEYS, StatsWriter, read_stats
from epdctl.cache.store import Pin, Store
from tests.cache.conftest import payload


def test_stats_writers_are_summed(store: Store) -> None:
    sched = StatsWriter(store.root, "pd-0-scheduler")
    worker = StatsWriter(store.root, "pd-0-worker0")
    sched.add("k1", hits=1)
    sched.add("k1", hits=1)
    sched.add(misses=1, invalid=1)
    worker.add("k1", loads=1, load_bytes=100)
    sched.close()
    worker.close()
    counts, key_hits = read_stats(store.root)
    assert counts == {"hits": 2, "misses": 1, "invalid": 1, "loads": 1, "load_bytes": 100}
    assert key_hits == {"k1": 3}
    assert sorted(os.listdir(store.root / "stats")) == ["pd-0-scheduler.json", "pd-0-worker0.json"]


def test_stats_flush_by_itself_and_stay_small(store: Store) -> None:
    writer = StatsWriter(store.root, "e-0-worker0")
    for i in range(MAX_KEYS + 10):
        writer.add(f"k{i}", saves=1)
    writer.close()
    data = json.loads((store.root / "stats" / "e-0-worker0.json").read_text())
    assert data["counts"] == {"saves": MAX_KEYS + 10}
    assert len(data["key_hits"]) == MAX_KEYS and "k0" not in data["key_hits"]


def test_a_damaged_stats_file_is_skipped(store: Store) -> None:
    (store.root / "stats" / "bad.json").write_text("{not json")
    (store.root / "stats" / "list.json").write_text("[]")
    assert read_stats(store.root) == ({}, {})


def test_inspect_and_list_entries(store_root: Path, store: Store) -> None:
    store.publish("a", payload(2), dtype="float32", shape=(2, 8))
    store.publish("b:c", payload(3), dtype="float32", shape=(3, 8))
    Path(store.entry_path("zz")).write_bytes(b"garbage")
    assert isinstance(store.pin("a", engine="e", request="r", index=0), Pin)
    writer = StatsWriter(store.root, "w")
    writer.add("a", hits=1, loads=1)
    writer.close()
    (ns,) = inspect(store_root)
    assert (ns.namespace, ns.entries, ns.pinned_entries, ns.pins) == ("ns-test", 3, 1, 1)
    assert (ns.hits, ns.loads, ns.misses) == (1, 1, 0)
    assert ns.size_bytes == sum(os.stat(p).st_size for p in store.entries.iterdir())
    by_key = {e.key: e for e in list_entries(store_root, "ns-test")}
    assert set(by_key) == {"a", "b:c", "zz"}
    assert (by_key["a"].pinned, by_key["a"].hits, by_key["a"].shape) == (True, 1, (2, 8))
    assert by_key["b:c"].file.startswith("~") and by_key["b:c"].dtype == "float32"
    assert (by_key["zz"].dtype, by_key["zz"].shape) == (None, None)


def _loaded(imports: str, watched: set[str]) -> set[str]:
    code = f"import sys, {imports}; print(' '.join(sorted({watched!r} & set(sys.modules))))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return set(out.stdout.split())


def test_imports_stay_light() -> None:
    heavy = {"torch", "numpy", "vllm", "click", "rich", "httpx", "pydantic"}
    store = "epdctl.cache.store, epdctl.cache.janitor, epdctl.cache.listing, epdctl.cache.stats"
    assert _loaded(store, heavy) == set()
    assert _loaded("epdctl.launch.plan", {"vllm", "torch"}) == set()
    assert _loaded("epdctl.launch.plan, vllm", {"vllm"}) == {"vllm"}  # the probe itself works
