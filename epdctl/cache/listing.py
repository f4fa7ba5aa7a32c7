"""Read-only views of the store for `epdctl cache inspect`: namespaces, entries, the pool."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from epdctl.cache._format import ENTRY_SUFFIX, PAGE_BYTES, FormatError, decode_header
from epdctl.cache._recycle import FREE, pool_usage
from epdctl.cache._scan import listdir, namespace_dirs, scan_entries
from epdctl.cache.sidecar import read_modality, sidecar_of
from epdctl.cache.stats import COUNTERS, read_stats
from epdctl.cache.store import PINS


@dataclass(frozen=True)
class NamespaceStats:
    """One namespace: what it holds and how it was used (summed over engines)."""

    namespace: str
    entries: int
    size_bytes: int
    pinned_entries: int
    pins: int
    oldest: float | None  # last use (mtime) of the least recently used entry
    newest: float | None
    hits: int
    misses: int
    invalid: int
    saves: int
    loads: int
    save_failures: int
    load_failures: int
    waits: int = 0
    wait_s: float = 0.0
    expired: int = 0
    lookups: int = 0
    skipped: int = 0
    sent: int = 0
    pool_files: int = 0
    """Spare files kept for the next saves (evicted entries, or pre-faulted ahead by E)."""
    pool_bytes: int = 0


@dataclass(frozen=True)
class EntryInfo:
    """One entry as `inspect --entries` shows it; dtype/shape None if the header is bad."""

    key: str
    file: str
    dtype: str | None
    shape: tuple[int, ...] | None
    size_bytes: int
    created: float | None
    last_used: float
    pinned: bool
    hits: int
    modality: str | None = None
    """image, video or audio, as the proxy kept it beside the entry; None: unknown (saved
    without the proxy, or before its next scan)."""


def inspect(store_root: Path) -> list[NamespaceStats]:
    """Every namespace under `store_root`, sorted by name."""
    result = []
    for ns_dir in namespace_dirs(Path(store_root)):
        entries = list(scan_entries(ns_dir))
        counts, _ = read_stats(ns_dir)
        times = [e.mtime for e in entries]
        pool_files, pool_bytes = pool_usage(ns_dir / FREE)
        result.append(
            NamespaceStats(
                namespace=ns_dir.name,
                entries=len(entries),
                size_bytes=sum(e.size for e in entries),
                pinned_entries=sum(1 for e in entries if e.nlink > 1),
                pins=len(listdir(ns_dir / PINS)),
                oldest=min(times, default=None),
                newest=max(times, default=None),
                **{k: int(counts.get(k, 0)) for k in COUNTERS if k != "wait_s"},
                wait_s=float(counts.get("wait_s", 0.0)),
                pool_files=pool_files,
                pool_bytes=pool_bytes,
            )
        )
    return result


def list_entries(store_root: Path, namespace: str) -> list[EntryInfo]:
    """The entries of one namespace, most recently used first."""
    ns_dir = Path(store_root) / namespace
    _, key_hits = read_stats(ns_dir)
    infos = []
    for e in scan_entries(ns_dir):
        name = os.path.basename(e.path)[: -len(ENTRY_SUFFIX)]
        key, dtype, shape, created = name, None, None, None
        try:
            with open(e.path, "rb", buffering=0) as f:
                header = decode_header(f.read(PAGE_BYTES))
            key, dtype, shape, created = (
                header.key,
                header.dtype,
                header.shape,
                header.created_ns / 1e9,
            )
        except (OSError, FormatError):
            pass  # shown with what the file name tells; the consumer treats it as a miss
        infos.append(
            EntryInfo(
                key=key,
                file=name,
                dtype=dtype,
                shape=shape,
                size_bytes=e.size,
                created=created,
                last_used=e.mtime,
                pinned=e.nlink > 1,
                hits=key_hits.get(key, 0),
                modality=read_modality(sidecar_of(e.path), key),
            )
        )
    return sorted(infos, key=lambda i: -i.last_used)
