"""Items already in the EC store skip E: hits, misses, bad entries, evictions, the rewrite."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest

from epdctl.cache.sidecar import meta_path
from epdctl.cache.stats import read_stats
from epdctl.cache.store import Store
from epdctl.proxy.request.media import content_key
from tests.proxy.fakes import MODEL, PNG, Fakes, Seen, completion, image_part

pytestmark = pytest.mark.anyio
KEY = content_key("image", PNG)
NAMESPACE = "demo-0123456789ab"
GRID = {"image_grid_thw": [1, 4, 4]}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path, NAMESPACE).create()


def with_store(rig_factory, store: Store, fakes: Fakes | None = None, **kwargs):
    """E|PD over fakes whose encoders save into `store`, the proxy looking in it."""
    fakes = fakes or Fakes()
    fakes.store = store
    kwargs.setdefault("encode", ("http://e0",))
    return rig_factory(fakes, store_dir=str(store.root.parent), namespace=store.namespace,
                       **kwargs)


async def counters(rig) -> dict[str, float]:
    text = (await rig.client.get("/metrics")).text
    names = {"lookups": "epdctl_proxy_store_lookups_total",
             "skipped": "epdctl_proxy_items_skipped_total",
             "sent": "epdctl_proxy_items_sent_total"}
    return {k: float(re.search(rf"^{v} (\S+)$", text, re.M)[1]) for k, v in names.items()}


async def test_a_repeated_image_skips_e_and_pd_gets_the_same_body(rig_factory, store):
    rig = with_store(rig_factory, store)
    for _ in range(2):
        r = await rig.chat([image_part(), {"type": "text", "text": "x"}])
        assert r.status_code == 200 and r.json() == completion()
    assert len(rig.fakes.posts("e")) == 1  # the first request only
    first, second = rig.fakes.posts("pd")
    # LLaVA-like (no metadata): the keyed image both times; PD loads it from the store.
    assert second.body["messages"] == first.body["messages"]
    assert second.body["messages"][0]["content"][0]["uuid"] == KEY
    assert await counters(rig) == {"lookups": 2, "skipped": 1, "sent": 1}
    rig.proxy.close()
    counts, key_hits = read_stats(store.root)
    assert {k: counts[k] for k in ("lookups", "skipped", "sent")} == {
        "lookups": 2, "skipped": 1, "sent": 1}
    assert key_hits == {}  # a hit per key is a consumer's load, not the proxy's look


async def test_a_hit_refreshes_the_entry_for_the_janitor(rig_factory, store):
    rig = with_store(rig_factory, store)
    assert (await rig.chat([image_part()])).status_code == 200
    os.utime(store.entry_path(KEY), (1.0, 1.0))
    assert (await rig.chat([image_part()])).status_code == 200
    assert len(rig.fakes.posts("e")) == 1
    assert os.stat(store.entry_path(KEY)).st_mtime > 1.0


async def test_each_distinct_item_counts_once_and_only_misses_go_to_e(rig_factory, store):
    rig = with_store(rig_factory, store, encode=("http://e0", "http://e1"))
    other = image_part(PNG + b"2")
    assert (await rig.chat([image_part()])).status_code == 200
    r = await rig.chat([image_part(), other, image_part()])
    assert r.status_code == 200
    await rig.proxy.settle()  # E may still work beside PD (overlap)
    encs = rig.fakes.posts("e")
    assert [s.body["messages"][0]["content"][0]["uuid"] for s in encs] == [
        KEY, content_key("image", PNG + b"2")]
    assert await counters(rig) == {"lookups": 3, "skipped": 1, "sent": 2}


@pytest.mark.parametrize("damage", ["none", "corrupt", "truncated", "foreign", "other-key"])
async def test_a_bad_entry_is_a_miss_and_goes_to_e(rig_factory, store, tmp_path, damage):
    path = store.entry_path(KEY)
    if damage in ("none", "truncated"):
        store.publish(KEY, bytes(64), dtype="float32", shape=(4, 4))
        if damage == "truncated":
            os.truncate(path, os.path.getsize(path) - 8)
    elif damage == "corrupt":
        Path(path).write_bytes(b"not an entry at all" * 300)
    else:
        # A valid entry of another namespace (or of another key), renamed into ours.
        other = Store(tmp_path / "other", "other-0123456789ab" if damage == "foreign"
                      else NAMESPACE).create()
        other.publish(KEY if damage == "foreign" else "another-key", bytes(64),
                      dtype="float32", shape=(4, 4))
        os.rename(other.entry_path(KEY if damage == "foreign" else "another-key"), path)
    rig = with_store(rig_factory, store, Fakes())  # its first scan sees the file
    rig.fakes.store = None  # keep the file as it is
    assert (await rig.chat([image_part()])).status_code == 200
    if damage == "none":  # the control: the same file, undamaged, is a hit
        assert rig.fakes.posts("e") == []
        assert await counters(rig) == {"lookups": 1, "skipped": 1, "sent": 0}
        return
    assert len(rig.fakes.posts("e")) == 1
    assert await counters(rig) == {"lookups": 1, "skipped": 0, "sent": 1}


async def test_an_entry_another_writer_made_is_found_from_the_next_scan(rig_factory, store):
    """Only names the index holds are checked on disk: what the last scan of entries/ saw,
    and what E answered for since; a scan runs every second beside the server."""
    rig = with_store(rig_factory, store)
    rig.fakes.store = None
    store.publish(KEY, bytes(64), dtype="float32", shape=(4, 4))  # not through this proxy
    assert (await rig.chat([image_part()])).status_code == 200
    assert len(rig.fakes.posts("e")) == 1
    rig.proxy.lookup.scan()
    assert (await rig.chat([image_part()])).status_code == 200
    assert len(rig.fakes.posts("e")) == 1
    assert await counters(rig) == {"lookups": 2, "skipped": 1, "sent": 1}


async def test_the_rewrite_works_on_a_hit_from_the_kept_metadata(rig_factory, store):
    rig = with_store(rig_factory, store, Fakes(encoder_metadata={"image_grid_thw": [[1, 4, 4]]}))
    content = [image_part(), {"type": "text", "text": "x"}]
    assert (await rig.chat(content)).status_code == 200
    assert (await rig.chat(content)).status_code == 200  # E's answer, still in memory
    rig.proxy.lookup.scan()  # writes it beside the entry
    kept = json.loads(Path(meta_path(store, KEY)).read_text())
    assert kept["key"] == KEY and kept["namespace"] == NAMESPACE
    assert kept["entry"]["metadata"] == {"image_grid_thw": [[1, 4, 4]]}
    # Another proxy over the same store (or this one restarted) reads it from there.
    again = with_store(rig_factory, store, rig.fakes)
    assert (await again.chat(content)).status_code == 200
    assert len(rig.fakes.posts("e")) == 1
    first, *hits = rig.fakes.posts("pd")
    embeds = {"type": "image_embeds", "image_embeds": GRID, "uuid": KEY}
    assert first.body["messages"][0]["content"][0] == embeds
    assert len(hits) == 2 and all(h.body == first.body for h in hits)  # what PD got from E


async def test_a_hit_without_kept_metadata_goes_to_e_once_metadata_is_known(rig_factory, store):
    """An entry saved while nobody kept E's metadata (skip off, another proxy) would never be
    rewritten again: once E has reported metadata for images, such a hit asks E."""
    rig = with_store(rig_factory, store, Fakes(encoder_metadata=GRID))
    other = image_part(PNG + b"2")
    store.publish(KEY, bytes(64), dtype="float32", shape=(4, 4))  # no sidecar
    rig.proxy.lookup.scan()
    assert (await rig.chat([image_part()])).status_code == 200  # nothing known yet: a hit
    assert rig.fakes.posts("e") == [] and rig.fakes.posts("pd")[-1].body["messages"][0][
        "content"][0]["type"] == "image_url"
    assert (await rig.chat([other])).status_code == 200  # E reports metadata for images
    assert (await rig.chat([image_part()])).status_code == 200  # so this one goes to E
    assert (await rig.chat([image_part()])).status_code == 200  # and is rewritten after
    assert len(rig.fakes.posts("e")) == 2
    assert [s.body["messages"][0]["content"][0]["type"] for s in rig.fakes.posts("pd")] == [
        "image_url", "image_embeds", "image_embeds", "image_embeds"]


def consumer(store: Store, outcomes: list[str], *, evict: bool):
    """PD as the connector behaves: load from the store, or encode the media, or fail a
    metadata-only item whose entry is gone (a retryable 500); `evict` first removes every
    entry, as an eviction between the proxy's look and PD's load would."""

    def handle(seen: Seen) -> httpx.Response:
        if evict:
            for name in os.listdir(store.entries):
                os.unlink(store.entries / name)
        part = seen.body["messages"][0]["content"][0]
        if store.has_entry(part["uuid"]):
            outcomes.append("loaded")
        elif part["type"].endswith("_embeds"):
            outcomes.append("failed")
            return httpx.Response(500, json={"error": {"message": "EC entry unavailable"}})
        else:
            outcomes.append("encoded")
        return httpx.Response(200, json=completion())

    return handle


@pytest.mark.parametrize("metadata", [{}, GRID], ids=["media", "rewritten"])
async def test_an_entry_evicted_after_the_look_still_gets_the_answer(
    rig_factory, store, metadata
):
    rig = with_store(rig_factory, store, Fakes(encoder_metadata=metadata))
    outcomes: list[str] = []
    rig.fakes.then("pd0", consumer(store, outcomes, evict=False),
                   consumer(store, outcomes, evict=True), consumer(store, outcomes, evict=False))
    assert (await rig.chat([image_part()])).json() == completion()
    r = await rig.chat([image_part()])
    assert r.status_code == 200 and r.json() == completion()
    assert len(rig.fakes.posts("e")) == 1
    if metadata:
        # The rewritten body failed on PD; the proxy resent it with the image.
        assert outcomes == ["loaded", "failed", "encoded"]
        assert rig.fakes.posts("pd")[-1].body["messages"][0]["content"][0]["type"] == (
            "image_url")
        metrics = (await rig.client.get("/metrics")).text
        assert 'epdctl_proxy_fallbacks_total{reason="rewrite"} 1.0' in metrics
    else:
        assert outcomes == ["loaded", "encoded"]


async def test_per_request_mm_kwargs_are_never_looked_up(rig_factory, store):
    """vLLM folds them into E's key: an entry under the bare uuid is another encoding."""
    rig = with_store(rig_factory, store)
    store.publish(KEY, bytes(64), dtype="float32", shape=(4, 4))
    rig.proxy.lookup.scan()
    assert (await rig.chat([image_part()], mm_processor_kwargs={"a": 1})).status_code == 200
    assert len(rig.fakes.posts("e")) == 1
    assert await counters(rig) == {"lookups": 0, "skipped": 0, "sent": 1}


