"""create_app(config, client): the Starlette app; the caller owns the client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from epdctl.proxy.client import wrap
from epdctl.proxy.config import MODE_LABEL, ProxyConfig
from epdctl.proxy.errors import JSON_TYPE, ProxyError, error_body
from epdctl.proxy.handler import ProxyHandler
from epdctl.proxy.routing import CHAT, COMPLETIONS

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Completions:
    """A raw ASGI endpoint: Starlette routes to it without wrapping it in Request/Response."""

    def __init__(self, proxy: ProxyHandler, route: str) -> None:
        self.proxy = proxy
        self.route = route

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.proxy.completions(self.route, scope, receive, send)


def create_app(config: ProxyConfig, client: Any,
               request_log: Callable[[str], None] | None = None) -> Starlette:
    """The proxy app over a caller-owned httpx.AsyncClient (or aiohttp.ClientSession).

    No lifespan hooks: the health loop is `app.state.proxy.run_health_checks()`, which the
    server runner starts as a task (tests drive `proxy.upstreams` directly). Request lines
    go to `request_log` (default: the `epdctl.proxy` logger at INFO).
    """
    upstream = wrap(client, config.connect_timeout_s, config.upstream_api_key)
    proxy = ProxyHandler(config, upstream, request_log)
    created = int(time.time())

    def _json(status: int, obj: object) -> Response:
        return Response(json.dumps(obj), status, media_type=JSON_TYPE)

    def _denied(request: Request) -> Response | None:
        if proxy.is_authorized(request.scope):
            return None
        err = ProxyError(401, "Missing or invalid API key", code="invalid_api_key",
                         type_="authentication_error")
        return Response(err.body(), 401, media_type=JSON_TYPE)

    async def models(request: Request) -> Response:
        denied = _denied(request)
        if denied is not None:
            return denied
        data = [{"id": m, "object": "model", "created": created, "owned_by": "epdctl"}
                for m in config.models]
        return _json(200, {"object": "list", "data": data})

    async def health(request: Request) -> Response:
        is_ok, report = proxy.upstreams.report()
        return _json(200 if is_ok else 503, {**report, "mode": MODE_LABEL[config.mode],
                                             "inflight": proxy.inflight})

    async def metrics(request: Request) -> Response:
        denied = _denied(request)
        if denied is not None:
            return denied
        return Response(proxy.metrics.render(proxy.upstreams), media_type=PROMETHEUS_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal proxy error"
        return Response(error_body(str(detail), "invalid_request_error", status), status,
                        media_type=JSON_TYPE)

    app = Starlette(
        routes=[
            Route(CHAT, _Completions(proxy, CHAT)),
            Route(COMPLETIONS, _Completions(proxy, COMPLETIONS)),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={404: http_error, 405: http_error},
    )
    app.state.proxy = proxy
    return app
