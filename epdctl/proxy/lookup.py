"""The proxy's look into the topology's EC store: an item already there needs no E round trip.

The proxy shares the host with the store, so before the E stage it checks each item's entry
the way a consumer does (epdctl.cache: header, key, namespace, size; no pin) and keeps E's
per-item metadata beside the entry when E answers, so a skipped item can still be rewritten
to `*_embeds` metadata. A look is only a hint: the entry may go before PD loads it, and then
PD encodes the media itself, or a rewritten request is resent with its media
(generate.next_attempt). Stdlib and epdctl.cache only: no vLLM here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epdctl.cache.sidecar import read_meta, write_meta
from epdctl.cache.stats import StatsWriter
from epdctl.cache.store import Miss, Store
from epdctl.proxy.routing import MediaItem

STATS_WRITER = "proxy"
"""The proxy's counters file in the namespace's stats/ (`cache inspect`, `status`)."""


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
        self.store = Store(store_dir, namespace)
        self.stats = StatsWriter(self.store.root, STATS_WRITER)
        self.reporting: set[str] = set()
        """Modalities E has reported metadata for since this proxy started."""

    def find(self, unique: dict[str, MediaItem], needs_metadata: bool) -> dict[str, Hit]:
        """The items (by uuid) whose entry is complete and valid now.

        With `needs_metadata` (the rewrite is on) an entry without kept metadata is no hit
        for a modality E reports metadata for: E's answer will keep it, and later requests
        are rewritten again instead of PD preprocessing their media from then on.
        """
        hits = {}
        for uuid, item in unique.items():
            if isinstance(self.store.check(uuid), Miss):
                continue
            entry = read_meta(self.store, uuid)
            if entry is None and needs_metadata and item.modality in self.reporting:
                continue
            # Used now: the janitor's LRU and grace period count from here, so the entry
            # stays at least `cache.grace` for PD's load. False: it went since the check.
            if not self.store.touch(uuid):
                continue
            hits[uuid] = Hit(uuid, entry["metadata"] if entry else {}, entry or {})
        return hits

    def keep(self, item: MediaItem, key: str, entry: dict[str, Any]) -> None:
        """After E answered for `item`: keep its metadata beside the entry E saved."""
        if not entry.get("metadata"):
            return
        self.reporting.add(item.modality)
        # A key other than the uuid (mm kwargs, LoRA prefix) can never be looked up by uuid.
        if key == item.uuid:
            write_meta(self.store, key, entry)

    def count(self, lookups: int, skipped: int, sent: int) -> None:
        self.stats.add(lookups=lookups, skipped=skipped, sent=sent)

    def close(self) -> None:
        self.stats.close()
