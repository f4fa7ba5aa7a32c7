"""The scheduler side of the connector: pins, local-encode choices, per-step metadata."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata
from vllm.distributed.ec_transfer.ec_connector.utils import (
    PlaceholderMetadataResolver,
    collect_ec_item_metadata,
)
from vllm.logger import init_logger

from epdctl.cache.store import EntryHeader, Miss, Pin, Store, unpin

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")

# Held pins get fresh names after this long, well inside the janitor's PIN_TTL_S.
PIN_RENEW_S = 120.0
# A request waiting for an item an encoder is computing (a pending mark) looks at the store
# again after FIRST_LOOK_S, then after twice as long each time, up to LAST_LOOK_S: a waiting
# engine steps about every millisecond, and each look is a link and a stat. The wait itself
# ends at the mark's deadline (the proxy's encode timeout), never earlier.
FIRST_LOOK_S = 0.001
LAST_LOOK_S = 0.050


class Clock(Protocol):
    """The scheduler's time: `monotonic` for its own intervals, `wall` for a mark's deadline
    (an epoch, the mark's mtime). A seam: tests step a clock of their own."""

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    monotonic = staticmethod(time.monotonic)
    wall = staticmethod(time.time)


@dataclass(frozen=True)
class Load:
    mm_hash: str
    paths: tuple[str, ...]  # one pin per loading rank
    header: EntryHeader


@dataclass
class EpdctlECMetadata(ECConnectorMetadata):
    """Scheduler -> worker, once per step: entries to load, items to republish."""

    loads: list[Load] = field(default_factory=list)
    republish: list[str] = field(default_factory=list)


@dataclass
class _Held:
    pin: Pin
    requests: set[str]
    pinned_at: float


@dataclass
class _Wait:
    """One request waiting for one pending item: since when, and when to look again."""

    since: float
    look_at: float
    interval: float = FIRST_LOOK_S


class SchedulerSide:
    """What the scheduler process keeps: validated pins and each request's fate."""

    def __init__(
        self,
        store: Store,
        *,
        engine_id: str,
        dtype: str | None,
        ranks: int,
        resolver: PlaceholderMetadataResolver,
        stat: Callable[..., None],
        clock: Clock | None = None,
    ) -> None:
        self.clock: Clock = clock or SystemClock()
        self._store = store
        self._engine_id = engine_id
        self._dtype = dtype
        self._ranks = ranks
        self._resolver = resolver
        self._stat = stat
        self._pins: dict[str, _Held] = {}
        self._local: dict[str, set[str]] = {}  # request -> items it encodes itself
        self._counted: dict[str, set[int]] = {}  # request -> items already counted as hits
        self._failed: set[str] = set()
        self._unavailable: set[str] = set()
        self._seen: set[str] = set()
        self._waiting: dict[tuple[str, str], _Wait] = {}  # (request, item) -> its wait
        self._meta = EpdctlECMetadata()

    def has(self, key: str) -> bool:
        return key in self._pins

    def produce(self, request: Request) -> None:
        """Producer: touch entries E answers from; queue local-cache hits the store lacks."""
        if request.request_id in self._seen:
            return
        self._seen.add(request.request_id)
        for feature in request.mm_features:
            if not self._store.touch(feature.identifier):
                self._meta.republish.append(feature.identifier)

    def ensure(self, request: Request, num_computed_tokens: int) -> bool:
        """Consumer: pin every needed entry, or choose local encoding, or fail."""
        rid = request.request_id
        if rid in self._failed:
            return False
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            key = feature.identifier
            if pos.offset + pos.length <= num_computed_tokens or key in self._local.get(rid, ()):
                continue
            if (held := self._pins.get(key)) is not None:
                held.requests.add(rid)
                self._count_hit(rid, index, key)
                if self.clock.monotonic() - held.pinned_at > PIN_RENEW_S:
                    # A request can wait long for KV space; stay clear of the janitor's TTL.
                    held.pin, held.pinned_at = (self._store.renew(held.pin),
                                                self.clock.monotonic())
                continue
            wait = self._waiting.get((rid, key))
            if wait is not None and self.clock.monotonic() < wait.look_at:
                return False  # not yet time to look again: no store call this step
            result = self._pin(rid, index, feature)
            if not isinstance(result, Pin) and result.is_missing:
                if self._is_pending(rid, key):
                    return False  # asked again next step; other requests are scheduled meanwhile
                # Not pending (any more): E may have saved the entry, and the proxy cleared
                # its mark, between the pin and the look at the mark. One more pin decides.
                result = self._pin(rid, index, feature)
            if isinstance(result, Pin):
                self._pins[key] = _Held(result, {rid}, self.clock.monotonic())
                self._count_hit(rid, index, key)
                self._end_wait(rid, key, landed=True)
                continue
            self._end_wait(rid, key, landed=False)
            self._stat(misses=1, invalid=0 if result.is_missing else 1)
            if not self._miss(request, feature, result):
                return False
        return True

    def _is_pending(self, rid: str, key: str) -> bool:
        """Whether to wait for `key`: an encoder is computing it (the proxy sent this
        request before E answered) and the mark's deadline is still ahead. Then the next
        look is due after the next interval, or at that deadline if it comes first."""
        until = self._store.pending_until(key)
        left = None if until is None else until - self.clock.wall()
        if left is None or left <= 0:
            return False
        now = self.clock.monotonic()
        wait = self._waiting.get((rid, key))
        if wait is None:
            wait = self._waiting[(rid, key)] = _Wait(since=now, look_at=now)
            self._stat(waits=1)
        else:
            wait.interval = min(wait.interval * 2, LAST_LOOK_S)
        wait.look_at = now + min(wait.interval, left)
        return True

    def _pin(self, rid: str, index: int, feature: MultiModalFeatureSpec) -> Pin | Miss:
        return self._store.pin(
            feature.identifier,
            engine=self._engine_id,
            request=rid,
            index=index,
            rows=feature.mm_position.get_num_embeds(),
            dtype=self._dtype,
            ranks=self._ranks,
        )

    def _end_wait(self, rid: str, key: str, *, landed: bool) -> None:
        """A wait is over: the entry landed, or E failed or ran out of time (local encode)."""
        wait = self._waiting.pop((rid, key), None)
        if wait is not None:
            self._stat(wait_s=self.clock.monotonic() - wait.since,
                       **({} if landed else {"expired": 1}))
            if not landed:
                logger.info("EC entry %s did not arrive while %s waited: encoding it locally",
                            key, rid)

    def _count_hit(self, rid: str, index: int, key: str) -> None:
        """One hit per request item: a chunked prefill asks again (and pins again) each step."""
        counted = self._counted.setdefault(rid, set())
        if index not in counted:
            counted.add(index)
            self._stat(key, hits=1)

    def _miss(self, request: Request, feature: MultiModalFeatureSpec, miss: Miss) -> bool:
        """Encode locally if the request carries the media; else fail it (retryable)."""
        rid, key = request.request_id, feature.identifier
        if _has_model_input(feature, self._resolver.fields_for(feature.modality)):
            logger.debug("EC store miss for %s (%s): encoding locally", key, miss.reason)
            self._local.setdefault(rid, set()).add(key)
            return True
        logger.warning(
            "EC store miss for %s (%s) and request %s has no media to encode: failing it",
            key,
            miss.reason,
            rid,
        )
        self._failed.add(rid)
        self._unavailable.add(rid)
        return False

    def take_unavailable(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        return taken

    def after_alloc(self, request: Request, index: int) -> None:
        """Hand a pinned entry to the workers for this step."""
        key = request.mm_features[index].identifier
        held = self._pins.pop(key, None)
        if held is not None:
            self._meta.loads.append(Load(key, held.pin.paths, held.pin.header))

    def take_meta(self) -> EpdctlECMetadata:
        """This step's metadata: a fresh object each step, never mutated later."""
        meta, self._meta = self._meta, EpdctlECMetadata()
        return meta

    def finished(self, request: Request, *, is_producer: bool) -> dict[str, Any] | None:
        """Drop unused pins; on E, the items whose entry is committed (for the proxy)."""
        rid = request.request_id
        self._local.pop(rid, None)
        self._counted.pop(rid, None)
        self._failed.discard(rid)
        self._seen.discard(rid)
        for feature in request.mm_features:
            self._waiting.pop((rid, feature.identifier), None)  # aborted while waiting
            held = self._pins.get(feature.identifier)
            # Pins never handed to a worker have no load in flight: safe to drop.
            if held is not None and not (held.requests - {rid}):
                unpin(held.pin.paths)
                del self._pins[feature.identifier]
            elif held is not None:
                held.requests.discard(rid)
        if not is_producer:
            return None
        items = collect_ec_item_metadata(request.mm_features, self._resolver)
        for key, item in items.items():
            if not self._store.has_entry(key):
                item["metadata"] = {}  # not saved (store full?): the proxy keeps the media
        return items or None

    def release_all(self) -> None:
        """Drop every pin no worker will read (shutdown)."""
        for held in self._pins.values():
            unpin(held.pin.paths)
        self._pins.clear()


def _has_model_input(feature: MultiModalFeatureSpec, metadata_fields: set[str]) -> bool:
    """Whether the item carries media the local encoder can run on (not metadata only)."""
    # Same rule as vLLM's ECCPU connector: a field outside the placeholder metadata
    # (pixel values, passthrough embeddings) with data means the item can be encoded.
    data = feature.data
    if not data:
        return False
    return any(v.data is not None for k, v in data.items() if k not in metadata_fields)
