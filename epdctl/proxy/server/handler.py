"""Every route but /health and /metrics, as raw ASGI: auth, bound, body, then E and PD (the
completion routes) or the instance as it is (the rest); the proxy's own errors as JSON."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.answer import Answer, StageFailed
from epdctl.proxy.attempts import Attempts
from epdctl.proxy.config import ProxyConfig
from epdctl.proxy.errors import JSON_TYPE, UNAUTHORIZED_BODY, ProxyError
from epdctl.proxy.metrics import Metrics, outcome_of
from epdctl.proxy.request.inflight import Request
from epdctl.proxy.request.media import MediaTooLarge, assign_uuids, scope_client_uuids
from epdctl.proxy.request.parse import CONTENT_FIELDS, ORCHESTRATED, parse_body, request_id
from epdctl.proxy.request.traffic import Recorded
from epdctl.proxy.server.asgi import (
    Disconnect,
    Scope,
    error_answer,
    presents,
    read_body,
    send_answer,
    send_stream,
    too_large,
)
from epdctl.proxy.stages.encode import Encoder
from epdctl.proxy.stages.generate import Generator
from epdctl.proxy.stages.lookup import StoreLookup
from epdctl.proxy.stages.media_stage import MediaStage
from epdctl.proxy.stages.mooncake import MooncakeRoute
from epdctl.proxy.stages.passthrough import Passthrough
from epdctl.proxy.stages.pending import Overlap, PendingMarks
from epdctl.proxy.stages.replay import Replayer
from epdctl.proxy.trace import Trace
from epdctl.proxy.transport import Upstream
from epdctl.proxy.upstreams import Upstreams

log = logging.getLogger("epdctl.proxy")
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
        self.is_draining = False
        """Set by `POST /epdctl/drain` (server/admin.py): nothing new is admitted."""
        self.metrics.inflight.set_function(lambda: self.inflight)  # read at scrape time
        encode_pool = self.upstreams.pools.get("encode")
        self.lookup = None
        if config.should_look_up or config.should_overlap:
            self.lookup = StoreLookup(config.store_dir, config.namespace)
        self.encoder = self.overlap = None
        if encode_pool:
            self.encoder = Encoder(config, encode_pool, client, self.metrics, self.lookup)
            if self.lookup is not None and config.should_overlap:  # E beside PD
                self.overlap = Overlap(PendingMarks(self.lookup.store), self.encoder,
                                       config.encode_timeout_s)
        self.media = MediaStage(config, self.encoder, self.lookup, self.overlap, self.metrics)
        self.generator = Generator(config, self.upstreams, client, self.metrics)
        self.replayer = Replayer(config, self.upstreams, self.generator, client, self.metrics)
        self.passthrough = Passthrough(config, self.upstreams, client, self.metrics)
        self.mooncake = None
        if self.encoder is not None and config.ec_protocol == "mooncake":
            self.mooncake = MooncakeRoute(config, self.encoder, self.generator, self.metrics)
        self._auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        # Who may see the instances' URLs on /health: a client with the api_key, or epdctl's
        # own tools with the run's internal key (nobody needs a key where neither is set).
        self._trusted = [f"Bearer {k}".encode() for k in (config.api_key, config.upstream_api_key)
                         if k]

    def is_authorized(self, scope: Scope) -> bool:
        return self._auth is None or presents(scope, [self._auth])

    def is_trusted(self, scope: Scope) -> bool:
        """Whether the caller may see the topology's insides (the instances' URLs)."""
        return not self._trusted or presents(scope, self._trusted)

    def close(self) -> None:
        """Flush what outlives the app (the store counters); __main__ calls it on exit.
        E stages still running beside PD are cancelled (their marks go as they unwind)."""
        if self.overlap is not None:
            self.overlap.cancel()
        if self.lookup is not None:
            self.lookup.close()

    async def stop_background(self) -> None:
        """Cancel the E stages still running beside PD (overlap) and wait until they are
        gone: their marks are removed and their requests' lines handed to the request log
        by then (__main__ flushes it after this)."""
        if self.overlap is not None:
            self.overlap.cancel()
            await self.overlap.settle()

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

    async def handle(self, scope: Scope, receive: Any, send: Any) -> None:
        """Any request: POSTs to the completion routes through E and P/D, the rest passed
        through to an instance (which answers unknown paths and methods as vLLM does)."""
        path = scope["path"]
        route = path if scope["method"] == "POST" and path in ORCHESTRATED else None
        rid_header = length = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid_header = value.decode("latin-1")
            elif name == b"content-length":
                length = value
        trace = Trace(request_id(rid_header), path)
        answer = self._refuse(scope, length)
        if answer is not None:
            await send_answer(send, answer, trace.rid)
            self._finish(trace, answer.status)
            return
        self.inflight += 1
        try:
            await self._serve(route, scope, receive, send, trace, rid_header is not None)
        finally:
            self.inflight -= 1

    def _refuse(self, scope: Scope, length: bytes | None) -> Answer | None:
        """The answer for a request turned away before its body is read, if it is."""
        if not self.is_authorized(scope):
            return Answer(401, JSON_TYPE, UNAUTHORIZED_BODY)
        if self.is_draining:
            return error_answer(ProxyError(
                503, "The proxy is draining before it stops; retry later",
                headers={"retry-after": str(self.config.retry_after_s)}))
        if self.inflight >= self.config.max_inflight:
            retry_after = str(self.config.retry_after_s)
            return error_answer(ProxyError(
                503, "The proxy is at its in-flight limit; retry later",
                headers={"retry-after": retry_after}))
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            return error_answer(too_large(self.config.max_body_bytes))
        return None

    async def _serve(self, route: str | None, scope: Scope, receive: Any, send: Any,
                     trace: Trace, has_rid: bool) -> None:
        try:
            raw = await read_body(receive, self.config.max_body_bytes)
        except ProxyError as exc:
            await send_answer(send, error_answer(exc), trace.rid)
            self._finish(trace, exc.status)
            return
        if raw is None:
            self._finish(trace, "client_gone")
            return
        watcher = Disconnect(receive)
        attempts = Attempts(trace, self.metrics, self.upstreams)
        try:
            try:
                if route is None:
                    answer = await self.passthrough.run(scope, raw, attempts)
                else:
                    answer = await self._answer(route, scope, raw, attempts, has_rid)
            except ProxyError as exc:
                answer = error_answer(exc)
            except StageFailed as failed:
                answer = failed.answer()
            if answer.stream is None:
                watcher.stop()
                await send_answer(send, answer, trace.rid)
                if trace.recorded is not None:
                    trace.recorded.answer = answer.body  # its usage, read for the line
                self._finish(trace, answer.status)
                return
            await send_stream(send, answer, trace.rid, watcher, trace.recorded)
            self._finish(trace, answer.status)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not watcher.is_gone or task is None:
                raise
            task.uncancel()  # our own cancel: the client left, nothing to answer
            self._finish(trace, "client_gone")
        except Exception:
            watcher.stop()
            log.exception("rid=%s internal proxy error", trace.rid)
            internal = error_answer(ProxyError(500, "internal proxy error"))
            await send_answer(send, internal, trace.rid)
            self._finish(trace, 500)
        finally:
            watcher.stop()

    async def _answer(self, route: str, scope: Scope, raw: bytes, attempts: Attempts,
                      has_rid: bool) -> Answer:
        """A completion route's answer: the body parsed once into the request that goes
        through the stages (media keyed, E, then PD with its replays)."""
        trace = attempts.trace
        try:
            body = parse_body(raw, route, self.config.models)
        except ProxyError:
            # Not ours to refuse: vLLM answers it (its own error, or its answer).
            trace.notes.append("passed_through=1")
            return await self.passthrough.run(scope, self._scoped_raw(route, raw), attempts)
        if not has_rid and isinstance(body.get("request_id"), str):
            trace.rid = request_id(body["request_id"])  # what vLLM names the answer by
        is_scoped = False
        if route in CONTENT_FIELDS:  # before anything reads a uuid: none goes on as sent
            scoped, by_client = scope_client_uuids(body, self.config.client_uuids,
                                                   field=CONTENT_FIELDS[route])
            self.metrics.keyed_by["client"].inc(by_client)
            is_scoped = scoped is not body
            body = scoped
        req = Request(route, raw, body, trace, attempts)
        trace.recorded = Recorded(route, body, req.is_stream)
        if self.config.is_split or is_scoped:
            req.for_pd(body)  # the client's bytes no longer say it
        items = self.media.items(route, body)
        if self.encoder is not None:  # the media found once (with fetched URLs' bytes, later)
            trace.recorded.items = items
        if items:
            trace.items = len(items)
            try:
                by_content = await assign_uuids(items, self.client,
                                                self.config.media_fetch_timeout_s,
                                                self.config.max_body_bytes)
            except ProxyError as exc:
                if self.mooncake is not None or isinstance(exc, MediaTooLarge):
                    raise  # media past the proxy's cap: its own answer, not sent on
                # Media the proxy cannot key (bad base64, a URL it cannot fetch): PD gets
                # the body as it came and answers for it, as vLLM would.
                trace.notes.append("media_unkeyed=1")
                return await self.replayer.run(req)
            self.metrics.keyed_by["content"].inc(by_content)
            if self.mooncake is not None:
                return await self.mooncake.run(req, items)
            await self.media.run(req, items)
        return await self.replayer.run(req)

    def _scoped_raw(self, route: str, raw: bytes) -> bytes:
        """A body the proxy does not take, with no client uuid left as sent either: vLLM may
        take what the proxy refuses, and would key the media by it."""
        if route not in CONTENT_FIELDS:
            return raw
        try:
            body = jsonio.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return raw
        if not isinstance(body, dict):
            return raw
        scoped, _ = scope_client_uuids(body, self.config.client_uuids,
                                       field=CONTENT_FIELDS[route])
        return raw if scoped is body else jsonio.dumps(scoped)

    async def settle(self) -> None:
        """Wait for the E stages still running beside PD (overlap); tests and shutdown."""
        if self.overlap is not None:
            await self.overlap.settle()

    def _finish(self, trace: Trace, status: int | str) -> None:
        outcome = outcome_of(status) if isinstance(status, int) else "cancelled"
        # A bounded label set: the completion routes by name, every other path as one.
        label = trace.route if trace.route in ORCHESTRATED else "passthrough"
        self.metrics.count(label, outcome)
        total_s = time.perf_counter() - trace.start
        self.metrics.stage["total"].observe(total_s)
        if trace.encoding is None or trace.encoding.done():
            self.request_log(trace.line(status, total_s * 1000))
            return
        # Overlap: PD may answer before E's own answer is back; the line waits for E's timings
        # (the total stays the client's).
        trace.encoding.add_done_callback(
            lambda _: self.request_log(trace.line(status, total_s * 1000)))


