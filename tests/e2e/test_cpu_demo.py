"""topologies/cpu-demo.yaml (E|PD, tiny LLaVA) for real: up, requests, cache hits, verify, down.

First as shipped (no API key, no overlap); then, after its `down`, with the settings it does
not ship with, proxy.api_key and proxy.overlap, for the tests those change: outputs, overlap,
the key (the instances refuse anything that comes straight to them without the run's
internal key), the bench, and `down` after SIGKILLs. One baseline serves both.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.baselines import Baselines
from tests.e2e.parity import bench, compare, missing_image, responses_image_entry
from tests.harness import (
    Server,
    TopologyRun,
    cache_entry,
    chat,
    chat_completion,
    chat_messages,
    check_all_ready,
    check_down,
    check_logs,
    check_verify,
    encoder_posts,
    image_data_url,
    make_image,
    proxy_counters,
    store_counters,
    topology_up,
    wait_for,
    write_topology,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
INSTANCES = ("encode-0", "pd-0")
KEY = "demo-key-for-the-e2e-test"


@pytest.fixture(scope="module")
def baseline(tiny_llava: Path, baselines: Baselines) -> Server:
    """The aggregated server both runs are compared with (the session's: it may still be
    starting, beside the first `up`, which waits for it)."""
    return baselines.start(tiny_llava)


@pytest.fixture(scope="module")
def demo(
    baseline: Server, tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """cpu-demo.yaml as shipped, with free ports, a private store and DEBUG logs."""
    tmp = tmp_path_factory.mktemp("cpu-demo")
    path, cache_dir = write_topology("cpu-demo", tmp, tiny_llava,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    with topology_up(path, cache_dir, tmp / "state", baseline=baseline) as run:
        yield run, baseline


@pytest.fixture(scope="module")
def variant(
    baseline: Server, tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TopologyRun, Server]]:
    """cpu-demo.yaml with an API key and overlap (PD gets each request beside E's). Up
    after the shipped run's tests, whose last one downs it: one topology at a time."""
    tmp = tmp_path_factory.mktemp("cpu-demo-variant")
    path, cache_dir = write_topology("cpu-demo", tmp, tiny_llava,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"},
                                     proxy={"api_key": KEY, "overlap": True})
    with topology_up(path, cache_dir, tmp / "state", baseline=baseline) as run:
        yield run, baseline


def test_status_all_ready(demo: tuple[TopologyRun, Server]) -> None:
    check_all_ready(demo[0], INSTANCES)


def test_the_shipped_proxy_overlaps_nothing(demo: tuple[TopologyRun, Server]) -> None:
    """Overlap is off as shipped: a new image goes to E first, then to PD, never beside
    (with overlap on, the second would: the first tells the proxy E reports no metadata)."""
    run, baseline = demo
    before = proxy_counters(run)
    for seed in (54, 55):
        url = image_data_url(make_image(seed))
        assert chat(run.proxy_url, MODEL, image_urls=[url]) == chat(
            baseline.base_url, baseline.model, image_urls=[url])
    after = proxy_counters(run)
    assert after["overlapped"] == before["overlapped"] == 0
    assert after["sent"] == before["sent"] + 2  # both went to E


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
    """Guards the equality tests: the tiny model's answer does depend on the image (images
    31, 34 and 35 open their answers apart; 32 and 33 happen to open alike)."""
    run, _ = demo
    answers = {chat(run.proxy_url, MODEL, image_urls=[image_data_url(make_image(s))])
               for s in (31, 34, 35)}
    assert len(answers) == 3


def test_repeated_image_is_loaded_from_the_store(demo: tuple[TopologyRun, Server]) -> None:
    """E encodes the image once; the repeat makes no E request at all (the proxy finds the
    entry in the store); PD loads it from the store both times and never runs the encoder."""
    from epdctl.proxy.request.media import content_key

    run, baseline = demo
    png = make_image(41)
    key, url = content_key("image", png), image_data_url(png)
    pd_start, e_start = len(run.log("pd-0")), len(run.log("encode-0"))
    counted = proxy_counters(run)
    # Salts keep the prefix cache from answering the repeat without the image.
    first = chat(run.proxy_url, MODEL, image_urls=[url],
                 extra_body={"cache_salt": "first"})
    # With overlap E's answer (and its access line) may come after PD's.
    assert wait_for(lambda: encoder_posts(run.log("encode-0")[e_start:]) == 1)
    entry = wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] >= 1 and e)
    assert entry, "no entry, or no hit on it, after the first request"
    e_mark, looked = len(run.log("encode-0")), store_counters(run)
    second = chat(run.proxy_url, MODEL, image_urls=[url],
                  extra_body={"cache_salt": "second"})
    assert first and first == second == chat(baseline.base_url, baseline.model, image_urls=[url])
    again = wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] > entry["hits"] and e)
    assert again and again["hits"] == entry["hits"] + 1

    # No E request for the repeat: E's log shows none, the proxy counted a skip, and
    # `cache inspect` one more lookup, a hit.
    assert encoder_posts(run.log("encode-0")[e_mark:]) == 0
    now = proxy_counters(run)
    assert {k: now[k] - counted[k] for k in ("lookups", "skipped", "sent")} == {
        "lookups": 2, "skipped": 1, "sent": 1}
    row = wait_for(lambda: (r := store_counters(run))["lookups"] > looked["lookups"] and r)
    assert row, store_counters(run)
    assert (row["lookups"] - looked["lookups"], row["skipped"] - looked["skipped"]) == (1, 1)

    # The first request reads the entry; for the second, PD's worker usually still holds the
    # tensor and skips the read (the pin above was still taken and validated).
    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("pd-0")[pd_start:]), run.log("pd-0")[-3000:]
    assert f"Finish execute for mm hash {key}" not in run.log("pd-0")
    assert f"Finish execute for mm hash {key}" in run.log("encode-0")


