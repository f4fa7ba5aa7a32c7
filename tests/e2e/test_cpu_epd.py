"""topologies/cpu-epd.yaml (E|P|D, tiny LLaVA) for real: up, requests, cache hits, verify, down.

As shipped (no overlap); overlap, a proxy setting alone, is tested on a second proxy with
`--overlap` before the same engines (tests/e2e/second_proxy.py): no second start of three
engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.baselines import Baselines
from tests.e2e.parity import bench, compare, missing_image, responses_image_entry
from tests.e2e.second_proxy import second_proxy
from tests.harness import (
    Server,
    TopologyRun,
    cache_entry,
    chat,
    check_all_ready,
    check_down,
    check_logs,
    check_verify,
    image_data_url,
    make_image,
    proxy_counters,
    topology_with_baseline,
    wait_for,
    write_topology,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
INSTANCES = ("encode-0", "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def epd(
    tiny_llava: Path, baselines: Baselines, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """cpu-epd.yaml as shipped, with free ports, a private store and DEBUG logs, plus its
    baseline."""
    tmp = tmp_path_factory.mktemp("cpu-epd")
    path, cache_dir = write_topology("cpu-epd", tmp, tiny_llava,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    # P and D use 32-token KV blocks; so does the baseline, so the kernels match too.
    with topology_with_baseline(path, cache_dir, tmp / "state", baselines, tiny_llava,
                                ("--block-size", "32")) as servers:
        yield servers


def test_status_all_ready(epd: tuple[TopologyRun, Server]) -> None:
    check_all_ready(epd[0], INSTANCES)


@pytest.mark.parametrize("is_streamed", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("seed", [None, 22], ids=["text", "image"])
def test_outputs_equal_the_baseline(
    epd: tuple[TopologyRun, Server], seed: int | None, is_streamed: bool
) -> None:
    run, baseline = epd
    urls = [image_data_url(make_image(seed))] if seed is not None else []
    mine = chat(run.proxy_url, MODEL, image_urls=urls, stream=is_streamed)
    theirs = chat(baseline.base_url, baseline.model, image_urls=urls)
    assert mine and mine == theirs


def test_kv_went_from_prefill_to_decode(epd: tuple[TopologyRun, Server]) -> None:
    """D answered from P's KV: the request reached both, and the KV files were written."""
    run, _ = epd
    assert chat(run.proxy_url, MODEL, image_urls=[image_data_url(make_image(23))])
    kv_dir = run.run_dir / "kv"
    assert kv_dir.is_dir() and any(kv_dir.rglob("*")), "no KV written by ExampleConnector"
    for name in ("prefill-0", "decode-0"):
        assert "POST /v1/chat/completions" in run.log(name), name


def test_repeated_image_is_loaded_from_the_store(epd: tuple[TopologyRun, Server]) -> None:
    """E encodes the image; P loads it from the store; neither P nor D runs the encoder."""
    from epdctl.proxy.request.media import content_key

    run, baseline = epd
    png = make_image(42)
    key, url = content_key("image", png), image_data_url(png)
    start = len(run.log("prefill-0"))
    # A new question the second time: P could otherwise reuse the first prompt's KV files
    # (the ExampleConnector ignores cache salts) and never need the image.
    texts = ("What is in the image?", "Describe the image in a few words.")
    answers = [chat(run.proxy_url, MODEL, image_urls=[url], text=texts[0])]
    entry = wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] >= 1 and e)
    assert entry, "no entry, or no hit on it, after the first request"
    answers.append(chat(run.proxy_url, MODEL, image_urls=[url], text=texts[1]))
    assert answers == [chat(baseline.base_url, baseline.model, image_urls=[url], text=t)
                       for t in texts]
    again = wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] > entry["hits"] and e)
    assert again, "no new hit for the repeated image"  # D may pin it too: no exact count

    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("prefill-0")[start:]), run.log("prefill-0")[-3000:]
    for name in ("prefill-0", "decode-0"):
        assert f"Finish execute for mm hash {key}" not in run.log(name), name
    assert f"Finish execute for mm hash {key}" in run.log("encode-0")


def test_with_overlap_p_gets_a_new_image_while_e_encodes_it(
    epd: tuple[TopologyRun, Server],
) -> None:
    """Overlap in E|P|D (on a second proxy with `--overlap`; the shipped one overlapped
    nothing): P has the request while E encodes, loads E's entry, and the answers, streamed
    or not, are the aggregated baseline's."""
    from epdctl.proxy.request.media import content_key

    run, baseline = epd
    assert proxy_counters(run)["overlapped"] == 0  # as shipped, after the images above
    with second_proxy(run, ["--overlap"]) as proxy:
        assert chat(proxy, MODEL, image_urls=[image_data_url(make_image(52))])  # it learns
        before = proxy_counters(run, proxy)["overlapped"]
        png = make_image(53)
        key, url = content_key("image", png), image_data_url(png)
        start = len(run.log("prefill-0"))
        answer = chat(proxy, MODEL, image_urls=[url])
        theirs = chat(baseline.base_url, baseline.model, image_urls=[url])
        assert answer and answer == theirs
        assert proxy_counters(run, proxy)["overlapped"] == before + 1
        streamed = image_data_url(make_image(56))
        assert chat(proxy, MODEL, image_urls=[streamed], stream=True) == chat(
            baseline.base_url, baseline.model, image_urls=[streamed])
        assert proxy_counters(run, proxy)["overlapped"] == before + 2
    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("prefill-0")[start:]), run.log("prefill-0")[-3000:]
    for name in ("prefill-0", "decode-0"):
        assert f"Finish execute for mm hash {key}" not in run.log(name), name


def test_logs_show_every_instance(epd: tuple[TopologyRun, Server]) -> None:
    check_logs(epd[0], INSTANCES)


def test_verify_passes(epd: tuple[TopologyRun, Server]) -> None:
    check_verify(*epd)


def test_the_proxy_answers_as_decode_does(epd: tuple[TopologyRun, Server]) -> None:
    """A drop-in for `vllm serve`: chat, completions, responses, the pass-through routes and
    vLLM's refusals, straight to decode-0 and through the proxy: same status, body, outputs."""
    run, _ = epd
    with missing_image() as missing:
        assert compare(run.instance_url("decode-0"), run.proxy_url, missing,
                       direct_key=run.state().internal_key) == {}


def test_responses_image_is_loaded_from_the_store(epd: tuple[TopologyRun, Server]) -> None:
    """/v1/responses gets chat's treatment: E encodes the input_image under the proxy's key,
    and the next stage loads it from the store (a hit) instead of encoding it."""
    assert responses_image_entry(epd[0], 63)


def test_bench_serve_responses_through_the_proxy(
    epd: tuple[TopologyRun, Server], tiny_llava: Path, tmp_path: Path
) -> None:
    """`vllm bench serve --backend openai-responses` completes every request; the random
    dataset finds /tokenize (no "skipping alignment")."""
    output, result = bench(epd[0].proxy_url, tiny_llava, tmp_path)
    assert (result["completed"], result["failed"]) == (result["num_prompts"], 0), output
    assert "/tokenize unavailable" not in output


def test_down_leaves_nothing(epd: tuple[TopologyRun, Server]) -> None:
    """Last in the module: no recorded process or group alive, no store or shm files."""
    check_down(epd[0])
