"""No request lost when PD dies (real vLLM, tiny LLaVA, cpu-demo E|PD with two PD replicas,
`restart: on-failure`), temperature 0:

1. One PD SIGKILLed under 12 concurrent image requests, half streamed: requests waiting or
   half answered go on at the other, and every answer equals the aggregated one (streams by
   the text their deltas add up to), none lost.
2. Both PDs SIGKILLed under 12 more: no instance is healthy, as with one PD; the requests
   wait for the restarted ones (inside `proxy.replay_wait`) and again all answer exactly.

A kill lands when a stream is under way (seen, not timed: its client has its first tokens
and more to come), on the PD whose own log names the stream's id: the proxy chooses where
each request goes, the test only which PD serves a stream. The PDs are frozen while the
stream and the logs are looked at (the window is short). Each test
first waits for every instance to be ready, whatever the one before left.

The aggregated answers: PD itself with the image under a uuid of its own (it encodes
locally; test_engine_faults checks that equals the E path), streamed and not.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import TopologyRun, check_down, edited_topology, store_root
from tests.reliability.helpers import kill_group, wait_for
from tests.reliability.probe import Probe, body, image

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
REQUESTS = 12
MAX_TOKENS = 600
"""Long enough that a stream is under way for a second or more (the tiny model decodes a
token in a few ms): the kill lands while some stream is half sent."""
UNDER_WAY = 200
"""Tokens a stream still has to come for the kill to land inside it: more than can be on
their way (in sockets, in the proxy) when its PD is frozen. Counted by the usage every
chunk carries (`continuous_usage_stats`): a chunk may hold many tokens (vLLM merges the
deltas of a reader that lags), so the chunks a client has say little of how far PD is."""
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

        with edited_topology("cpu-demo", tmp, tiny_llava, cache_dir, change) as running:
            yield running


@pytest.fixture(scope="module")
def probe(run: TopologyRun) -> Probe:
    return Probe(run)


def request(seed: int, **extra: Any) -> dict[str, Any]:
    return body(MODEL, urls=(image(seed)[1],), max_tokens=MAX_TOKENS, ignore_eos=True,
                **extra)


USAGE = {"include_usage": True, "continuous_usage_stats": True}


def pieces(base: str, req: dict[str, Any], started: dict[int, list[Any]] | None = None,
           seed: int = 0, key: str | None = None) -> list[str]:
    """A stream's content deltas; it must end with [DONE] and no error, and its usage count
    every token (`key`: an instance wants the run's internal key). `started[seed]`: the
    stream's id and the tokens it has had so far, once it has one."""
    out: list[str] = []
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", f"{base}/v1/chat/completions",
                      json={**req, "stream": True, "stream_options": USAGE},
                      timeout=REPLAY_WAIT_S + 120, headers=headers) as reply:
        assert reply.status_code == 200, reply.read()
        lines = []
        tokens = 0
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if line == "data: [DONE]":
                break
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            for choice in event["choices"]:
                if choice["delta"].get("content") is not None and "role" not in choice["delta"]:
                    out.append(choice["delta"]["content"])
                    if started is not None:
                        started[seed] = [event["id"], tokens]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    assert tokens == MAX_TOKENS, (tokens, lines[-3:])
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


