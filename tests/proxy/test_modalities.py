"""Every modality through the proxy's E stage: keys, routing, the rewrite, skips, the cap.

Over fakes (tests/proxy/fakes.py): each video, audio clip (`audio_url`, `input_audio`) and
image is its own E sub-request and key; E's metadata is rewritten into that modality's
`*_embeds` part where E reports some (Qwen2-VL's `video_grid_thw`), passed through where it
reports none (an audio model here); fuzzed bodies of random mixes keep every rule.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epdctl.cache.store import Store
from epdctl.proxy.request.media import CLIENT_PREFIX, client_key, content_key
from epdctl.proxy.request.parse import MEDIA_TYPES, MediaItem
from epdctl.proxy.request.shape import rewrite_media
from tests.proxy.fakes import MODEL, PNG, TRANSPORTS, Fakes, rig_on_a_loop

pytestmark = pytest.mark.anyio
MP4 = b"\x00\x00\x00\x18ftypmp42 fake video bytes"
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt fake audio bytes"
VIDEO_GRID = {"video_grid_thw": [[2, 4, 4]]}
IMAGE_GRID = {"image_grid_thw": [[1, 4, 4]]}
QWEN2VL = {"video_url": VIDEO_GRID, "image_url": IMAGE_GRID}  # what its E reports


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def part(kind: str, data: bytes, **extra: Any) -> dict[str, Any]:
    """A chat media part of this type carrying `data`."""
    if kind == "input_audio":
        return {"type": kind, "input_audio": {"data": b64(data), "format": "wav"}, **extra}
    mime = {"image_url": "image/png", "video_url": "video/mp4", "audio_url": "audio/wav"}[kind]
    return {"type": kind, kind: {"url": f"data:{mime};base64,{b64(data)}"}, **extra}


def key(kind: str, data: bytes) -> str:
    return content_key(MEDIA_TYPES[kind], data)


def sent_parts(rig: Any, prefix: str) -> list[dict[str, Any]]:
    return [s.body["messages"][0]["content"][0] for s in rig.fakes.posts(prefix)]


async def test_each_item_of_every_modality_is_its_own_e_request_and_key(rig_factory):
    rig = rig_factory(Fakes(metadata_by_type={}), encode=("http://e0", "http://e1"))
    content = [part("video_url", MP4), part("audio_url", WAV), part("input_audio", WAV + b"2"),
               part("image_url", PNG), part("image_url", PNG + b"2"), part("video_url", MP4),
               {"type": "text", "text": "what are these?"}]
    assert (await rig.chat(content)).status_code == 200
    keys = [key("video_url", MP4), key("audio_url", WAV), key("input_audio", WAV + b"2"),
            key("image_url", PNG), key("image_url", PNG + b"2")]
    assert len(set(keys)) == 5
    got = {p["uuid"]: p for p in sent_parts(rig, "e")}
    assert sorted(got) == sorted(keys)  # the repeated video once
    for n, k in enumerate(keys):
        assert got[k] == {**content[n], "uuid": k}  # its own part, as the client sent it
    [pd] = rig.fakes.posts("pd")  # no metadata: every part passed through, keyed
    assert pd.body["messages"][0]["content"] == [
        {**p, "uuid": k} for p, k in zip(content[:6], [*keys, keys[0]], strict=True)
    ] + [content[6]]


def test_the_same_bytes_or_uuid_on_another_modality_are_another_key():
    assert len({key("video_url", MP4), key("image_url", MP4), key("audio_url", MP4)}) == 3
    assert key("audio_url", WAV) == key("input_audio", WAV)  # one modality, one key
    assert len({client_key("u", "video"), client_key("u", "image"),
                client_key("u", "audio")}) == 3


async def test_one_client_uuid_on_a_video_and_an_image_is_two_items(rig_factory):
    """Found by the fuzzer: one E request for both, and the video's metadata on the image."""
    rig = rig_factory(Fakes(metadata_by_type=QWEN2VL), encode=("http://e0",))
    content = [part("video_url", MP4, uuid="u1"), part("image_url", PNG, uuid="u1")]
    assert (await rig.chat(content)).status_code == 200
    assert sorted(p["type"] for p in sent_parts(rig, "e")) == ["image_url", "video_url"]
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"] == [
        {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]},
         "uuid": client_key("u1", "video")},
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]},
         "uuid": client_key("u1", "image")}]