async def test_the_switch_off_or_no_store_means_every_item_goes_to_e(rig_factory, store):
    store.publish(KEY, bytes(64), dtype="float32", shape=(4, 4))
    off = with_store(rig_factory, store, skip_cached_items=False)
    plain = rig_factory(Fakes(), encode=("http://e0",))
    for rig in (off, plain):
        for _ in range(2):
            assert (await rig.chat([image_part()])).status_code == 200
        await rig.proxy.settle()
        assert len(rig.fakes.posts("e")) == 2
        assert await counters(rig) == {"lookups": 0, "skipped": 0, "sent": 2}
    assert not Path(meta_path(store, KEY)).exists()


async def test_hits_are_served_while_every_encoder_is_out(rig_factory, store):
    rig = with_store(rig_factory, store)
    assert (await rig.chat([image_part()])).status_code == 200
    rig.proxy.upstreams.pools["encode"].instances[0].is_ejected = True
    assert (await rig.chat([image_part(), image_part(PNG + b"2")])).status_code == 200
    assert len(rig.fakes.posts("e")) == 1
    assert await counters(rig) == {"lookups": 3, "skipped": 1, "sent": 1}
    metrics = (await rig.client.get("/metrics")).text
    assert 'epdctl_proxy_fallbacks_total{reason="encoder"} 1.0' in metrics


