"""`epdctl cache inspect` and `epdctl cache clean`: exact output and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdctl.cache._recycle import pool_name
from epdctl.cache.sidecar import write_meta
from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import Pin, Store
from epdctl.proxy.stages.lookup import STATS_WRITER

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A store root under /dev/shm with a fixed-size filesystem as far as inspect can tell."""
    root = Path(tempfile.mkdtemp(prefix="epdctl-test-", dir="/dev/shm"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(64 << 20, 0, 48 << 20))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def populate(root: Path) -> Store:
    """Two entries (3 h and 5 min unused), one pinned and one with E's metadata beside it,
    one hit and one miss counted; the proxy looked 4 items up and found 1."""
    store = Store(root, "demo-0123456789ab").create()
    now = time.time()
    for key, rows, idle_s in (("img-a", 4, 3 * 3600 + 30), ("lora:img-b", 2, 300 + 10)):
        store.publish(key, bytes(rows * 16 * 4), dtype="float32", shape=(rows, 16))
        os.utime(store.entry_path(key), (now - idle_s, now - idle_s))
    assert isinstance(store.pin("img-a", engine="pd-0", request="r1", index=0), Pin)
    stats = StatsWriter(store.root, "pd-0-scheduler")
    stats.add("img-a", hits=1)
    stats.add(misses=1)
    stats.close()
    write_meta(store, "lora:img-b", {"metadata": {"video_grid_thw": [[2, 2, 2]]}}, "video")
    proxy = StatsWriter(store.root, STATS_WRITER)
    proxy.add(lookups=4, skipped=1, sent=3)
    proxy.close()
    return store


def test_inspect_empty_store(epdctl, shm: Path) -> None:
    result = epdctl("cache", "inspect", "--store-dir", str(shm / "none"))
    assert (result.exit_code, result.stdout) == (0, "")
    assert result.stderr == f"The EC store {shm / 'none'} is empty.\n"


def test_inspect_table_and_entries(epdctl, shm: Path) -> None:
    populate(shm)
    result = epdctl("cache", "inspect", "--store-dir", str(shm), "--entries")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == (
        "NAMESPACE          ENTRIES     SIZE  PINNED  HITS  MISSES  SAVES  LOADS  HIT%  OLDEST  "
        "NEWEST\n"
        "demo-0123456789ab        2  8.4 KiB     1/1     1       1      0      0   25%   3h00m  "
        " 5m10s\n"
        f"store {shm}: 8.4 KiB used; filesystem 48.0 MiB free of 64.0 MiB\n"
        "HIT% = the proxy's store lookups that found the item (no encoder round trip)\n"
        "\n"
        "demo-0123456789ab\n"
        "KEY         MODALITY    DTYPE  SHAPE     SIZE    AGE  HITS  PINNED\n"
        "lora:img-b     video  float32   2x16  4.1 KiB  5m10s     0        \n"
        "img-a              ?  float32   4x16  4.2 KiB  3h00m     1     yes\n"
    )


def test_inspect_json(epdctl, shm: Path) -> None:
    store = populate(shm)
    result = epdctl("cache", "inspect", "--store-dir", str(shm), "--json", "--entries")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["store_dir"] == str(shm) and doc["capacity_bytes"] is None
    assert doc["filesystem"] == {"total_bytes": 64 << 20, "free_bytes": 48 << 20}
    (ns,) = doc["namespaces"]
    assert {k: ns[k] for k in ("namespace", "entries", "pinned_entries", "hits", "misses",
                               "lookups", "skipped", "sent", "hit_ratio")} == {
        "namespace": "demo-0123456789ab",
        "entries": 2,
        "pinned_entries": 1,
        "hits": 1,
        "misses": 1,
        "lookups": 4,
        "skipped": 1,
        "sent": 3,
        "hit_ratio": 0.25,
    }
    assert (
        ns["size_bytes"]
        == doc["size_bytes"]
        == sum(p.stat().st_size for p in store.entries.glob("*.ec"))
    )
    assert [(i["key"], i["shape"], i["pinned"], i["modality"]) for i in ns["items"]] == [
        ("lora:img-b", [2, 16], False, "video"),
        ("img-a", [4, 16], True, None),
    ]


def test_inspect_shows_the_pool(epdctl, shm: Path) -> None:
    store = populate(shm)
    for _ in range(2):  # two spare files of 4 MiB, as E's stocker keeps them
        fd = os.open(pool_name(store.free, 4 << 20), os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4 << 20)
        os.close(fd)
    result = epdctl("cache", "inspect", "--store-dir", str(shm))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[2] == (
        f"store {shm}: 8.0 MiB used (8.0 MiB of it in the pool: 2 spare files for the next "
        "saves); filesystem 48.0 MiB free of 64.0 MiB")
    doc = json.loads(epdctl("cache", "inspect", "--store-dir", str(shm), "--json").stdout)
    (ns,) = doc["namespaces"]
    assert (doc["pool_files"], doc["pool_bytes"]) == (ns["pool_files"], ns["pool_bytes"]) == (
        2, 8 << 20)
    assert doc["size_bytes"] == ns["size_bytes"] < 1 << 20  # the entries alone


def test_clean_dry_run_then_all_keeps_the_pinned_entry(epdctl, shm: Path) -> None:
    store = populate(shm)
    dry = epdctl("cache", "clean", "--store-dir", str(shm), "--all", "--dry-run")
    assert dry.exit_code == 0, dry.stderr
    assert dry.stdout == (
        f"Would remove 1 entry (4.1 KiB), 0 stale pins, 0 orphaned tmp files from {shm}; "
        "kept 1 being loaded\n"
    )
    assert len(os.listdir(store.entries)) == 3  # two entries, one's metadata
    result = epdctl("cache", "clean", "--store-dir", str(shm), "--all", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [(r["reason"], r["namespace"]) for r in doc["removed"]] == [("all", "demo-0123456789ab")]
    assert (doc["kept_pinned"], doc["dry_run"]) == (1, False)
    assert os.listdir(store.entries) == ["img-a.ec"]


def test_clean_older_than_and_max_bytes(epdctl, shm: Path) -> None:
    store = populate(shm)
    result = epdctl("cache", "clean", "--store-dir", str(shm), "--older-than", "1h")
    assert result.exit_code == 0, result.stderr
    # img-a is 3 h old but pinned; lora:img-b is 5 min old.
    assert result.stdout.startswith("Removed 0 entries (0 B), 0 stale pins")
    result = epdctl(
        "cache",
        "clean",
        "--store-dir",
        str(shm),
        "--max-bytes",
        "1KiB",
        "--namespace",
        "demo-0123456789ab",
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("Removed 1 entry (4.1 KiB)")
    assert os.listdir(store.entries) == ["img-a.ec"]


def test_clean_errors(epdctl, shm: Path) -> None:
    populate(shm)
    result = epdctl("cache", "clean", "--store-dir", str(shm), "--namespace", "nope")
    assert result.exit_code == 1
    assert result.stderr == f"Error: no namespace `nope` in the EC store {shm}\n"
    result = epdctl("cache", "clean", "--store-dir", str(shm), "--older-than", "soon")
    assert result.exit_code == 2
    assert "Invalid value for '--older-than'" in result.stderr
    result = epdctl("cache", "clean", "--store-dir", str(shm), "--max-bytes", "lots")
    assert result.exit_code == 2