def test_a_uuid_naming_another_images_content_key_poisons_nothing(
    demo: tuple[TopologyRun, Server],
) -> None:
    """Issue 17: a red image tagged with the blue image's content key, then a plain request
    for the blue image: it gets the blue image's own answer, and the red one is cached under
    the client's key, not the blue image's."""
    import httpx

    from epdctl.proxy.request.media import client_key, content_key

    run, baseline = demo
    red, blue = make_image(71), make_image(72)
    red_url, blue_url = image_data_url(red), image_data_url(blue)
    blue_key = content_key("image", blue)
    red_answer = chat(baseline.base_url, baseline.model, image_urls=[red_url])
    blue_answer = chat(baseline.base_url, baseline.model, image_urls=[blue_url])
    assert red_answer != blue_answer, "a poisoned answer would not show"

    messages = chat_messages("What is in the image?", [red_url])
    messages[0]["content"][0]["uuid"] = blue_key
    reply = httpx.post(f"{run.proxy_url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "temperature": 0.0, "max_tokens": 16})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == red_answer
    assert wait_for(lambda: cache_entry(run, client_key(blue_key))), "no entry for the uuid"
    assert cache_entry(run, blue_key) is None

    assert chat(run.proxy_url, MODEL, image_urls=[blue_url]) == blue_answer
    assert wait_for(lambda: cache_entry(run, blue_key)), "no entry for the blue image"
    assert f"Finish execute for mm hash {blue_key}" in run.log("encode-0")


def test_a_responses_uuid_naming_another_images_content_key_poisons_nothing(
    demo: tuple[TopologyRun, Server],
) -> None:
    """Issue 17 on /v1/responses: an input_image's uuid is scoped as a chat part's is."""
    import httpx

    from epdctl.proxy.request.media import client_key, content_key

    run, baseline = demo
    red, blue = make_image(73), make_image(74)
    blue_url = image_data_url(blue)
    blue_key = content_key("image", blue)
    blue_answer = chat(baseline.base_url, baseline.model, image_urls=[blue_url])
    part = {"type": "input_image", "image_url": image_data_url(red), "uuid": blue_key}
    reply = httpx.post(f"{run.proxy_url}/v1/responses", timeout=120, json={
        "model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is in the image?"}, part]}],
        "temperature": 0.0, "max_output_tokens": 16})
    assert reply.status_code == 200, reply.text
    assert wait_for(lambda: cache_entry(run, client_key(blue_key))), "no entry for the uuid"
    assert cache_entry(run, blue_key) is None
    assert chat(run.proxy_url, MODEL, image_urls=[blue_url]) == blue_answer


