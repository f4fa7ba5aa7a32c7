"""benchmarks/decode_speed.py: its arms are PD's planned argv with our connector, without
one, with vLLM's example consumer, and without one plus --enable-mm-embeds, and nothing else
differs (the benchmark itself needs real vLLM)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from epdctl.plan import plan
from epdctl.topology import load_topology

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
