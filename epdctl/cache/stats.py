"""Per-engine hit/miss/save/load counters, written to the store and summed by inspect."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from epdctl.cache._format import name_part
from epdctl.cache.store import STATS
from epdctl.host import private

FLUSH_INTERVAL_S = 1.0
# Per-key hit counts kept per writer; older keys fall off so the file stays small.
MAX_KEYS = 1000
COUNTERS = ("hits", "misses", "invalid", "saves", "save_failures", "loads", "load_failures",
            "waits", "wait_s", "expired", "lookups", "skipped", "sent")
"""Engines count hits (per request item) to load_failures; consumers count the items they
waited for while an encoder computed them (overlap), the seconds waited, and the waits that
ended without the entry (then the item was encoded locally); the proxy counts the last
three, per distinct media item of a request: looked up in the store, found there (no E
sub-request), sent to an encoder."""


def hit_ratio(counts: Counter[str] | dict[str, float]) -> float | None:
    """The share of the proxy's store lookups that found the item (None: no lookup yet)."""
    lookups = counts.get("lookups", 0)
    return counts.get("skipped", 0) / lookups if lookups else None


class StatsWriter:
    """Counters of one engine process, flushed atomically at most every second."""

    def __init__(self, ns_dir: str | os.PathLike[str], writer_id: str) -> None:
        self.path = Path(ns_dir) / STATS / f"{name_part(writer_id)}.json"
        self.counts: Counter[str] = Counter()
        self.key_hits: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, key: str | None = None, **counts: float) -> None:
        """Bump counters (e.g. hits=1, load_bytes=n); `key` also counts a hit on it."""
        with self._lock:
            self.counts.update(counts)
            if key is not None:
                self.key_hits[key] = self.key_hits.pop(key, 0) + 1
                while len(self.key_hits) > MAX_KEYS:
                    self.key_hits.popitem(last=False)
        self._dirty.set()
        if self._thread is None:
            # Started lazily so that merely importing or constructing starts no thread.
            self._thread = threading.Thread(target=self._run, name="epdctl-ec-stats", daemon=True)
            self._thread.start()

    def set_totals(self, **counts: float) -> None:
        """Set counters to these totals, for a writer that counts on its own and calls
        flush() itself (the proxy: no lock or thread per request)."""
        with self._lock:
            self.counts.update({k: v - self.counts[k] for k, v in counts.items()})

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"counts": dict(self.counts), "key_hits": dict(self.key_hits)}

    def flush(self) -> None:
        """Write the counters now (an unguessable tmp, then rename) into a stats dir that is
        the user's alone; errors are ignored, stats are best effort."""
        self._dirty.clear()
        body = json.dumps({**self.snapshot(), "updated": time.time()}).encode()
        try:
            # Not parents=True: a namespace removed by `down` or `clean` stays removed.
            self.path.parent.mkdir(mode=private.DIR_MODE, exist_ok=True)
            if private.dir_problem(self.path.parent) is None:
                private.write_file(self.path, body)  # never through a planted link
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._dirty.set()
            self._thread.join(timeout=2.0)
        self.flush()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            self.flush()
            self._stop.wait(FLUSH_INTERVAL_S)


def read_stats(ns_dir: str | os.PathLike[str]) -> tuple[Counter[str], Counter[str]]:
    """Summed counters and per-key hits of every writer in a namespace."""
    counts: Counter[str] = Counter()
    key_hits: Counter[str] = Counter()
    for path in (Path(ns_dir) / STATS).glob("*.json"):
        try:
            data = json.loads(path.read_bytes())
            counts.update({k: v for k, v in data.get("counts", {}).items()})
            key_hits.update(data.get("key_hits", {}))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # a writer's file being replaced or damaged: skip it
    return counts, key_hits


def read_writers(ns_dir: str | os.PathLike[str]) -> dict[str, Counter[str]]:
    """Each writer's counters by its file's name (`<engine id>-<side>`), for `epdctl top`."""
    result: dict[str, Counter[str]] = {}
    for path in (Path(ns_dir) / STATS).glob("*.json"):
        try:
            result[path.stem] = Counter(json.loads(path.read_bytes()).get("counts", {}))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return result