async def test_video_metadata_is_rewritten_to_video_embeds_and_audio_passes_through(
    rig_factory,
):
    """Qwen2-VL's E reports `video_grid_thw` (PD gets the flat list vLLM takes); an audio
    model's E here reports none, so its clip goes to PD as it came, keyed."""
    rig = rig_factory(Fakes(metadata_by_type=QWEN2VL), encode=("http://e0",))
    content = [part("video_url", MP4), part("image_url", PNG), part("audio_url", WAV)]
    assert (await rig.chat(content)).status_code == 200
    [pd] = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"] == [
        {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]},
         "uuid": key("video_url", MP4)},
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]},
         "uuid": key("image_url", PNG)},
        {**content[2], "uuid": key("audio_url", WAV)},
    ]


async def test_audio_num_tokens_is_rewritten_to_audio_embeds(rig_factory):
    fakes = Fakes(metadata_by_type={"audio_url": {"audio_num_tokens": [25]},
                                    "input_audio": {"audio_num_tokens": [13]}})
    rig = rig_factory(fakes, encode=("http://e0",))
    content = [part("audio_url", WAV), part("input_audio", WAV + b"2")]
    assert (await rig.chat(content)).status_code == 200
    [pd] = rig.fakes.posts("pd")
    assert [p["audio_embeds"] for p in pd.body["messages"][0]["content"]] == [
        {"audio_num_tokens": [25]}, {"audio_num_tokens": [13]}]


def test_rewrite_of_two_videos_is_all_or_none():
    body = {"messages": [{"role": "user", "content": [part("video_url", MP4),
                                                      part("video_url", MP4 + b"2"),
                                                      part("image_url", PNG)]}]}
    items = [MediaItem(0, n, p["type"], MEDIA_TYPES[p["type"]], "", f"k{n}")
             for n, p in enumerate(body["messages"][0]["content"])]
    every = {"k0": ("k0", VIDEO_GRID), "k1": ("k1", {"video_grid_thw": [[4, 2, 2]]}),
             "k2": ("k2", IMAGE_GRID)}
    out = rewrite_media(body, items, every)
    assert out is not None
    assert [p["video_embeds"] for p in out["messages"][0]["content"][:2]] == [
        {"video_grid_thw": [2, 4, 4]}, {"video_grid_thw": [4, 2, 2]}]
    one_short = {**every, "k1": ("k1", {})}  # vLLM refuses raw and embeds of one modality
    out = rewrite_media(body, items, one_short)
    assert out is not None
    assert [p["type"] for p in out["messages"][0]["content"]] == [
        "video_url", "video_url", "image_embeds"]
    assert body["messages"][0]["content"][0]["type"] == "video_url"  # not touched


async def test_a_repeated_video_skips_e_and_pd_gets_the_kept_metadata(rig_factory,
                                                                      tmp_path: Path):
    store = Store(tmp_path, "demo-0123456789ab").create()
    fakes = Fakes(metadata_by_type=QWEN2VL, store=store)
    rig = rig_factory(fakes, encode=("http://e0",), store_dir=str(tmp_path),
                      namespace=store.namespace)
    content = [part("video_url", MP4), part("audio_url", WAV)]
    assert (await rig.chat(content)).status_code == 200
    rig.proxy.lookup.scan()
    assert (await rig.chat(content)).status_code == 200
    assert len(rig.fakes.posts("e")) == 2  # the first request's two items only
    first, again = rig.fakes.posts("pd")
    assert again.body["messages"] == first.body["messages"]
    assert [p["type"] for p in first.body["messages"][0]["content"]] == [
        "video_embeds", "audio_url"]


async def test_a_client_uuid_on_a_video_never_names_another_videos_entry(rig_factory):
    rig = rig_factory(Fakes(metadata_by_type={}), encode=("http://e0",))
    victim = key("video_url", MP4)
    content = [part("video_url", MP4 + b"evil", uuid=victim), part("video_url", MP4)]
    assert (await rig.chat(content)).status_code == 200
    scoped = client_key(victim, "video")
    assert sorted(p["uuid"] for p in sent_parts(rig, "e")) == sorted([scoped, victim])
    [pd] = rig.fakes.posts("pd")
    assert [p["uuid"] for p in pd.body["messages"][0]["content"]] == [scoped, victim]


