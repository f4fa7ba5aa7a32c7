"""vLLM's ECExampleConnector's files, `<dir>/<mm_hash>/encoder_cache.safetensors`: listed and
removed for `cache inspect/clean`, looked up for `verify` (stdlib only)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

ITEM_FILE = "encoder_cache.safetensors"
"""The one file per item (example_connector.py `_generate_filename_debug`)."""


@dataclass(frozen=True)
class Item:
    """One item E saved: its key (vLLM's mm_hash: the proxy's content key) and its file."""

    key: str
    path: str
    size_bytes: int
    mtime: float
    """When E wrote it (the connector never touches a file it loads)."""


def item_file(root: Path, key: str) -> Path:
    return root / key / ITEM_FILE


def list_items(root: Path) -> list[Item]:
    """Every complete item under root, most recent first (none if root is missing)."""
    items = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        path = item_file(root, name)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            continue  # a folder created before its file, or removed while listed
        items.append(Item(name, str(path), st.st_size, st.st_mtime))
    return sorted(items, key=lambda i: -i.mtime)


def select(items: list[Item], *, remove_all: bool = False, older_than_s: float | None = None,
           max_bytes: int | None = None, now: float | None = None) -> list[tuple[Item, str]]:
    """What `cache clean` removes, with why: all, older-than, then oldest first to max_bytes."""
    now = time.time() if now is None else now
    doomed: dict[str, tuple[Item, str]] = {}
    for item in items:
        if remove_all:
            doomed[item.key] = (item, "all")
        elif older_than_s is not None and now - item.mtime > older_than_s:
            doomed[item.key] = (item, "older-than")
    if max_bytes is not None:
        kept = sum(i.size_bytes for i in items if i.key not in doomed)
        for item in sorted(items, key=lambda i: i.mtime):
            if kept <= max_bytes:
                break
            if item.key not in doomed:
                doomed[item.key] = (item, "budget")
                kept -= item.size_bytes
    return list(doomed.values())


def remove(root: Path, items: list[Item]) -> None:
    """Remove each item's folder (a loader holding the file open keeps reading it)."""
    for item in items:
        shutil.rmtree(root / item.key, ignore_errors=True)
