"""Listing the store's namespaces, entries and files (shared by the janitor and inspect)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from epdctl.cache import check_store_dir
from epdctl.cache._format import ENTRY_SUFFIX
from epdctl.cache.store import ENTRIES


@dataclass(frozen=True)
class Entry:
    """An entry file as stat saw it."""

    namespace: str
    path: str
    size: int
    mtime: float
    nlink: int
    ino: int


def namespace_dirs(root: Path) -> list[Path]:
    """Namespace directories under a store root (or `root` itself if it is one), sorted.

    CacheError if the root or one of them is not this user's alone (check_store_dir): the
    janitor and `cache` commands read and remove files only in directories of their own.
    """
    try:
        check_store_dir(root)
    except FileNotFoundError:
        return []
    if (root / ENTRIES).is_dir():
        return [root]
    try:
        found = sorted(d for d in root.iterdir() if d.is_dir() and (d / ENTRIES).is_dir())
    except FileNotFoundError:
        return []
    for ns_dir in found:
        check_store_dir(ns_dir)
    return found


def scan_entries(ns_dir: Path) -> Iterator[Entry]:
    """Entry files of one namespace (skipping any that vanish while listed)."""
    for path in listdir(ns_dir / ENTRIES):
        if not path.endswith(ENTRY_SUFFIX):
            continue
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        yield Entry(ns_dir.name, path, st.st_size, st.st_mtime, st.st_nlink, st.st_ino)


def listdir(path: Path) -> list[str]:
    """Full paths in `path`; empty if it does not exist."""
    try:
        return [f"{path}/{name}" for name in os.listdir(path)]
    except (FileNotFoundError, NotADirectoryError):
        return []
