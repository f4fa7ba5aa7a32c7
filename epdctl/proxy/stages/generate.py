"""The PD stage, or P then D: send, another attempt when the policy allows one (attempts.py),
peek at streams before they are committed, relay them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.answer import Answer, StageFailed
from epdctl.proxy.attempts import ATTEMPTS
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.deadlines import deadline
from epdctl.proxy.errors import ProxyError, UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request.inflight import Body, Request
from epdctl.proxy.request.parse import RESPONSES
from epdctl.proxy.request.responses import needs_prefill
from epdctl.proxy.request.shape import decode_body, dumps, prefill_body, upstream_headers
from epdctl.proxy.sse import error_event, error_status, verdict
from epdctl.proxy.trace import Trace
from epdctl.proxy.transport import Reply, Upstream
from epdctl.proxy.upstreams import Instance, Pool, Upstreams


class Generator:
    """Runs PD (or P then D) for one prepared body."""

    def __init__(self, config: ProxyConfig, upstreams: Upstreams, client: Upstream,
                 metrics: Metrics) -> None:
        self.config = config
        self.upstreams = upstreams
        self.client = client
        self.metrics = metrics
        self.prefill_pool: Pool | None = upstreams.pools.get("prefill")
        self.decode_pool = upstreams.pools[config.final_role]
        self.decode_stage = config.final_role
        self.decode_read_s = config.final_read_s

    async def run(self, req: Request) -> Answer:
        """Send `req.first`; when the attempt policy allows another, `req.fallback` elsewhere."""
        body, is_rewritten = req.first, req.is_rewritten
        for attempt in range(ATTEMPTS):
            # Only an attempt that may fall back turns an early in-stream error into a failure.
            may_fall_back = req.attempts.may_fall_back(attempt, is_rewritten)
            try:
                return await self.attempt(req, body, may_fall_back)
            except StageFailed as failed:
                req.attempts.retry(failed, attempt, is_rewritten=is_rewritten)
                body, is_rewritten = req.fallback, False
        raise AssertionError("unreachable")

    async def attempt(self, req: Request, body: Body, may_fall_back: bool,
                      chosen: dict[str, Instance] | None = None) -> Answer:
        """One try: P first when the roles are split, then D (or PD); on the instances
        `chosen` names (a replay picks them), else the pools pick, away from the instances
        whose attempts failed (`req.attempts.avoid`)."""
        chosen = chosen or {}
        avoid = req.attempts.avoid if not chosen else {}
        if self.prefill_pool is not None:
            as_dict = req.dict_of(body)
            if req.route != RESPONSES or needs_prefill(as_dict):
                pool = self.prefill_pool
                kv = await self._prefill(req, as_dict, chosen.get("prefill") or (
                    await self._serving(pool) if pool.draining else
                    pool.pick(avoid.get("prefill"))))
                body = decode_body(as_dict, kv)
        pool = self.decode_pool
        inst = chosen.get(self.decode_stage) or (
            await self._serving(pool) if pool.draining else
            pool.pick(avoid.get(self.decode_stage)))
        return await self._decode(req, body, may_fall_back, inst)

    async def _serving(self, pool: Pool) -> Instance:
        """An instance of a pool some of whose instances drain (`epdctl restart`): at once
        where another takes requests; else the first re-admitted within replay_wait, or a 503
        the client may retry."""
        try:
            with deadline(self.config.replay_wait_s):
                while not pool.healthy and pool.draining:
                    await self.upstreams.revival()
        except TimeoutError:
            raise ProxyError(503, f"every {pool.role} instance is restarting; retry later",
                             headers={"retry-after": str(self.config.retry_after_s)}) from None
        return pool.pick()

    async def answer_from(self, inst: Instance, req: Request, body: Body,
                          may_fall_back: bool) -> Answer:
        """One attempt on a PD instance the caller chose (Mooncake picks PD before E)."""
        return await self._decode(req, body, may_fall_back, inst)

    async def _prefill(self, req: Request, body: dict[str, Any], inst: Instance) -> object:
        """P's kv_transfer_params, for D to pull the KV from."""
        route, trace = req.route, req.trace
        trace.instances["prefill"] = inst.url
        headers = upstream_headers(f"{trace.rid}:prefill")
        timeout_s = self.config.prefill_timeout_s
        started = time.perf_counter()
        inst.outstanding += 1
        try:
            with deadline(timeout_s):
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

    async def _decode(self, req: Request, body: Body, may_fall_back: bool,
                      inst: Instance) -> Answer:
        """D's (or PD's) answer; a stream is committed only after its first content (an error
        event before it fails the attempt when another is due: `may_fall_back`).

        The client's own request id goes here unchanged, so the answer's `id` is the one
        vLLM gives for it (E and P get child ids, for the logs).
        """
        stage, route, trace = self.decode_stage, req.route, req.trace
        trace.instances[stage] = inst.url
        headers = upstream_headers(trace.rid, is_main=True)
        payload = body if isinstance(body, bytes) else dumps(body)
        timeout_s = self.config.decode_timeout_s
        started = time.perf_counter()
        reply: Reply | None = None
        is_handed_off = False
        inst.outstanding += 1
        try:
            with deadline(timeout_s):
                reply = await self.client.post(inst.url, route, payload, headers,
                                               self.decode_read_s, stage)
                if reply.status != 200 or not req.is_stream:
                    data = await reply.read()
                    if reply.status != 200:
                        raise StageFailed(stage, inst, status=reply.status,
                                          content_type=reply.content_type, body=data)
                    return Answer(200, reply.content_type, data)
                chunks = reply.chunks().__aiter__()
                head, in_stream, judged = await _peek(chunks)
            if in_stream is not None and may_fall_back:  # else vLLM's own stream, as it is
                raise StageFailed(stage, inst, status=error_status(in_stream),
                                  body=jsonio.dumps(in_stream))
            if trace.recorded is not None and trace.recorded.waits is None:
                # The events before its content (vLLM's role event), for the trace's count
                # of output tokens: the peek judged them already.
                trace.recorded.waits = head.count(b"\n\n", 0, judged)
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
    """A committed stream's raw bytes through, untouched (after `head`, already read), as
    they come; a later stall (`idle_s` without a byte: the transport's deadline) or failure
    ends it with an error event. Releases the instance and the reply."""
    reply.idle(idle_s)
    try:
        if head:
            yield head
        async for chunk in chunks:
            yield chunk
    except UpstreamError as exc:
        if exc.kind == "timeout":
            trace.notes.append("stream_idle_timeout=1")
            yield error_event(f"{stage} instance {inst.url}: no data in {idle_s}s")
            return
        trace.notes.append("stream_broken=1")
        if trace.is_resumable:
            raise  # replay.py goes on elsewhere
        yield error_event(str(exc))
    finally:
        inst.outstanding -= 1
        await reply.close()


async def _peek(chunks: AsyncIterator[bytes]) -> tuple[bytes, dict[str, Any] | None, int]:
    """Read until the first content chunk, [DONE], an error event or the end of the stream;
    with where the events judged "wait" (before any content) end."""
    buf = b""
    judged = 0  # the events before it were judged "wait": never looked at again
    async for chunk in chunks:
        buf += chunk
        kind, error, judged = verdict(buf, judged)
        if kind == "error":
            return buf, error, judged
        if kind == "commit":
            return buf, None, judged
    return buf, None, judged
