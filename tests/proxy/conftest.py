"""Fixtures: the proxy app over fake upstreams (see proxy_fakes.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from epdctl.proxy import ProxyConfig, create_app
from tests.e2e.conftest import tiny_llava  # noqa: F401  (test_real_vllm.py)
from tests.proxy.fakes import MODEL, Fakes, Rig


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def rig_factory() -> AsyncIterator[Callable[..., Rig]]:
    clients: list[httpx.AsyncClient] = []
    rigs: list[Rig] = []

    def make(fakes: Fakes | None = None, **kwargs: Any) -> Rig:
        fakes = fakes or Fakes()
        kwargs.setdefault("models", (MODEL,))
        # No health probes run here, so nothing dead comes back: don't wait for it.
        kwargs.setdefault("replay_wait_s", 0.01)
        if not kwargs.get("prefill"):
            kwargs.setdefault("prefill_decode", ("http://pd0",))
        config = ProxyConfig(**kwargs)
        upstream = httpx.AsyncClient(transport=httpx.MockTransport(fakes.handle))
        app = create_app(config, upstream)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://proxy")
        clients.extend([upstream, client])
        rigs.append(Rig(app, client, fakes, config))
        return rigs[-1]

    yield make
    for client in clients:
        await client.aclose()
    for rig in rigs:
        rig.proxy.close()


