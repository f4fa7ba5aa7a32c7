"""Eviction: TTL and LRU under a byte budget, stale pins, orphaned tmp files, old namespaces."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from epdctl.cache import _recycle
from epdctl.cache._scan import Entry, listdir, namespace_dirs, scan_entries
from epdctl.cache.sidecar import META_SUFFIX, entry_of, sidecar_of
from epdctl.cache.store import ENTRIES, PENDING, PINS, TMP

# A pin not read within this long belongs to a load that will never happen (the request
# was aborted, or KV allocation failed after has_cache_item); the inode can go.
PIN_TTL_S = 600.0
# A tmp file whose writer is alive is removed only past this age (a write takes < 1 s).
TMP_TTL_S = 600.0
# A pending mark holds its deadline as mtime; past it by this long its proxy is long done.
PENDING_TTL_S = 60.0
# What plan.compute_namespace appends to a topology's name.
_NAMESPACE_TAIL = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class Removed:
    """One file (or namespace dir) the janitor removed, or would remove in a dry run."""

    namespace: str
    path: str
    size_bytes: int
    # ttl, budget, namespace, all, older-than, stale-pin, orphan-tmp, orphan-meta, pooled,
    # stale-pending, empty-namespace
    reason: str


@dataclass
class EvictionReport:
    """What a janitor pass found and did."""

    removed: list[Removed] = field(default_factory=list)
    kept_pinned: int = 0
    kept_young: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    dry_run: bool = False

    @property
    def freed_bytes(self) -> int:
        return sum(r.size_bytes for r in self.removed)

    def count(self, *reasons: str) -> int:
        return sum(1 for r in self.removed if r.reason in reasons)


def enforce(
    store_dir: Path,
    *,
    capacity_bytes: int | None,
    ttl_s: float,
    grace_s: float,
    keep_namespaces: set[str] | None = None,
    pin_ttl_s: float = PIN_TTL_S,
    now: float | None = None,
) -> EvictionReport:
    """One supervisor pass: TTL, LRU down to the budget (None: no budget), foreign
    namespaces, stale pins."""
    now = time.time() if now is None else now

    def is_foreign(ns: str) -> bool:
        return keep_namespaces is not None and ns not in keep_namespaces

    def expired(e: Entry) -> str | None:
        if is_foreign(e.namespace):
            return "namespace"
        return "ttl" if now - e.mtime > ttl_s else None

    return _sweep(
        Path(store_dir),
        now=now,
        namespaces=None,
        expired=expired,
        budget_bytes=capacity_bytes,
        grace_s=grace_s,
        pin_ttl_s=pin_ttl_s,
        drop_empty=is_foreign,
        dry_run=False,
        recycle=True,
        # A stocked pool is kept while entries would be (within the budget, as they are).
        pool_ttl_s=ttl_s,
    )


def keep_topology_store(ns_dir: Path, topology: str, *, earlier: Collection[str] = (),
                        capacity_bytes: int, ttl_s: float,
                        grace_s: float) -> list[EvictionReport]:
    """The supervisor's pass for one running topology whose namespace is `ns_dir`.

    Its budget and TTL hold on its own namespace alone. A namespace an earlier run of this
    topology used (another model, dtype or vLLM version: it can never be hit again) is
    emptied and removed only if it is provably that: named `<topology>-<12 hex>` exactly
    and in `earlier`, the namespaces this topology's own runs recorded (store_root.py). A
    shared prefix proves nothing (`cpu-demo-example-connector-…` is not `cpu-demo`'s), so
    every other namespace is left alone.
    """
    reports = [enforce(ns_dir, capacity_bytes=capacity_bytes, ttl_s=ttl_s, grace_s=grace_s)]
    root = ns_dir.parent
    stale = {d.name for d in namespace_dirs(root)
             if d.name != ns_dir.name and d.name in earlier and is_namespace_of(d.name, topology)}
    if stale:
        keep = {d.name for d in namespace_dirs(root)} - stale
        reports.append(enforce(root, capacity_bytes=None, ttl_s=float("inf"), grace_s=grace_s,
                               keep_namespaces=keep))
    return reports


def is_namespace_of(name: str, topology: str) -> bool:
    """Whether `name` has the form of a namespace of `topology`: `<topology>-<12 hex>`."""
    prefix = f"{topology}-"
    return name.startswith(prefix) and _NAMESPACE_TAIL.fullmatch(name[len(prefix):]) is not None


def clean(
    store_root: Path,
    *,
    all: bool = False,
    older_than_s: float | None = None,
    max_bytes: int | None = None,
    namespace: str | None = None,
    dry_run: bool = False,
    keep_namespaces: set[str] | frozenset[str] = frozenset(),
    pin_ttl_s: float = PIN_TTL_S,
    now: float | None = None,
) -> EvictionReport:
    """User-requested cleaning; pinned entries and young pins are never touched.

    With `all`, emptied namespace dirs go too, except `keep_namespaces` (a running one's).
    """
    now = time.time() if now is None else now

    def expired(e: Entry) -> str | None:
        if all:
            return "all"
        if older_than_s is not None and now - e.mtime > older_than_s:
            return "older-than"
        return None

    return _sweep(
        Path(store_root),
        now=now,
        namespaces=None if namespace is None else {namespace},
        expired=expired,
        budget_bytes=max_bytes,
        grace_s=0.0,
        pin_ttl_s=pin_ttl_s,
        drop_empty=lambda ns: all and ns not in keep_namespaces,
        dry_run=dry_run,
        recycle=False,
    )


def _sweep(
    root: Path,
    *,
    now: float,
    namespaces: set[str] | None,
    expired: Callable[[Entry], str | None],
    budget_bytes: int | None,
    grace_s: float,
    pin_ttl_s: float,
    drop_empty: Callable[[str], bool],
    dry_run: bool,
    recycle: bool,
    pool_ttl_s: float = 0.0,
) -> EvictionReport:
    report = EvictionReport(dry_run=dry_run)
    ns_dirs = [d for d in namespace_dirs(root) if namespaces is None or d.name in namespaces]
    entries = [e for d in ns_dirs for e in scan_entries(d)]
    report.bytes_before = sum(e.size for e in entries)
    evictable = _evictable(entries, now, grace_s, report)
    doomed = _doomed(entries, evictable, expired, budget_bytes, recycle)
    for e in entries:
        if e.path in doomed and _remove_entry(e, dry_run, recycle):
            report.removed.append(Removed(e.namespace, e.path, e.size, doomed[e.path]))
    report.bytes_after = report.bytes_before - report.freed_bytes
    # Pooled files are memory too: dropped by `clean`, when unused for long, and past what
    # the entries leave of the budget (entries + pool within it). Without a budget, a
    # namespace on its way out keeps no pool and the others' are left to their own pass.
    pool_room = 0 if budget_bytes is None else _recycle.pool_limit(budget_bytes,
                                                                   report.bytes_after)
    for d in ns_dirs:
        if not recycle:
            report.removed.extend(_pooled(d, dry_run))
        elif budget_bytes is None and not drop_empty(d.name):
            _recycle.expire(d / _recycle.FREE, now, ttl_s=max(_recycle.FREE_TTL_S, pool_ttl_s))
        else:
            _recycle.expire(d / _recycle.FREE, now, max_bytes=pool_room,
                            ttl_s=max(_recycle.FREE_TTL_S, pool_ttl_s))
            pool_room = max(0, pool_room - _recycle.pool_usage(d / _recycle.FREE)[1])
        report.removed.extend(_stale_pins(d, now, pin_ttl_s, dry_run))
        report.removed.extend(_orphan_tmp(d, now, dry_run))
        report.removed.extend(_orphan_meta(d, now, grace_s, dry_run))
        report.removed.extend(_stale_pending(d, now, dry_run))
        if drop_empty(d.name) and _is_empty(d, doomed, report, dry_run):
            if not dry_run:
                shutil.rmtree(d, ignore_errors=True)
            report.removed.append(Removed(d.name, str(d), 0, "empty-namespace"))
    return report


def _evictable(entries: list[Entry], now: float, grace_s: float,
               report: EvictionReport) -> list[Entry]:
    """The entries neither pinned nor younger than the grace (those counted in `report`)."""
    evictable: list[Entry] = []
    for e in entries:
        # A second link is a pin: some engine is about to read this inode.
        if e.nlink > 1:
            report.kept_pinned += 1
        elif now - e.mtime < grace_s:
            report.kept_young += 1
        else:
            evictable.append(e)
    return evictable


def _doomed(entries: list[Entry], evictable: list[Entry],
            expired: Callable[[Entry], str | None], budget_bytes: int | None,
            recycle: bool) -> dict[str, str]:
    """The evictable entries to remove, by path, with the reason: expired, else the least
    recently used past the budget."""
    doomed = {e.path: reason for e in evictable if (reason := expired(e))}
    if budget_bytes is not None:
        total = sum(e.size for e in entries) - sum(e.size for e in evictable
                                                   if e.path in doomed)
        # The pool counts in the budget: at capacity, entries leave it room for a few files,
        # so that evicted ones wait there for the next saves (recycled, not made anew).
        reserve = _recycle.pool_reserve(budget_bytes, max((e.size for e in entries), default=0))
        for e in sorted(evictable, key=lambda e: e.mtime):
            if total <= budget_bytes - (reserve if recycle else 0):
                break
            if e.path not in doomed:
                doomed[e.path] = "budget"
                total -= e.size
    return doomed


def _stale_pins(ns_dir: Path, now: float, pin_ttl_s: float, dry_run: bool) -> Iterator[Removed]:
    for path in listdir(ns_dir / PINS):
        created = pin_created_s(path)
        if created is None:
            try:
                # Not one of our names; its ctime is a safe lower bound of its age.
                created = os.stat(path).st_ctime
            except FileNotFoundError:
                continue
        if now - created > pin_ttl_s and _remove(path, dry_run):
            yield Removed(ns_dir.name, path, 0, "stale-pin")


def pin_created_s(path: str) -> float | None:
    """Creation time encoded at the end of a pin's name, or None."""
    tail = path.rsplit(".", 1)[-1]
    return int(tail) / 1e9 if tail.isdigit() else None


def _orphan_tmp(ns_dir: Path, now: float, dry_run: bool) -> Iterator[Removed]:
    for path in listdir(ns_dir / TMP):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        parts = os.path.basename(path).rsplit(".", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        orphan = pid is None or not _alive(pid) or now - st.st_mtime > TMP_TTL_S
        if orphan and _remove(path, dry_run):
            yield Removed(ns_dir.name, path, st.st_size, "orphan-tmp")


def _stale_pending(ns_dir: Path, now: float, dry_run: bool) -> Iterator[Removed]:
    """Pending marks whose deadline is long past (their proxy died before clearing them)."""
    for path in listdir(ns_dir / PENDING):
        try:
            deadline = os.stat(path).st_mtime
        except FileNotFoundError:
            continue
        if now - deadline > PENDING_TTL_S and _remove(path, dry_run):
            yield Removed(ns_dir.name, path, 0, "stale-pending")


def _orphan_meta(ns_dir: Path, now: float, grace_s: float, dry_run: bool) -> Iterator[Removed]:
    """Sidecars whose entry is gone (its eviction raced the proxy's write), past the grace."""
    for path in listdir(ns_dir / ENTRIES):
        if not path.endswith(META_SUFFIX) or os.path.exists(entry_of(path)):
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if now - st.st_mtime >= grace_s and _remove(path, dry_run):
            yield Removed(ns_dir.name, path, st.st_size, "orphan-meta")


def _is_empty(ns_dir: Path, doomed: dict[str, str], report: EvictionReport, dry_run: bool) -> bool:
    gone = {r.path for r in report.removed} | set(doomed) if dry_run else set()
    for sub in (ENTRIES, PINS, TMP, PENDING):
        # Sidecars alone keep nothing alive: they mean nothing without their entries.
        if any(p not in gone and not p.endswith(META_SUFFIX) for p in listdir(ns_dir / sub)):
            return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pooled(ns_dir: Path, dry_run: bool) -> Iterator[Removed]:
    for path in listdir(ns_dir / _recycle.FREE):
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            continue
        if _remove(path, dry_run):
            yield Removed(ns_dir.name, path, size, "pooled")


def _remove_entry(e: Entry, dry_run: bool, recycle: bool = False) -> bool:
    """Unlink an entry unless it was pinned, touched or republished since the scan."""
    try:
        st = os.stat(e.path)
    except FileNotFoundError:
        return False
    if (st.st_ino, st.st_mtime, st.st_nlink) != (e.ino, e.mtime, 1):
        return False
    # A pin taken between this stat and the unlink keeps the inode: the reader is safe
    # (and retire() sees its link and keeps the file out of the pool).
    if (
        recycle
        and not dry_run
        and _recycle.retire(e.path, Path(e.path).parent.parent / _recycle.FREE, e.size)
    ):
        _remove(sidecar_of(e.path), dry_run)
        return True
    if not _remove(e.path, dry_run):
        return False
    _remove(sidecar_of(e.path), dry_run)  # its metadata goes with it
    return True


def _remove(path: str, dry_run: bool) -> bool:
    if dry_run:
        return True
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
