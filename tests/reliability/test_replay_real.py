"""No request lost when PD dies (real vLLM, tiny LLaVA, cpu-demo E|PD with two PD replicas,
`restart: on-failure`), temperature 0:

1. pd-0 SIGKILLed under 12 concurrent image requests, half streamed: requests waiting or
   half answered go on at pd-1, and every answer equals the aggregated one (streams by the
   text their deltas add up to), none lost.
2. Both PDs SIGKILLed under 12 more: no instance is healthy, as with one PD; the requests
   wait for the restarted ones (inside `proxy.replay_wait`) and again all answer exactly.

The aggregated answers: PD itself with the image under a uuid of its own (it encodes
locally; test_engine_faults checks that equals the E path), streamed and not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.topology_run import TopologyRun, check_down
from tests.reliability.helpers import kill_group, wait_for
from tests.reliability.realrun import Probe, body, image, store_root, topology

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
REQUESTS = 12
MAX_TOKENS = 160
REPLAY_WAIT_S = 400  # a loaded 2-core CI machine restarts PD in about a minute
RESTART_READY_S = 400
SEEDS = range(1, REQUESTS + 1)


@pytest.fixture(scope="module")
def run(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TopologyRun]:
    tmp = tmp_path_factory.mktemp("replay")
    with store_root(tmp) as (cache_dir, is_small):

        def change(data: dict[str, Any]) -> None:
            args = data["engine"]["args"]
            args[args.index("--max-model-len") + 1] = "1024"
            args[args.index("--max-num-seqs") + 1] = str(REQUESTS)  # none queued at PD
            data["roles"]["prefill_decode"]["replicas"] = 2
            data["restart"] = {"policy": "on-failure", "max_restarts": 3, "backoff": "1s"}
            data["proxy"]["replay_wait"] = f"{REPLAY_WAIT_S}s"
            if is_small:
                data["cache"]["capacity"] = "2MiB"  # the tmpfs is 4 MiB

        with topology("cpu-demo", tmp, tiny_llava, cache_dir, change) as running:
            yield running


@pytest.fixture(scope="module")
def probe(run: TopologyRun) -> Probe:
    return Probe(run)


def request(seed: int, **extra: Any) -> dict[str, Any]:
    return body(MODEL, urls=(image(seed)[1],), max_tokens=MAX_TOKENS, ignore_eos=True,
                **extra)


def pieces(base: str, req: dict[str, Any], started: list[int] | None = None,
           seed: int = 0, key: str | None = None) -> list[str]:
    """A stream's content deltas, one per token; it must end with [DONE] and no error
    (`key`: an instance wants the run's internal key)."""
    out: list[str] = []
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**req, "stream": True},
                      timeout=REPLAY_WAIT_S + 120, headers=headers) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
        for line in lines:
            if line == "data: [DONE]":
                break
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            for choice in event["choices"]:
                if choice["delta"].get("content") is not None and "role" not in choice["delta"]:
                    out.append(choice["delta"]["content"])
                    if started is not None and seed not in started:
                        started.append(seed)
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    return out


def whole(base: str, req: dict[str, Any], key: str | None = None) -> str:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    reply = httpx.post(f"{base}/v1/chat/completions", json=req, timeout=REPLAY_WAIT_S + 120,
                       headers=headers)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


REFERENCE: dict[int, tuple[str, list[str]]] = {}


def reference(probe: Probe, seed: int) -> tuple[str, list[str]]:
    """The aggregated answer for image `seed`: whole, and streamed token by token."""
    if seed not in REFERENCE:
        key = image(seed)[0]
        req = {**request(seed), "messages": body(MODEL, urls=(image(seed)[1],),
                                                 uuid_=f"ref-{key}")["messages"]}
        pd = probe.urls["pd-0"]
        REFERENCE[seed] = (whole(pd, req, probe.key), pieces(pd, req, key=probe.key))
    return REFERENCE[seed]


