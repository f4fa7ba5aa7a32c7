"""Every modality the tiny models take, end to end through EPD on real vLLM (CPU).

One module, three topologies run one after another (a parametrized module fixture: the
next starts once the last is down): the tiny Qwen2-VL as E|PD (topologies/cpu-qwen2vl.yaml)
and as E|P|D (cpu-qwen2vl-epd.yaml), for videos, images and their mixes; the tiny
Qwen2-Audio as E|PD (cpu-audio.yaml) for `audio_url` and `input_audio` clips. All with the
metadata rewrite on (E reports `video_grid_thw` / `image_grid_thw` / `audio_num_tokens`).

For each request: the answer through the proxy equals the aggregated baseline's
(temperature 0); E's log shows it encoded each item (`Finish execute for mm hash K`); the
consumers' logs show they loaded each one (`Success load encoder cache for hash K`, never
`Finish execute`), and each item's store entry counts a hit (`cache inspect --entries`).
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.baselines import AUDIO_ARGS, QWEN2VL_ARGS, Baselines
from tests.harness import (
    Server,
    TopologyRun,
    cache_entry,
    encoder_posts,
    make_image,
    proxy_counters,
    topology_with_baseline,
    wait_for,
    write_topology,
)
from tests.media_samples import (
    Part,
    audio_url_part,
    chat_parts,
    image_part,
    input_audio_part,
    make_video,
    make_wav,
    video_part,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Case:
    topology: str
    model_fixture: str
    model: str
    consumers: tuple[str, ...]
    """Never run the encoder on an item; the first loads each one. (Decode in E|P|D loads
    only for prompt tokens the transferred KV does not cover, so maybe not at all.)"""
    baseline_args: tuple[str, ...]
    modalities: frozenset[str] = frozenset({"image", "video"})


VL_ARGS = QWEN2VL_ARGS
CASES = {
    "qwen2vl-e-pd": Case("cpu-qwen2vl", "tiny_qwen2vl", "tiny-qwen2vl", ("pd-0",), VL_ARGS),
    "qwen2vl-e-p-d": Case("cpu-qwen2vl-epd", "tiny_qwen2vl", "tiny-qwen2vl",
                          ("prefill-0", "decode-0"), VL_ARGS),
    "audio-e-pd": Case("cpu-audio", "tiny_qwen2audio", "tiny-qwen2audio", ("pd-0",),
                       AUDIO_ARGS, frozenset({"audio"})),
    "audio-e-p-d": Case("cpu-audio-epd", "tiny_qwen2audio", "tiny-qwen2audio",
                        ("prefill-0", "decode-0"), AUDIO_ARGS, frozenset({"audio"})),
}


@dataclass
class Running:
    case: Case
    run: TopologyRun
    baseline: Server

    def ask(self, parts: list[Part], **kwargs: object) -> str:
        return chat_parts(self.run.proxy_url, self.case.model, parts, **kwargs)  # type: ignore[arg-type]

    def reference(self, parts: list[Part]) -> str:
        return chat_parts(self.baseline.base_url, self.baseline.model, parts)


@pytest.fixture(scope="module", params=list(CASES))
def topo(request: pytest.FixtureRequest, baselines: Baselines,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """The case's topology with free ports, a private store and DEBUG logs, and a baseline."""
    case = CASES[request.param]
    if "audio" in case.modalities:
        pytest.importorskip("soundfile", reason="vLLM decodes audio with soundfile (setup-cpu.sh)")
    model = request.getfixturevalue(case.model_fixture)
    tmp = tmp_path_factory.mktemp(request.param)
    path, cache_dir = write_topology(case.topology, tmp, model,
                                     env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    data = yaml.safe_load(path.read_text())  # E comes back after the SIGKILL test
    data["restart"] = {"policy": "on-failure", "backoff": 0.5}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with topology_with_baseline(path, cache_dir, tmp / "state", baselines, model,
                                case.baseline_args) as (run, baseline):
        yield Running(case, run, baseline)


def only(*names: str) -> pytest.MarkDecorator:
    """Run a test on these cases of the module fixture only."""
    return pytest.mark.parametrize("topo", names, indirect=True)


def key_of(part: Part) -> str:
    """The content key the proxy gives a part (modality + decoded bytes)."""
    import base64

    from epdctl.proxy.request.media import content_key
    from epdctl.proxy.request.parse import MEDIA_TYPES

    kind = part["type"]
    if kind == "input_audio":
        return content_key("audio", base64.b64decode(part[kind]["data"]))
    return content_key(MEDIA_TYPES[kind], base64.b64decode(part[kind]["url"].split(",", 1)[1]))


Requests = dict[str, Callable[[int], list[Part]]]
VL_REQUESTS: Requests = {
    "video": lambda s: [video_part(make_video(s))],
    "two-images": lambda s: [image_part(s), image_part(s + 1)],
    "image-and-video": lambda s: [image_part(s), video_part(make_video(s + 1))],
    "two-videos": lambda s: [video_part(make_video(s)), video_part(make_video(s + 1))],
}
AUDIO_REQUESTS: Requests = {
    "audio-url": lambda s: [audio_url_part(make_wav(s))],
    "input-audio": lambda s: [input_audio_part(make_wav(s))],
    "two-clips": lambda s: [audio_url_part(make_wav(s)), input_audio_part(make_wav(s + 1))],
}


def requests_of(case: Case) -> Requests:
    return AUDIO_REQUESTS if "audio" in case.modalities else VL_REQUESTS


def check_encoded_then_loaded(topo: Running, parts: list[Part], marks: dict[str, int]) -> None:
    """E encoded every item; every consumer loaded (never encoded) it; each entry has a hit."""
    run, first = topo.run, topo.case.consumers[0]
    for key in {key_of(p) for p in parts}:
        done = f"Finish execute for mm hash {key}"
        assert wait_for(lambda k=done: k in run.log("encode-0")[marks["encode-0"]:]), key
        loaded = f"Success load encoder cache for hash {key}"
        assert wait_for(lambda k=loaded: k in run.log(first)[marks[first]:]), (first, key)
        for name in topo.case.consumers:
            assert done not in run.log(name), (name, key)
        entry = wait_for(lambda k=key: (e := cache_entry(run, k)) and e["hits"] >= 1 and e)
        assert entry, key


def log_marks(topo: Running) -> dict[str, int]:
    return {name: len(topo.run.log(name)) for name in ("encode-0", *topo.case.consumers)}


def test_each_request_answers_as_the_baseline(topo: Running) -> None:
    """Each modality and mix: the proxy's answer is the baseline's; E encoded each item, the
    consumers loaded each one. Different media give different answers (the check's power)."""
    answers = {}
    for n, (name, make) in enumerate(requests_of(topo.case).items()):
        parts = make(10 + 3 * n)
        marks = log_marks(topo)
        expected = topo.reference(parts)
        assert topo.ask(parts, stream=n % 2 == 1) == expected, name
        check_encoded_then_loaded(topo, parts, marks)
        answers[name] = expected
    assert len(set(answers.values())) == len(answers), answers


def test_rewritten_parts_carry_the_models_metadata(topo: Running) -> None:
    """E reported each modality's metadata (the proxy keeps it beside the entry): PD got the
    `*_embeds` form, not the media."""
    from epdctl.cache.sidecar import read_meta
    from epdctl.cache.store import Store

    field = ("audio", "audio_num_tokens") if "audio" in topo.case.modalities else (
        "video", "video_grid_thw")
    make = make_wav if field[0] == "audio" else make_video
    parts = [audio_url_part(make(40))] if field[0] == "audio" else [video_part(make(40))]
    assert topo.ask(parts) == topo.reference(parts)
    store = Store(topo.run.cache_dir, topo.run.state().namespace)
    kept = wait_for(lambda: read_meta(store, key_of(parts[0])))
    assert kept and kept["metadata"][field[1]], kept


def test_verify_sends_every_modality_the_topology_takes(topo: Running) -> None:
    """`verify --baseline-url`: its prompts of each modality the engines let in (and no
    other) answer as the baseline's, and P/PD loaded their media from the EC store."""
    run = topo.run
    result = run.cli("verify", str(run.path), "--baseline-url", topo.baseline.url, "--json",
                     timeout_s=600)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and all(p["equal"] for p in doc["prompts"])
    sent = {m for p in doc["prompts"] for m, n in (("image", p["images"]),
                                                  ("video", p["videos"]),
                                                  ("audio", p["audios"])) if n}
    assert sent == topo.case.modalities
    with_media = [p for p in doc["prompts"] if p["images"] or p["videos"] or p["audios"]]
    assert all(p["cache"]["verdict"] == "hit" for p in with_media), with_media


def test_a_repeated_video_or_clip_makes_no_second_e_request(topo: Running) -> None:
    """The repeat's item is found in the store: E gets nothing, PD the kept metadata."""
    run = topo.run
    is_audio = "audio" in topo.case.modalities
    parts = [input_audio_part(make_wav(50))] if is_audio else [video_part(make_video(50))]
    expected = topo.reference(parts)
    e_start = len(run.log("encode-0"))
    assert topo.ask(parts, extra_body={"cache_salt": "first"}) == expected
    assert wait_for(lambda: encoder_posts(run.log("encode-0")[e_start:]) == 1)
    key = key_of(parts[0])
    assert wait_for(lambda: (e := cache_entry(run, key)) and e["hits"] >= 1)
    e_mark, counted = len(run.log("encode-0")), proxy_counters(run)
    assert topo.ask(parts, extra_body={"cache_salt": "second"}, stream=True) == expected
    assert encoder_posts(run.log("encode-0")[e_mark:]) == 0
    now = proxy_counters(run)
    assert (now["lookups"] - counted["lookups"], now["skipped"] - counted["skipped"],
            now["sent"] - counted["sent"]) == (1, 1, 0)


@only("qwen2vl-e-pd", "audio-e-pd")
def test_a_modality_the_model_does_not_take_is_vllms_own_400(topo: Running) -> None:
    """An audio clip to Qwen2-VL, a video to Qwen2-Audio: the proxy's answer is the
    aggregated server's refusal, status and message."""
    import httpx

    part = video_part(make_video(80)) if "audio" in topo.case.modalities else \
        audio_url_part(make_wav(80))

    def post(url: str, model: str) -> httpx.Response:
        body = {"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

    mine = post(topo.run.proxy_url, topo.case.model)
    theirs = post(topo.baseline.url, topo.baseline.model)
    assert theirs.status_code == 400, theirs.text
    assert mine.status_code == 400, mine.text
    assert mine.json()["error"]["message"] == theirs.json()["error"]["message"]


@only("qwen2vl-e-pd")
def test_a_client_uuid_cannot_alias_another_videos_entry(topo: Running) -> None:
    """Video B sent with a uuid equal to video A's content key (and A with a client uuid
    B's request reuses): B's answer is B's, from an entry of its own."""
    first = video_part(make_video(60))
    assert topo.ask([first]) == topo.reference([first])
    other = make_video(61)
    expected = topo.reference([video_part(other)])
    assert expected != topo.reference([first])
    assert topo.ask([video_part(other, uuid=key_of(first))]) == expected
    # A client uuid names one entry of its own: another video under it is not A either.
    assert topo.ask([video_part(make_video(62), uuid="clip-1")]) == topo.reference(
        [video_part(make_video(62))])


@only("qwen2vl-e-pd")
def test_e_sigkilled_during_video_requests_loses_none(topo: Running) -> None:
    """E is stopped, then SIGKILLed with video requests waiting on it: each falls back to
    PD with the video and answers as the baseline; the next one is served too."""
    import os

    run = topo.run
    pid = run.state().records["encode-0"].pid
    restarts = instances(run)["encode-0"]["restarts"]
    requests = [[video_part(make_video(s))] for s in (70, 71, 72)]
    expected = [topo.reference(p) for p in requests]
    with ThreadPoolExecutor(3) as pool:
        os.killpg(pid, signal.SIGSTOP)  # E answers none of them before it dies
        try:
            inflight = [pool.submit(topo.ask, p, stream=n == 1) for n, p in enumerate(requests)]
            assert wait_for(lambda: proxy_health(run).get("inflight") == 3, 60), proxy_health(run)
        finally:
            os.killpg(pid, signal.SIGKILL)
        assert [f.result(timeout=180) for f in inflight] == expected
    after = [video_part(make_video(73))]
    assert topo.ask(after) == topo.reference(after)  # E still out: PD encodes it
    # The supervisor restarts E (restart: on-failure); it is sent videos again.
    row = wait_for(lambda: (r := instances(run)["encode-0"])["state"] == "ready"
                   and r["restarts"] == restarts + 1 and r, 300, 1.0)
    assert row, instances(run)["encode-0"]
    assert wait_for(lambda: proxy_health(run).get("status") == "ok", 60), proxy_health(run)
    again = [video_part(make_video(74))]
    marks = log_marks(topo)
    assert topo.ask(again) == topo.reference(again)
    check_encoded_then_loaded(topo, again, marks)


def instances(run: TopologyRun) -> dict[str, dict[str, Any]]:
    """`status --json` by instance (it exits non-zero while one is not ready)."""
    result = run.cli("status", "--json")
    return {i["name"]: i for i in json.loads(result.stdout)["instances"]}


def proxy_health(run: TopologyRun) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"{run.proxy_url}/health", timeout=5) as reply:
            return dict(json.loads(reply.read()))
    except OSError as exc:
        return {"error": str(exc)}


def test_the_test_media_differ() -> None:
    """Guards the equality checks: distinct seeds give distinct bytes (so distinct keys)."""
    assert make_video(1) != make_video(2) and make_wav(1) != make_wav(2)
    assert make_image(1) != make_image(2)
