"""The completion routes as raw ASGI: auth, bound, body, E, then PD; errors as JSON."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from epdctl.proxy.client import Upstream
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.encode import Encoder
from epdctl.proxy.errors import JSON_TYPE, ProxyError
from epdctl.proxy.generate import Answer, Generator, StageFailed
from epdctl.proxy.lookup import StoreLookup
from epdctl.proxy.media import assign_uuids
from epdctl.proxy.metrics import Metrics, outcome_of
from epdctl.proxy.mooncake import MooncakeRoute
from epdctl.proxy.routing import (
    CHAT,
    find_media,
    parse_body,
    pd_body,
    request_id,
)
from epdctl.proxy.trace import Trace
from epdctl.proxy.upstreams import Upstreams

log = logging.getLogger("epdctl.proxy")
Scope = MutableMapping[str, Any]


class _Disconnect:
    """Cancels the request's task when the client goes away before the answer is done."""

    def __init__(self, receive: Any) -> None:
        self.is_gone = False
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._wait(receive))

    async def _wait(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.is_gone = True
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        self._watch.cancel()


class ProxyHandler:
    """Shared state of one app: config, pools, client, metrics, in-flight count."""

    def __init__(self, config: ProxyConfig, client: Upstream,
                 request_log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.request_log = request_log or (lambda line: log.info("%s", line))
        self.client = client
        self.upstreams = Upstreams(config)
        self.metrics = Metrics()
        self.inflight = 0
        self.metrics.inflight.set_function(lambda: self.inflight)  # read at scrape time
        encode_pool = self.upstreams.pools.get("encode")
        self.lookup = None
        if config.should_look_up:
            self.lookup = StoreLookup(config.store_dir, config.namespace)
        self.encoder = None
        if encode_pool:
            self.encoder = Encoder(config, encode_pool, client, self.metrics, self.lookup)
        self.generator = Generator(config, self.upstreams, client, self.metrics)
        self.mooncake = None
        if self.encoder is not None and config.ec_protocol == "mooncake":
            self.mooncake = MooncakeRoute(config, self.encoder, self.generator, self.metrics)
        self._auth = f"Bearer {config.api_key}".encode() if config.api_key else None

    def is_authorized(self, scope: Scope) -> bool:
        if self._auth is None:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._auth)
        return False

    def close(self) -> None:
        """Flush what outlives the app (the store counters); __main__ calls it on exit."""
        if self.lookup is not None:
            self.lookup.close()

    async def run_health_checks(self) -> None:
        """Background probe loop (and the store index's scans); __main__ runs it as a task
        beside the server."""
        scans = asyncio.ensure_future(self.lookup.run_scans()) if self.lookup else None
        try:
            await self.upstreams.run_health_checks(
                lambda url: self.client.probe(url, self.config.health_timeout_s),
                self.config.health_interval_s)
        finally:
            if scans is not None:
                scans.cancel()

    async def completions(self, route: str, scope: Scope, receive: Any, send: Any) -> None:
        """POST /v1/chat/completions and /v1/completions."""
        rid_header = length = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid_header = value.decode("latin-1")
            elif name == b"content-length":
                length = value
        trace = Trace(request_id(rid_header), route)
        answer = self._refuse(scope, length)
        if answer is not None:
            await _send(send, answer, trace.rid)
            self._finish(trace, answer.status)
            return
        self.inflight += 1
        try:
            await self._serve(route, receive, send, trace)
        finally:
            self.inflight -= 1

    def _refuse(self, scope: Scope, length: bytes | None) -> Answer | None:
        """The answer for a request turned away before its body is read, if it is."""
        if scope["method"] != "POST":
            return _error(ProxyError(405, "Method Not Allowed", code="method_not_allowed"))
        if not self.is_authorized(scope):
            return _error(ProxyError(401, "Missing or invalid API key", code="invalid_api_key",
                                     type_="authentication_error"))
        if self.inflight >= self.config.max_inflight:
            retry_after = str(self.config.retry_after_s)
            return _error(ProxyError(503, "The proxy is at its in-flight limit; retry later",
                                     type_="server_error", code="overloaded",
                                     headers={"retry-after": retry_after}))
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            return _error(_too_large(self.config.max_body_bytes))
        return None

    async def _serve(self, route: str, receive: Any, send: Any, trace: Trace) -> None:
        try:
            raw = await _read_body(receive, self.config.max_body_bytes)
        except ProxyError as exc:
            await _send(send, _error(exc), trace.rid)
            self._finish(trace, exc.status)
            return
        if raw is None:
            self._finish(trace, "client_gone")
            return
        watcher = _Disconnect(receive)
        try:
            try:
                answer = await self._answer(route, raw, trace)
            except ProxyError as exc:
                answer = _error(exc)
            except StageFailed as failed:
                answer = failed.answer()
            if answer.stream is None:
                watcher.stop()
                await _send(send, answer, trace.rid)
                self._finish(trace, answer.status)
                return
            await _send_stream(send, answer, trace.rid, watcher)
            self._finish(trace, 200)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watcher.is_gone or task is None:
                raise
            task.uncancel()  # our own cancel: the client left, nothing to answer
            self._finish(trace, "client_gone")
        except Exception:
            watcher.stop()
            log.exception("rid=%s internal proxy error", trace.rid)
            await _send(send, _error(ProxyError(500, "internal proxy error",
                                                type_="server_error")), trace.rid)
            self._finish(trace, 500)
        finally:
            watcher.stop()

    async def _answer(self, route: str, raw: bytes, trace: Trace) -> Answer:
        body = parse_body(raw, route, self.config.models)
        is_stream = body.get("stream") is True
        first: dict[str, Any] | bytes = body if self.config.is_split else raw
        second, is_rewritten = first, False
        items = find_media(body) if route == CHAT and self.encoder is not None else []
        if items:
            assert self.encoder is not None
            trace.items = len(items)
            await assign_uuids(items, self.client, self.config.media_fetch_timeout_s,
                               self.config.max_body_bytes)
            if self.mooncake is not None:
                return await self.mooncake.run(route, body, items, is_stream, trace)
            encoded = await self.encoder.run(body, items, trace)
            first, is_rewritten = pd_body(body, items, encoded.reported, encoded.params,
                                          self.config.metadata_rewrite)
            if is_rewritten:  # the fallback: the media themselves
                second = pd_body(body, items, encoded.reported, encoded.params, False)[0]
            else:
                second = first
        return await self.generator.run(route, first, second, is_rewritten, is_stream, trace)

    def _finish(self, trace: Trace, status: int | str) -> None:
        outcome = outcome_of(status) if isinstance(status, int) else "cancelled"
        self.metrics.count(trace.route, outcome)
        self.metrics.stage["total"].observe(time.perf_counter() - trace.start)
        self.request_log(trace.line(status))


def _error(exc: ProxyError) -> Answer:
    return Answer(exc.status, JSON_TYPE, exc.body(), headers=exc.headers)


def _too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body is larger than {limit} bytes",
                      code="request_too_large")


async def _read_body(receive: Any, max_bytes: int) -> bytes | None:
    """The whole body, or None if the client left; 413 past the limit."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _headers(answer: Answer, rid: str) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", answer.content_type.encode()),
               (b"x-request-id", rid.encode())]
    headers += [(k.encode(), v.encode()) for k, v in answer.headers.items()]
    return headers


async def _send(send: Any, answer: Answer, rid: str) -> None:
    headers = _headers(answer, rid)
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _send_stream(send: Any, answer: Answer, rid: str, watcher: _Disconnect) -> None:
    """Relay a committed stream; the watcher's cancel stops it if the client leaves."""
    assert answer.stream is not None
    stream = answer.stream
    try:
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": _headers(answer, rid)})
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        watcher.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