async def test_a_failed_video_falls_back_alone(rig_factory):
    """E fails the video: PD encodes it (the raw video, keyed); the image is still rewritten."""
    fakes = Fakes(metadata_by_type=QWEN2VL)

    def refuse_video(seen: Any) -> httpx.Response | None:
        if seen.body["messages"][0]["content"][0]["type"] == "video_url":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        return None

    fakes.then("e0", refuse_video, refuse_video)
    rig = rig_factory(fakes, encode=("http://e0",))
    content = [part("video_url", MP4), part("image_url", PNG)]
    assert (await rig.chat(content)).status_code == 200
    [pd] = rig.fakes.posts("pd")
    assert [p["type"] for p in pd.body["messages"][0]["content"]] == [
        "video_url", "image_embeds"]
    assert pd.body["messages"][0]["content"][0]["uuid"] == key("video_url", MP4)


class Remote:
    """Media URLs: their bytes, and a count of fetches."""

    def __init__(self, content: dict[str, bytes]) -> None:
        self.content = content
        self.fetches: list[str] = []


class WithRemote(Fakes):
    """The fakes, and the web server `media.example` serving `remote`'s videos."""

    def __init__(self, remote: Remote) -> None:
        super().__init__(metadata_by_type={})
        self.remote = remote

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "media.example":
            self.remote.fetches.append(request.url.path)
            return httpx.Response(200, content=self.remote.content[request.url.path],
                                  headers={"content-type": "video/mp4"})
        return await super().handle(request)


def with_remote(rig_factory, remote: Remote, **kwargs: Any) -> Any:
    rig = rig_factory(WithRemote(remote), encode=("http://e0",), **kwargs)
    return rig.client, rig.fakes


def remote_video(path: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": f"http://media.example{path}"}}


async def test_a_remote_video_is_fetched_once_and_inlined_once(rig_factory):
    remote = Remote({"/v.mp4": MP4 * 100})
    client, fakes = with_remote(rig_factory, remote)
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        remote_video("/v.mp4"), remote_video("/v.mp4")]}]}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert remote.fetches == ["/v.mp4"]
    inline = f"data:video/mp4;base64,{b64(MP4 * 100)}"
    [enc] = fakes.posts("e")
    assert enc.body["messages"][0]["content"][0]["video_url"]["url"] == inline
    [pd] = fakes.posts("pd")
    assert [p["video_url"]["url"] for p in pd.body["messages"][0]["content"]] == [inline] * 2


@pytest.mark.parametrize("sizes", [(5000,), (2000, 2000)], ids=["one", "together"])
async def test_remote_media_past_the_cap_is_the_proxys_own_400(rig_factory, sizes):
    """Each fetch stops at the cap, and the fetched media together may not pass it: the
    proxy answers (PD would fetch the same bytes again), E and PD get nothing."""
    remote = Remote({f"/{n}.mp4": bytes(size) for n, size in enumerate(sizes)})
    client, fakes = with_remote(rig_factory, remote, max_body_bytes=3000)
    content = [remote_video(f"/{n}.mp4") for n in range(len(sizes))]
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 400, r.text
    assert "more than the proxy's limit of 3000 bytes (--max-body-bytes)" in (
        r.json()["error"]["message"])
    assert fakes.posts("e") == [] and fakes.posts("pd") == []


async def test_a_body_past_the_cap_is_a_413(rig_factory):
    rig = rig_factory(encode=("http://e0",), max_body_bytes=1000)
    r = await rig.chat([part("video_url", bytes(2000))])
    assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
    assert rig.fakes.seen == [] or all(s.path == "/health" for s in rig.fakes.seen)


# Fuzzed bodies: random mixes of every media part type, repeats, client uuids, text.
BLOBS = [MP4, WAV, PNG, b"x", MP4 + PNG]
KINDS = ["image_url", "video_url", "audio_url", "input_audio"]
PARTS = st.one_of(
    st.builds(lambda k, d, u: part(k, d, **({"uuid": u} if u is not None else {})),
              st.sampled_from(KINDS), st.sampled_from(BLOBS),
              st.none() | st.sampled_from(["u1", "u2", key("video_url", MP4)])),
    st.just({"type": "text", "text": "hi"}),
)
MESSAGES = st.lists(st.lists(PARTS, min_size=1, max_size=4), min_size=1, max_size=3)


