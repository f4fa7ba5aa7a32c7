"""Overlap (`proxy.overlap: true`) in real vLLM (tiny LLaVA, cpu-demo E|PD through `up -d`):
requests that share an image while E encodes it make one E encode and no local encode, and a
hung E is answered by PD's local encode at the mark's deadline, inside the client's timeout.

E is held with SIGSTOP while the requests arrive, so "E is still encoding" is a fact the test
makes, not a race it hopes to win; the proxy ejects a stopped E only after three failed
health probes (about 6 s), long after the few requests here have arrived.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from epdctl.cache.store import Store
from tests.harness import (
    TopologyRun,
    cache_entry,
    edited_topology,
    proxy_counters,
    store_counters,
    store_root,
)
from tests.reliability.helpers import kill_group, wait_for
from tests.reliability.probe import Probe, answer, body, debug_logs, image, reference

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
MODEL = "tiny-llava"
ENCODE_TIMEOUT_S = 8
DECODE_TIMEOUT_S = 40  # the client gets a 504 past this: the local encode must come first


@pytest.fixture(scope="module")
def probe(tiny_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    tmp = tmp_path_factory.mktemp("overlap-engines")
    with store_root(tmp) as (cache_dir, is_small):

        def change(data: dict[str, Any]) -> None:
            debug_logs(data)  # the connector's "encoding locally" lines
            data["proxy"] = {**(data.get("proxy") or {}), "overlap": True,
                             "encode_timeout": ENCODE_TIMEOUT_S,
                             "decode_timeout": DECODE_TIMEOUT_S}
            if is_small:
                data["cache"]["capacity"] = "2MiB"  # the tmpfs is 4 MiB

        with edited_topology("cpu-demo", tmp, tiny_llava, cache_dir, change) as running:
            yield Probe(running)


def healthy(probe: Probe) -> None:
    """Both instances in, and the proxy has learned that LLaVA's E reports no metadata
    (until then an image waits for E: nothing would overlap)."""
    assert wait_for(lambda: probe.health()[1].get("status") == "ok", 60), probe.health()
    assert ask(probe, 100) == reference(probe, 100)




def ask(probe: Probe, seed: int, timeout_s: float = DECODE_TIMEOUT_S + 20) -> str:
    _, url = image(seed)
    return answer(probe.proxy, body(MODEL, urls=(url,)), timeout_s)


def waits(run: TopologyRun) -> tuple[int, int]:
    """PD's waits for pending items, and those that ran out (`cache inspect`)."""
    row = store_counters(run)
    return int(row["waits"]), int(row["expired"])


def key_hits(run: TopologyRun, key: str) -> int:
    entry = cache_entry(run, key)
    return int(entry["hits"]) if entry else 0


def test_requests_sharing_an_image_make_one_e_encode_and_no_local_encode(
        probe: Probe) -> None:
    healthy(probe)
    key, _ = image(1)
    expected = reference(probe, 1)
    run, pending = probe.run, probe.run.cache_dir / probe.run.state().namespace / "pending"
    counted, waited = proxy_counters(run), waits(run)
    e_at, pd_at = probe.mark("encode-0"), probe.mark("pd-0")
    encoder = probe.pid("encode-0")
    kill_group(encoder, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            replies = [pool.submit(ask, probe, 1) for _ in range(2)]
            # Both at PD (overlapped) while E, stopped, holds the one request for the image.
            assert wait_for(lambda: proxy_counters(run)["overlapped"]
                            == counted["overlapped"] + 2, 30), proxy_counters(run)
            assert [p.name for p in pending.iterdir()] == [Store.stem(key)]
            # ... and PD's scheduler is deferring both (its counters flush once a second):
            # thawed sooner, E may save before PD looks, and PD would never wait at all.
            assert wait_for(lambda: waits(run)[0] >= waited[0] + 2, ENCODE_TIMEOUT_S / 2), \
                waits(run)
            assert not any(r.done() for r in replies), "answered without E's entry"
            kill_group(encoder, signal.SIGCONT)
            assert [r.result(timeout=DECODE_TIMEOUT_S) for r in replies] == [expected] * 2
    finally:
        kill_group(encoder, signal.SIGCONT)
    now = proxy_counters(run)
    assert now["sent"] - counted["sent"] == 1  # one item to E, for both requests
    assert probe.wait_logged("encode-0", e_at, f"Finish execute for mm hash {key}")
    assert probe.run.log("encode-0")[e_at:].count(f"Finish execute for mm hash {key}") == 1
    # PD waited for the entry both times and took it from the store (a hit each), never
    # encoding the image itself (the connector logs each local encode and each wait that
    # ran out). Only these two requests use this image; the counters flush once a second.
    assert wait_for(lambda: key_hits(run, key) >= 2), key_hits(run, key)
    assert key_hits(run, key) == 2
    assert wait_for(lambda: waits(run)[0] >= waited[0] + 2), waits(run)
    assert waits(run) == (waited[0] + 2, waited[1])
    pd_log = probe.run.log("pd-0")[pd_at:]
    assert f"EC store miss for {key}" not in pd_log and "did not arrive" not in pd_log
    assert wait_for(lambda: not any(pending.iterdir()), 10), "the mark outlived E's answer"


def test_a_hung_encoder_is_answered_by_a_local_encode_before_the_clients_timeout(
        probe: Probe) -> None:
    """E stops with the request at E and PD: PD waits until the mark's deadline (the proxy's
    encode timeout), encodes the image itself and answers well inside the decode timeout."""
    healthy(probe)
    key, _ = image(2)
    expected = reference(probe, 2)
    pd_at = probe.mark("pd-0")
    encoder = probe.pid("encode-0")
    kill_group(encoder, signal.SIGSTOP)
    try:
        begin = time.monotonic()
        text = ask(probe, 2, timeout_s=DECODE_TIMEOUT_S)  # a 504 (or no answer) fails here
        took = time.monotonic() - begin
    finally:
        kill_group(encoder, signal.SIGCONT)
    assert text == expected
    assert ENCODE_TIMEOUT_S * 0.9 <= took < DECODE_TIMEOUT_S, took
    assert probe.logged("pd-0", pd_at, f"EC entry {key} did not arrive while")