@pytest.fixture(scope="module")
def dozen(demo: tuple[TopologyRun, Server]) -> dict[str, Any]:
    """A dozen requests through the proxy (8 with an image), each salted so that PD takes
    every image from the EC store; their response ids, and the store's hits before them."""
    run, _ = demo
    hits_before = _active_namespace(run)["hits"]
    ids: dict[str, list[str]] = {"image": [], "text": []}
    for i in range(12):
        urls = [image_data_url(make_image(60 + i % 4))] if i % 3 else []
        response = chat_completion(run.proxy_url, MODEL, image_urls=urls, max_tokens=4,
                                   extra_body={"cache_salt": f"dozen-{i}"})
        ids["image" if urls else "text"].append(response.id)
    return {"ids": ids, "hits_before": hits_before}


def _proxy_lines(run: TopologyRun, response_ids: list[str]) -> list[str]:
    """The proxy's log lines of these requests (what a failed check shows)."""
    rids = [f"rid={i.removeprefix('chatcmpl-')}" for i in response_ids]
    return [line for line in run.log("proxy").splitlines() if any(r in line for r in rids)]


def _active_namespace(run: TopologyRun) -> dict[str, Any]:
    doc = run.cli_json("cache", "inspect")
    return next(ns for ns in doc["namespaces"] if ns["active"])


def test_logs_hold_no_probe_line(demo: tuple[TopologyRun, Server], dozen: dict) -> None:
    """vLLM leaves the probes out (the plan's --disable-access-log-for-endpoints): the
    supervisor, the proxy's health loop and `top` poll /health and /metrics all along."""
    run, _ = demo
    result = run.cli("logs", "-n", "20")
    assert result.returncode == 0, result.stderr
    rows = result.stdout.splitlines()
    # Access lines only: vLLM's own stats line names its module, `[v1/metrics/loggers.py]`.
    probes = [r for r in rows if '"GET /health ' in r or '"GET /metrics ' in r]
    assert len(rows) >= 20 and not probes, probes
    # The access log is on for the rest (vLLM's periodic stats lines may fill the last 20).
    more = run.cli("logs", "-n", "400").stdout.splitlines()
    assert any('"POST /v1/chat/completions HTTP/1.1" 200' in r for r in more)
    assert not [r for r in more if '"GET /health HTTP' in r or '"GET /metrics HTTP' in r]
    for name in INSTANCES:
        log = run.log(name)
        assert "--disable-access-log-for-endpoints /health,/metrics" in log.splitlines()[0]
        assert '"GET /health HTTP' not in log and '"GET /metrics HTTP' not in log, name


