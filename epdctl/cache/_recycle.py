"""The pool of spare entry files (`free/`): evicted entries recycled, new files stocked ahead.

A fresh tmpfs file costs a page allocation (and zeroing) per 4 KiB before the copy; a
pooled file's pages are already there, and so are the writer's and readers' kept
mappings of it (`_maps`), which turn both copies into plain memcpys. The pool is fed by
the janitor (evicted entries, at capacity) and by the writer's stocker (`_prefault`, while
the store fills up).

The pool counts in the store's capacity: entries plus pool stay within it (pool_limit),
and the pool is the first to give room back when entries need it.

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
FREE_TTL_S = 60.0  # an unused free file goes back to the kernel after this long (at least)
POOL_SHARE = 8  # the pool holds at most 1/POOL_SHARE of the capacity


def pool_name(free_dir: Path, size: int) -> str:
    # The size leads the name: claim() picks a file without a stat per candidate. The time
    # comes next, so of equal sizes the oldest goes first (readers have mapped it by then).
    return f"{free_dir}/{size}.{time.time_ns():016x}{secrets.token_hex(4)}"


def pool_files(free_dir: Path) -> list[tuple[str, int]]:
    """The pool's files now, with their sizes."""
    found = []
    try:
        with os.scandir(free_dir) as it:
            for item in it:
                try:
                    found.append((item.path, item.stat(follow_symlinks=False).st_size))
                except FileNotFoundError:
                    continue  # claimed or expired while listed
    except OSError:
        pass
    return found


def pool_usage(free_dir: Path) -> tuple[int, int]:
    """The pool's files and bytes now."""
    files = pool_files(free_dir)
    return len(files), sum(n for _, n in files)


def pool_limit(capacity_bytes: int, entries_bytes: int) -> int:
    """The most the pool may hold: what the entries leave of the capacity, and at most
    1/POOL_SHARE of it."""
    return max(0, min(capacity_bytes // POOL_SHARE, capacity_bytes - entries_bytes))


def pool_reserve(capacity_bytes: int, file_bytes: int) -> int:
    """What the janitor keeps free of entries at capacity, so that evicted files can wait in
    the pool for the next saves: whole files of `file_bytes` (what E writes), at most
    FREE_MAX_FILES and 1/POOL_SHARE of the capacity (none when not one file fits there)."""
    if file_bytes <= 0:
        return 0
    return min(FREE_MAX_FILES, capacity_bytes // POOL_SHARE // file_bytes) * file_bytes


def _pool_size(free_dir: Path) -> int:
    """Files in the pool; a missing or unreadable pool counts as full."""
    try:
        return len(os.listdir(free_dir))
    except OSError:
        return FREE_MAX_FILES + 1


def _slot(free_dir: Path, size: int) -> str | None:
    """A fresh pool name for a file of `size` bytes, or None when the pool is full."""
    return None if _pool_size(free_dir) >= FREE_MAX_FILES else pool_name(free_dir, size)


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
    dst = pool_name(free_dir, size)
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
    except OSError:  # another took it first, or the pool is broken: a fresh file then
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


def expire(free_dir: Path, now: float | None = None, *, max_bytes: int | None = None,
           ttl_s: float = FREE_TTL_S) -> int:
    """Unlink pooled files unused for `ttl_s`, then the oldest past `max_bytes`."""
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
        if now - st.st_ctime > ttl_s or (max_bytes is not None and kept > max_bytes):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            kept -= st.st_size
            freed += st.st_size
    return freed
