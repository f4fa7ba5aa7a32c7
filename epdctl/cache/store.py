"""One namespace of the EC store: atomic publish, hard-link pins, validated reads."""

from __future__ import annotations

import itertools
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from epdctl.cache import _recycle, make_store_dir
from epdctl.cache._format import (
    ENTRY_SUFFIX,
    PAGE_BYTES,
    EntryHeader,
    FormatError,
    decode_header,
    encode_header,
    key_filename,
    name_part,
    namespace_dirname,
    payload_nbytes,
)
from epdctl.cache._maps import MAPPINGS
from epdctl.cache._payload import Fill, fill_from
from epdctl.cache._payload import map_entry as map_entry
from epdctl.cache._payload import read_into as read_into
from epdctl.cache._prefault import Premapper, Stocker
from epdctl.errors import CacheError
from epdctl.host import private

if TYPE_CHECKING:
    from typing_extensions import Buffer

# EntryHeader and MAPPINGS (the entry format, the process's kept mappings), read_into and
# map_entry (_payload) are this module's public names for the connector's I/O, as well as
# the store's own.

ENTRIES, PINS, TMP, STATS, PENDING = "entries", "pins", "tmp", "stats", "pending"

_tmp_ids = itertools.count()
# In every tmp name: a name of ours cannot be guessed (and is created O_EXCL anyway).
TMP_TOKEN = secrets.token_hex(6)


@dataclass(frozen=True)
class Pin:
    """Hard links to one validated entry, one per loading rank; read through them."""

    paths: tuple[str, ...]
    header: EntryHeader


@dataclass(frozen=True)
class Miss:
    """Why an entry could not be pinned: missing, or invalid (with the reason)."""

    reason: str

    @property
    def is_missing(self) -> bool:
        return self.reason == "missing"


