"""How the proxy talks to its instances: the contract every stage relies on (base.py) and
its implementations side by side, none importing another, as httpx's transports are laid
out: httpx_impl (`--client httpx`), aiohttp_impl (passed-through routes, media, probes under
`--client aiohttp`) and raw_impl (the POSTs to the instances under `--client aiohttp`, the
hot path: its own HTTP/1.1 pool). `wrap` picks them for a caller-owned client."""

from __future__ import annotations

from typing import Any

import httpx

from epdctl.proxy.transport.base import Reply, Upstream, with_key
from epdctl.proxy.transport.httpx_impl import HttpxUpstream

__all__ = ["Reply", "Split", "Upstream", "with_key", "wrap"]


class Split:
    """POSTs to the instances on one transport, everything else (passed-through routes,
    media fetches, health probes: rare, and needing redirects, decompression, any method)
    on another."""

    def __init__(self, posts: Any, rest: Any) -> None:
        self.posts = posts
        self.rest = rest
        self.post = posts.post
        self.request = rest.request
        self.fetch = rest.fetch
        self.probe = rest.probe

    def close(self) -> None:
        self.posts.close()


def wrap(client: Any, connect_timeout_s: float = 5.0, api_key: str | None = None) -> Upstream:
    """Our interface over a caller-owned client: httpx.AsyncClient or aiohttp.ClientSession.

    `api_key`: the instances' internal key, sent with every request to them, passed-through
    ones too (never with a media fetch, which goes elsewhere; /health probes need none).
    """
    if isinstance(client, httpx.AsyncClient):
        return HttpxUpstream(client, connect_timeout_s, api_key)
    # aiohttp: POSTs to the instances over the proxy's own pools (raw_impl), the rest on
    # it; all on it where httptools (a dependency where it builds) is missing.
    from epdctl.proxy.transport.aiohttp_impl import AiohttpUpstream

    rest = AiohttpUpstream(client, connect_timeout_s, api_key)
    try:
        from epdctl.proxy.transport.raw_impl import RawUpstream
    except ImportError:
        return rest
    return Split(RawUpstream(connect_timeout_s, api_key), rest)  # type: ignore[return-value]


