"""`vllm serve ... --middleware epdctl.engines.guard.RequireKey`: an engine behind a keyed
proxy answers only requests that carry its internal key, on every route but /health.

The key comes from VLLM_API_KEY, which vLLM's own check reads too. That check guards only
paths under /v1, /v2, /inference and /cohere: /invocations (SageMaker's way into chat and
completions), /tokenize, /pooling, /classify, /score and the rest answer anyone. This one
guards them all; /health stays open for the supervisor's and the proxy's probes. No key in
the environment means nothing but /health is served. Stdlib only: vLLM imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY_ENV = "VLLM_API_KEY"
MIDDLEWARE = f"{__name__}.RequireKey"
OPEN_PATHS = frozenset({"/health"})
_BODY = b'{"error":"Unauthorized"}'

Scope = MutableMapping[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


def _digest(value: bytes) -> bytes:
    # Digests of equal length: compare_digest then takes the same time for any header.
    return hashlib.sha256(value).digest()


class RequireKey:
    """Pure ASGI middleware: 401 unless `authorization: Bearer $VLLM_API_KEY`."""

    def __init__(self, app: App) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV)
        self._expected = _digest(f"Bearer {key}".encode()) if key else None

    def is_allowed(self, scope: Scope) -> bool:
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if path in OPEN_PATHS:
            return True
        if self._expected is None:
            return False
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                return hmac.compare_digest(_digest(value), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.is_allowed(scope):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_BODY)).encode())]})
            await send({"type": "http.response.body", "body": _BODY})
