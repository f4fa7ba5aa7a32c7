"""The proxy's look into the topology's EC store: an item already there needs no E round trip.

The proxy shares the host with the store, so before the E stage it checks each item's entry
the way a consumer does (epdctl.cache: header, key, namespace, size; no pin) and keeps E's
per-item metadata beside the entry when E answers, so a skipped item can still be rewritten
to `*_embeds` metadata. A look is only a hint: the entry may go before PD loads it, and then
PD encodes the media itself, or a rewritten request is resent with its media
(the attempt policy: attempts.py). Stdlib and epdctl.cache only: no vLLM here.

File-system calls cost far more inside the busy proxy than their own time (measured: a
missed lookup by open(2) added ~5 % of the proxy's CPU per image request), so a key is
checked on disk only when an index says its entry may be there: the names the last scan of
`entries/` saw (every SCAN_INTERVAL_S) and the keys E answered for since. An entry another
writer made since the last scan is found by the next one; until then its item goes to E.

Neither the scan nor a hit's checks run on the event loop: a listing of thousands of entries
and a hit's header read, sidecar read and `utime` run in a worker thread (asyncio.to_thread),
the loop only tests names against the index. Scans run one at a time (a lock, which close()
waits on too). A scan lists `entries/` again only when the directory changed since the last
listing (its inode and mtime), so a large store that holds still costs one stat a second.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from epdctl.cache.sidecar import read_meta, write_meta
from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import Miss, Store
from epdctl.proxy.request.parse import MediaItem

STATS_WRITER = "proxy"
"""The proxy's counters file in the namespace's stats/ (`cache inspect`, `status`)."""
SCAN_INTERVAL_S = 1.0
"""How often the index is rebuilt from `entries/`, E's metadata written beside its entries
and the counters flushed."""
SAME_TICK_NS = 100_000_000
"""A listing is reused while `entries/` is unchanged only if its last change was this long
before the listing began: a change in the same clock tick as a listing (a directory's mtime
is coarse) may be missing from it yet leave the mtime as it was."""


Kept = tuple[dict[str, Any], str]
"""E's ec_transfer_params entry for an item, and the item's modality."""


@dataclass(frozen=True)
class Hit:
    """An item whose entry is in the store, with what E reported for it (if kept)."""

    key: str
    metadata: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    """E's whole ec_transfer_params entry for the item, as PD would have got it."""


