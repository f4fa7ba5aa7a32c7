"""Overlap: PD (or P) gets its request while E encodes; the items E computes are marked
pending in the store until E answers, fails or runs out of time."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from epdctl.cache.store import Store
from epdctl.proxy.request.media import content_key
from tests.proxy.fakes import PNG, Fakes, Seen, image_part
from tests.proxy.test_skip import NAMESPACE
from tests.proxy.test_skip import with_store as with_plain_store
from tests.waits import until

pytestmark = pytest.mark.anyio
OTHER = PNG + b"other"  # another image: a miss in the store


def with_store(rig_factory, store: Store, fakes: Fakes | None = None, **kwargs):
    """E|PD over fakes saving into `store`, the proxy with overlap on (off by default)."""
    kwargs.setdefault("overlap", True)
    return with_plain_store(rig_factory, store, fakes, **kwargs)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path, NAMESPACE).create()


def e_after_pd(fakes: Fakes, store: Store, key: str, seen_marks: list[float | None],
               answer: httpx.Response | None = None) -> Any:
    """An E that answers only once PD (or P) has its request, noting the item's mark."""

    async def handler(seen: Seen) -> httpx.Response | None:
        seen_marks.append(store.pending_until(key))
        await until(lambda: fakes.posts("p"), "PD got its request before E answered")
        return answer

    return handler


