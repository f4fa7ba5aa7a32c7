"""epdctl.engines.guard: with VLLM_API_KEY, only /health answers without the key."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from epdctl.engines.guard import KEY_ENV, RequireKey

PATHS = ("/v1/chat/completions", "/invocations", "/tokenize", "/pooling", "/metrics", "/x")


async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def client(monkeypatch: pytest.MonkeyPatch, key: str | None) -> httpx.AsyncClient:
    if key is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, key)
    app = RequireKey(inner)  # reads the key when vLLM builds its middleware stack
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e")


@pytest.mark.anyio
async def test_every_route_but_health_needs_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    async with client(monkeypatch, "k3y") as c:
        assert (await c.get("/health")).text == "served"
        for path in PATHS:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "k3y"},
                            {"authorization": "Bearer k3y "}):
                reply = await c.post(path, headers=headers)
                assert reply.status_code == 401 and reply.json() == {"error": "Unauthorized"}
            good = await c.post(path, headers={"authorization": "Bearer k3y"})
            assert good.status_code == 200 and good.text == "served"


@pytest.mark.anyio
async def test_without_a_key_only_health_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    async with client(monkeypatch, None) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.post("/v1/completions", headers={"authorization": "Bearer "})
                ).status_code == 401