class Store:
    """Entries, pins and tmp files of one namespace under `store_dir/namespace`.

    `capacity_bytes`: the namespace's budget (cache.capacity). Given it, a process that
    publishes keeps the pool stocked with pre-faulted files within it (`stocker`).
    """

    def __init__(self, store_dir: str | os.PathLike[str], namespace: str,
                 capacity_bytes: int | None = None) -> None:
        self.namespace = namespace
        self.root = Path(store_dir) / namespace_dirname(namespace)
        self.entries = self.root / ENTRIES
        self.pins = self.root / PINS
        self.tmp = self.root / TMP
        self.pending = self.root / PENDING
        self.free = self.root / _recycle.FREE
        self._spare: str | None = None  # the file this writer last put in the pool
        self.capacity_bytes = capacity_bytes
        self.stocker: Stocker | None = None
        """Started by the first publish when there is a capacity to stock within."""
        self._premapper: Premapper | None = None
        self.refused: str | None = None
        """Why open() refused the store's directories; then nothing is read or written."""

    def create(self) -> Store:
        """Create the namespace's directories 0700 (idempotent); CacheError if the root or
        the namespace dir is not the user's alone (see make_store_dir)."""
        make_store_dir(self.root.parent)
        make_store_dir(self.root)
        # Inside a directory only we can write to, nobody else can have made these.
        for path in (self.entries, self.pins, self.tmp, self.free, self.pending,
                     self.root / STATS):
            path.mkdir(mode=private.DIR_MODE, exist_ok=True)
        return self

    def open(self) -> Store:
        """create(), except that a refused directory is recorded in `refused` instead of
        raised: every pin is then a miss and nothing is published (the connector's way, as
        an engine must not die of it)."""
        try:
            self.create()
        except CacheError as exc:
            self.refused = str(exc)
        return self

    @staticmethod
    def stem(key: str) -> str:
        """`key`'s file-name stem, as entry_stems lists it."""
        return key_filename(key)

    def entry_path(self, key: str) -> str:
        return f"{self.entries}/{key_filename(key)}{ENTRY_SUFFIX}"

    def has_entry(self, key: str) -> bool:
        return self.refused is None and os.path.exists(self.entry_path(key))

    def pending_path(self, key: str) -> str:
        return f"{self.pending}/{key_filename(key)}"

    def mark_pending(self, key: str, until: float) -> bool:
        """Say that an encoder is computing `key`'s entry, until epoch `until` at the
        latest: a consumer waits for the entry meanwhile instead of encoding the item itself.
        The mark is an empty file whose mtime is the deadline (one stat reads it)."""
        if self.refused is not None:
            return False
        path = self.pending_path(key)
        try:
            # Never through a link planted at its name (ELOOP): the mark is ours or none.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         private.FILE_MODE)
            try:
                os.utime(fd, (until, until))
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    def clear_pending(self, key: str) -> None:
        """The encoder answered (its entry is in, or will never be): nobody waits more."""
        try:
            os.unlink(self.pending_path(key))
        except OSError:
            pass

    def pending_until(self, key: str) -> float | None:
        """The deadline of `key`'s pending mark (epoch seconds), or None if unmarked."""
        if self.refused is not None:
            return None
        try:
            return os.stat(self.pending_path(key)).st_mtime
        except OSError:
            return None

    def entry_stems(self) -> set[str]:
        """The file-name stems (key_filename) of every entry now: one listdir, no stat."""
        if self.refused is not None:
            return set()
        try:
            names = os.listdir(self.entries)
        except (FileNotFoundError, NotADirectoryError):
            return set()
        return {n.removesuffix(ENTRY_SUFFIX) for n in names if n.endswith(ENTRY_SUFFIX)}

    def touch(self, key: str) -> bool:
        """Mark `key` used now (LRU and grace count from here); False if it is gone."""
        if self.refused is not None:
            return False
        try:
            os.utime(self.entry_path(key))
        except FileNotFoundError:
            return False
        return True

    def publish(
        self, key: str, data: Buffer | Fill, *, dtype: str, shape: tuple[int, ...]
    ) -> int:
        """Write an entry atomically and return its payload size; OSError on failure.

        `data`: the payload bytes, or a function that writes them into the entry (it gets
        the mapped payload, a memoryview of exactly the payload's size).
        """
        if self.refused is not None:
            raise CacheError(self.refused)
        header = encode_header(key, self.namespace, dtype, shape, time.time_ns())
        nbytes = payload_nbytes(dtype, shape)
        fill = data if callable(data) else fill_from(data, nbytes)
        name = key_filename(key)
        tmp = f"{self.tmp}/{name}.{os.getpid()}.{TMP_TOKEN}{next(_tmp_ids)}"
        total = len(header) + nbytes
        claimed = _recycle.claim(self.free, tmp, total, self._spare)
        if claimed is None:
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, private.FILE_MODE)
            except FileNotFoundError:
                self.create()
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, private.FILE_MODE)
            size, st = 0, None
        else:
            fd, st = claimed
            size = st.st_size
        try:
            if size < total:
                # A new file: allocate its pages now, so a full tmpfs is ENOSPC here and
                # not a SIGBUS in the middle of the copy through the mapping.
                os.posix_fallocate(fd, 0, total)
            with MAPPINGS.view(fd, total, write=True, st=st) as mapped:
                mapped[: len(header)] = header
                if nbytes:
                    fill(mapped[len(header) :])
            if size > total:
                os.ftruncate(fd, total)  # a recycled file was larger
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        entry = f"{self.entries}/{name}{ENTRY_SUFFIX}"
        aside = _recycle.keep_aside(entry, self.free, total, check_room=claimed is None)
        # No fsync: tmpfs has nothing to flush, and rename is atomic; two writers of
        # one key both finish and the last rename wins.
        try:
            os.rename(tmp, entry)
        except BaseException:
            _unlink(tmp)
            raise
        self._spare = aside
        if self.capacity_bytes is not None:
            if self.stocker is None:
                self.stocker = Stocker(self.entries, self.tmp, self.free, self.capacity_bytes)
            self.stocker.wrote(total)
        return nbytes

    def watch_pool(self) -> None:
        """Map the pool's files ahead in this (reader) process as they appear, read-only as
        read_into maps an entry (a first load goes that way on CUDA too, through staging)."""
        if self.refused is None and self._premapper is None:
            self._premapper = Premapper(self.free)
            self._premapper.start()

    def close(self) -> None:
        """Stop this store's background threads (stocking, pre-mapping)."""
        for worker in (self.stocker, self._premapper):
            if worker is not None:
                worker.close()

    def pin(
        self,
        key: str,
        *,
        engine: str,
        request: str,
        index: int,
        rows: int | None = None,
        dtype: str | None = None,
        ranks: int = 1,
    ) -> Pin | Miss:
        """Pin `key` for `ranks` readers and validate it; a Miss instead of an error."""
        if self.refused is not None:
            return Miss("refused store")
        created = time.time_ns()
        owner = f"{name_part(engine)}.{name_part(request)}.{index}"
        base = f"{self.pins}/{key_filename(key)}.{owner}"
        paths = tuple(f"{base}.{rank}.{created}" for rank in range(ranks))
        try:
            # Link first, validate second: a link either pins the inode or fails,
            # so eviction after this point can no longer take the bytes away.
            self._link(self.entry_path(key), paths[0])
        except FileNotFoundError:
            return Miss("missing")
        except OSError as exc:
            return Miss(f"pin failed: {exc.strerror}")
        reason = _validate(paths[0], key, self.namespace, rows, dtype)
        if isinstance(reason, Miss):
            _unlink(paths[0])
            return reason
        try:
            for path in paths[1:]:
                os.link(paths[0], path)
        except OSError as exc:
            unpin(paths)
            return Miss(f"pin failed: {exc.strerror}")
        return Pin(paths, reason)

    def check(self, key: str) -> EntryHeader | Miss:
        """Validate `key`'s entry as a consumer would, without pinning it (the proxy's look:
        the entry may still go before anyone loads it)."""
        if self.refused is not None:
            return Miss("refused store")
        return _validate(self.entry_path(key), key, self.namespace, None, None)

    def renew(self, pin: Pin) -> Pin:
        """The same pin under fresh names, so the janitor's pin TTL starts again."""
        created = time.time_ns()
        paths = tuple(f"{p.rsplit('.', 1)[0]}.{created}" for p in pin.paths)
        try:
            for old, new in zip(pin.paths, paths, strict=True):
                os.link(old, new)
        except OSError:
            unpin(paths)
            return pin  # keep the old names; they are still valid until the pin TTL
        unpin(pin.paths)
        return Pin(paths, pin.header)

    def _link(self, src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except FileNotFoundError:
            if self.pins.is_dir():
                raise
            # `cache clean --all` may have removed the namespace's dirs under us.
            self.create()
            os.link(src, dst)


def _validate(
    path: str, key: str, namespace: str, rows: int | None, dtype: str | None
) -> EntryHeader | Miss:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            head = os.pread(fd, PAGE_BYTES, 0)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        header = decode_header(head)
    except FormatError as exc:
        return Miss(f"corrupt: {exc}")
    except FileNotFoundError:
        return Miss("missing")
    except OSError as exc:
        return Miss(f"unreadable: {exc.strerror}")
    if header.key != key:
        return Miss(f"key mismatch: {header.key!r}")
    if header.namespace != namespace:
        return Miss(f"namespace {header.namespace!r}")
    if dtype is not None and header.dtype != dtype:
        return Miss(f"dtype {header.dtype}, expected {dtype}")
    if rows is not None and (len(header.shape) < 1 or header.rows != rows):
        return Miss(f"shape {list(header.shape)}, expected {rows} rows")
    if size < header.data_offset:
        return Miss(f"corrupt: truncated inside its header ({size} bytes)")
    if size - header.data_offset != header.nbytes:
        return Miss(f"size {size - header.data_offset}, expected {header.nbytes}")
    return header


def unpin(paths: tuple[str, ...] | list[str]) -> None:
    """Drop pins (a pin that is already gone is fine)."""
    for path in paths:
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
