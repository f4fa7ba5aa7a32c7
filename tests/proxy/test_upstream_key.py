"""The instances' internal key: the proxy sends it with every sub-request to them, never to a
media URL, and it travels in the environment only."""

from __future__ import annotations

import httpx
import pytest

from epdctl.proxy.__main__ import upstream_client
from epdctl.proxy.argv import parse_argv
from epdctl.proxy.config import UPSTREAM_KEY_ENV, ProxyConfig
from epdctl.proxy.transport import wrap
from tests.proxy.fakes import MODEL, image_part
from tests.proxy.sockets import Names

pytestmark = pytest.mark.anyio
KEY = "int3rnal"


@pytest.mark.parametrize("split", [False, True], ids=["e-pd", "e-p-d"])
async def test_every_sub_request_carries_the_internal_key(rig_factory, split: bool) -> None:
    roles = ({"prefill": ("http://p0",), "decode": ("http://d0",)} if split else
             {"prefill_decode": ("http://pd0",)})
    rig = rig_factory(encode=("http://e0",), upstream_api_key=KEY, api_key="outside", **roles)
    reply = await rig.client.post(
        "/v1/chat/completions", headers={"authorization": "Bearer outside"},
        json={"model": MODEL, "messages": [{"role": "user", "content": [image_part()]}]})
    assert reply.status_code == 200, reply.text
    posts = [s for s in rig.fakes.seen if s.path != "/health"]
    assert {s.instance for s in posts} == ({"e0", "p0", "d0"} if split else {"e0", "pd0"})
    assert all(s.headers["authorization"] == f"Bearer {KEY}" for s in posts)
    await rig.proxy.upstreams.probe_all(lambda url: rig.proxy.client.probe(url, 1.0))
    probes = [s for s in rig.fakes.seen if s.path == "/health"]
    assert probes and all("authorization" not in s.headers for s in probes)  # /health is open


async def test_a_media_fetch_never_carries_the_key(names: Names, transport: str) -> None:
    seen: list[httpx.Headers] = []

    def web(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, content=b"png", headers={"content-type": "image/png"})

    names.add(web)
    config = ProxyConfig(models=(MODEL,), prefill_decode=("http://pd0",), client=transport)
    async with upstream_client(config) as client:
        upstream = wrap(client, 5.0, KEY)
        assert (await upstream.fetch("http://img.example/a.png", 5.0, 1 << 20))[2] == b"png"
        await (await upstream.post("http://e0", "/v1/chat/completions", b"{}", {}, 5.0,
                                   "encode")).close()
        getattr(upstream, "close", lambda: None)()  # RawUpstream's own pools
    assert "authorization" not in seen[0] and seen[1]["authorization"] == f"Bearer {KEY}"


def test_the_internal_key_is_read_from_the_environment_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = ProxyConfig(models=(MODEL,), prefill_decode=("http://pd0",), upstream_api_key=KEY)
    assert KEY not in " ".join(config.to_argv())
    assert config.env() == {UPSTREAM_KEY_ENV: KEY}
    monkeypatch.setenv(UPSTREAM_KEY_ENV, KEY)
    assert parse_argv(config.to_argv()) == config
    monkeypatch.delenv(UPSTREAM_KEY_ENV)
    assert parse_argv(config.to_argv()).upstream_api_key is None


@pytest.mark.parametrize("api_key", [None, "outside"])
async def test_health_shows_urls_only_to_a_keyed_caller(rig_factory, api_key) -> None:
    """Anyone may probe /health (roles and counts); which URLs lie behind it is for the
    run's own tools (the internal key) and clients with the api_key."""
    rig = rig_factory(encode=("http://e0",), upstream_api_key=KEY, api_key=api_key)
    anonymous = await rig.client.get("/health")
    assert anonymous.status_code == 200
    assert anonymous.json()["roles"] == {"encode": {"in": 1, "out": 0},
                                         "prefill_decode": {"in": 1, "out": 0}}
    assert "http://" not in anonymous.text
    wrong = await rig.client.get("/health", headers={"authorization": "Bearer nope"})
    assert "http://" not in wrong.text
    keys = [KEY] + ([api_key] if api_key else [])
    for key in keys:
        shown = await rig.client.get("/health", headers={"authorization": f"Bearer {key}"})
        assert shown.json()["roles"]["encode"] == {"in": ["http://e0"], "out": []}


async def test_a_proxy_without_keys_shows_its_urls(rig_factory) -> None:
    """Run alone before URLs its user gave it: nothing to hide from that user."""
    rig = rig_factory(encode=("http://e0",))
    assert (await rig.client.get("/health")).json()["roles"]["encode"]["in"] == ["http://e0"]
