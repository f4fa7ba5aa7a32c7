"""Client-supplied media uuids live in their own key space; --no-client-uuids ignores them.

The fakes here keep what the real engines keep by mm_hash (= the part's `uuid`): E writes
the image it encoded to a store under that key, and PD answers from the store's entry, or
else from its own cache (vLLM's processor and prefix caches), or else from the image it got.
So an answer names the image PD's key led it to, and aliasing shows as a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from epdctl.proxy.request.media import CLIENT_PREFIX, client_key, content_key, scope_client_uuids
from tests.proxy.fakes import MODEL, Fakes, Seen, completion, image_part

pytestmark = pytest.mark.anyio
RED, BLUE = b"\x89PNG red pixels", b"\x89PNG blue pixels"
URLS = {"red": image_part(RED)["image_url"]["url"], "blue": image_part(BLUE)["image_url"]["url"]}
NAMES = {url: name for name, url in URLS.items()}


@dataclass
class Engines(Fakes):
    """E saves under the part's uuid; PD answers with the name of the image its key finds."""

    encoded: dict[str, str] = field(default_factory=dict)
    pd_cache: dict[str, str] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)

    def default(self, seen: Seen) -> httpx.Response:
        body = seen.body or {}
        parts = [p for m in body.get("messages", ()) if isinstance(m["content"], list)
                 for p in m["content"] if p["type"] != "text"]
        if seen.instance.startswith("e"):
            self.encoded[parts[0]["uuid"]] = parts[0]["image_url"]["url"]
            return super().default(seen)
        answer = []
        for part in parts:
            url = part["image_url"]["url"]
            key = part.get("uuid")
            if key in self.encoded:
                self.hits.append(key)
                url = self.encoded[key]
            elif key is not None:
                url = self.pd_cache.setdefault(key, url)
            answer.append(NAMES.get(url, "?"))
        return httpx.Response(200, json=completion("+".join(answer)))


async def ask(rig: Any, *parts: dict[str, Any]) -> str:
    r = await rig.chat(list(parts))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def sent_uuids(fakes: Fakes, prefix: str) -> list[str | None]:
    return [p.get("uuid") for s in fakes.posts(prefix) for p in s.body["messages"][0]["content"]]


@pytest.mark.parametrize("encode", [("http://e0",), ()], ids=["E|PD", "aggregated"])
async def test_a_client_uuid_equal_to_a_content_key_does_not_alias_it(rig_factory, encode):
    fakes = Engines()
    rig = rig_factory(fakes, encode=encode)
    blue_key = content_key("image", BLUE)
    # The attack: red pixels tagged with the blue image's content key.
    assert await ask(rig, image_part(RED, uuid=blue_key)) == "red"
    assert blue_key not in fakes.encoded and blue_key not in fakes.pd_cache
    assert sent_uuids(fakes, "pd") == [client_key(blue_key)]
    assert await ask(rig, image_part(BLUE)) == "blue"
    # Content keys are what they were (without E, the proxy leaves them to vLLM).
    assert sent_uuids(fakes, "pd")[-1] == (blue_key if encode else None)
    if encode:
        assert fakes.encoded == {client_key(blue_key): URLS["red"], blue_key: URLS["blue"]}
        assert sent_uuids(fakes, "e") == [client_key(blue_key), blue_key]


async def test_the_same_client_uuid_gets_the_same_key_and_hits(rig_factory):
    fakes = Engines()
    rig = rig_factory(fakes, encode=("http://e0",))
    for _ in range(2):
        assert await ask(rig, image_part(RED, uuid="photo-1")) == "red"
    assert sent_uuids(fakes, "e") == sent_uuids(fakes, "pd") == [client_key("photo-1")] * 2
    assert fakes.hits == [client_key("photo-1")] * 2 and len(fakes.encoded) == 1
    assert await ask(rig, image_part(BLUE, uuid="photo-2")) == "blue"
    assert sent_uuids(fakes, "pd")[-1] == client_key("photo-2")


async def test_without_client_uuids_every_item_is_keyed_by_content(rig_factory):
    fakes = Engines()
    rig = rig_factory(fakes, encode=("http://e0",), client_uuids=False)
    blue_key = content_key("image", BLUE)
    assert await ask(rig, image_part(RED, uuid=blue_key)) == "red"
    assert await ask(rig, image_part(BLUE, uuid="photo-1")) == "blue"
    assert await ask(rig, image_part(RED, uuid="photo-1")) == "red"
    red_key = content_key("image", RED)
    assert sent_uuids(fakes, "e") == sent_uuids(fakes, "pd") == [red_key, blue_key, red_key]
    # An item without a content key goes on without the uuid: PD hashes it itself.
    file_part = {"type": "image_url", "image_url": {"url": "file:///x.png"}, "uuid": "cat"}
    await rig.chat([file_part])
    assert "uuid" not in fakes.posts("pd")[-1].body["messages"][0]["content"][0]


