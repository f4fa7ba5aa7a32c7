"""The PD stage, or P then D: send, retry once before the first byte, peek at streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import JSON_TYPE, UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request.parse import RESPONSES
from epdctl.proxy.request.responses import needs_prefill
from epdctl.proxy.request.shape import decode_body, dumps, prefill_body, upstream_headers
from epdctl.proxy.sse import error_event, error_status, verdict
from epdctl.proxy.trace import Trace
from epdctl.proxy.transport import Reply, Upstream
from epdctl.proxy.upstreams import Instance, Pool, Upstreams


@dataclass
class Answer:
    """What goes back to the client: a whole body, or a committed stream."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    raw_headers: list[tuple[bytes, bytes]] | None = None
    """An instance's own response headers, relayed instead of content type and `headers`."""


class StageFailed(Exception):
    """One attempt failed before any byte reached the client: no (whole) answer, or a
    refusal (status and body as the instance sent them)."""

    def __init__(self, stage: str, inst: Instance, *, error: UpstreamError | None = None,
                 status: int = 502, content_type: str = JSON_TYPE, body: bytes = b"") -> None:
        super().__init__(f"{stage} {inst.url}: {error or status}")
        self.stage = stage
        self.inst = inst
        self.error = error
        self.status = status
        self.content_type = content_type
        self.body = body

    @property
    def is_retryable(self) -> bool:
        """Only when the instance did not answer at all (refused, or reset before any
        response byte). A refusal is vLLM's answer, and the client gets it as it is."""
        return self.error is not None and self.error.is_retryable

    @property
    def is_timeout(self) -> bool:
        """Never tried again: it would double the wait."""
        return self.error is not None and self.error.kind == "timeout"

    def answer(self) -> Answer:
        """vLLM's refusal unchanged; our own 502/504 when it gave no answer."""
        if self.error is not None:
            err = self.error.to_proxy_error()
            return Answer(err.status, JSON_TYPE, err.body())
        return Answer(self.status, self.content_type, self.body)


ATTEMPTS = 2
"""A request gets one more attempt, elsewhere, when the first fails before any byte."""


def next_attempt(failed: StageFailed, attempt: int, is_rewritten: bool, trace: Trace,
                 metrics: Metrics, *, is_pushed: bool = False) -> None:
    """The one attempt policy, for every route and both EC protocols: raise `failed` unless
    another attempt is due. The client's request as it is gets one only when the instance did
    not answer at all: a refusal is vLLM's answer. An attempt that rests on what the proxy
    arranged gets one on any failure but a timeout: a rewritten body (PD may lack an item's
    entry; the next attempt sends the media) and Mooncake's pushes (the next attempt pushes
    again, elsewhere)."""
    if attempt + 1 >= ATTEMPTS or failed.is_timeout:
        raise failed
    if is_rewritten:
        trace.fallbacks.append("rewrite")
        metrics.fallbacks.labels("rewrite").inc()
    elif is_pushed or failed.is_retryable:
        trace.retries += 1
        metrics.retries.labels(failed.stage).inc()
    else:
        raise failed


