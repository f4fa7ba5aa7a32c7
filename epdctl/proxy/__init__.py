"""The embedded OpenAI-compatible proxy: routes requests through E, then PD or P and D."""

from __future__ import annotations

from epdctl.proxy.app import create_app
from epdctl.proxy.config import ProxyConfig

__all__ = ["ProxyConfig", "create_app"]
