"""Faults in real vLLM (tiny LLaVA, cpu-demo E|PD through `epdctl up -d`): nothing is lost.

One topology for the module, with `restart: on-failure`. In order: the encoder hangs
(SIGSTOP), the encoder is killed (SIGKILL) and restarted, the EC store fills up and holds a
foreign entry, PD is killed mid-stream and restarted, and `down` still leaves nothing.

Reference answers come from PD itself with the image and a uuid of its own (so nothing from
the store can be used): PD encoding locally is the aggregated computation, and the first test
checks it equals the E path's answer (which tests/e2e/test_cpu_demo.py checks against a
separate aggregated server).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import TopologyRun, check_down, edited_topology, store_root
from tests.reliability.helpers import kill_group, wait_for
from tests.reliability.probe import (
    Probe,
    answer,
    body,
    broken_store,
    debug_logs,
    image,
    reference,
    streamed,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny-llava"
ENCODE_TIMEOUT_S = 10
RESTART_READY_S = 300
# The tiny LLaVA's max_position_embeddings: room for the longest answer test_killed_pd asks.
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def run(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TopologyRun]:
    tmp = tmp_path_factory.mktemp("engine-faults")
    with store_root(tmp) as (cache_dir, is_small):

        def change(data: dict[str, Any]) -> None:
            debug_logs(data)
            args = data["engine"]["args"]
            args[args.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
            data["restart"] = {"policy": "on-failure", "max_restarts": 2, "backoff": "1s"}
            data["proxy"]["encode_timeout"] = ENCODE_TIMEOUT_S
            data["proxy"]["overlap"] = True  # faults in E with requests waiting at PD
            # What the client gets when PD is not back in time: test_replay_real.py has
            # the replays and resumed streams.
            data["proxy"]["replay_wait"] = "1s"
            if is_small:
                data["cache"]["capacity"] = "2MiB"  # the tmpfs is 4 MiB

        with edited_topology("cpu-demo", tmp, tiny_llava, cache_dir, change) as running:
            yield running


@pytest.fixture(scope="module")
def probe(run: TopologyRun) -> Probe:
    return Probe(run)




def ask(probe: Probe, seed: int, *, stream: bool = False) -> str:
    """Image `seed` through the proxy."""
    _, url = image(seed)
    request = body(MODEL, urls=(url,))
    return streamed(probe.proxy, request) if stream else answer(probe.proxy, request)


def wait_ready(probe: Probe, name: str, restarts: int) -> dict[str, Any]:
    """`name` restarted `restarts` times and ready again, and the proxy's /health is ok."""
    row = wait_for(lambda: (r := probe.status()[name])["state"] == "ready"
                   and r["restarts"] == restarts and r, RESTART_READY_S, 1.0)
    assert row, json.dumps(probe.status()[name])  # in full: the state is what tells
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 30), probe.health()
    return dict(row)


def test_references_equal_the_e_path(probe: Probe) -> None:
    """Guards the references: PD's local answer equals E→store→PD's, and images matter."""
    refs = [reference(probe, seed) for seed in range(1, 20)]
    key, _ = image(1)
    pd_at = probe.mark("pd-0")
    assert ask(probe, 1) == refs[0]
    assert probe.wait_logged("pd-0", pd_at, f"Success load encoder cache for hash {key}")
    assert len(set(refs[:4])) == 4


def test_hung_encoder(probe: Probe) -> None:
    """SIGSTOP E: the in-flight request and new ones succeed through PD's local encode; the
    proxy ejects E (and stops waiting for it), status says unhealthy; SIGCONT re-admits it."""
    encoder = probe.pid("encode-0")
    assert ask(probe, 1) == reference(probe, 1)  # the proxy learns: no metadata, overlap
    reference(probe, 2)
    pending = probe.run.cache_dir / probe.run.state().namespace / "pending"
    kill_group(encoder, signal.SIGSTOP)
    try:
        begin = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            hung = pool.submit(ask, probe, 2)  # in flight at E when it hung
            # PD has it too (overlap), waiting for the entry; a text request still passes.
            assert wait_for(lambda: any(pending.iterdir()), 30), "no pending mark"
            assert answer(probe.proxy, body(MODEL, text="Hello there."))
            assert not hung.done(), "the text request waited for the deferred one"
            assert hung.result(timeout=120) == reference(probe, 2)
        assert time.monotonic() - begin >= ENCODE_TIMEOUT_S * 0.9
        assert wait_for(probe.encoders_out, 30), probe.health()
        for seed, stream in ((3, False), (4, True)):
            begin = time.monotonic()
            assert ask(probe, seed, stream=stream) == reference(probe, seed)
            assert time.monotonic() - begin < ENCODE_TIMEOUT_S / 2, "waited for the hung E"
        assert probe.health()[1]["status"] == "degraded"
        assert wait_for(lambda: probe.status()["encode-0"]["state"] == "unhealthy", 30, 1.0)
    finally:
        kill_group(encoder, signal.SIGCONT)
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 30), probe.health()
    key, _ = image(5)
    e_at, pd_at = probe.mark("encode-0"), probe.mark("pd-0")
    assert ask(probe, 5) == reference(probe, 5)
    assert probe.wait_logged("encode-0", e_at, f"Finish execute for mm hash {key}")
    assert probe.wait_logged("pd-0", pd_at, f"Success load encoder cache for hash {key}")
    assert probe.status()["encode-0"]["restarts"] == 0


