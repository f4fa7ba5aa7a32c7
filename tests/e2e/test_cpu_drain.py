"""`epdctl down --drain` on topologies/cpu-demo.yaml for real (tiny LLaVA, E|PD): twelve
image requests streamed at temperature 0, all in flight when `down` begins, are answered
whole, each equal to the aggregated server's answer; one that comes during the drain gets the
proxy's JSON 503; then nothing of the run is left.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.baselines import Baselines
from tests.harness import edit_topology, leftovers, topology_up, wait_for, write_topology
from tests.reliability.probe import answer, body, image, streamed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
REQUESTS = 12
MAX_TOKENS = 600
"""cpu-demo.yaml serves 4 sequences at a time: twelve such streams take three rounds of
decoding of seconds each, so they are all in flight (at PD or waiting for it) together."""


def longer(data: dict[str, Any]) -> None:
    """Room for MAX_TOKENS after the image's prompt (as test_replay_real)."""
    args = data["engine"]["args"]
    args[args.index("--max-model-len") + 1] = "1024"


def request(seed: int) -> dict[str, Any]:
    return body(MODEL, urls=(image(seed)[1],), max_tokens=MAX_TOKENS, ignore_eos=True)


def inflight(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/health", timeout=5).json().get("inflight", -1))
    except (httpx.HTTPError, ValueError):
        return -1


def test_down_drains_twelve_streams_whole(tiny_llava: Path, baselines: Baselines,
                                          tmp_path: Path) -> None:
    baseline = baselines.start(tiny_llava, ("--max-model-len", "1024"))
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    edit_topology(path, longer)
    with topology_up(path, cache_dir, tmp_path / "state", baseline=baseline) as run:
        expected = [answer(baseline.url, {**request(seed), "model": baseline.model})
                    for seed in range(REQUESTS)]
        url = run.proxy_url
        cli = [sys.executable, "-m", "epdctl", "--state-dir", str(run.state_root)]
        with ThreadPoolExecutor(REQUESTS) as pool:
            streams = [pool.submit(streamed, url, request(seed), 600)
                       for seed in range(REQUESTS)]
            is_all = wait_for(lambda: inflight(url) == REQUESTS, 120, 0.05)
            assert is_all, (inflight(url), [s.exception() for s in streams if s.done()])
            down = subprocess.Popen([*cli, "down", "--drain", "120"], env=run.env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                assert wait_for(lambda: _status(url) == "draining", 60, 0.05)
                refused = httpx.post(f"{url}/v1/chat/completions", json=request(99),
                                     timeout=30)
                texts = [s.result(timeout=600) for s in streams]
                _, err = down.communicate(timeout=300)
            finally:
                down.kill()
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        assert "draining" in refused.json()["error"]["message"]
        assert down.returncode == 0, err
        assert f"Drained {run.name}: {REQUESTS} request(s) finished." in err, err
        assert texts == expected
        assert leftovers(run) == []


def _status(url: str) -> str:
    try:
        return str(httpx.get(f"{url}/health", timeout=5).json().get("status"))
    except (httpx.HTTPError, ValueError):
        return ""
