"""topologies/cpu-demo.yaml (E|PD, tiny LLaVA) for real: up, requests, cache hits, verify, down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.topology_run import (
    TopologyRun,
    cache_entry,
    check_all_ready,
    check_down,
    check_logs,
    check_verify,
    encoder_posts,
    proxy_counters,
    store_counters,
    topology_with_baseline,
    wait_for,
    write_topology,
)
from tests.vllm_harness import Server, chat, image_data_url, make_image

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
INSTANCES = ("encode-0", "pd-0")


@pytest.fixture(scope="module")
def demo(
    tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """cpu-demo.yaml with free ports, a private store and DEBUG logs, plus its baseline."""
    tmp = tmp_path_factory.mktemp("cpu-demo")
    path, cache_dir = write_topology("cpu-demo", tmp, tiny_llava,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    with topology_with_baseline(path, cache_dir, tmp / "state", tiny_llava) as servers:
        yield servers


def test_status_all_ready(demo: tuple[TopologyRun, Server]) -> None:
    check_all_ready(demo[0], INSTANCES)


@pytest.mark.parametrize("is_streamed", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", [None, 21], ids=["text", "image"])
def test_outputs_equal_the_baseline(
    demo: tuple[TopologyRun, Server], seed: int | None, is_streamed: bool
) -> None:
    run, baseline = demo
    urls = [image_data_url(make_image(seed))] if seed is not None else []
    mine = chat(run.proxy_url, MODEL, image_urls=urls, stream=is_streamed)
    theirs = chat(baseline.base_url, baseline.model, image_urls=urls)
    assert mine and mine == theirs


def test_different_images_answer_differently(demo: tuple[TopologyRun, Server]) -> None:
    """Guards the equality tests: the tiny model's answer does depend on the image."""
    run, _ = demo
    answers = {chat(run.proxy_url, MODEL, image_urls=[image_data_url(make_image(s))])
               for s in (31, 32, 33)}
    assert len(answers) == 3


def test_repeated_image_is_loaded_from_the_store(demo: tuple[TopologyRun, Server]) -> None:
    """E encodes the image once; the repeat makes no E request at all (the proxy finds the
    entry in the store); PD loads it from the store both times and never runs the encoder."""
    from epdctl.proxy.media import content_key

    run, baseline = demo
    png = make_image(41)
    key, url = content_key("image", png), image_data_url(png)
    pd_start, e_start = len(run.log("pd-0")), len(run.log("encode-0"))
    counted = proxy_counters(run)
    # Salts keep the prefix cache from answering the repeat without the image.
    first = chat(run.proxy_url, MODEL, image_urls=[url], extra_body={"cache_salt": "first"})
    assert encoder_posts(run.log("encode-0")[e_start:]) == 1
    entry = wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] >= 1 and e)
    assert entry, "no entry, or no hit on it, after the first request"
    e_mark, looked = len(run.log("encode-0")), store_counters(run)
    second = chat(run.proxy_url, MODEL, image_urls=[url], extra_body={"cache_salt": "second"})
    assert first and first == second == chat(baseline.base_url, baseline.model, image_urls=[url])
    again = wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] > entry["hits"] and e)
    assert again and again["hits"] == entry["hits"] + 1

    # No E request for the repeat: E's log shows none, the proxy counted a skip, and
    # `cache inspect` one more lookup, a hit.
    assert encoder_posts(run.log("encode-0")[e_mark:]) == 0
    now = proxy_counters(run)
    assert {k: now[k] - counted[k] for k in now} == {"lookups": 2, "skipped": 1, "sent": 1}
    row = wait_for(lambda: (r := store_counters(run))["lookups"] > looked["lookups"] and r)
    assert row, store_counters(run)
    assert (row["lookups"] - looked["lookups"], row["skipped"] - looked["skipped"]) == (1, 1)

    # The first request reads the entry; for the second, PD's worker usually still holds the
    # tensor and skips the read (the pin above was still taken and validated).
    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("pd-0")[pd_start:]), run.log("pd-0")[-3000:]
    assert f"Finish execute for mm hash {key}" not in run.log("pd-0")
    assert f"Finish execute for mm hash {key}" in run.log("encode-0")


def test_logs_show_every_instance(demo: tuple[TopologyRun, Server]) -> None:
    check_logs(demo[0], INSTANCES)


def test_verify_passes(demo: tuple[TopologyRun, Server]) -> None:
    check_verify(*demo)


def test_down_leaves_nothing(demo: tuple[TopologyRun, Server]) -> None:
    """Last in the module: no recorded process or group alive, no store files."""
    check_down(demo[0])
