"""The media's part of a request before PD: each item looked up in the store, the rest
encoded by E, then or beside PD (overlap); what PD gets (its body, and the fallback when the
media were rewritten to E's metadata)."""

from __future__ import annotations

from typing import Any

from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request import responses
from epdctl.proxy.request.inflight import Request
from epdctl.proxy.request.parse import CHAT, RESPONSES, MediaItem, find_media
from epdctl.proxy.request.shape import pd_body
from epdctl.proxy.stages.encode import Encoder, Looked
from epdctl.proxy.stages.lookup import StoreLookup
from epdctl.proxy.stages.pending import Overlap


class MediaStage:
    """E for a request's media: after the store's lookup, before PD or beside it."""

    def __init__(self, config: ProxyConfig, encoder: Encoder | None,
                 lookup: StoreLookup | None, overlap: Overlap | None, metrics: Metrics) -> None:
        self.config = config
        self.encoder = encoder
        self.lookup = lookup
        self.overlap = overlap
        self.metrics = metrics

    def items(self, route: str, body: dict[str, Any]) -> list[MediaItem]:
        """The media items E is to encode (none without an encoder)."""
        if self.encoder is None:
            return []
        if route == CHAT:
            return find_media(body)
        return responses.find_media(body) if route == RESPONSES else []

    async def run(self, req: Request, items: list[MediaItem]) -> None:
        """E for every item; then what PD gets (`req.for_pd`): its body, and the fallback
        where the first has the media rewritten to E's metadata."""
        assert self.encoder is not None
        body = req.body
        if req.route == RESPONSES:
            view, moved = responses.encoder_view(body, items)
            looked = await self.encoder.look(view, moved, req)
            if self._overlaps(looked, moved, has_rewrite=False):
                self._overlap(view, looked, req)
                encoded = looked.hits
            else:
                encoded = await self.encoder.fan_out(view, looked, req)
            req.for_pd(responses.pd_body(body, items, encoded.params))
            return
        looked = await self.encoder.look(body, items, req)
        if self._overlaps(looked, items, has_rewrite=self.config.metadata_rewrite):
            self._overlap(body, looked, req)
            req.for_pd(pd_body(body, items, looked.hits.reported, looked.hits.params, False)[0])
            return
        encoded = await self.encoder.fan_out(body, looked, req)
        first, is_rewritten = pd_body(body, items, encoded.reported, encoded.params,
                                      self.config.metadata_rewrite)
        if not is_rewritten:
            req.for_pd(first)
            return
        # The fallback: the media themselves.
        media = pd_body(body, items, encoded.reported, encoded.params, False)[0]
        req.for_pd(first, media, is_rewritten=True)

    def _overlaps(self, looked: Looked, items: list[MediaItem], *, has_rewrite: bool) -> bool:
        """Whether PD gets the request now, E's items marked pending, instead of after E.

        Not when nothing goes to E, when E's keys are not the uuids (PD would find no mark),
        nor where the media may be rewritten to E's metadata, which only E's answer gives: a
        modality overlaps once E has answered for it without metadata (LLaVA), never while
        it reports some (the Qwen2-VL family) or before E has said either.
        """
        known = self.lookup
        if known is None or not self.config.should_overlap or not looked.is_keyed \
                or self.encoder is None or not self.encoder.will_send(looked):
            return False
        return not has_rewrite or all(it.modality in known.silent and it.modality not in
                                      known.reporting for it in items)

    def _overlap(self, body: dict[str, Any], looked: Looked, req: Request) -> None:
        """E beside PD: marks that go when no request relies on them any more (then PD
        encodes what it still lacks); one E for an item several such requests share."""
        assert self.overlap is not None
        self.overlap.start(body, looked, req)
        self.metrics.overlapped.inc()
