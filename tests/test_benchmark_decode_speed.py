"""benchmarks/decode_speed.py: its arms are PD's planned argv with our connector, without
one, with vLLM's example consumer, and without one plus --enable-mm-embeds, and nothing else
differs (the benchmark itself needs real vLLM)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from epdctl.launch.plan import plan
from epdctl.topology.model import load_topology

ROOT = Path(__file__).parent.parent
BENCH = ROOT / "benchmarks" / "decode_speed.py"


def test_the_arms_differ_only_in_the_connector_or_the_embeds_flag(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("decode_speed", BENCH)
        assert spec is not None and spec.loader is not None
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(BENCH.parent))
    topology = load_topology(ROOT / "topologies" / "cpu-demo.yaml")
    (pd,) = [s for s in plan(topology, tmp_path, cpu_count=2).specs if s.name == "pd-0"]
    ours = bench.arm_argv(pd.argv, 9001, "ours", "/dev/shm/private")
    none = bench.arm_argv(pd.argv, 9002, "none", "/dev/shm/private")
    example = bench.arm_argv(pd.argv, 9001, "example", "/dev/shm/private")
    embeds = bench.arm_argv(pd.argv, 9001, "embeds", "/dev/shm/private")
    at = ours.index("--ec-transfer-config")
    config = json.loads(ours[at + 1])
    assert config["ec_role"] == "ec_consumer"
    assert config["ec_connector_extra_config"]["store_dir"] == "/dev/shm/private"
    assert "--ec-transfer-config" not in none
    assert ours[ours.index("--port") + 1] == "9001" and none[none.index("--port") + 1] == "9002"
    none[none.index("--port") + 1] = "9001"
    assert ours[:at] + ours[at + 2:] == none  # the same instance, less its connector
    other = json.loads(example[at + 1])
    assert (other["ec_connector"], other["ec_role"]) == ("ECExampleConnector", "ec_consumer")
    assert example[:at] + example[at + 2:] == none
    assert embeds == [*none, "--enable-mm-embeds"]


def _load(name: str):  # type: ignore[no-untyped-def]
    path = BENCH.parent / f"{name}.py"
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH.parent))


def test_the_median_interval_is_the_binomial_order_statistics() -> None:
    median_interval = _load("decode_speed").median_interval
    # n=20: the 6th and 15th of 20 (P(X <= 5) = 2.1 %, P(X <= 6) = 5.8 % for binomial(20, .5)).
    assert median_interval([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few: the whole range
    assert median_interval([float(x) for x in range(1, 7)]) == (1.0, 6.0)
    assert median_interval([float(x) for x in range(1, 10)]) == (2.0, 8.0)


def test_connector_step_runs_both_consumers_and_leaves_nothing(capsys, monkeypatch) -> None:
    import os

    bench = _load("connector_step")
    def ours() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith("epdctl-bench-step-")}

    before = ours()
    monkeypatch.setattr(sys, "argv", ["connector_step", "--steps", "50", "--repeats", "1"])
    bench.main()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = dict(item.split("=") for item in last.split())
    assert set(figures) == {"ours_step_us", "ours_speed_left", "example_step_us",
                            "example_speed_left"}
    assert all(float(v) > 0 for v in figures.values())
    assert ours() == before