async def test_uuids_on_other_parts_are_scoped_too(rig_factory):
    """vLLM reads a `uuid` on any part carrying media or embeddings, whatever its `type`."""
    fakes = Fakes()
    rig = rig_factory(fakes, encode=("http://e0",))
    key = content_key("image", BLUE)
    embeds = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": key}
    odd = {**image_part(RED), "type": "text", "text": "hi", "uuid": key}
    assert (await rig.chat([embeds, odd, {"type": "text", "text": "x", "uuid": ""}])).is_success
    [pd] = fakes.posts("pd")
    assert [p.get("uuid") for p in pd.body["messages"][0]["content"]] == [
        client_key(key), client_key(key), None]
    assert fakes.posts("e") == []


async def test_metrics_count_items_keyed_by_client_uuid_and_by_content(rig_factory):
    rig = rig_factory(encode=("http://e0",))
    await rig.chat([image_part(RED, uuid="a"), image_part(BLUE), image_part(RED)])
    await rig.chat([image_part(BLUE, uuid="b")])
    text = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_media_keys_total{keyed_by="client"} 2.0' in text
    assert 'epdctl_proxy_media_keys_total{keyed_by="content"} 2.0' in text
    off = rig_factory(encode=("http://e0",), client_uuids=False)
    await off.chat([image_part(RED, uuid="a")])
    text = (await off.client.get("/metrics")).text
    assert 'epdctl_proxy_media_keys_total{keyed_by="client"} 0.0' in text
    assert 'epdctl_proxy_media_keys_total{keyed_by="content"} 1.0' in text


def test_client_keys_are_their_own_space():
    key = content_key("image", BLUE)
    assert client_key("x") == client_key("x") != client_key("y")
    assert client_key(key) != key and client_key(key).startswith(CLIENT_PREFIX)
    assert CLIENT_PREFIX not in key  # content keys are bare lower-case hex
    body = {"messages": [{"role": "user", "content": [image_part(RED, uuid=7)]}]}
    scoped, count = scope_client_uuids(body, True)
    assert count == 1 and scoped["messages"][0]["content"][0]["uuid"] == client_key("7")
    assert body["messages"][0]["content"][0]["uuid"] == 7  # the client's body is not touched
    assert scope_client_uuids({"messages": [{"role": "user", "content": "hi"}]}, True)[1] == 0


@pytest.mark.parametrize("honoured", [True, False], ids=["client-uuids", "no-client-uuids"])
async def test_responses_input_image_uuids_are_scoped_as_chats_are(rig_factory, honoured):
    """/v1/responses: red pixels tagged with the blue image's content key poison nothing."""
    fakes = Engines()
    rig = rig_factory(fakes, encode=("http://e0",), client_uuids=honoured)
    blue_key = content_key("image", BLUE)
    part = {"type": "input_image", "image_url": URLS["red"], "uuid": blue_key}
    body = {"model": MODEL, "input": [{"role": "user", "content": [part]}]}
    r = await rig.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    key = client_key(blue_key) if honoured else content_key("image", RED)
    assert fakes.encoded == {key: URLS["red"]}  # E keyed it in the client's space
    [pd] = fakes.posts("pd")
    assert pd.body["input"][0]["content"][0]["uuid"] == key
    assert body["input"][0]["content"][0]["uuid"] == blue_key  # the client's body untouched


@pytest.mark.parametrize("route, field, part", [
    ("/v1/chat/completions", "messages", image_part(RED, uuid="k")),
    ("/v1/responses", "input", {"type": "input_image", "image_url": URLS["red"], "uuid": "k"}),
])
async def test_a_body_the_proxy_passes_through_gets_its_uuids_scoped_too(rig_factory, route,
                                                                         field, part):
    """A body the proxy does not take goes to PD for vLLM to answer, which may take it: its
    uuids are no less the client's there."""
    fakes = Fakes()
    rig = rig_factory(fakes, encode=("http://e0",))
    body = {"model": MODEL, field: [{"role": "user", "content": [part]}],
            "stream_options": "not an object"}  # refused by the proxy's checks
    r = await rig.client.post(route, json=body)
    assert r.status_code == 200, r.text
    [pd] = fakes.posts("pd")
    assert pd.body[field][0]["content"][0]["uuid"] == client_key("k")
    assert pd.body["stream_options"] == "not an object"  # the rest as it came
    assert fakes.posts("e") == []
    junk = await rig.client.post(route, content=b"{not json")
    assert junk.status_code == 200 and fakes.posts("pd")[-1].raw == b"{not json"
