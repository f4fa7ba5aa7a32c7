"""Whether a store's filesystem can hold its budget (`up` and `doctor` ask before a start)."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from epdctl.cache import make_store_dir
from epdctl.cache._format import ENTRY_SUFFIX
from epdctl.cache._recycle import FREE
from epdctl.cache.store import ENTRIES
from epdctl.errors import CacheError
from epdctl.units import format_bytes


def check_capacity(store_dir: str | os.PathLike[str], capacity_bytes: int) -> None:
    """CacheError unless `store_dir` is the user's own, writable, and its filesystem can
    hold the budget (it is created 0700 when missing)."""
    root = make_store_dir(store_dir)
    try:
        probe = root / f".probe.{os.getpid()}.{secrets.token_hex(8)}"
        # O_EXCL: a link planted at its name fails the probe instead of being followed.
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as exc:
        raise CacheError(f"the EC store `{root}` is not writable: {exc.strerror}") from None
    problem = capacity_problem(root, capacity_bytes)
    if problem:
        raise CacheError(problem)


class Usage(Protocol):
    """What capacity_problem reads of shutil.disk_usage's answer."""

    @property
    def total(self) -> int: ...
    @property
    def free(self) -> int: ...


DiskUsage = Callable[[Path], Usage]


def capacity_problem(
    store_dir: str | os.PathLike[str], capacity_bytes: int,
    disk_usage: DiskUsage = shutil.disk_usage,
) -> str | None:
    """Why the store's filesystem cannot hold the budget (entries and pooled files it holds
    count as room).

    Reads the nearest existing directory, so a store that does not exist yet is judged by
    the filesystem it will be created on. None when the budget fits.
    """
    root = Path(store_dir)
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    usage = disk_usage(existing)
    available = usage.free + _store_bytes(root)
    if available >= capacity_bytes:
        return None
    return (
        f"the EC store `{root}` has {format_bytes(available)} available "
        f"(filesystem size {format_bytes(usage.total)}) but the cache capacity is "
        f"{format_bytes(capacity_bytes)}; lower cache.capacity or enlarge the filesystem "
        "(Docker: --shm-size)"
    )


def _store_bytes(root: Path) -> int:
    """The bytes the store holds now: its entries and its pooled spare files."""
    total = 0
    for entry in (*root.glob(f"*/{ENTRIES}/*{ENTRY_SUFFIX}"), *root.glob(f"*/{FREE}/*")):
        try:
            total += entry.stat().st_size
        except FileNotFoundError:
            pass
    return total
