"""Pre-faulted pool files, made off the critical path: the writer stocks, readers map ahead.

A store that is still filling up evicts nothing, so nothing is recycled (`_recycle`): every
save would go into a fresh tmpfs file and pay a page allocation and zeroing per 4 KiB on the
request's critical path (0.1x a memcpy; 0.9x through a kept, pre-faulted mapping). So the
writer process keeps the pool stocked instead: a background thread makes files of the size
E writes, allocated and pre-faulted through this process's kept mappings (`_maps`), within
the store's capacity (`_recycle.pool_limit`). A save claims one and copies at memcpy speed.
Readers (P/PD) watch the pool and map its files as they appear, so their first read of the
entry such a file becomes finds its pages mapped as well.

Neither ever creates a store directory: once `down` or `cache clean --all` removed the
namespace, nothing is stocked there again.
"""

from __future__ import annotations

import collections
import os
import secrets
import stat
import threading
import time
from pathlib import Path

from epdctl.cache import _recycle
from epdctl.cache._format import ENTRY_SUFFIX
from epdctl.cache._maps import MAPPINGS, Mappings
from epdctl.host import private

RECENT_SIZES = 8  # the stocker makes files of the largest of the last saves' sizes
# The stocker waits until saves have been quiet this long, plus the time a slow copy of the
# entry takes: right after a save PD reads it, and zeroing pages beside that copy takes its
# CPU and memory bandwidth (a 9 MiB round trip went 1.2 -> 45 ms, best of 11, on a busy
# 2-core VM). A pass also yields to the next save after each file.
QUIET_S = 0.005
QUIET_BYTES_PER_S = 1e9
IDLE_POLL_S = 0.05  # how often an idle stocker looks for saves (saves do not wake it)
# Both threads run this much nicer than the engine (Linux: per thread): the CPU goes to the
# requests first, and the pool's 8 files leave the stocker time to catch up.
BACKGROUND_NICE = 10
WATCH_S = 0.05  # how often a reader looks for new pooled files (one listdir)
STOP_TIMEOUT_S = 5.0


def entries_bytes(entries: Path) -> int:
    """The bytes of every entry file now (what the janitor counts against the capacity)."""
    total = 0
    try:
        with os.scandir(entries) as it:
            for item in it:
                if item.name.endswith(ENTRY_SUFFIX):
                    try:
                        total += item.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
    except OSError:
        pass
    return total


