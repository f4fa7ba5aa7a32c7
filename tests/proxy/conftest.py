"""Fixtures: the proxy app, on each of its production clients, over fake instances served on
local sockets (fakes.py, sockets.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from tests.proxy.fakes import TRANSPORTS, Fakes, Rig, close_rig, make_rig
from tests.proxy.sockets import Names


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def _one_tls_context() -> Iterator[None]:
    """httpx clients here share one default TLS context: each would read the CA bundle into
    its own (~0.1 s, most of an httpx rig's setup), and no fake instance speaks TLS."""
    from httpx._transports import default

    create = default.create_ssl_context
    shared = create()

    def create_shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is True and cert is None and trust_env:
            return shared
        return create(verify=verify, cert=cert, trust_env=trust_env)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(default, "create_ssl_context", create_shared)
        yield


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Every rig test runs on each client the proxy ships with (its id names which)."""
    return str(request.param)


@pytest.fixture
async def names() -> AsyncIterator[Names]:
    """Fake instance names resolve to their local servers during the test; every server is
    closed after it (and an error a handler raised fails it)."""
    names = Names()
    names.install()
    try:
        yield names
    finally:
        await names.close()


@pytest.fixture
async def rig_factory(transport: str, names: Names) -> AsyncIterator[Callable[..., Rig]]:
    """rig_factory(fakes=None, **ProxyConfig's fields) -> a Rig (fakes.make_rig)."""
    rigs: list[Rig] = []

    def make(fakes: Fakes | None = None, **kwargs: Any) -> Rig:
        rigs.append(make_rig(names, transport, fakes, **kwargs))
        return rigs[-1]

    yield make
    for rig in rigs:
        await close_rig(rig)