class Generator:
    """Runs PD (or P then D) for one prepared body."""

    def __init__(self, config: ProxyConfig, upstreams: Upstreams, client: Upstream,
                 metrics: Metrics) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.prefill_pool: Pool | None = upstreams.pools.get("prefill")
        self.decode_pool = upstreams.pools[config.final_role]
        self.decode_stage = config.final_role
        self.decode_read_s = config.final_read_s

    async def run(self, route: str, first: dict[str, Any] | bytes,
                  second: dict[str, Any] | bytes, is_rewritten: bool, is_stream: bool,
                  trace: Trace) -> Answer:
        """Try `first`; when next_attempt allows, send `second` elsewhere."""
        avoid: dict[str, Instance] = {}
        body = first
        for attempt in range(ATTEMPTS):
            # Only an attempt that may fall back turns an early in-stream error into a failure.
            may_fall_back = is_rewritten and attempt + 1 < ATTEMPTS
            try:
                return await self.attempt(route, body, may_fall_back, is_stream, trace, avoid)
            except StageFailed as failed:
                avoid[failed.stage] = failed.inst
                trace.failed.append((failed.stage, failed.inst.url))
                next_attempt(failed, attempt, is_rewritten, trace, self.metrics)
                body, is_rewritten = second, False
        raise AssertionError("unreachable")

    async def attempt(self, route: str, body: dict[str, Any] | bytes, may_fall_back: bool,
                      is_stream: bool, trace: Trace, avoid: dict[str, Instance],
                      chosen: dict[str, Instance] | None = None) -> Answer:
        """One try: P first when the roles are split, then D (or PD); on the instances
        `chosen` names (a replay picks them), else the pools pick, avoiding `avoid`."""
        chosen = chosen or {}
        if self.prefill_pool is not None:
            as_dict = body if isinstance(body, dict) else jsonio.loads(body)
            if route != RESPONSES or needs_prefill(as_dict):
                kv = await self._prefill(route, as_dict, trace, avoid.get("prefill"),
                                         chosen.get("prefill"))
                body = decode_body(as_dict, kv)
        inst = chosen.get(self.decode_stage) or self.decode_pool.pick(avoid.get(self.decode_stage))
        return await self._decode(route, body, may_fall_back, is_stream, trace, inst)

    async def answer_from(self, inst: Instance, route: str, body: dict[str, Any],
                          may_fall_back: bool, is_stream: bool, trace: Trace) -> Answer:
        """One attempt on a PD instance the caller chose (Mooncake picks PD before E)."""
        return await self._decode(route, body, may_fall_back, is_stream, trace, inst)

    async def _prefill(self, route: str, body: dict[str, Any], trace: Trace,
                       avoid: Instance | None, chosen: Instance | None = None) -> object:
        """P's kv_transfer_params, for D to pull the KV from."""
        assert self.prefill_pool is not None
        inst = chosen or self.prefill_pool.pick(avoid)
        trace.instances["prefill"] = inst.url
        headers = upstream_headers(f"{trace.rid}:prefill")
        timeout_s = self.config.prefill_timeout_s
        started = time.perf_counter()
        inst.outstanding += 1
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self.client.post(inst.url, route, dumps(prefill_body(body, route)),
                                               headers, timeout_s, "prefill")
                try:
                    data = await reply.read()
                finally:
                    await reply.close()
        except TimeoutError:
            error = UpstreamError("prefill", inst.url, "timeout", f"no answer in {timeout_s}s")
            raise StageFailed("prefill", inst, error=error) from None
        except UpstreamError as exc:
            raise StageFailed("prefill", inst, error=exc) from None
        finally:
            inst.outstanding -= 1
            self.metrics.stage["prefill"].observe(trace.timed("prefill", started))
        if reply.status != 200:
            raise StageFailed("prefill", inst, status=reply.status,
                              content_type=reply.content_type, body=data)
        try:
            return jsonio.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            return None

    async def _decode(self, route: str, body: dict[str, Any] | bytes, may_fall_back: bool,
                      is_stream: bool, trace: Trace, inst: Instance) -> Answer:
        """D's (or PD's) answer; a stream is committed only after its first content (an error
        event before it fails the attempt when another is due: `may_fall_back`).

        The client's own request id goes here unchanged, so the answer's `id` is the one
        vLLM gives for it (E and P get child ids, for the logs).
        """
        stage = self.decode_stage
        trace.instances[stage] = inst.url
        headers = upstream_headers(trace.rid, is_main=True)
        payload = body if isinstance(body, bytes) else dumps(body)
        timeout_s = self.config.decode_timeout_s
        started = time.perf_counter()
        reply: Reply | None = None
        is_handed_off = False
        inst.outstanding += 1
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self.client.post(inst.url, route, payload, headers,
                                               self.decode_read_s, stage)
                if reply.status != 200 or not is_stream:
                    data = await reply.read()
                    if reply.status != 200:
                        raise StageFailed(stage, inst, status=reply.status,
                                          content_type=reply.content_type, body=data)
                    return Answer(200, reply.content_type, data)
                chunks = reply.chunks().__aiter__()
                head, in_stream = await _peek(chunks)
            if in_stream is not None and may_fall_back:  # else vLLM's own stream, as it is
                raise StageFailed(stage, inst, status=error_status(in_stream),
                                  body=jsonio.dumps(in_stream))
            stream = relay(head, chunks, reply, inst, trace, stage,
                           self.config.stream_idle_timeout_s)
            is_handed_off = True  # the relay closes the reply and releases the instance
            return Answer(200, reply.content_type, stream=stream)
        except TimeoutError:
            error = UpstreamError(stage, inst.url, "timeout", f"no answer in {timeout_s}s")
            raise StageFailed(stage, inst, error=error) from None
        except UpstreamError as exc:
            raise StageFailed(stage, inst, error=exc) from None
        finally:
            self.metrics.stage["decode"].observe(trace.timed("decode", started))
            if not is_handed_off:
                inst.outstanding -= 1
                if reply is not None:
                    await reply.close()


async def relay(head: bytes, chunks: AsyncIterator[bytes], reply: Reply, inst: Instance,
                trace: Trace, stage: str, idle_s: float) -> AsyncIterator[bytes]:
    """A committed stream's raw bytes through, untouched (after `head`, already read); a
    later stall or failure ends it with an error event. Releases the instance and the reply."""
    try:
        if head:
            yield head
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            yield chunk
    except TimeoutError:
        trace.notes.append("stream_idle_timeout=1")
        yield error_event(f"{stage} instance {inst.url}: no data in {idle_s}s")
    except UpstreamError as exc:
        trace.notes.append("stream_broken=1")
        if trace.is_resumable:
            raise  # replay.py goes on elsewhere
        yield error_event(str(exc))
    finally:
        inst.outstanding -= 1
        await reply.close()


async def _peek(chunks: AsyncIterator[bytes]) -> tuple[bytes, dict[str, Any] | None]:
    """Read until the first content chunk, [DONE], an error event or the end of the stream."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        kind, error = verdict(buf)
        if kind == "error":
            return buf, error
        if kind == "commit":
            return buf, None
    return buf, None