class Stocker:
    """Keeps a namespace's pool stocked with pre-faulted files of the size saves need.

    `wrote()` (after each save) tells a daemon thread, started in the process that saves;
    once saves have been quiet for a while (QUIET_S) it adds files until the pool holds
    FREE_MAX_FILES that fit, or the capacity leaves no room for another (entries + pool
    within `capacity_bytes`, pool within its share), or another save comes.
    """

    def __init__(self, entries: Path, tmp: Path, free: Path, capacity_bytes: int,
                 mappings: Mappings = MAPPINGS) -> None:
        self.entries, self.tmp, self.free = entries, tmp, free
        self.capacity_bytes = capacity_bytes
        self.mappings = mappings
        self._sizes: collections.deque[int] = collections.deque(maxlen=RECENT_SIZES)
        self._cond = threading.Condition()
        self._wanted = self._done = 0  # wake-ups asked for, and those served
        self._last_save = 0.0  # monotonic
        self._stopped = False
        self._pid: int | None = None
        self._thread: threading.Thread | None = None

    def wrote(self, size_bytes: int) -> None:
        """A save of `size_bytes` (header included) happened: restock in the background.

        The thread is not woken here: woken in the middle of the hand-off it would take the
        GIL back from the saving thread, and a busy machine may deschedule it while it holds
        it (the save then waits milliseconds). It looks every IDLE_POLL_S instead.
        """
        with self._cond:
            self._sizes.append(size_bytes)
            self._wanted += 1
            self._last_save = time.monotonic()
            if self._pid != os.getpid() and not self._stopped:
                # First save in this process (threads do not survive a fork).
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="epdctl-ec-stock",
                                                daemon=True)
                self._thread.start()

    def settled(self, timeout_s: float) -> bool:
        """Wait until every save so far has been answered by a stocking pass."""
        with self._cond:
            return self._cond.wait_for(lambda: self._done == self._wanted or self._stopped,
                                       timeout_s)

    def close(self) -> None:
        """Stop the thread (a pass in progress ends after its current file)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)

    def stock(self) -> int:
        """One pass, in the calling thread: the files it added to the pool (it stops early
        when a save happens meanwhile)."""
        with self._cond:
            size = max(self._sizes, default=0)
            wanted = self._wanted
        added = 0
        while size and not self._stopped and wanted == self._wanted and self._has_room(size):
            path = self._stock_one(size)
            if path is None:
                break
            if not self._has_room(0):
                # Another writer stocked (or saved) meanwhile: ours goes back.
                _unlink(path)
                break
            added += 1
        return added

    def _has_room(self, size: int) -> bool:
        """Whether the pool may take one more file of `size` bytes (0: whether it is within
        its limits as it is)."""
        files = _recycle.pool_files(self.free)
        if size and sum(1 for _, n in files if n >= size) >= _recycle.FREE_MAX_FILES:
            return False  # stocked enough for the next saves
        if len(files) + (1 if size else 0) > _recycle.FREE_MAX_FILES:
            return False
        pooled = sum(n for _, n in files) + size
        return pooled <= _recycle.pool_limit(self.capacity_bytes, entries_bytes(self.entries))

    def _stock_one(self, size: int) -> str | None:
        # `<x>.<pid>.<token>`: the janitor reads the writer's pid from a tmp file's name.
        tmp = f"{self.tmp}/pool.{os.getpid()}.{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         private.FILE_MODE)
        except OSError:
            return None  # the namespace is gone: never create it again
        try:
            # Allocated first: a full tmpfs is ENOSPC here, not SIGBUS while pre-faulting.
            os.posix_fallocate(fd, 0, size)
            self.mappings.view(fd, size, write=True, populate=True).release()
            path = _recycle.pool_name(self.free, size)
            os.rename(tmp, path)
        except OSError:
            _unlink(tmp)
            return None
        finally:
            os.close(fd)
        return path

    def _run(self) -> None:
        _be_nice()
        while True:
            with self._cond:
                # Until there are saves to answer and they have been quiet for a while.
                while not self._stopped:
                    if self._done == self._wanted:
                        self._cond.wait(IDLE_POLL_S)
                        continue
                    size = max(self._sizes, default=0)
                    left = self._last_save + QUIET_S + size / QUIET_BYTES_PER_S - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._stopped:
                    return
                wanted = self._wanted
            try:
                self.stock()
            except OSError:
                pass  # best effort: a save that finds no pooled file writes a fresh one
            with self._cond:
                self._done = wanted
                self._cond.notify_all()


class Premapper:
    """Maps a namespace's pooled files in a reader process as they appear (kept, pre-faulted),
    so that the entry one becomes is read through page tables already filled."""

    def __init__(self, free: Path, mappings: Mappings = MAPPINGS,
                 watch_s: float = WATCH_S) -> None:
        self.free = free
        self.mappings = mappings
        self.watch_s = watch_s
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="epdctl-ec-premap",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_S)

    def scan(self) -> int:
        """One look at the pool: map the files not seen before; returns how many."""
        try:
            names = set(os.listdir(self.free))
        except OSError:
            names = set()
        self._seen &= names  # claimed or expired files are forgotten
        mapped = 0
        for name in names - self._seen:
            self._seen.add(name)
            mapped += self._map(f"{self.free}/{name}")
        return mapped

    def _map(self, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return 0  # claimed by a writer meanwhile (or a link: never followed)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                return 0
            self.mappings.view(fd, st.st_size, write=False, st=st, populate=True).release()
        except OSError:
            return 0
        finally:
            os.close(fd)
        return 1

    def _run(self) -> None:
        _be_nice()
        while not self._stop.wait(self.watch_s):
            self.scan()


def _be_nice() -> None:
    """Lower the calling thread's priority by BACKGROUND_NICE (best effort)."""
    try:
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + BACKGROUND_NICE))
    except (OSError, AttributeError):
        pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