async def test_repeats_go_to_the_same_encoder(rig_factory, store):
    """Sent items are routed by key, so E's own caches see the repeats."""
    rig = rig_factory(Fakes(), encode=("http://e0", "http://e1", "http://e2"))
    images = [image_part(PNG + bytes([n])) for n in range(12)]
    for _ in range(3):
        for part in images:
            assert (await rig.chat([part])).status_code == 200
    by_key: dict[str, set[str]] = {}
    for seen in rig.fakes.posts("e"):
        by_key.setdefault(seen.body["messages"][0]["content"][0]["uuid"], set()).add(
            seen.instance)
    assert len(by_key) == 12 and all(len(v) == 1 for v in by_key.values())
    assert len({next(iter(v)) for v in by_key.values()}) > 1  # and they spread


def test_the_store_flags_go_together_and_only_the_shared_protocol_looks(capsys):
    from epdctl.proxy.__main__ import parse_args

    base = ["--model", MODEL, "--prefill-decode", "http://p", "--encode", "http://e"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--store-dir", "/dev/shm/epdctl"])
    assert "--store-dir and --namespace go together" in capsys.readouterr().err
    store = [*base, "--store-dir", "/dev/shm/epdctl", "--namespace", NAMESPACE]
    assert parse_args(store).should_look_up
    assert not parse_args([*store, "--no-skip-cached-items"]).should_look_up
    assert not parse_args(base).should_look_up
    # Mooncake pushes each encoding into the PD it picked: there is no shared store.
    assert not parse_args([*store, "--ec-protocol", "mooncake",
                           "--ec-consumer", "http://p=tcp://p:1"]).should_look_up
