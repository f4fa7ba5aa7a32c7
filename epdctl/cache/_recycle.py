"""Recycling evicted entry files: overwriting allocated tmpfs pages is ~2x faster than new ones.

A fresh tmpfs file costs a page allocation (and zeroing) per 4 KiB before the copy; an
evicted entry's pages are already there. Safety rests on one invariant: a file in `free/`
has no name under `entries/`, so no new pin (a hard link of an entries/ name) can reach
it, and a writer claims it only after seeing `st_nlink == 1` (no pin left either).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

FREE = "free"
FREE_MAX_FILES = 8  # enough for a few steps' worth of saves; more is just held memory
FREE_TTL_S = 60.0  # an unused free file goes back to the kernel after this long


def _slot(free_dir: Path) -> str | None:
    """A fresh name in the pool, or None when the pool is full (or unreadable)."""
    try:
        if len(os.listdir(free_dir)) >= FREE_MAX_FILES:
            return None
    except OSError:
        return None
    return f"{free_dir}/{secrets.token_hex(8)}"


def retire(path: str, free_dir: Path) -> bool:
    """Move an entry file into the pool instead of deleting it; False if it was not moved."""
    dst = _slot(free_dir)
    if dst is None:
        return False
    try:
        os.rename(path, dst)
    except OSError:
        return False
    # A pin taken just before the rename still holds the inode: never hand it out.
    if os.stat(dst).st_nlink != 1:
        os.unlink(dst)
    return True


def keep_aside(entry: str, free_dir: Path) -> str | None:
    """Link the entry about to be replaced into the pool (called before the rename)."""
    dst = _slot(free_dir)
    if dst is None:
        return None
    try:
        os.link(entry, dst)
    except OSError:
        return None
    return dst


def settle(aside: str | None) -> None:
    """After the replacing rename: drop the pooled link if the old inode is still pinned."""
    if aside is None:
        return
    try:
        if os.stat(aside).st_nlink != 1:
            os.unlink(aside)
    except FileNotFoundError:
        pass


def claim(free_dir: Path, tmp: str, size: int) -> int | None:
    """Take the smallest pooled file of at least `size` bytes as `tmp`; an fd, or None."""
    try:
        candidates = []
        for item in os.scandir(free_dir):
            st = item.stat()
            if st.st_size >= size:
                candidates.append((st.st_size, item.path))
    except OSError:
        return None
    for _, path in sorted(candidates):
        try:
            os.rename(path, tmp)  # atomic: of two writers, one gets it
        except FileNotFoundError:
            continue
        fd = os.open(tmp, os.O_WRONLY)
        st = os.fstat(fd)
        if st.st_nlink == 1 and st.st_size >= size:
            return fd
        os.close(fd)
        os.unlink(tmp)
    return None


def expire(free_dir: Path, now: float | None = None, *, max_bytes: int | None = None) -> int:
    """Unlink pooled files unused for FREE_TTL_S, then the oldest past `max_bytes`."""
    now = time.time() if now is None else now
    try:
        items = [(item.stat(), item.path) for item in os.scandir(free_dir)]
    except OSError:
        return 0
    # ctime moves on rename and link: the time the file entered the pool.
    items.sort(key=lambda it: -it[0].st_ctime)
    kept = freed = 0
    for st, path in items:
        kept += st.st_size
        if now - st.st_ctime > FREE_TTL_S or (max_bytes is not None and kept > max_bytes):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            kept -= st.st_size
            freed += st.st_size
    return freed