def running(probe: Probe, name: str) -> float:
    """Requests instance `name` is running now (vLLM's `vllm:num_requests_running`)."""
    reply = httpx.get(f"{probe.urls[name]}/metrics", timeout=10,
                      headers={"authorization": f"Bearer {probe.key}"})
    return sum(float(line.rsplit(" ", 1)[1]) for line in reply.text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def under_load(probe: Probe, kill: list[str]) -> tuple[dict[int, Any], float]:
    """12 requests (even seeds streamed); once every stream has begun, SIGKILL `kill`.
    Every answer, and the seconds from the kill to the last one."""
    started: list[int] = []
    with ThreadPoolExecutor(REQUESTS) as pool:
        futures: dict[int, Future[Any]] = {}
        for seed in SEEDS:
            if seed % 2 == 0:
                futures[seed] = pool.submit(pieces, probe.proxy, request(seed), started, seed)
            else:
                futures[seed] = pool.submit(whole, probe.proxy, request(seed))
        streams = REQUESTS // 2
        # Killed once every stream has begun (or one request is already done) and every PD
        # to kill has requests running (its own gauge, seen, not a duration): some are half
        # answered (the test checks that some stream was resumed), some never began.
        assert wait_for(lambda: len(started) == streams
                        or any(f.done() for f in futures.values()), 300), started
        assert wait_for(lambda: all(running(probe, name) > 0 for name in kill), 60), \
            {name: running(probe, name) for name in kill}
        pids = [probe.pid(name) for name in kill]
        killed_at = time.monotonic()
        for pid in pids:
            kill_group(pid)
        answers = {seed: f.result(timeout=REPLAY_WAIT_S + 300) for seed, f in futures.items()}
    return answers, time.monotonic() - killed_at


def check_exact(probe: Probe, answers: dict[int, Any]) -> None:
    """Every answer equals the aggregated one; a stream's text, delta after delta, too
    (vLLM merges deltas a slow reader has not taken yet, so chunks may hold several tokens,
    and differ from run to run: only the text they add up to is the answer)."""
    for seed, got in answers.items():
        text, stream = reference(probe, seed)
        if seed % 2 == 0:
            assert "".join(got) == "".join(stream) == text, seed
        else:
            assert got == text, seed


def wait_ready(probe: Probe, restarts: dict[str, int]) -> None:
    for name, count in restarts.items():
        assert wait_for(lambda n=name, c=count: (r := probe.status()[n])["state"] == "ready"
                        and r["restarts"] == c, RESTART_READY_S, 1.0), probe.status()[name]
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 60), probe.health()


def replays(probe: Probe, since: int) -> tuple[int, int]:
    """Replays before the first byte and resumed streams the proxy logged since `since`."""
    log = probe.run.log("proxy")[since:]
    return log.count(" replay "), log.count(" resume ")


def test_references(probe: Probe) -> None:
    """The references, before any fault; the proxy's answers equal them."""
    with ThreadPoolExecutor(REQUESTS) as pool:
        list(pool.map(lambda seed: reference(probe, seed), SEEDS))
    assert whole(probe.proxy, request(1)) == reference(probe, 1)[0]
    assert "".join(pieces(probe.proxy, request(2))) == "".join(reference(probe, 2)[1])
    assert len({reference(probe, s)[0] for s in SEEDS}) > 1


@pytest.mark.xfail(strict=False, reason=(
    "issue 28, open: the kill is timed against requests in flight (on a fast or idle "
    "machine they may all be done first), and pd-0's restart after both were killed was not "
    "seen within replay_wait in one run"))
def test_one_of_two_pds_killed(probe: Probe) -> None:
    at = probe.mark("proxy")
    restarts = {n: r["restarts"] for n, r in probe.status().items()}
    answers, took_s = under_load(probe, ["pd-0"])
    check_exact(probe, answers)
    replayed, resumed = replays(probe, at)
    print(f"\none PD of two killed: all {REQUESTS} answered exactly; {replayed} replayed, "
          f"{resumed} streams resumed; the last answer {took_s:.1f}s after the kill")
    assert resumed >= 1, probe.run.log("proxy")[at:]
    metrics = httpx.get(f"{probe.proxy}/metrics", timeout=10).text
    assert 'epdctl_proxy_replays_total{outcome="ok",stage="prefill_decode"}' in metrics
    wait_ready(probe, {"pd-0": restarts["pd-0"] + 1})


@pytest.mark.xfail(strict=False, reason=(
    "issue 28, open: the kill is timed against requests in flight (on a fast or idle "
    "machine they may all be done first), and pd-0's restart after both were killed was not "
    "seen within replay_wait in one run"))
def test_no_pd_left_waits_for_the_restart(probe: Probe) -> None:
    at = probe.mark("proxy")
    restarts = {n: r["restarts"] for n, r in probe.status().items()}
    answers, took_s = under_load(probe, ["pd-0", "pd-1"])
    check_exact(probe, answers)
    replayed, resumed = replays(probe, at)
    print(f"\nevery PD killed: all {REQUESTS} answered exactly after the restart; "
          f"{replayed} replayed, {resumed} streams resumed; the last answer {took_s:.1f}s "
          "after the kill")
    assert replayed + resumed >= 1  # they did wait for the restart (not one was lost)
    wait_ready(probe, {"pd-0": restarts["pd-0"] + 1, "pd-1": restarts["pd-1"] + 1})


def test_down_leaves_nothing(run: TopologyRun) -> None:
    check_down(run)
