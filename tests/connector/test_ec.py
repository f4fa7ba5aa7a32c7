"""EpdctlShmECConnector driven the way vLLM's scheduler and workers drive it."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from epdctl.cache.stats import read_stats  # noqa: E402
from epdctl.cache.store import Store  # noqa: E402
from tests.connector.driving import (  # noqa: E402
    NS,
    SCHED,
    WORKER,
    feature,
    make,
    pins,
    produce,
    request,
    step,
)
from tests.connector.epd import ec_item  # noqa: E402


def test_e_saves_and_pd_loads_without_encoding(store_root: Path) -> None:
    t = torch.randn(6, 16)
    produce(store_root, "img1", t)
    sched, worker = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    req = request("r1", feature("img1", 6))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("img1") is True
    sched.update_state_after_alloc(req, 0)
    cache: dict = {}
    step(sched, worker, cache)
    assert torch.equal(cache["img1"], t)
    assert pins(store_root) == []  # the worker dropped its pin after reading
    assert sched.request_finished(req) == (False, None)
    sched.shutdown()
    worker.shutdown()
    counts, key_hits = read_stats(store_root / NS)
    assert (counts["hits"], counts["loads"], key_hits["img1"]) == (1, 1, 1)


def test_a_request_pinned_on_several_steps_counts_one_hit(store_root: Path) -> None:
    """A chunked prefill asks for the item again on each step until it is computed."""
    produce(store_root, "img", torch.randn(6, 16))
    sched, worker = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    cache: dict = {}
    for rid in ("r1", "r2"):  # the repeat is another request item: its own hit
        req = request(rid, feature("img", 6))  # placeholder tokens 3..8
        for computed in (0, 4, 6):  # three prefill chunks; only the first allocates
            assert sched.ensure_cache_available(req, computed) and sched.has_cache_item("img")
            if computed == 0:
                sched.update_state_after_alloc(req, 0)
            step(sched, worker, cache)
        assert sched.request_finished(req) == (False, None)
    assert pins(store_root) == []
    sched.shutdown()
    worker.shutdown()
    counts, key_hits = read_stats(store_root / NS)
    assert (counts["hits"], counts["loads"], key_hits["img"]) == (2, 1, 2)


def test_bfloat16_round_trip(store_root: Path) -> None:
    t = torch.randn(4, 8).to(torch.bfloat16)
    produce(store_root, "bf", t)
    sched = make(store_root, SCHED, "ec_consumer", dtype=torch.bfloat16)
    worker = make(store_root, WORKER, "ec_consumer", dtype=torch.bfloat16)
    req = request("r", feature("bf", 4))
    assert sched.ensure_cache_available(req, 0) and sched.has_cache_item("bf")
    sched.update_state_after_alloc(req, 0)
    cache: dict = {}
    step(sched, worker, cache)
    assert cache["bf"].dtype == torch.bfloat16 and torch.equal(cache["bf"], t)


def test_miss_with_media_encodes_locally(store_root: Path) -> None:
    sched = make(store_root, SCHED, "ec_consumer")
    req = request("r1", feature("absent", 4))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("absent") is False
    assert sched.take_unavailable_requests() == set()


@pytest.mark.parametrize("damage", ["missing", "rows", "dtype", "truncated"])
def test_metadata_only_request_without_a_usable_entry_fails_alone(
    store_root: Path, damage: str
) -> None:
    if damage != "missing":
        produce(
            store_root,
            "k",
            torch.zeros(
                5 if damage == "rows" else 4, 8, dtype=torch.float16 if damage == "dtype" else None
            ),
        )
    if damage == "truncated":
        path = Store(store_root, NS).entry_path("k")
        os.truncate(path, os.path.getsize(path) - 1)
    sched = make(store_root, SCHED, "ec_consumer")
    req = request("r1", feature("k", 4, media=False))
    assert sched.ensure_cache_available(req, 0) is False
    assert sched.has_cache_item("k") is False
    assert sched.take_unavailable_requests() == {"r1"}
    assert sched.take_unavailable_requests() == set()
    assert sched.ensure_cache_available(req, 0) is False  # never scheduled before it fails
    sched.request_finished(req)
    other = request("r2", feature("k", 4, media=True))
    assert sched.ensure_cache_available(other, 0) is True and not sched.has_cache_item("k")
    assert pins(store_root) == []


def test_items_already_computed_are_not_pinned(store_root: Path) -> None:
    produce(store_root, "k", torch.zeros(4, 8))
    sched = make(store_root, SCHED, "ec_consumer")
    assert sched.ensure_cache_available(request("r", feature("k", 4)), 3 + 4) is True
    assert not sched.has_cache_item("k") and pins(store_root) == []


def test_unused_pins_are_released_when_the_last_request_finishes(store_root: Path) -> None:
    produce(store_root, "k", torch.zeros(4, 8))
    sched = make(store_root, SCHED, "ec_consumer")
    a, b = request("a", feature("k", 4)), request("b", feature("k", 4))
    assert sched.ensure_cache_available(a, 0) and sched.ensure_cache_available(b, 0)
    assert len(pins(store_root)) == 1  # one pin per item, shared by both requests
    sched.request_finished(a)
    assert sched.has_cache_item("k") and len(pins(store_root)) == 1
    sched.request_finished(b)
    assert not sched.has_cache_item("k") and pins(store_root) == []


def test_tensor_parallel_ranks_each_read_their_own_pin(store_root: Path) -> None:
    t = torch.randn(4, 8)
    produce(store_root, "k", t)
    sched = make(store_root, SCHED, "ec_consumer", tp=2)
    req = request("r", feature("k", 4))
    assert sched.ensure_cache_available(req, 0)
    assert len(pins(store_root)) == 2
    sched.update_state_after_alloc(req, 0)
    meta = pickle.dumps(sched.build_connector_meta(None))  # type: ignore[arg-type]
    Store(store_root, NS).entry_path("k")
    os.unlink(Store(store_root, NS).entry_path("k"))  # evicted after the pins were taken
    for rank in (1, 0):
        worker = make(store_root, WORKER, "ec_consumer", tp=2, rank=rank)
        worker.bind_connector_metadata(pickle.loads(meta))
        cache: dict = {}
        worker.start_load_caches(cache)
        assert torch.equal(cache["k"], t)
    assert pins(store_root) == []


def test_a_vanished_pin_is_logged_not_raised(store_root: Path) -> None:
    produce(store_root, "k", torch.randn(4, 8))
    sched, worker = make(store_root, SCHED, "ec_consumer"), make(store_root, WORKER, "ec_consumer")
    req = request("r", feature("k", 4))
    assert sched.ensure_cache_available(req, 0)
    sched.update_state_after_alloc(req, 0)
    for pin in pins(store_root):
        os.unlink(store_root / NS / "pins" / pin)  # removed by hand: not the janitor's doing
    cache: dict = {}
    step(sched, worker, cache)
    assert "k" not in cache  # the entry's own name is never read: its file may be recycled
    worker.shutdown()
    assert read_stats(store_root / NS)[0]["load_failures"] == 1


def test_held_pins_are_renewed_before_the_janitor_could_expire_them(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from epdctl.connector import _scheduler

    produce(store_root, "k", torch.randn(4, 8))
    sched = make(store_root, SCHED, "ec_consumer")
    req = request("r", feature("k", 4))
    assert sched.ensure_cache_available(req, 0)
    (first,) = pins(store_root)
    assert sched.ensure_cache_available(req, 0) and pins(store_root) == [first]
    monkeypatch.setattr(_scheduler, "PIN_RENEW_S", -1.0)
    assert sched.ensure_cache_available(req, 0) and sched.has_cache_item("k")
    (renewed,) = pins(store_root)
    assert renewed != first and renewed.rsplit(".", 1)[0] == first.rsplit(".", 1)[0]


def _with_modality(collect):
    """vLLM 0.33's collect_ec_item_metadata: each entry also names its modality."""

    def collect_033(features, resolver):
        items = collect(features, resolver)
        for spec in features:
            items[spec.identifier] = {"modality": spec.modality, **items[spec.identifier]}
        return items

    return collect_033


