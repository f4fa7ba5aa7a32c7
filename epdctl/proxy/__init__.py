"""The embedded OpenAI-compatible proxy: routes requests through E, then PD or P and D.

Attributes load lazily: `epdctl.proxy.config` (the knobs, stdlib only) is read by the plan
and the topology model without importing the server's libraries.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ProxyConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from epdctl.proxy.server.app import create_app

        return create_app
    if name == "ProxyConfig":
        from epdctl.proxy.config import ProxyConfig

        return ProxyConfig
    raise AttributeError(name)