class StoreLookup:
    """Looks items up in one namespace and keeps E's metadata there; counts both."""

    def __init__(self, store_dir: str, namespace: str) -> None:
        # Refused (not the user's alone, see epdctl.host.private): every look is a miss.
        self.store = Store(store_dir, namespace).open()
        self.reporting: set[str] = set()
        """Modalities E has reported metadata for since this proxy started."""
        self.silent: set[str] = set()
        """Modalities E has answered for without metadata (nothing to rewrite them to)."""
        self._stems: set[str] = set()  # entries the last scan saw, and E's keys since
        self._added: set[str] = set()  # E's keys since the running scan began
        # E's entries (and the items' modalities) not yet kept beside theirs, and those the
        # running scan is keeping.
        self._fresh: dict[str, Kept] = {}
        self._writing: dict[str, Kept] = {}
        self._scan_lock = threading.Lock()
        # Plain counts on the hot path; scan() writes them for `cache inspect`.
        self.lookups = self.skipped = self.sent = 0
        # A refused store is written nothing, not even counters (its stats/ is theirs).
        self._stats = None if self.store.refused else StatsWriter(self.store.root, STATS_WRITER)
        self._flushed = (0, 0, 0)
        self._listed: tuple[tuple[int, int] | None, int, set[str]] = (None, 0, set())
        """The last listing: entries/' (inode, mtime_ns), when it began, the stems."""
        self.scan()

    async def find_off_loop(self, unique: dict[str, MediaItem],
                            needs_metadata: bool) -> dict[str, Hit]:
        """find(), its file-system calls in a worker thread; the loop only tests the index
        (no thread at all when no item is in it: a miss costs a set lookup)."""
        candidates = {uuid: item for uuid, item in unique.items()
                      if Store.stem(uuid) in self._stems}
        if not candidates:
            return {}
        return await asyncio.to_thread(self.find, candidates, needs_metadata)

    def find(self, unique: dict[str, MediaItem], needs_metadata: bool) -> dict[str, Hit]:
        """The items (by uuid) whose entry is complete and valid now (blocking: file-system
        calls per indexed item; the proxy calls it through find_off_loop).

        With `needs_metadata` (the rewrite is on) an entry without kept metadata is no hit
        for a modality E reports metadata for: E's answer will keep it, and later requests
        are rewritten again instead of PD preprocessing their media from then on.
        """
        hits = {}
        for uuid, item in unique.items():
            stem = Store.stem(uuid)
            if stem not in self._stems:
                continue
            if isinstance(self.store.check(uuid), Miss):
                self._stems.discard(stem)
                continue
            fresh = self._fresh.get(uuid) or self._writing.get(uuid)
            entry = fresh[0] if fresh and fresh[0].get("metadata") else read_meta(
                self.store, uuid)
            if entry is None and needs_metadata and item.modality in self.reporting:
                continue
            # Used now: the janitor's LRU and grace period count from here, so the entry
            # stays at least `cache.grace` for PD's load. False: it went since the check.
            if not self.store.touch(uuid):
                continue
            hits[uuid] = Hit(uuid, entry["metadata"] if entry else {}, entry or {})
        return hits

    def keep(self, item: MediaItem, key: str, entry: dict[str, Any]) -> None:
        """After E answered for `item`: its entry is in the store now (E saves before it
        answers); its metadata goes beside it at the next scan."""
        has_metadata = bool(entry.get("metadata"))
        (self.reporting if has_metadata else self.silent).add(item.modality)
        # A key other than the uuid (mm kwargs, LoRA prefix) can never be looked up by uuid.
        if key != item.uuid:
            return
        stem = Store.stem(key)
        self._stems.add(stem)
        self._added.add(stem)
        # Kept for every item (its modality at least, for `cache inspect --entries`).
        self._fresh[key] = (entry, item.modality)

    def count(self, lookups: int, skipped: int, sent: int) -> None:
        self.lookups += lookups
        self.skipped += skipped
        self.sent += sent

    def scan(self) -> None:
        """Rebuild the index from `entries/`, keep E's fresh metadata beside the entries it
        describes (atomically), and flush the counters if they changed; all here and now
        (at start and close; run_scans does the file work in a thread)."""
        self._apply(self._scan_files(*self._take()))

    async def run_scans(self) -> None:
        """A scan every SCAN_INTERVAL_S, its file work in a worker thread; a task beside the
        server, cancelled with it."""
        while True:
            await asyncio.sleep(SCAN_INTERVAL_S)
            job = self._take()
            self._apply(await asyncio.to_thread(self._scan_files, *job))

    def _take(self) -> tuple[dict[str, Kept], tuple[int, int, int]]:
        """On the loop: what a scan writes (E's fresh metadata, the counters), taken; with
        what a scan that never finished (cancelled at shutdown) had taken."""
        self._writing, self._fresh = {**self._writing, **self._fresh}, {}
        self._added = set()
        return self._writing, (self.lookups, self.skipped, self.sent)

    def _scan_files(self, fresh: dict[str, Kept], totals: tuple[int, int, int]) -> set[str]:
        """The blocking part of a scan (any thread): list, write metadata, flush counters."""
        with self._scan_lock:
            stems = self._entry_stems()
            for key, (entry, modality) in fresh.items():
                if Store.stem(key) in stems:
                    write_meta(self.store, key, entry, modality)
            if totals != self._flushed and self._stats is not None:
                self._stats.set_totals(lookups=totals[0], skipped=totals[1], sent=totals[2])
                self._stats.flush()  # best effort, like every stats writer
                self._flushed = totals
            return stems

    def _entry_stems(self) -> set[str]:
        """The store's entry stems: the last listing while `entries/` holds still."""
        began = time.time_ns()
        try:
            st = os.stat(self.store.entries)
            mark: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
        except OSError:
            mark = None
        last_mark, last_began, last_stems = self._listed
        if mark is not None and mark == last_mark and last_began - mark[1] > SAME_TICK_NS:
            return last_stems
        stems = self.store.entry_stems()
        self._listed = (mark, began, stems)
        return stems

    def _apply(self, stems: set[str]) -> None:
        """On the loop: the new index, with the keys E answered for while it was made."""
        self._stems = stems | self._added
        self._added = set()
        self._writing = {}

    def close(self) -> None:
        self.scan()