async def overlapped(rig) -> float:
    text = (await rig.client.get("/metrics")).text
    found = re.search(r"^epdctl_proxy_overlapped_requests_total (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


async def learned(rig) -> None:
    """The first request for a modality waits for E (is there metadata to rewrite to?)."""
    assert (await rig.chat([image_part(PNG + b"learn")])).status_code == 200
    assert [s.instance for s in rig.fakes.posts("")] == ["e0", "pd0"]
    rig.fakes.seen.clear()


async def test_pd_gets_the_request_while_e_encodes_and_the_mark_goes_after(rig_factory, store,
                                                                           caplog):
    caplog.set_level("INFO", "epdctl.proxy")
    rig = with_store(rig_factory, store)
    await learned(rig)
    key, marks = content_key("image", OTHER), []
    rig.fakes.then("e0", e_after_pd(rig.fakes, store, key, marks))
    reply = await rig.chat([image_part(OTHER), {"type": "text", "text": "x"}])
    assert reply.status_code == 200
    (pd,) = rig.fakes.posts("pd")
    assert pd.body["messages"][0]["content"][0]["uuid"] == key  # the keyed image, as before
    await until(lambda: marks, "E got its request")
    assert marks[0] is not None and marks[0] > time.time()  # pending while E worked
    await rig.proxy.settle()
    assert store.pending_until(key) is None  # cleared once E answered
    assert store.has_entry(key)
    assert await overlapped(rig) == 1
    # PD answered first; the request's one line waited for E's timing.
    (line,) = [r.getMessage() for r in caplog.records if "overlap=1" in r.getMessage()]
    assert "encode_ms=" in line and "status=200" in line


async def test_a_failed_encoder_clears_the_mark_so_pd_encodes_at_once(rig_factory, store):
    rig = with_store(rig_factory, store)
    await learned(rig)
    key, marks = content_key("image", OTHER), []
    rig.fakes.then("e0", e_after_pd(rig.fakes, store, key, marks,
                                    httpx.Response(500, json={"error": "boom"})))
    assert (await rig.chat([image_part(OTHER)])).status_code == 200
    await until(lambda: marks, "E got its request")
    assert marks[0] is not None
    await rig.proxy.settle()
    assert store.pending_until(key) is None  # cleared once E answered
    assert not store.has_entry(key)
    assert rig.fakes.posts("pd")[0].body["messages"][0]["content"][0]["type"] == "image_url"


@pytest.mark.parametrize("mode", ["e-p-d", "streamed"])
async def test_p_or_a_streamed_pd_overlaps_too(rig_factory, store, mode):
    kwargs = ({"prefill": ("http://p0",), "decode": ("http://d0",)} if mode == "e-p-d"
              else {})
    rig = with_store(rig_factory, store, **kwargs)
    assert (await rig.chat([image_part(PNG + b"learn")])).status_code == 200  # E first
    rig.fakes.seen.clear()
    key, marks = content_key("image", OTHER), []
    rig.fakes.then("e0", e_after_pd(rig.fakes, store, key, marks))
    reply = await rig.chat([image_part(OTHER)], stream=mode == "streamed")
    assert reply.status_code == 200
    await until(lambda: marks, "E got its request")
    assert marks[0] is not None
    if mode == "e-p-d":
        names = [s.instance for s in rig.fakes.posts("")]
        assert sorted(names) == ["d0", "e0", "p0"] and names.index("p0") < names.index("d0")


async def test_metadata_to_rewrite_to_keeps_e_first(rig_factory, store):
    """A Qwen2-VL-like E reports metadata: PD must get it, so PD waits for E's answer."""
    grid = {"image_grid_thw": [1, 4, 4]}
    rig = with_store(rig_factory, store, Fakes(encoder_metadata=grid))
    for data in (PNG, OTHER):
        assert (await rig.chat([image_part(data)])).status_code == 200
    assert [s.instance for s in rig.fakes.posts("")] == ["e0", "pd0", "e0", "pd0"]
    assert rig.fakes.posts("pd")[-1].body["messages"][0]["content"][0]["type"] == "image_embeds"
    assert await overlapped(rig) == 0


@pytest.mark.parametrize("why", ["default", "switched-off", "mm-kwargs", "no-store"])
async def test_no_overlap_where_it_cannot_or_should_not(rig_factory, store, tmp_path, why):
    if why == "no-store":
        rig = rig_factory(Fakes(), encode=("http://e0",), metadata_rewrite=False, overlap=True)
    elif why == "default":
        rig = with_plain_store(rig_factory, store)
        await learned(rig)
    else:
        rig = with_store(rig_factory, store, overlap=why != "switched-off")
        await learned(rig)
    extra = {"mm_processor_kwargs": {"a": 1}} if why == "mm-kwargs" else {}
    assert (await rig.chat([image_part(OTHER)], **extra)).status_code == 200
    assert [s.instance for s in rig.fakes.posts("")][-2:] == ["e0", "pd0"]
    assert await overlapped(rig) == 0
    assert list(store.pending.iterdir()) == []


async def test_without_rewrite_the_first_request_overlaps_too(rig_factory, store):
    rig = with_store(rig_factory, store, metadata_rewrite=False)
    key, marks = content_key("image", OTHER), []
    rig.fakes.then("e0", e_after_pd(rig.fakes, store, key, marks))
    assert (await rig.chat([image_part(OTHER)])).status_code == 200
    await until(lambda: marks, "E got its request")
    assert marks[0] is not None and await overlapped(rig) == 1


async def test_responses_overlap(rig_factory, store):
    rig = with_store(rig_factory, store)
    key, marks = content_key("image", OTHER), []
    rig.fakes.then("e0", e_after_pd(rig.fakes, store, key, marks))
    import base64

    url = "data:image/png;base64," + base64.b64encode(OTHER).decode()
    body = {"model": rig.config.models[0], "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "x"}]}]}
    reply = await rig.client.post("/v1/responses", json=body)
    assert reply.status_code == 200
    await until(lambda: marks, "E got its request")
    assert marks[0] is not None
    (pd,) = rig.fakes.posts("pd")
    assert pd.body["input"][0]["content"][0]["uuid"] == key


async def test_two_overlapped_requests_sharing_an_image_make_one_e_encode(rig_factory, store,
                                                                          caplog):
    """The second request's item is already at E for the first: it goes to no encoder, both
    PDs wait on the one mark, which stays until that E is over (no PD encodes meanwhile)."""
    caplog.set_level("INFO", "epdctl.proxy")
    rig = with_store(rig_factory, store)
    await learned(rig)
    key, gate = content_key("image", OTHER), asyncio.Event()

    async def held_e(seen: Seen) -> None:
        await gate.wait()

    rig.fakes.then("e0", held_e)
    replies = await asyncio.gather(*(rig.chat([image_part(OTHER)], request_id=f"r{n}")
                                     for n in (1, 2)))
    assert [r.status_code for r in replies] == [200, 200]  # PD answered both, E still busy
    assert len(rig.fakes.posts("e")) == 1 and len(rig.fakes.posts("pd")) == 2
    for pd in rig.fakes.posts("pd"):
        assert pd.body["messages"][0]["content"][0]["uuid"] == key
    assert store.pending_until(key) is not None and rig.proxy.overlap.marks.count(key) == 2
    assert await overlapped(rig) == 2
    gate.set()
    await rig.proxy.settle()
    assert len(rig.fakes.posts("e")) == 1
    assert store.has_entry(key) and store.pending_until(key) is None
    lines = sorted(r.getMessage() for r in caplog.records if "overlap=1" in r.getMessage())
    assert len(lines) == 2 and "encode_shared" not in lines[0]
    assert lines[1].startswith("rid=r2 ") and "encode_shared=1" in lines[1]
