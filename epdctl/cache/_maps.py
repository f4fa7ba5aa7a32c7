"""Shared mappings of store files, kept per process and found again by inode.

A copy into or out of a tmpfs file through `write()`, `preadv()` or a fresh `mmap` pays
for setting up each 4 KiB page and runs at about half of memcpy speed. Through a mapping
whose page tables are already filled it runs at memcpy speed. Entry files are recycled
(`_recycle`): at capacity the same inodes come back to the writer and to the readers, so
each process keeps its mappings, keyed by inode, and its copies become plain memcpys.

A kept mapping holds its file's pages. A sweeper thread drops the mappings of files that
no directory names any more (`st_nlink == 0`: evicted, not recycled) within `SWEEP_S`,
so memory the janitor frees goes back to the kernel even while this process is idle.
Accesses never go past the file's current size, so a file cut shorter (a recycled file
is trimmed before it becomes an entry) never faults. A new entry gets a kept mapping ahead
of its first copy too: the writer maps and pre-faults the files it stocks the pool with,
and readers map pooled files as they appear (`_prefault`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SWEEP_S = 1.0
# madvise options of Linux 5.14 that Python 3.11's mmap module does not name yet.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
PREFAULT_CHUNK_BYTES = 1 << 20
PAGE_BYTES = mmap.PAGESIZE


@dataclass
class _Map:
    fd: int  # our own descriptor: fstat() tells when the file is gone
    mm: mmap.mmap
    length: int
    # Run before the mapping goes (e.g. the connector's CUDA registration is undone).
    finalizers: list[Callable[[], None]] = field(default_factory=list)


def _max_maps() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Two descriptors per mapping (ours and mmap's own dup); leave the engine most of them.
    return max(16, min(1024, soft // 8)) if soft != resource.RLIM_INFINITY else 1024


class Mappings:
    """Mappings of store files by (device, inode, writable), least recently used first."""

    def __init__(self, max_maps: int | None = None, sweep_s: float = SWEEP_S) -> None:
        self.max_maps = _max_maps() if max_maps is None else max_maps
        self.sweep_s = sweep_s
        self._maps: OrderedDict[tuple[int, int, bool], _Map] = OrderedDict()
        self._lock = threading.Lock()
        self._sweeper_pid: int | None = None

    def __len__(self) -> int:
        return len(self._maps)

    def view(
        self, fd: int, size: int, *, write: bool, st: os.stat_result | None = None,
        populate: bool = False,
    ) -> memoryview:
        """The first `size` bytes of the file open as `fd` (its stat: `st`), kept mapped.

        Release the view (`with`) when done: a mapping in use is never dropped. `populate`:
        fault a new mapping's pages in before it is kept (prefault), so that the next copy
        through it runs at memcpy speed (the pool's stocker and pre-mapper).
        """
        st = os.fstat(fd) if st is None else st
        if size > st.st_size:
            raise OSError(errno.EIO, f"file holds {st.st_size} bytes, {size} expected")
        key = (st.st_dev, st.st_ino, write)
        with self._lock:
            part = self._find(key, size)
        if part is None:
            # Mapped (and pre-faulted) outside the lock: a copy in another thread must not
            # wait for this one's page faults.
            m = _map(fd, st.st_size, write)
            if populate:
                try:
                    prefault(m.mm, write=write)
                except BaseException:
                    _close(m)
                    raise
            with self._lock:
                part = self._find(key, size)
                if part is None:
                    self._maps[key] = m
                    for old in list(self._maps)[: max(0, len(self._maps) - self.max_maps)]:
                        self._drop(old)  # oldest first; one in use stays (BufferError)
                    # Exported under the lock: the sweeper cannot close a mapping in use.
                    part = memoryview(m.mm)[:size]
            if part.obj is not m.mm:  # another thread mapped the file first: use its mapping
                _close(m)
        if self._sweeper_pid != os.getpid():
            self._start_sweeper()
        return part

    def _find(self, key: tuple[int, int, bool], size: int) -> memoryview | None:
        """The kept mapping of `key` as a view of `size` bytes (lock held), or None."""
        m = self._maps.get(key)
        if m is None:
            return None
        if m.length < size:
            # Mapped while the file was shorter (epdctl's files only shrink; safe anyway).
            if not self._drop(key):
                os.close(self._maps.pop(key).fd)  # in use: its view keeps it mapped
            return None
        self._maps.move_to_end(key)
        return memoryview(m.mm)[:size]

    def is_mapped(self, st: os.stat_result, *, write: bool) -> bool:
        """Whether the file `st` describes is kept mapped (writable or read-only) here."""
        with self._lock:
            return (st.st_dev, st.st_ino, write) in self._maps

    def sweep(self) -> int:
        """Drop mappings of files no longer named anywhere; returns how many."""
        dropped = 0
        with self._lock:
            for key, m in list(self._maps.items()):
                try:
                    gone = os.fstat(m.fd).st_nlink == 0
                except OSError:
                    gone = True
                if gone and self._drop(key):
                    dropped += 1
        return dropped

    def on_drop(self, mm: object, fn: Callable[[], None]) -> bool:
        """Call `fn` before the kept mapping `mm` (a view's `.obj`) goes; False if not kept."""
        with self._lock:
            for m in self._maps.values():
                if m.mm is mm:
                    m.finalizers.append(fn)
                    return True
        return False

    def clear(self) -> None:
        with self._lock:
            for key in list(self._maps):
                self._drop(key)

    def _drop(self, key: tuple[int, int, bool]) -> bool:
        m = self._maps[key]
        while m.finalizers:
            try:
                m.finalizers.pop()()
            except Exception:  # a finalizer must not keep the memory mapped
                pass
        try:
            m.mm.close()
        except BufferError:
            return False  # a copy is using it; the next sweep tries again
        del self._maps[key]
        os.close(m.fd)
        return True

    def _after_fork(self) -> None:
        # A child may be forked while the parent's sweeper holds the lock; its copies of the
        # mappings stay valid, and its own sweeper starts on first use.
        self._lock = threading.Lock()
        self._sweeper_pid = None

    def _start_sweeper(self) -> None:
        pid = os.getpid()
        # First use in this process (threads do not survive a fork: start one per pid).
        with self._lock:
            if self._sweeper_pid == pid:
                return
            self._sweeper_pid = pid
        threading.Thread(target=self._sweep_forever, name="epdctl-ec-maps", daemon=True).start()

    def _sweep_forever(self) -> None:
        event = threading.Event()
        while not event.wait(self.sweep_s):
            self.sweep()


def _map(fd: int, length: int, write: bool) -> _Map:
    own = os.dup(fd)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        mm = mmap.mmap(own, length, flags=mmap.MAP_SHARED, prot=prot)
    except (ValueError, OSError) as exc:
        os.close(own)
        if isinstance(exc, OSError):
            raise
        raise OSError(errno.EINVAL, f"cannot map the file: {exc}") from None
    return _Map(own, mm, length)


def _close(m: _Map) -> None:
    m.mm.close()
    os.close(m.fd)


def prefault(mm: mmap.mmap, *, write: bool) -> None:
    """Fault every page of `mm` in now: allocate (and zero) a new file's pages, fill the
    page tables. In chunks, so that no other thread waits long for this process's mmap
    lock (one MAP_POPULATE of 64 MiB holds it for 100+ ms); a writable mapping's chunks
    (allocating and zeroing: the costly kind) with the GIL released, too."""
    address = None
    if write:
        try:
            anchor = ctypes.c_char.from_buffer(mm)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # not writable after all, or empty
            pass
        else:
            address = ctypes.addressof(anchor)
            del anchor  # the address stays valid while `mm` is mapped; the export must go
    option = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    for start in range(0, len(mm), PREFAULT_CHUNK_BYTES):
        length = min(PREFAULT_CHUNK_BYTES, len(mm) - start)
        if address is not None and _madvise(address + start, length, option):
            continue
        try:
            mm.madvise(option, start, length)
        except OSError:  # before Linux 5.14 (EINVAL): touch a byte of every page instead
            for offset in range(start, start + length, PAGE_BYTES):
                if write:
                    mm[offset] = mm[offset]  # nobody else writes a pooled file
                else:
                    _ = mm[offset]


def _madvise(address: int, length: int, option: int) -> bool:
    """madvise(2) through ctypes, which releases the GIL for the call; False if it failed."""
    global _libc_madvise
    if _libc_madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        _libc_madvise = libc.madvise
        _libc_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_madvise.restype = ctypes.c_int
    return bool(_libc_madvise(address, length, option) == 0)


_libc_madvise: Any = None


# One set per process: E's writer and P's readers meet the same inodes again and again.
MAPPINGS = Mappings()
os.register_at_fork(after_in_child=MAPPINGS._after_fork)
