"""The real proxy (`python -m epdctl.proxy`) with every chat request held DELAY_MS before it
is handled: a hop of known cost, for the EC hand-off profile to find.

    python tests/delayed_proxy.py DELAY_MS <the proxy's arguments>
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from epdctl.proxy.__main__ import main
from epdctl.proxy.server import app as proxy_app

CHAT = "/v1/chat/completions"


def hold_chat_requests(seconds: float) -> None:
    handle = proxy_app.ProxyApp.__call__

    async def held(self: proxy_app.ProxyApp, scope: dict[str, Any], receive: Any,
                   send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == CHAT:
            await asyncio.sleep(seconds)
        await handle(self, scope, receive, send)

    proxy_app.ProxyApp.__call__ = held  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_chat_requests(float(sys.argv.pop(1)) / 1000)
    main()