def under_load(probe: Probe, count: int) -> tuple[dict[int, Any], float, list[str]]:
    """12 requests (even seeds streamed); SIGKILL `count` of the two PDs once a stream one
    of them serves is under way (its client has its first tokens, and UNDER_WAY more are to
    come; that PD's own log names the stream's id): that PD first. Every answer, the seconds
    from the kill to the last, and the PDs killed.

    The window is a second or two of decoding, no longer than a look at the logs on a
    loaded machine: once a stream is under way, both PDs are frozen (SIGSTOP), the stream
    and the logs looked at while nothing moves, and thawed to try again if the moment has
    passed. Which PD serves which request is the proxy's choice: the one serving a stream
    under way is the one killed."""
    started: dict[int, list[Any]] = {}
    pds = ["pd-0", "pd-1"]
    pids = {name: probe.pid(name) for name in pds}
    killed: list[str] = []
    with ThreadPoolExecutor(REQUESTS) as pool:
        futures: dict[int, Future[Any]] = {}
        for seed in SEEDS:
            if seed % 2 == 0:
                futures[seed] = pool.submit(pieces, probe.proxy, request(seed), started, seed)
            else:
                futures[seed] = pool.submit(whole, probe.proxy, request(seed))

        def under_way() -> list[str]:
            return [rid for seed, (rid, count) in list(started.items())
                    if count < MAX_TOKENS - UNDER_WAY and not futures[seed].done()]

        looks: list[int] = []  # streams under way at each frozen look, for a failure's message

        def signal_all(sig: signal.Signals, names: list[str] = pds) -> None:
            for name in names:
                kill_group(pids[name], sig)

        def is_time() -> bool:
            if not under_way():
                return False
            signal_all(signal.SIGSTOP)
            rids = under_way()
            looks.append(len(rids))
            serving = [name for name in pds
                       if any(f"Received request {rid}:" in probe.run.log(name) for rid in rids)]
            if serving:
                killed.extend((serving + [n for n in pds if n not in serving])[:count])
                return True
            signal_all(signal.SIGCONT)
            return False

        try:
            assert wait_for(is_time, 300, 0.02), (started, looks)
        except BaseException:
            signal_all(signal.SIGCONT)
            raise
        killed_at = time.monotonic()
        signal_all(signal.SIGKILL, killed)
        signal_all(signal.SIGCONT, [n for n in pds if n not in killed])
        try:
            answers = {seed: f.result(timeout=REPLAY_WAIT_S + 300)
                       for seed, f in futures.items()}
        except AssertionError as exc:  # what the proxy said of its replays tells the most
            said = [line for line in probe.run.log("proxy").splitlines() if " WARNING " in line]
            raise AssertionError(f"{exc}\nkilled {killed}; the proxy's warnings:\n"
                                 + "\n".join(said[-40:])) from exc
    return answers, time.monotonic() - killed_at, killed


def check_exact(probe: Probe, answers: dict[int, Any]) -> None:
    """Every answer equals the aggregated one; a stream's text, delta after delta, too
    (vLLM merges deltas a slow reader has not taken yet, so chunks may hold several tokens,
    and differ from run to run: only the text they add up to is the answer).

    What a resume promises is the text sent before the break, then the greedy continuation
    of that prefix, with no token repeated or dropped. The tiny model makes every greedy
    choice decisive (epdctl.dev._weights.make_decisive: the input's two choices lead by
    >= 0.034 logits, each later token by >= 25, against float noise of ~1e-5 between batch
    shapes and a prefix prefilled at once or decoded token by token), so the continuation
    of any prefix of the aggregated answer is the rest of that answer: equality with it is
    that promise, and a resume that repeats or drops one token fails it."""
    for seed, got in answers.items():
        text, stream = reference(probe, seed)
        if seed % 2 == 0:
            assert "".join(got) == "".join(stream) == text, seed
        else:
            assert got == text, seed


def wait_ready(probe: Probe, restarts: dict[str, int]) -> None:
    for name, count in restarts.items():
        is_back = wait_for(lambda n=name, c=count: (r := probe.status()[n])["state"] == "ready"
                           and r["restarts"] == c, RESTART_READY_S, 1.0)
        assert is_back, json.dumps(probe.status()[name])  # in full: the state is what tells
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 60), probe.health()


def replays(probe: Probe, since: int, least: int = 1) -> tuple[int, int, str]:
    """Replays before the first byte and resumed streams the proxy logged since `since`,
    once at least `least` of them are in its log (lines come through the log relay), and
    how the streams went on ("after" the text sent, or generated "again, less" it)."""
    def counts() -> tuple[int, int]:
        log = probe.run.log("proxy")[since:]
        return log.count(" replay "), log.count(" resume ")

    wait_for(lambda: sum(counts()) >= least, 30)
    hows = re.findall(r" resume \d+ (after|again, less) ", probe.run.log("proxy")[since:])
    return (*counts(), ", ".join(f"{hows.count(h)} {h}" for h in sorted(set(hows))) or "-")


def all_ready(probe: Probe) -> dict[str, int]:
    """Every instance ready and the proxy's health ok (whatever an earlier test left); the
    restarts of each so far."""
    assert wait_for(lambda: all(r["state"] == "ready" for r in probe.status().values()),
                    RESTART_READY_S, 1.0), probe.status()
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 60), probe.health()
    return {n: r["restarts"] for n, r in probe.status().items()}