def test_killed_encoder(probe: Probe) -> None:
    """SIGKILL E's group mid-request: in-flight and new requests succeed, status and /health
    show it out; the restart policy brings it back and the proxy sends it work again."""
    old, restarts = probe.pid("encode-0"), probe.status()["encode-0"]["restarts"]
    proxy_at = probe.mark("proxy")
    with ThreadPoolExecutor(4) as pool:
        kill_group(old, signal.SIGSTOP)  # E answers none of them before it dies
        try:
            inflight = [pool.submit(ask, probe, seed, stream=seed % 2 == 0) for seed in (6, 7, 8)]
            assert wait_for(lambda: probe.health()[1].get("inflight") == 3, 30), probe.health()
        finally:
            kill_group(old)
        answers = [f.result(timeout=120) for f in inflight]
    assert answers == [reference(probe, s) for s in (6, 7, 8)]
    assert wait_for(lambda: probe.status()["encode-0"]["restarts"] == restarts + 1, 30, 0.5)
    # Out of rotation until it is back: the log says so for good, /health only meanwhile.
    ejected = f"ejecting encode instance {probe.urls['encode-0']}"
    assert probe.wait_logged("proxy", proxy_at, ejected, 30)
    assert probe.health()[0] == 200  # E is optional: degraded, not unavailable
    for seed in (9, 10):
        assert ask(probe, seed, stream=seed == 10) == reference(probe, seed)
    row = wait_ready(probe, "encode-0", restarts + 1)
    assert row["pid"] != old
    key, _ = image(11)
    e_at, pd_at = probe.mark("encode-0"), probe.mark("pd-0")
    assert ask(probe, 11) == reference(probe, 11)
    assert probe.wait_logged("encode-0", e_at, f"Finish execute for mm hash {key}")
    assert probe.wait_logged("pd-0", pd_at, f"Success load encoder cache for hash {key}")


def _foreign_entry(run: TopologyRun, key: str, model_key: str) -> None:
    """Put an entry for `key` with another namespace in its header where PD will look."""
    from epdctl.cache._format import PAGE_BYTES, decode_header
    from epdctl.cache.store import Store

    ours = Store(run.cache_dir, run.state().namespace)
    data = Path(ours.entry_path(model_key)).read_bytes()
    header = decode_header(data[:PAGE_BYTES])
    other = Store(run.cache_dir, "someone-else").create()
    other.publish(key, data[header.data_offset:], dtype=header.dtype, shape=header.shape)
    os.replace(other.entry_path(key), ours.entry_path(key))
    shutil.rmtree(other.root, ignore_errors=True)


def test_store_full_and_foreign_entry(run: TopologyRun, probe: Probe) -> None:
    """E cannot save (tmpfs full, or its tmp dir is a file): answers stay right, PD encodes
    locally, E and PD live on; an entry from another namespace is not used. Then it heals."""
    from epdctl.cache.stats import read_stats
    from epdctl.cache.store import Store

    store = Store(run.cache_dir, run.state().namespace)
    full_key, _ = image(12)
    foreign_key, _ = image(13)
    model_key, _ = image(18)  # an entry of ours to copy, whatever ran before
    assert ask(probe, 18) == reference(probe, 18)
    assert store.has_entry(model_key)
    _foreign_entry(run, foreign_key, model_key)
    before = read_stats(store.root)[0]
    e_at, pd_at = probe.mark("encode-0"), probe.mark("pd-0")
    with broken_store(run):
        assert ask(probe, 12) == reference(probe, 12)
        assert ask(probe, 13, stream=True) == reference(probe, 13)
        assert probe.wait_logged("encode-0", e_at, f"EC store: could not save {full_key}")
        assert not store.has_entry(full_key)
        assert probe.wait_logged("pd-0", pd_at, f"Finish execute for mm hash {full_key}")
        assert probe.wait_logged("pd-0", pd_at, f"EC store miss for {foreign_key} (namespace")
        assert probe.logged("pd-0", pd_at, f"Finish execute for mm hash {foreign_key}")
    status = probe.status()
    assert all(r["state"] == "ready" for r in status.values()), status
    assert status["pd-0"]["restarts"] == 0
    key, _ = image(14)
    pd_at = probe.mark("pd-0")
    assert ask(probe, 14) == reference(probe, 14)
    assert store.has_entry(key)
    assert probe.wait_logged("pd-0", pd_at, f"Success load encoder cache for hash {key}")
    # Counters that could not be flushed while the store was full are written now.
    after = wait_for(lambda: (c := read_stats(store.root)[0])["invalid"] > before["invalid"]
                     and c["save_failures"] > before["save_failures"] and c, 10)
    assert after, read_stats(store.root)[0]


