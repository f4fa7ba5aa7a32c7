"""create_app(config, client): the proxy as an ASGI app; the caller owns the client."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from starlette.responses import Response

from epdctl.proxy import jsonio
from epdctl.proxy.config import MODE_LABEL, ProxyConfig
from epdctl.proxy.errors import JSON_TYPE, UNAUTHORIZED_BODY
from epdctl.proxy.server.admin import PREFIX, Admin
from epdctl.proxy.server.handler import ProxyHandler
from epdctl.proxy.transport import wrap

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ProxyApp:
    """`GET /health`, `GET /metrics` and the controls under `/epdctl/` (server/admin.py)
    are the proxy's own; everything else, every method
    and path, goes to ProxyHandler.handle (E and P/D, or the instance as it is), so the
    proxy serves what `vllm serve` serves and answers what it does not as vLLM would."""

    def __init__(self, proxy: ProxyHandler) -> None:
        self.state = SimpleNamespace(proxy=proxy)
        self._proxy = proxy
        self._own = {"/health": self._health, "/metrics": self._metrics}
        self._admin = Admin(proxy)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not proxied
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1000})
            return
        path = scope["path"]
        own = self._own.get(path) if scope["method"] == "GET" else None
        if own is not None:
            await own(scope)(scope, receive, send)
        elif path.startswith(PREFIX) and self._admin.serves(path):
            await self._admin(scope, receive, send)
        else:
            await self._proxy.handle(scope, receive, send)

    def _health(self, scope: dict[str, Any]) -> Response:
        proxy = self._proxy
        # Roles and counts for anyone (probes, load balancers); URLs only to a keyed caller.
        is_ok, report = proxy.upstreams.report(with_urls=proxy.is_trusted(scope))
        body = {**report, "mode": MODE_LABEL[proxy.config.mode], "inflight": proxy.inflight}
        if proxy.is_draining:
            body["status"], is_ok = "draining", False
        return Response(jsonio.dumps(body), 200 if is_ok else 503, media_type=JSON_TYPE)

    def _metrics(self, scope: dict[str, Any]) -> Response:
        proxy = self._proxy
        if not proxy.is_authorized(scope):
            return Response(UNAUTHORIZED_BODY, 401, media_type=JSON_TYPE)
        return Response(proxy.metrics.render(proxy.upstreams), media_type=PROMETHEUS_TYPE)


def create_app(config: ProxyConfig, client: Any,
               request_log: Callable[[str], None] | None = None) -> ProxyApp:
    """The proxy app over a caller-owned httpx.AsyncClient (or aiohttp.ClientSession).

    No lifespan hooks: the health loop is `app.state.proxy.run_health_checks()`, which the
    server runner starts as a task (tests drive `proxy.upstreams` directly). Request lines
    go to `request_log` (default: the `epdctl.proxy` logger at INFO).
    """
    upstream = wrap(client, config.connect_timeout_s, config.upstream_api_key)
    return ProxyApp(ProxyHandler(config, upstream, request_log))