@pytest.mark.parametrize("vllm", ["installed", "0.33"])
def test_producer_reports_committed_items_and_republishes_cache_hits(
    store_root: Path, monkeypatch: pytest.MonkeyPatch, vllm: str
) -> None:
    from epdctl.connector import _scheduler

    if vllm == "0.33":
        monkeypatch.setattr(_scheduler, "collect_ec_item_metadata",
                            _with_modality(_scheduler.collect_ec_item_metadata))
    sched, worker = make(store_root, SCHED, "ec_producer"), make(store_root, WORKER, "ec_producer")
    saved, cached = torch.randn(4, 8), torch.randn(6, 8)
    req = request("r", feature("saved", 4), feature("cached", 6), feature("lost", 4))
    assert sched.ensure_cache_available(req, 0) is True
    assert sched.has_cache_item("saved") is False  # E always encodes
    encoder_cache = {"cached": cached}  # a hit in E's own encoder cache from an earlier request
    step(sched, worker, encoder_cache)  # start_save_caches republishes it
    worker.save_caches({"saved": saved}, "saved")  # freshly encoded this step
    done, items = sched.request_finished(req)
    assert done is False and items is not None
    assert ec_item(items["saved"]) == {"item_indices": [0],
                                       "metadata": {"image_grid_thw": [1, 2, 2]}}
    assert items["cached"]["metadata"] == {"image_grid_thw": [1, 2, 3]}
    assert ec_item(items["lost"]) == {"item_indices": [2], "metadata": {}}  # unsaved: keep media


def test_producer_touches_entries_it_answers_from(store_root: Path) -> None:
    produce(store_root, "k", torch.zeros(4, 8))
    path = Store(store_root, NS).entry_path("k")
    os.utime(path, (1, 1))
    sched = make(store_root, SCHED, "ec_producer")
    sched.ensure_cache_available(request("r", feature("k", 4)), 0)
    assert os.stat(path).st_mtime > 1
    assert sched.build_connector_meta(None).republish == []  # type: ignore[arg-type,attr-defined]


def test_saves_only_on_a_producer_rank_zero_and_never_raise(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = {"k": torch.zeros(4, 8)}
    make(store_root, WORKER, "ec_consumer").save_caches(t, "k")  # V1 calls it in every role
    make(store_root, WORKER, "ec_producer", tp=2, rank=1).save_caches(t, "k")
    assert not Store(store_root, NS).has_entry("k")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    producer = make(store_root, WORKER, "ec_producer")
    monkeypatch.setattr(Store, "publish", full)
    producer.save_caches(t, "k")
    producer.shutdown()
    assert read_stats(store_root / NS)[0]["save_failures"] == 1


def test_metadata_objects_are_not_reused(store_root: Path) -> None:
    produce(store_root, "k", torch.zeros(4, 8))
    sched = make(store_root, SCHED, "ec_consumer")
    req = request("r", feature("k", 4))
    sched.ensure_cache_available(req, 0)
    sched.update_state_after_alloc(req, 0)
    first = sched.build_connector_meta(None)  # type: ignore[arg-type]
    second = sched.build_connector_meta(None)  # type: ignore[arg-type]
    assert first is not second and len(first.loads) == 1 and second.loads == []  # type: ignore[attr-defined]
    assert sched.has_pending_push_work() is False
