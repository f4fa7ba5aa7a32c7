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
is trimmed before it becomes an entry) never faults.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

SWEEP_S = 1.0


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
        self, fd: int, size: int, *, write: bool, st: os.stat_result | None = None
    ) -> memoryview:
        """The first `size` bytes of the file open as `fd` (its stat: `st`), kept mapped.

        Release the view (`with`) when done: a mapping in use is never dropped.
        """
        st = os.fstat(fd) if st is None else st
        if size > st.st_size:
            raise OSError(errno.EIO, f"file holds {st.st_size} bytes, {size} expected")
        key = (st.st_dev, st.st_ino, write)
        with self._lock:
            m = self._maps.get(key)
            if m is not None and m.length < size:
                # Mapped while the file was shorter (epdctl's files only shrink; safe anyway).
                if not self._drop(key):
                    os.close(self._maps.pop(key).fd)  # in use: its view keeps it mapped
                m = None
            if m is None:
                m = _map(fd, st.st_size, write)
                self._maps[key] = m
                for old in list(self._maps)[: max(0, len(self._maps) - self.max_maps)]:
                    self._drop(old)  # oldest first; one in use stays (BufferError)
            else:
                self._maps.move_to_end(key)
            # Exported under the lock: the sweeper cannot close a mapping in use.
            part = memoryview(m.mm)[:size]
        if self._sweeper_pid != os.getpid():
            self._start_sweeper()
        return part

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


# One set per process: E's writer and P's readers meet the same inodes again and again.
MAPPINGS = Mappings()
os.register_at_fork(after_in_child=MAPPINGS._after_fork)
