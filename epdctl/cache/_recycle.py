"""Recycling evicted entry files: overwriting allocated tmpfs pages is ~2x faster than new ones.

A fresh tmpfs file costs a page allocation (and zeroing) per 4 KiB before the copy; an
evicted entry's pages are already there, and so are the writer's and readers' kept
mappings of it (`_maps`), which turn both copies into plain memcpys.

Safety rests on one invariant: a file in `free/` has no name under `entries/`, so no new
pin (a hard link of an entries/ name) can reach it, and a writer claims it only after
seeing `st_nlink == 1` (no pin left either).
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path

FREE = "free"
FREE_MAX_FILES = 8  # enough for a few steps' worth of saves; more is just held memory
FREE_TTL_S = 60.0  # an unused free file goes back to the kernel after this long


def _pool_name(free_dir: Path, size: int) -> str:
    # The size leads the name: claim() picks a file without a stat per candidate.
    return f"{free_dir}/{size}.{secrets.token_hex(6)}"


def _pool_size(free_dir: Path) -> int:
    """Files in the pool; a missing or unreadable pool counts as full."""
    try:
        return len(os.listdir(free_dir))
    except OSError:
        return FREE_MAX_FILES + 1


def _slot(free_dir: Path, size: int) -> str | None:
    """A fresh pool name for a file of `size` bytes, or None when the pool is full."""
    return None if _pool_size(free_dir) >= FREE_MAX_FILES else _pool_name(free_dir, size)


def _named_size(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def retire(path: str, free_dir: Path, size: int) -> bool:
    """Move an entry file into the pool instead of deleting it; False if it was not moved."""
    dst = _slot(free_dir, size)
    if dst is None:
        return False
    try:
        os.rename(path, dst)
    except OSError:
        return False
    # A pin taken just before the rename still holds the inode: keep it out of the pool
    # (claim() checks again; a writer may even have claimed it already).
    try:
        if os.stat(dst).st_nlink != 1:
            os.unlink(dst)
    except FileNotFoundError:
        pass
    return True


def keep_aside(entry: str, free_dir: Path, size: int, *, check_room: bool = True) -> str | None:
    """Link the entry about to be replaced into the pool (called before the rename).

    `size`: the new entry's. Keys name content, so the replaced file is almost always
    the same size; claim() checks the real size (and that no pin holds the file: a
    pinned entry may slip in here) before it reuses one. `check_room=False` skips
    counting the pool when the caller has just taken a file out of it.
    """
    dst = _pool_name(free_dir, size)
    try:
        os.link(entry, dst)
    except OSError:
        return None  # a new key (nothing is replaced), or the pool is gone
    if check_room and _pool_size(free_dir) > FREE_MAX_FILES:
        os.unlink(dst)
        return None
    return dst


def claim(
    free_dir: Path, tmp: str, size: int, hint: str | None = None
) -> tuple[int, os.stat_result] | None:
    """Take the smallest pooled file of at least `size` bytes as `tmp`: (fd, its stat).

    `hint`: a pool file to try first (the one this writer put aside last), saving a listing.
    """
    if hint is not None and _named_size(os.path.basename(hint)) >= size:
        claimed = _take(hint, tmp, size)
        if claimed is not None:
            return claimed
    try:
        names = os.listdir(free_dir)
    except OSError:
        return None
    for _, name in sorted((n, name) for name in names if (n := _named_size(name)) >= size):
        claimed = _take(f"{free_dir}/{name}", tmp, size)
        if claimed is not None:
            return claimed
    return None


def _take(path: str, tmp: str, size: int) -> tuple[int, os.stat_result] | None:
    try:
        os.rename(path, tmp)  # atomic: of two writers, one gets it
    except FileNotFoundError:
        return None
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW)  # read too: the writer maps it
    except OSError:  # a link (never followed) or gone
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size >= size:
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)  # an older epdctl's entry (0644): the new one is private
        return fd, st
    os.close(fd)
    os.unlink(tmp)  # still pinned (or not ours): the pin keeps the bytes, the pool lets go
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