@pytest.mark.parametrize("form", ["response id", "x-request-id"])
def test_one_image_request_s_journey(demo: tuple[TopologyRun, Server], dozen: dict,
                                     form: str) -> None:
    """`logs --request ID`: the proxy's line with its stage timings, then E's lines for the
    request and PD's, in time order (the dozen's second image is new to the store and to
    the proxy: E encoded it, then PD got the request, as shipped: no overlap)."""
    run, _ = demo
    response_id = dozen["ids"]["image"][1]  # chatcmpl-<rid>: vLLM's id for the client's rid
    rid = response_id.removeprefix("chatcmpl-")
    result = run.cli("logs", "--request", response_id if form == "response id" else rid,
                     "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(row) for row in result.stdout.splitlines()]
    first, rest = lines[0], lines[1:]
    assert first["instance"] == "proxy" and f"rid={rid} route=/v1/chat/completions" in (
        first["text"])
    assert "status=200" in first["text"] and "encode_ms=" in first["text"] and (
        "items=1" in first["text"])
    assert "overlap=1" not in first["text"]
    names = [line["instance"] for line in rest]
    assert all(f"chatcmpl-{rid}:enc0" in line["text"] for line in rest
               if line["instance"] == "encode-0")
    assert all(f"chatcmpl-{rid}" in line["text"] for line in rest
               if line["instance"] == "pd-0")
    assert {"encode-0", "pd-0"} <= set(names)
    times = [line["time"] for line in rest]
    assert times == sorted(times) and all(line["time_source"] == "own" for line in lines)
    assert result.stderr == ""


def test_top_once_reports_what_metrics_and_cache_inspect_show(
        demo: tuple[TopologyRun, Server], dozen: dict) -> None:
    from epdctl.top.prom import Scrape

    run, _ = demo
    images = len(dozen["ids"]["image"])
    # The store's counters are flushed once a second: wait for the dozen's hits.
    assert wait_for(lambda: _active_namespace(run)["hits"] >= dozen["hits_before"] + images,
                    timeout_s=10), (dozen["hits_before"], _active_namespace(run),
                                    _proxy_lines(run, dozen["ids"]["image"]))
    doc = run.cli_json("top", "--once")
    state = run.state()
    def scrape(url: str, key: str | None) -> Scrape:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(f"{url}/metrics", headers=headers)
        return Scrape(urllib.request.urlopen(request).read().decode())

    proxy = scrape(state.proxy.url, None)
    encoder = scrape(state.engines[0].url, state.internal_key)
    assert doc["proxy"]["requests"] == proxy.total("epdctl_proxy_requests_total") >= 12
    fanout = proxy.histogram("epdctl_proxy_encoder_fanout_items")
    assert fanout is not None
    assert doc["proxy"]["encoder_fanout"]["items"] == fanout.sum >= images
    assert doc["proxy"]["encoder_fanout"]["requests"] == fanout.total
    encode = doc["instances"][0]
    assert encode["name"] == "encode-0"
    assert encode["requests"] == encoder.total("vllm:request_success_total") >= images
    assert doc["proxy"]["stages"]["encode"]["p50_s"] > 0
    namespace = _active_namespace(run)
    assert (doc["cache"]["hits"], doc["cache"]["saves"], doc["cache"]["entries"]) == (
        namespace["hits"], namespace["saves"], namespace["entries"])
    assert doc["cache"]["hits"] >= dozen["hits_before"] + images
    pd = doc["instances"][1]
    assert (pd["cache"]["hits"], pd["cache"]["misses"]) == (namespace["hits"],
                                                             namespace["misses"])


def test_logs_show_every_instance(demo: tuple[TopologyRun, Server]) -> None:
    check_logs(demo[0], INSTANCES)


def test_verify_passes(demo: tuple[TopologyRun, Server]) -> None:
    check_verify(*demo)


def test_the_proxy_answers_as_pd_does(demo: tuple[TopologyRun, Server]) -> None:
    """A drop-in for `vllm serve`: chat, completions, responses, the pass-through routes and
    vLLM's refusals, straight to pd-0 and through the proxy: same status, body, outputs."""
    run, _ = demo
    with missing_image() as missing:
        assert compare(run.instance_url("pd-0"), run.proxy_url, missing,
                       direct_key=run.state().internal_key) == {}  # pd-0 wants the run's key


def test_responses_image_is_loaded_from_the_store(demo: tuple[TopologyRun, Server]) -> None:
    """/v1/responses gets chat's treatment: E encodes the input_image under the proxy's key,
    and the next stage loads it from the store (a hit) instead of encoding it."""
    assert responses_image_entry(demo[0], 83)  # a seed no other test here uses


def test_bench_serve_responses_through_the_proxy(
    demo: tuple[TopologyRun, Server], tiny_llava: Path, tmp_path: Path
) -> None:
    """`vllm bench serve --backend openai-responses` completes every request; the random
    dataset finds /tokenize (no "skipping alignment")."""
    output, result = bench(demo[0].proxy_url, tiny_llava, tmp_path)
    assert (result["completed"], result["failed"]) == (result["num_prompts"], 0), output
    assert "/tokenize unavailable" not in output


def test_down_leaves_nothing(demo: tuple[TopologyRun, Server]) -> None:
    """Last of the shipped run: no recorded process or group alive, no store, shm or
    semaphore file, no socket or file of the run in /tmp."""
    check_down(demo[0])


# The settings cpu-demo.yaml does not ship with (proxy.api_key, proxy.overlap), on a second
# run after the first is down; only the tests they change.


@pytest.mark.parametrize("is_streamed", [False, True], ids=["plain", "stream"])
def test_variant_outputs_equal_the_baseline(
    variant: tuple[TopologyRun, Server], is_streamed: bool
) -> None:
    run, baseline = variant
    urls = [image_data_url(make_image(24))]
    mine = chat(run.proxy_url, MODEL, api_key=KEY, image_urls=urls, stream=is_streamed)
    assert mine and mine == chat(baseline.base_url, baseline.model, image_urls=urls)


def test_variant_pd_gets_a_new_image_while_e_encodes_it(
    variant: tuple[TopologyRun, Server],
) -> None:
    """Overlap (#20): the proxy sends PD the request beside E's; PD waits for E's entry,
    loads it (never running the vision tower) and answers as the aggregated baseline."""
    from epdctl.proxy.request.media import content_key

    run, baseline = variant
    # The first image the proxy sees tells it whether E reports metadata (LLaVA: none).
    assert chat(run.proxy_url, MODEL, api_key=KEY, image_urls=[image_data_url(make_image(50))])
    before = proxy_counters(run)
    png = make_image(51)
    key, url = content_key("image", png), image_data_url(png)
    pd_start = len(run.log("pd-0"))
    answer = chat(run.proxy_url, MODEL, api_key=KEY, image_urls=[url])
    assert answer and answer == chat(baseline.base_url, baseline.model, image_urls=[url])
    assert proxy_counters(run)["overlapped"] == before["overlapped"] + 1
    loaded = f"Success load encoder cache for hash {key}"
    assert wait_for(lambda: loaded in run.log("pd-0")[pd_start:]), run.log("pd-0")[-3000:]
    assert f"Finish execute for mm hash {key}" not in run.log("pd-0")
    pending = run.cache_dir / run.state().namespace / "pending"
    assert wait_for(lambda: not any(pending.iterdir())), list(pending.iterdir())  # E answered


def test_variant_instances_refuse_requests_that_go_around_the_proxy(
    variant: tuple[TopologyRun, Server],
) -> None:
    """Straight to PD (or E), the proxy's key is no good and no key is worse: 401 on the
    OpenAI routes and on vLLM's others (/invocations); /health stays open; no output shows
    either key."""
    import httpx

    run, _ = variant
    internal = run.state().internal_key
    assert internal and internal != KEY
    body = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hello"}]}
    for name in INSTANCES:
        url = next(s.url for s in run.state().specs if s.name == name)
        for path in ("/v1/chat/completions", "/invocations"):
            for headers in ({}, {"authorization": f"Bearer {KEY}"}):
                reply = httpx.post(url + path, json=body, headers=headers, timeout=60)
                assert reply.status_code == 401, (name, path, headers, reply.text)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    pd = next(s.url for s in run.state().specs if s.name == "pd-0")
    ok = httpx.post(pd + "/v1/chat/completions", json=body, timeout=120,
                    headers={"authorization": f"Bearer {internal}"})
    assert ok.status_code == 200, ok.text  # the 401s above were the key, nothing else
    assert chat(run.proxy_url, MODEL, api_key=KEY, text="Hello")
    commands = (("status",), ("status", "--json"), ("logs", "-n", "500"),
                ("up", str(run.path), "--dry-run"))
    shown = [run.cli(*args) for args in commands]
    assert all(r.returncode == 0 for r in shown), [r.stderr for r in shown]
    logs = [p.read_text(errors="replace") for p in (run.run_dir / "logs").iterdir()]
    for text in [r.stdout + r.stderr for r in shown] + logs:
        assert KEY not in text and internal not in text


def test_variant_bench_serve_responses_through_the_proxy(
    variant: tuple[TopologyRun, Server], tiny_llava: Path, tmp_path: Path
) -> None:
    """`vllm bench serve --backend openai-responses` through a proxy with an api_key
    completes every request."""
    output, result = bench(variant[0].proxy_url, tiny_llava, tmp_path, api_key=KEY)
    assert (result["completed"], result["failed"]) == (result["num_prompts"], 0), output
    # This module's proxy has an api_key, which it requires on every route but /health
    # (vLLM's guard covers /v1 alone), and vLLM's bench asks /tokenize without its key: the
    # alignment check is test_cpu_epd's, whose proxy is open.


def test_variant_sigkill_then_down_leaves_nothing(variant: tuple[TopologyRun, Server]) -> None:
    """SIGKILL of the supervisor and every engine, so none of them cleans up: `down` still
    leaves no process, no store, shm or `sem.*` file, and no socket or file of the run in
    /tmp (its IPC sockets were in directories of the run)."""
    check_down(variant[0], sigkill=True)
