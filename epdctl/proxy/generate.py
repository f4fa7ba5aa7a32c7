"""The PD stage, or P then D: send, retry once before the first byte, peek at streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from epdctl.proxy.client import Reply, Upstream
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import JSON_TYPE, UpstreamError, error_body
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.routing import decode_body, dumps, prefill_body, upstream_headers
from epdctl.proxy.sse import error_event, error_status, verdict
from epdctl.proxy.trace import Trace
from epdctl.proxy.upstreams import Instance, Pool, Upstreams


@dataclass
class Answer:
    """What goes back to the client: a whole body, or a committed stream."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


class StageFailed(Exception):
    """One attempt failed before any byte reached the client."""

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
        """Connection errors and 5xx; never a timeout (it would double the wait)."""
        if self.error is not None:
            return self.error.kind != "timeout"
        return self.status >= 500

    def answer(self) -> Answer:
        """Upstream errors pass through unchanged; non-JSON bodies get OpenAI's shape."""
        if self.error is not None:
            err = self.error.to_proxy_error()
            return Answer(err.status, JSON_TYPE, err.body())
        try:
            json.loads(self.body)
            return Answer(self.status, self.content_type, self.body)
        except ValueError:
            text = self.body.decode(errors="replace")[:500]
            message = f"{self.stage} instance {self.inst.url} answered HTTP {self.status}: {text}"
            return Answer(self.status, JSON_TYPE, error_body(message, "upstream_error",
                                                             self.status))


ATTEMPTS = 2
"""A request gets one more attempt, elsewhere, when the first fails before any byte."""


def next_attempt(failed: StageFailed, attempt: int, is_rewritten: bool, trace: Trace,
                 metrics: Metrics) -> None:
    """The one attempt policy, for both EC protocols: raise `failed` unless another attempt
    is due. A rewritten body gets one with the raw media on any failure but a timeout (PD
    may lack a rewritten item's entry); any other body, on a retryable failure."""
    if attempt + 1 < ATTEMPTS and is_rewritten and (failed.error is None
                                                   or failed.is_retryable):
        trace.fallbacks.append("rewrite")
        metrics.fallbacks.labels("rewrite").inc()
    elif attempt + 1 < ATTEMPTS and failed.is_retryable:
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
        self.decode_pool = upstreams.pools["decode" if config.is_split else "pd"]
        self.decode_stage = "decode" if config.is_split else "prefill_decode"
        self.decode_read_s = max(config.decode_timeout_s, config.stream_idle_timeout_s)

    async def run(self, route: str, first: dict[str, Any] | bytes,
                  second: dict[str, Any] | bytes, is_rewritten: bool, is_stream: bool,
                  trace: Trace) -> Answer:
        """Try `first`; on a retryable failure (any, if rewritten) send `second` elsewhere."""
        avoid: dict[str, Instance] = {}
        body = first
        for attempt in range(ATTEMPTS):
            try:
                return await self._attempt(route, body, is_stream, trace, avoid)
            except StageFailed as failed:
                avoid[failed.stage] = failed.inst
                next_attempt(failed, attempt, is_rewritten, trace, self.metrics)
                body, is_rewritten = second, False
        raise AssertionError("unreachable")

    async def _attempt(self, route: str, body: dict[str, Any] | bytes, is_stream: bool,
                       trace: Trace, avoid: dict[str, Instance]) -> Answer:
        if self.prefill_pool is not None:
            as_dict = body if isinstance(body, dict) else json.loads(body)
            kv = await self._prefill(route, as_dict, trace, avoid.get("prefill"))
            body = decode_body(as_dict, kv)
        inst = self.decode_pool.pick(avoid.get(self.decode_stage))
        return await self._decode(route, body, is_stream, trace, inst)

    async def answer_from(self, inst: Instance, route: str, body: dict[str, Any],
                          is_stream: bool, trace: Trace) -> Answer:
        """One attempt on a PD instance the caller chose (Mooncake picks PD before E)."""
        return await self._decode(route, body, is_stream, trace, inst)

    async def _prefill(self, route: str, body: dict[str, Any], trace: Trace,
                       avoid: Instance | None) -> object:
        """P's kv_transfer_params, for D to pull the KV from."""
        assert self.prefill_pool is not None
        inst = self.prefill_pool.pick(avoid)
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
            return json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            return None

    async def _decode(self, route: str, body: dict[str, Any] | bytes, is_stream: bool,
                      trace: Trace, inst: Instance) -> Answer:
        """D's (or PD's) answer; a stream is committed only after its first content."""
        stage = self.decode_stage
        trace.instances[stage] = inst.url
        headers = upstream_headers(f"{trace.rid}:decode")
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
            if in_stream is not None:
                raise StageFailed(stage, inst, status=error_status(in_stream),
                                  body=json.dumps(in_stream).encode())
            stream = self._relay(head, chunks, reply, inst, trace)
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

    async def _relay(self, head: bytes, chunks: AsyncIterator[bytes], reply: Reply,
                     inst: Instance, trace: Trace) -> AsyncIterator[bytes]:
        """Raw bytes through, untouched; a later stall or failure ends with an error event."""
        idle_s = self.config.stream_idle_timeout_s
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
            yield error_event(f"{self.decode_stage} instance {inst.url}: no data in {idle_s}s")
        except UpstreamError as exc:
            trace.notes.append("stream_broken=1")
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