def test_references(probe: Probe) -> None:
    """The references, before any fault; the proxy's answers equal them."""
    with ThreadPoolExecutor(REQUESTS) as pool:
        list(pool.map(lambda seed: reference(probe, seed), SEEDS))
    assert whole(probe.proxy, request(1)) == reference(probe, 1)[0]
    assert "".join(pieces(probe.proxy, request(2))) == "".join(reference(probe, 2)[1])
    assert len({reference(probe, s)[0] for s in SEEDS}) > 1


KILLS = 2
"""Kills test_one_of_two_pds_killed may take to land inside a stream. The stream it aims at
had UNDER_WAY tokens to come at the client, but a PD on a fast CPU may have sent them all
before it froze (into loopback sockets that hold megabytes): its streams then end whole,
none resumed, and one is killed again once it is back (the module's kills stay within the
topology's max_restarts: at most three of one PD)."""


def test_one_of_two_pds_killed(probe: Probe) -> None:
    for kill in range(1, KILLS + 1):
        restarts = all_ready(probe)
        at = probe.mark("proxy")
        answers, took_s, [pd] = under_load(probe, 1)
        check_exact(probe, answers)
        replayed, resumed, hows = replays(probe, at)
        print(f"\none PD of two killed ({pd}, kill {kill}): all {REQUESTS} answered exactly; "
              f"{replayed} replayed, {resumed} streams resumed ({hows}); the last answer "
              f"{took_s:.1f}s after the kill")
        wait_ready(probe, {pd: restarts[pd] + 1})
        if resumed:
            break
    assert resumed >= 1, probe.run.log("proxy")[at:]
    metrics = httpx.get(f"{probe.proxy}/metrics", timeout=10).text
    assert 'epdctl_proxy_replays_total{outcome="ok",stage="prefill_decode"}' in metrics


def test_no_pd_left_waits_for_the_restart(probe: Probe) -> None:
    restarts = all_ready(probe)
    at = probe.mark("proxy")
    answers, took_s, _ = under_load(probe, 2)
    check_exact(probe, answers)
    replayed, resumed, hows = replays(probe, at)
    print(f"\nevery PD killed: all {REQUESTS} answered exactly after the restart; "
          f"{replayed} replayed, {resumed} streams resumed ({hows}); the last answer "
          f"{took_s:.1f}s after the kill")
    assert replayed + resumed >= 1  # they did wait for the restart (not one was lost)
    wait_ready(probe, {"pd-0": restarts["pd-0"] + 1, "pd-1": restarts["pd-1"] + 1})


def test_restart_one_pd_under_load_answers_every_request_exactly(probe: Probe) -> None:
    """`epdctl restart pd-0` while the 12 requests (half streamed) are under way: pd-0 gets
    nothing new (pd-1 takes it), finishes what it has, restarts and is taken back; every
    answer equals the aggregated one, none lost, and the restart is not counted as a crash."""
    restarts = all_ready(probe)
    before = probe.pid("pd-0")
    with ThreadPoolExecutor(REQUESTS) as pool:
        futures = {seed: pool.submit(pieces if seed % 2 == 0 else whole, probe.proxy,
                                     request(seed)) for seed in SEEDS}
        assert wait_for(lambda: probe.health()[1].get("inflight", 0) >= REQUESTS // 2, 120,
                        0.05), probe.health()
        done = probe.run.cli("restart", "pd-0", "--drain", "120", "--json",
                             timeout_s=RESTART_READY_S + 200)
        answers = {seed: f.result(timeout=REPLAY_WAIT_S + 300) for seed, f in futures.items()}
    assert done.returncode == 0, done.stderr
    [restarted] = json.loads(done.stdout)["restarted"]
    check_exact(probe, answers)
    print(f"\npd-0 restarted under load in {restarted['seconds']}s: all {REQUESTS} answered "
          f"exactly; {restarted['finished']} finished on pd-0 while it drained, "
          f"{restarted['cut']} cut")
    status = probe.status()
    assert probe.pid("pd-0") != before and status["pd-0"]["state"] == "ready"
    assert status["pd-0"]["restarts"] == restarts["pd-0"]  # asked for: not a crash
    assert restarted["cut"] == 0
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 60), probe.health()


def test_down_leaves_nothing(run: TopologyRun) -> None:
    check_down(run)