def expected_key(p: dict[str, Any]) -> str | None:
    if p["type"] == "text":
        return None
    if p.get("uuid"):
        return client_key(p["uuid"], MEDIA_TYPES[p["type"]])
    data = p[p["type"]]["data"] if p["type"] == "input_audio" else p[p["type"]]["url"]
    return content_key(MEDIA_TYPES[p["type"]], base64.b64decode(data.split(",")[-1]))


@pytest.fixture(scope="module", params=TRANSPORTS)
def fuzz_rig(request):
    """One rig for every example (a rig per example would cost more than the example)."""
    fakes = Fakes(metadata_by_type={"video_url": VIDEO_GRID})
    with rig_on_a_loop(request.param, fakes, encode=("http://e0", "http://e1")) as (loop, rig):
        yield loop, rig.client, fakes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(messages=MESSAGES)
def test_fuzzed_mixes_each_distinct_item_once_to_e_and_keyed_on_pd(fuzz_rig, messages):
    loop, client, fakes = fuzz_rig
    fakes.seen.clear()
    body = {"model": MODEL, "messages": [{"role": "user", "content": c} for c in messages]}
    r = loop.run_until_complete(client.post("/v1/chat/completions",
                                            content=json.dumps(body).encode()))
    assert r.status_code == 200, r.text
    flat = [p for c in messages for p in c]
    wanted = {k for p in flat if (k := expected_key(p)) is not None}
    encs = [s.body["messages"][0]["content"] for s in fakes.posts("e")]
    assert all(len(c) == 1 for c in encs)  # one item per sub-request
    assert sorted(c[0]["uuid"] for c in encs) == sorted(wanted)  # each distinct item once
    for c in encs:  # the item's own type, with its own bytes
        original = next(p for p in flat if expected_key(p) == c[0]["uuid"])
        assert c[0]["type"] == original["type"]
    [pd] = fakes.posts("pd")
    got = [p for m in pd.body["messages"] for p in m["content"]]
    assert len(got) == len(flat)
    videos_rewritten = any(p["type"] == "video_embeds" for p in got)
    for sent, original in zip(got, flat, strict=True):
        k = expected_key(original)
        if k is None:
            assert sent == original
            continue
        assert sent["uuid"] == k and not sent["uuid"].startswith(("u1", "u2"))
        if original["type"] == "video_url" and videos_rewritten:
            assert sent == {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4]},
                            "uuid": k}
        else:
            assert sent == {**original, "uuid": k}
    assert all(not p.get("uuid", "").startswith(CLIENT_PREFIX) or p["uuid"] in wanted
               for p in got)


async def test_each_entry_is_listed_with_its_modality(rig_factory, tmp_path: Path):
    """The proxy keeps every item's modality beside its entry (with metadata or none), for
    `cache inspect --entries`; a later lookup is no hit from a metadata-less sidecar."""
    from epdctl.cache.listing import list_entries

    store = Store(tmp_path, "demo-0123456789ab").create()
    fakes = Fakes(metadata_by_type={"video_url": VIDEO_GRID}, store=store)
    rig = rig_factory(fakes, encode=("http://e0",), store_dir=str(tmp_path),
                      namespace=store.namespace)
    content = [part("video_url", MP4), part("input_audio", WAV), part("image_url", PNG)]
    assert (await rig.chat(content)).status_code == 200
    rig.proxy.lookup.scan()
    listed = {e.key: e.modality for e in list_entries(tmp_path, store.namespace)}
    assert listed == {key("video_url", MP4): "video", key("input_audio", WAV): "audio",
                      key("image_url", PNG): "image"}


def test_a_video_as_a_list_of_frames_is_keyed_by_its_frames():
    """vLLM's `video/jpeg` data URL (base64 frames joined by commas) is keyed, not passed
    through unkeyed: same frames, same key; other frames or another split, another key."""
    from epdctl.proxy.request.media import data_url_bytes

    def frames(*parts: bytes) -> str:
        return "data:video/jpeg;base64," + ",".join(b64(p) for p in parts)

    one = data_url_bytes(frames(PNG, PNG + b"2"), "v")
    assert one == data_url_bytes(frames(PNG, PNG + b"2"), "v")
    assert one != data_url_bytes(frames(PNG + b"2", PNG), "v")
    assert data_url_bytes(frames(b"ab", b"c"), "v") != data_url_bytes(frames(b"a", b"bc"), "v")
