"""E|PD over vLLM's ECMooncakeConnector: pick PD first, then E pushes every item into it."""

from __future__ import annotations

from typing import Any

from epdctl.proxy.answer import Answer, StageFailed
from epdctl.proxy.attempts import ATTEMPTS
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import ProxyError, bad_request
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request import responses
from epdctl.proxy.request.inflight import Request
from epdctl.proxy.request.parse import CONTENT_FIELDS, RESPONSES, MediaItem
from epdctl.proxy.request.shape import pd_body
from epdctl.proxy.stages.encode import Encoded, Encoder
from epdctl.proxy.stages.generate import Generator
from epdctl.proxy.upstreams import Instance


def consumer_items(items: list[MediaItem], encoded: Encoded) -> list[dict[str, str]]:
    """PD's `ec_items`: one per media part, in request order, naming the push to wait for.

    `mm_hash` is E's reported key, which PD's own key equals (same uuid, same kwargs). When E
    reported none it is left out, and vLLM matches the entry by position instead.
    """
    out = []
    for it in items:
        uuid = it.uuid or ""
        key = encoded.reported[uuid][0]
        entry = {"transfer_id": encoded.transfer_ids[uuid]}
        out.append({"mm_hash": key, **entry} if key in encoded.params else entry)
    return out


def consumer_body(body: dict[str, Any], items: list[MediaItem], encoded: Encoded,
                  should_rewrite: bool) -> tuple[dict[str, Any], bool]:
    """PD's body (embeds metadata if possible, else keyed media) and whether it was rewritten."""
    params = {**encoded.params, "ec_items": consumer_items(items, encoded)}
    return pd_body(body, items, encoded.reported, params, should_rewrite)


class MooncakeRoute:
    """Requests with media under `--ec-protocol mooncake`.

    A Mooncake consumer cannot encode media itself: it waits up to `push_wait_timeout_s`
    (60 s) for each item's push and then fails the request. So there is no raw-media
    fallback here: an item E cannot encode fails the request at once (502), and a retry on
    another PD (when the first did not answer at all) re-runs E for it under fresh ids.
    """

    def __init__(self, config: ProxyConfig, encoder: Encoder, generator: Generator,
                 metrics: Metrics) -> None:
        self.config = config
        self.encoder = encoder
        self.generator = generator
        self.metrics = metrics

    async def run(self, req: Request, items: list[MediaItem]) -> Answer:
        """Pick PD, encode for it, send; on a failure (but a timeout) do it all again
        elsewhere: the pushes may be what failed.

        /v1/responses: E gets the chat request it gets for chat (responses.encoder_view),
        PD the input with each image's key and the transfer ids (vLLM 0.33 reads a
        Responses request's `ec_transfer_params`); nothing is rewritten to metadata there.
        """
        route, body = req.route, req.body
        unkeyed = [n for n, it in enumerate(items) if it.uuid is None]
        if unkeyed:
            how = ("give it a `uuid`" if self.config.client_uuids
                   else "this proxy ignores client uuids")
            raise bad_request(
                f"media item #{unkeyed[0]} has no content key (only data: and http(s) URLs "
                f"get one): {how}, since every item must go through the encoder",
                CONTENT_FIELDS[route])
        is_responses = route == RESPONSES
        view, moved = responses.encoder_view(body, items) if is_responses else (body, items)
        should_rewrite = self.config.metadata_rewrite and not is_responses
        avoid: Instance | None = None
        for attempt in range(ATTEMPTS):
            inst = self.generator.decode_pool.pick(avoid)
            encoded = await self._encode_for(inst, view, moved, req)
            if is_responses:
                params = {**encoded.params, "ec_items": consumer_items(moved, encoded)}
                first, is_rewritten = responses.pd_body(body, items, params), False
            else:
                first, is_rewritten = consumer_body(body, items, encoded, should_rewrite)
            try:
                return await self.generator.answer_from(inst, req, first,
                                                        attempt + 1 < ATTEMPTS)
            except StageFailed as failed:
                req.attempts.retry(failed, attempt, is_rewritten=is_rewritten, is_pushed=True)
                # The next attempt sends the media (pushed again, under fresh transfer ids).
                should_rewrite = False
                avoid = inst
        raise AssertionError("unreachable")

    async def _encode_for(self, inst: Instance, body: dict[str, Any], items: list[MediaItem],
                          req: Request) -> Encoded:
        """E pushes every item to `inst`'s control socket; any failure fails the request."""
        # The request is PD's from now on (its pushes reserve PD memory): count it there.
        inst.outstanding += 1
        try:
            consumer = self.config.consumer_zmq(inst.url)
            encoded = await self.encoder.run(body, items, req, consumer)
        finally:
            inst.outstanding -= 1
        if encoded.problems:
            req.trace.notes.append(f"encode_failed={len(encoded.problems)}")
            problem = next(iter(encoded.problems.values()))
            raise ProxyError(
                502, f"the encoder could not encode {len(encoded.problems)} media item(s), "
                f"and a Mooncake PD cannot encode them itself: {problem}")
        return encoded
