"""Routes with nothing to orchestrate: sent to a PD (or D) instance, answered as it answers.

`/tokenize`, `/detokenize`, `/version`, `/ping`, `/load`, `/v1/models`, `/openapi.json`,
pooling and scoring routes, `/v1/messages`, `/invocations`, unknown paths (vLLM's own 404)
and the bodies the proxy cannot orchestrate: method, path, query, headers and body go to
the instance; its status, headers and body (streamed when it streams) come back as sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from epdctl.proxy.answer import Answer, StageFailed
from epdctl.proxy.attempts import ATTEMPTS, Attempts
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import UpstreamError
from epdctl.proxy.metrics import Metrics
from epdctl.proxy.request.parse import header_id
from epdctl.proxy.stages.generate import relay
from epdctl.proxy.trace import Trace
from epdctl.proxy.transport import Reply, Upstream
from epdctl.proxy.upstreams import Instance, Upstreams

# Hop-by-hop headers, what the proxy itself sets, and the proxy's own API key stay here.
REQUEST_DROP = frozenset({b"connection", b"keep-alive", b"proxy-authorization", b"te",
                          b"trailer", b"transfer-encoding", b"upgrade", b"host",
                          b"content-length", b"authorization", b"accept-encoding", b"expect"})
RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding",
                           b"content-length", b"date", b"server"})
SSE_TYPE = "text/event-stream"


def forwarded_headers(scope_headers: list[tuple[bytes, bytes]], rid: str) -> dict[str, str]:
    """The client's headers for the instance, with its request id (or ours) and identity
    encoding, since the proxy relays the bytes as they come."""
    out = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope_headers
           if name not in REQUEST_DROP}
    out["accept-encoding"] = "identity"
    out["x-request-id"] = header_id(rid)
    return out


def relayed_headers(reply: Reply) -> list[tuple[bytes, bytes]]:
    """The instance's response headers, less those that describe its connection to us."""
    return [(name.lower(), value) for name, value in reply.header_list()
            if name.lower() not in RESPONSE_DROP]


class Passthrough:
    """Sends a request as it came to the final stage's least busy healthy instance."""

    def __init__(self, config: ProxyConfig, upstreams: Upstreams, client: Upstream,
                 metrics: Metrics) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.pool = upstreams.pools[config.final_role]
        self.stage = config.final_role
        self.read_s = config.final_read_s

    async def run(self, scope: Mapping[str, Any], raw: bytes, attempts: Attempts) -> Answer:
        """The instance's answer; another attempt elsewhere where the policy allows one
        (only when the first instance did not answer at all)."""
        trace = attempts.trace
        path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        target = (path + b"?" + query if query else path).decode("latin-1")
        headers = forwarded_headers(scope["headers"], trace.rid)
        for attempt in range(ATTEMPTS):
            inst = self.pool.pick(attempts.avoid.get(self.stage))
            try:
                return await self._once(inst, scope["method"], target, raw, headers, trace)
            except StageFailed as failed:
                attempts.retry(failed, attempt)
        raise AssertionError("unreachable")

    async def _once(self, inst: Instance, method: str, target: str, raw: bytes,
                    headers: dict[str, str], trace: Trace) -> Answer:
        trace.instances[self.stage] = inst.url
        timeout_s = self.config.decode_timeout_s
        started = time.perf_counter()
        reply: Reply | None = None
        is_handed_off = False
        inst.outstanding += 1
        try:
            async with asyncio.timeout(timeout_s):
                reply = await self.client.request(method, inst.url, target, raw, headers,
                                                  self.read_s, self.stage)
                head = relayed_headers(reply)
                if not reply.content_type.startswith(SSE_TYPE):
                    body = await reply.read()
                    return Answer(reply.status, reply.content_type, body, raw_headers=head)
            stream = relay(b"", reply.chunks().__aiter__(), reply, inst, trace, self.stage,
                           self.config.stream_idle_timeout_s)
            is_handed_off = True  # the relay closes the reply and releases the instance
            return Answer(reply.status, reply.content_type, stream=stream, raw_headers=head)
        except TimeoutError:
            error = UpstreamError(self.stage, inst.url, "timeout", f"no answer in {timeout_s}s")
            raise StageFailed(self.stage, inst, error=error) from None
        except UpstreamError as exc:
            raise StageFailed(self.stage, inst, error=exc) from None
        finally:
            trace.timed("passthrough", started)
            if not is_handed_off:
                inst.outstanding -= 1
                if reply is not None:
                    await reply.close()

