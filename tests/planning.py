"""Shared by the plan tests: a demo topology planned on a fixed, fake machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epdctl.launch.plan import LaunchSpec, Plan, flag_value, plan
from epdctl.topology.model import Topology, load_topology, parse_topology

ROOT = Path(__file__).parent.parent
SHIPPED = sorted((ROOT / "topologies").glob("*.yaml"))
STATE = Path("/state/demo")
GPUS = ["0", "1", "2", "3", "4", "5"]
PY = "/opt/py/bin/python"
VLLM = "0.33.0"
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


def demo_topology(roles: dict, **extra: Any) -> Topology:
    return parse_topology({"name": "demo", "model": MODEL, "roles": roles, **extra})


def demo_plan(topology: Topology, **kw: Any) -> Plan:
    kw = {"visible_gpus": GPUS, "vllm_version": VLLM, "python": PY, "cpu_count": 16, **kw}
    return plan(topology, STATE, **kw)


def json_flag(spec: LaunchSpec, flag: str) -> dict | None:
    value = flag_value(spec.argv, flag)
    return None if value is None else json.loads(value)


def load_shipped(path: Path) -> Topology:
    try:
        return load_topology(path)
    except Exception as exc:  # a CPU topology may name a model built by a set-up step
        pytest.skip(f"{path.name} does not load here: {exc}")