def _longest(probe: Probe) -> dict[str, Any]:
    """A text request that generates up to the context length (no EOS can end it early)."""
    request = body(MODEL, text="Tell me a long story.", ignore_eos=True)
    size = httpx.post(f"{probe.urls['pd-0']}/tokenize", json={
        "model": MODEL, "messages": request["messages"]}, timeout=30,
        headers={"authorization": f"Bearer {probe.key}"}).json()
    return {**request, "max_tokens": size["max_model_len"] - size["count"]}


def _until_content(lines: Iterator[str]) -> list[str]:
    """Lines up to the first event with content: the proxy has committed the stream."""
    head = []
    for line in lines:
        head.append(line)
        choices = json.loads(line[6:]).get("choices", []) if line.startswith("data: {") else []
        if any(c.get("delta", {}).get("content") for c in choices):
            return head
    raise AssertionError(f"the stream ended before any content: {head}")


def _error_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    return dict(reply.json()["error"])


def test_killed_pd(probe: Probe) -> None:
    """SIGKILL PD's group mid-answer: a committed stream ends with an error event (no [DONE]),
    a non-streamed request gets a JSON 502; new requests get a JSON 5xx at once, never a
    hang; the restart policy brings PD back and answers are right again."""
    url = f"{probe.proxy}/v1/chat/completions"
    old, proxy_at = probe.pid("pd-0"), probe.mark("proxy")
    restarts = {name: row["restarts"] for name, row in probe.status().items()}
    longest = _longest(probe)
    with ThreadPoolExecutor(1) as pool:
        # Killed at its first content: the answer has about MAX_MODEL_LEN tokens still to go.
        with httpx.stream("POST", url, json={**longest, "stream": True}, timeout=60) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            head = _until_content(lines)
            # Frozen first, so the non-streamed request is surely in flight when PD dies
            # (however fast this machine generates).
            kill_group(old, signal.SIGSTOP)
            plain = pool.submit(httpx.post, url, json=longest, timeout=60)
            assert wait_for(lambda: probe.health()[1].get("inflight") == 2, 30), probe.health()
            kill_group(old)
            tail = list(lines)
        events = [line for line in [*head, *tail] if line.startswith("data: ")]
        assert "data: [DONE]" not in events
        last = json.loads(events[-1].removeprefix("data: "))
        assert "error" in last and "prefill_decode" in last["error"]["message"], last
        lost = plain.result(timeout=60)
    assert lost.status_code == 502, lost.text
    assert _error_of(lost)["code"] == 502

    for request in (body(MODEL), body(MODEL, urls=(image(15)[1],), stream=True)):
        begin = time.monotonic()
        reply = httpx.post(url, json=request, timeout=60)
        assert reply.status_code in (502, 503), reply.text
        assert _error_of(reply)["message"]
        assert time.monotonic() - begin < 15
    # /health says 503 only until PD is back (seconds, on a fast machine): the log keeps it.
    ejected = f"ejecting prefill_decode instance {probe.urls['pd-0']}"
    assert probe.wait_logged("proxy", proxy_at, ejected, 30)
    assert wait_for(lambda: probe.status()["pd-0"]["restarts"] == restarts["pd-0"] + 1, 30, 0.5)

    row = wait_ready(probe, "pd-0", restarts["pd-0"] + 1)
    assert row["pid"] != old
    assert ask(probe, 16) == reference(probe, 16)
    assert ask(probe, 17, stream=True) == reference(probe, 17)
    after = {name: row["restarts"] for name, row in probe.status().items()}
    assert after == {**restarts, "pd-0": restarts["pd-0"] + 1}  # only what we killed


def test_down_leaves_nothing(run: TopologyRun) -> None:
    """Last: restarted instances included, no process or group, store or shm file is left."""
    check_down(run)
