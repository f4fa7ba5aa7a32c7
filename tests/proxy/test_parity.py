"""The proxy as a drop-in for `vllm serve`: the same requests straight to a (vLLM-like) fake
instance and through the proxy, E|PD and E|P|D, get the same status, headers and body."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.proxy.fakes import MODEL, image_part
from tests.proxy.vllm_like import VllmLike

pytestmark = pytest.mark.anyio
TOPOLOGIES = {
    "e-pd": ({"encode": ("http://e0",)}, "http://pd0"),
    "epd": ({"encode": ("http://e0",), "prefill": ("http://p0",), "decode": ("http://d0",)},
            "http://d0"),
}
IMAGE = image_part()
RESPONSES_IMAGE = {"type": "input_image", "image_url": IMAGE["image_url"]["url"],
                   "detail": "auto"}


def chat(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def responses(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": [{"role": "user", "content": content}],
            "request_id": "resp_fixed", **extra}


# (method, path, JSON body or raw bytes); every request carries the same x-request-id.
REQUESTS: list[tuple[str, str, Any]] = [
    ("POST", "/v1/chat/completions", chat()),
    ("POST", "/v1/chat/completions", chat(stream=True)),
    ("POST", "/v1/chat/completions", chat([IMAGE, {"type": "text", "text": "what?"}])),
    ("POST", "/v1/chat/completions", chat([IMAGE], stream=True)),
    ("POST", "/v1/chat/completions", chat(stream="yes")),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True}),
    ("POST", "/v1/responses", responses()),
    ("POST", "/v1/responses", responses(stream=True)),
    ("POST", "/v1/responses", responses([RESPONSES_IMAGE,
                                         {"type": "input_text", "text": "what?"}])),
    ("POST", "/v1/responses", responses([RESPONSES_IMAGE], stream=True)),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("GET", "/version", None),
    ("GET", "/ping", None),
    ("GET", "/load", None),
    ("GET", "/v1/models", None),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/invocations", chat()),
    ("POST", "/pooling", {"model": MODEL, "input": "hi"}),
    ("GET", "/openapi.json?x=1", None),
    ("DELETE", "/v1/chat/completions", None),
    ("POST", "/health", None),
    # vLLM's refusals, unchanged
    ("POST", "/v1/chat/completions", chat(model="gpt-4")),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": ['),
    ("POST", "/v1/chat/completions", b"[1, 2]"),
    ("POST", "/v1/chat/completions", chat(stream="maybe")),
    ("POST", "/v1/chat/completions",
     chat([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}])),
    ("POST", "/v1/chat/completions",
     chat([{"type": "image_url", "image_url": {"url": "http://media/missing.png"}}])),
    ("POST", "/v1/responses", responses([{**RESPONSES_IMAGE,
                                          "image_url": "http://media/missing.png"}])),
]


@pytest.fixture(params=sorted(TOPOLOGIES))
async def pair(request, rig_factory) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """(a client straight to the final instance, the rig with the proxy in front of it)."""
    roles, final = TOPOLOGIES[request.param]
    rig = rig_factory(VllmLike(), **roles)
    async with httpx.AsyncClient(base_url=final) as direct:  # to the rig's own instance
        yield direct, rig


async def _send(client: httpx.AsyncClient, method: str, path: str, body: Any,
                rid: str | None = "parity-1") -> httpx.Response:
    headers = {"x-request-id": rid} if rid else {}
    if isinstance(body, bytes):
        headers["content-type"] = "application/json"
        return await client.request(method, path, content=body, headers=headers)
    return await client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body"), REQUESTS,
                         ids=[f"{m} {p} {n}" for n, (m, p, _) in enumerate(REQUESTS)])
async def test_same_answer_straight_and_through_the_proxy(pair, method, path, body):
    direct, rig = pair
    theirs = await _send(direct, method, path, body)
    mine = await _send(rig.client, method, path, body)
    assert (mine.status_code, mine.content) == (theirs.status_code, theirs.content)
    for header in ("content-type", "allow"):
        assert mine.headers.get(header) == theirs.headers.get(header), header


async def test_media_went_through_e_and_the_final_stage_got_keys(pair):
    direct, rig = pair
    r = await _send(rig.client, "POST", "/v1/responses", responses([RESPONSES_IMAGE]))
    assert r.status_code == 200
    [enc] = rig.fakes.posts("e")
    assert enc.body["messages"][0]["content"][0]["image_url"] == IMAGE["image_url"]
    key = enc.body["messages"][0]["content"][0]["uuid"]
    final = rig.fakes.posts(direct.base_url.host)[-1]
    assert final.body["input"][0]["content"][0] == {**RESPONSES_IMAGE, "uuid": key}
    assert final.headers["x-request-id"] == "parity-1"
    if rig.config.is_split:
        [p] = rig.fakes.posts("p0")
        assert (p.body["max_output_tokens"], p.body["store"], p.body["stream"]) == (
            1, False, False)
        assert final.body["kv_transfer_params"] == rig.fakes.kv_params


async def test_ids_have_vllms_shape_without_a_client_id(pair):
    direct, rig = pair
    for path, body, prefix in (("/v1/chat/completions", chat(), "chatcmpl-"),
                               ("/v1/completions", {"prompt": "hi"}, "cmpl-"),
                               ("/v1/responses", {"input": "hi"}, "resp_")):
        theirs = (await _send(direct, "POST", path, body, rid=None)).json()["id"]
        mine = (await _send(rig.client, "POST", path, body, rid=None)).json()["id"]
        pattern = re.escape(prefix) + "[0-9a-f]{16}"
        assert re.fullmatch(pattern, theirs) and re.fullmatch(pattern, mine), (theirs, mine)
    r = await _send(rig.client, "POST", "/v1/chat/completions", chat(request_id="mine"),
                    rid=None)
    assert r.json()["id"] == "chatcmpl-mine"  # the body's request_id, as vLLM uses it


async def test_a_continuation_skips_prefill(pair):
    direct, rig = pair
    r = await _send(rig.client, "POST", "/v1/responses",
                    responses(previous_response_id="resp_before"))
    assert r.status_code == 200
    assert rig.fakes.posts("p0") == []
