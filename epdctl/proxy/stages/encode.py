"""The E stage: one non-streaming sub-request per distinct media item, in parallel."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.attempts import ENCODE_ATTEMPTS
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.deadlines import deadline
from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request.inflight import Request
from epdctl.proxy.request.parse import CHAT, MM_KWARGS, MediaItem
from epdctl.proxy.request.shape import dumps, encoder_body, push_body, upstream_headers
from epdctl.proxy.stages.lookup import StoreLookup
from epdctl.proxy.transport import Upstream
from epdctl.proxy.upstreams import Pool

log = logging.getLogger("epdctl.proxy")
Reported = dict[str, tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Encoded:
    """What the E stage produced, per item uuid; items that failed are absent."""

    reported: Reported = field(default_factory=dict)
    """uuid -> (E's key for the item, its metadata)."""
    params: dict[str, Any] = field(default_factory=dict)
    """E's ec_transfer_params entries by E's key, for PD."""
    transfer_ids: dict[str, str] = field(default_factory=dict)
    """uuid -> the Mooncake transfer_id E pushed it under (only with a consumer)."""
    problems: dict[str, str] = field(default_factory=dict)
    """uuid -> why E could not encode it."""


@dataclass
class Looked:
    """A request's distinct media items after the store look: hits and what E must do."""

    hits: Encoded
    """What the store gave (filled in further by fan_out)."""
    unique: dict[str, MediaItem]
    """uuid -> item, for the items E must encode."""
    is_keyed: bool
    """Whether E's keys are the uuids (no per-request mm kwargs): marks and looks work."""
    lookups: int = 0
    skipped: int = 0


class Encoder:
    """Fans media out to the encode pool; a failed item falls back to raw media on PD.

    With a store to look in, items already there skip E. With Mooncake there is no
    fallback (and no store): the caller gets the failures and answers for them.
    """

    def __init__(self, config: ProxyConfig, pool: Pool, client: Upstream,
                 metrics: Metrics, lookup: StoreLookup | None = None) -> None:
        self.config = config
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.lookup = lookup

    async def run(self, body: dict[str, Any], items: list[MediaItem], req: Request,
                  consumer_zmq: str | None = None) -> Encoded:
        """Encode every distinct item; with `consumer_zmq`, E pushes each one there (Mooncake).

        Without a consumer a failed item is a fallback (PD encodes it); with one it is not:
        a Mooncake consumer cannot encode, so the caller decides what a failure means.
        """
        return await self.fan_out(body, await self.look(body, items, req, consumer_zmq),
                                  req, consumer_zmq)

    async def look(self, body: dict[str, Any], items: list[MediaItem], req: Request,
                   consumer_zmq: str | None = None) -> Looked:
        """The distinct items, and which of them the store already holds (no E for those)."""
        trace = req.trace
        unique: dict[str, MediaItem] = {}
        for item in items:
            if item.uuid is not None:
                unique.setdefault(item.uuid, item)
        # Per-request mm kwargs fold into E's key, which the proxy cannot compute.
        is_keyed = consumer_zmq is None and not any(body.get(k) for k in MM_KWARGS)
        looked = Looked(Encoded(), unique, is_keyed)
        if unique and is_keyed and self.lookup is not None and self.config.should_look_up:
            looked.lookups = len(unique)
            out = looked.hits
            found = await self.lookup.find_off_loop(unique, self.config.metadata_rewrite)
            for uuid, hit in found.items():
                out.reported[uuid] = (hit.key, hit.metadata)
                if hit.params:
                    out.params[hit.key] = hit.params
                del unique[uuid]
                looked.skipped += 1
            if looked.skipped:
                trace.notes.append(f"cached={looked.skipped}")
        return looked

    def will_send(self, looked: Looked) -> bool:
        """Whether fan_out will send anything to an encoder."""
        return bool(looked.unique) and bool(self.pool.healthy)

    async def fan_out(self, body: dict[str, Any], looked: Looked, req: Request,
                      consumer_zmq: str | None = None) -> Encoded:
        """E for the items the store lacks; what they and the store's hits give PD."""
        trace = req.trace
        out, unique = looked.hits, looked.unique
        looked_up, skipped = looked.lookups, looked.skipped
        if not unique and not looked_up:
            return out
        if not unique or (not self.pool.healthy and consumer_zmq is None):
            self._count(looked_up, skipped, 0)
            if unique:
                # Every encoder is ejected (dead or hung): PD encodes at once, instead of
                # each request waiting out a refused connection or encode_timeout on it. The
                # health loop re-admits an encoder on its first good probe.
                trace.notes.append("encoders_out=1")
                trace.fallbacks.extend("encoder" for _ in unique)
                self.metrics.fallbacks.labels("encoder").inc(len(unique))
            return out
        self._count(looked_up, skipped, len(unique))
        self.metrics.fanout.observe(len(unique))
        started = time.perf_counter()
        results: dict[str, tuple[str, dict[str, Any], dict[str, Any], str | None] | str] = {}
        try:
            # A deadline for the whole stage: whatever is unfinished falls back to PD.
            with deadline(self.config.encode_timeout_s):
                if len(unique) == 1:  # the common case needs no task of its own
                    await self._one(body, next(iter(unique.values())), 0, req, results,
                                    consumer_zmq)
                else:
                    async with asyncio.TaskGroup() as tg:
                        for n, item in enumerate(unique.values()):
                            tg.create_task(self._one(body, item, n, req, results,
                                                     consumer_zmq))
        except TimeoutError:
            trace.notes.append("encode_timeout=1")
        self.metrics.stage["encode"].observe(trace.timed("encode", started))
        for key in unique:
            result = results.get(key)
            if not isinstance(result, tuple):
                out.problems[key] = result or "no answer in time"
                if consumer_zmq is None:
                    trace.fallbacks.append("encoder")
                    self.metrics.fallbacks.labels("encoder").inc()
                continue
            e_key, metadata, entry, transfer_id = result
            out.reported[key] = (e_key, metadata)
            if entry:
                out.params[e_key] = entry
                if self.lookup is not None and consumer_zmq is None:
                    self.lookup.keep(unique[key], e_key, entry)
            if transfer_id is not None:
                out.transfer_ids[key] = transfer_id
        return out

    def _count(self, lookups: int, skipped: int, sent: int) -> None:
        """Per distinct item of a request: looked up, found (no E), sent to E."""
        if lookups:
            self.metrics.lookups.inc(lookups)
        if skipped:
            self.metrics.skipped.inc(skipped)
        if sent:
            self.metrics.sent.inc(sent)
        if self.lookup is not None and lookups:
            self.lookup.count(lookups, skipped, sent)

    async def _one(self, body: dict[str, Any], item: MediaItem, n: int, req: Request,
                   results: dict[str, Any], consumer_zmq: str | None = None) -> None:
        """Send one item, again on another encoder where the attempt policy says so; never
        raises."""
        trace = req.trace
        request = encoder_body(body, item)
        payload = dumps(request)
        headers = upstream_headers(f"{trace.rid}:enc{n}")
        avoid = None
        transfer_id = None
        for attempt in range(ENCODE_ATTEMPTS):
            if consumer_zmq:
                # A fresh id per attempt: an attempt that failed may still have pushed, and
                # a consumer refuses an id that already names a transfer.
                transfer_id = os.urandom(16).hex()
                payload = dumps(push_body(request, consumer_zmq, transfer_id))
            inst = avoid = self.pool.pick(avoid, item.uuid)
            inst.outstanding += 1
            try:
                reply = await self.client.post(inst.url, CHAT, payload, headers,
                                               self.config.encode_timeout_s, "encode")
                try:
                    data = await reply.read()
                finally:
                    await reply.close()
            except UpstreamError as exc:
                problem, is_retryable = str(exc), exc.is_retryable
            else:
                if reply.status == 200:
                    results[item.uuid or ""] = (*_parse(data, item.uuid or ""), transfer_id)
                    return
                # An answer, even a 5xx, is not tried again (attempts.py).
                problem = f"encode instance {inst.url}: HTTP {reply.status}: {data[:200]!r}"
                is_retryable = False
            finally:
                inst.outstanding -= 1
            if not req.attempts.encode_again(attempt, is_retryable):
                break
        then = "giving up" if consumer_zmq else "PD will encode it"
        log.warning("rid=%s:enc%d encoder failed, %s: %s", trace.rid, n, then, problem)
        results[item.uuid or ""] = problem


def _parse(data: bytes, uuid: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """E's key for the item, its metadata and its whole ec_transfer_params entry."""
    try:
        params = jsonio.loads(data).get("ec_transfer_params")
    except (ValueError, AttributeError):
        params = None
    if not isinstance(params, dict) or not params:
        return uuid, {}, {}
    # One item per sub-request: E's key is our uuid, or (with mm kwargs) a hash of it.
    key = uuid if uuid in params else next(iter(params)) if len(params) == 1 else None
    entry = params.get(key) if key is not None else None
    if not isinstance(entry, dict):
        return uuid, {}, {}
    metadata = entry.get("metadata")
    return key or uuid, metadata if isinstance(metadata, dict) else {}, entry
