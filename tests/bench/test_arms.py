"""Arm derivation for every shipped topology: which devices each arm gets, TP kept, CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epdctl.bench.arms import aggregated, derive_arms, devices, image_limit, max_model_len
from epdctl.errors import BenchError
from epdctl.launch.plan import plan
from epdctl.topology.model import Topology, parse_topology
from epdctl.topology.yamlfile import read_yaml

TOPOLOGIES = sorted((Path(__file__).parents[2] / "topologies").glob("*.yaml"))
GPUS = [str(i) for i in range(8)]


def load(path: Path) -> Topology:
    # parse, not load: the CPU topologies' tiny models need not exist on this machine
    return parse_topology(read_yaml(path), str(path))


def placed(topology: Topology) -> dict[str, tuple[str, ...]]:
    """instance -> the devices plan() gives it."""
    result = plan(topology, Path("/state"), visible_gpus=GPUS, vllm_version="0.32.0", cpu_count=2)
    return {s.name: s.gpus for s in result.instances}


def test_every_shipped_topology_is_covered() -> None:
    assert len(TOPOLOGIES) == 11


# name -> (EPD instance -> GPUs, aggregated instance -> GPUs, aggregated TP)
EXPECTED = {
    "qwen2_5-vl-1e1pd.yaml": (
        {"encode-0": ("0",), "pd-0": ("1",)}, {"pd-0": ("0",), "pd-1": ("1",)}, 1),
    "qwen2_5-vl-1e1p1d.yaml": (
        {"encode-0": ("0",), "prefill-0": ("1",), "decode-0": ("2",)},
        {"pd-0": ("0",), "pd-1": ("1",), "pd-2": ("2",)}, 1),
    "qwen2_5-vl-2e2pd-tp2.yaml": (
        {"encode-0": ("0",), "encode-1": ("1",), "pd-0": ("2", "3"), "pd-1": ("4", "5")},
        {"pd-0": ("0", "1"), "pd-1": ("2", "3"), "pd-2": ("4", "5")}, 2),
    "qwen2_5-vl-shared-gpu.yaml": (
        {"encode-0": ("0",), "pd-0": ("0",)}, {"pd-0": ("0",)}, 1),
}


@pytest.mark.parametrize("path", TOPOLOGIES, ids=lambda p: p.name)
def test_aggregated_arm_gets_the_topologys_devices(path: Path) -> None:
    topology = load(path)
    arms = derive_arms(topology, path)
    assert [a.name for a in arms] == ["epd", "aggregated"]
    epd, agg = arms
    assert epd.topology is topology
    base = agg.topology
    assert set(base.roles) == {"prefill_decode"} and base.mode == "pd"
    assert base.name == f"{topology.name}-agg" and base.model == topology.model
    assert base.proxy == topology.proxy and base.engine == topology.engine
    pd = base.roles["prefill_decode"]
    if topology.device == "cpu":
        # as many instances as the topology, all of them prefill+decode, no GPUs
        assert pd.replicas == sum(r.replicas for r in topology.roles.values())
        assert pd.gpus is None and pd.tensor_parallel == 1
        assert all(g == () for g in placed(base).values())
        return
    mine, theirs, tp = EXPECTED[path.name]
    assert placed(topology) == mine
    assert placed(base) == theirs
    assert pd.tensor_parallel == tp
    used = {g for gs in mine.values() for g in gs}
    assert {g for gs in theirs.values() for g in gs} == used


def test_shared_gpu_baseline_gets_what_both_roles_had() -> None:
    topology = load(next(p for p in TOPOLOGIES if p.name == "qwen2_5-vl-shared-gpu.yaml"))
    base, _ = aggregated(topology)
    assert base.roles["prefill_decode"].gpu_memory_utilization == 0.9  # 0.15 + 0.75


def test_epd_baseline_keeps_the_larger_tp_and_prefills_args() -> None:
    topology = parse_topology({
        "name": "x", "model": "m", "roles": {
            "encode": {"gpus": [0]},
            "prefill": {"gpus": [1, 2], "tensor_parallel": 2, "args": ["--max-num-seqs", "8"]},
            "decode": {"gpus": [3]}}})
    base, notes = aggregated(topology)
    pd = base.roles["prefill_decode"]
    assert (pd.replicas, pd.tensor_parallel, pd.gpus) == (2, 2, [0, 1, 2, 3])
    assert pd.args == ["--max-num-seqs", "8"]
    assert notes == ("2 prefill+decode replica(s) x tensor_parallel 2 on 4 GPU(s)",)


def test_leftover_gpus_are_noted() -> None:
    topology = parse_topology({"name": "x", "model": "m", "roles": {
        "encode": {"gpus": [0]}, "prefill_decode": {"gpus": [1, 2], "tensor_parallel": 2}}})
    base, notes = aggregated(topology)
    assert base.roles["prefill_decode"].gpus == [0, 1]
    assert "GPU 2 left unused" in notes[1]


def test_counted_gpus_stay_counts() -> None:
    topology = parse_topology({"name": "x", "model": "m", "roles": {
        "encode": {}, "prefill_decode": {"replicas": 2}}})
    assert devices(topology) == ([], 3)
    base, _ = aggregated(topology)
    assert base.roles["prefill_decode"].gpus == 3
    assert placed(base) == {"pd-0": ("0",), "pd-1": ("1",), "pd-2": ("2",)}


@pytest.mark.parametrize("path", [p for p in TOPOLOGIES if "cpu" not in p.name],
                         ids=lambda p: p.name)
def test_tp_baseline_is_one_instance_over_every_device(path: Path) -> None:
    topology = load(path)
    _, tp = derive_arms(topology, path, "tp")
    listed, _ = devices(topology)
    pd = tp.topology.roles["prefill_decode"]
    assert tp.name == "tp" and pd.replicas == 1 and pd.tensor_parallel == len(listed)
    assert list(placed(tp.topology).values()) == [tuple(str(g) for g in listed)]


def test_tp_baseline_is_refused_on_cpu_and_where_heads_do_not_divide(tmp_path: Path) -> None:
    cpu = load(next(p for p in TOPOLOGIES if p.name == "cpu-demo.yaml"))
    with pytest.raises(BenchError, match="needs `device: cuda`"):
        derive_arms(cpu, Path("cpu-demo.yaml"), "tp")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_attention_heads": 16}}))
    topology = parse_topology({"name": "x", "model": str(tmp_path), "roles": {
        "encode": {"gpus": [0]}, "prefill_decode": {"replicas": 2, "gpus": [1, 2]}}})
    with pytest.raises(BenchError, match="16 attention heads, which tensor_parallel 3"):
        derive_arms(topology, Path("x.yaml"), "tp")


def test_baseline_none_and_extra_arms() -> None:
    topology = load(next(p for p in TOPOLOGIES if p.name == "cpu-demo.yaml"))
    other = topology.model_copy(update={"name": "other"})
    arms = derive_arms(topology, Path("a.yaml"), "none", [(Path("b.yaml"), other)])
    assert [(a.name, a.kind) for a in arms] == [("epd", "epd"), ("other", "extra")]


def test_extra_arm_of_another_model_or_name_is_refused() -> None:
    topology = load(next(p for p in TOPOLOGIES if p.name == "cpu-demo.yaml"))
    other = topology.model_copy(update={"name": "other", "model": "another/model"})
    with pytest.raises(BenchError, match=r"--arm b.yaml: model `another/model` is not"):
        derive_arms(topology, Path("a.yaml"), "aggregated", [(Path("b.yaml"), other)])
    with pytest.raises(BenchError, match="name `cpu-demo` is taken"):
        derive_arms(topology, Path("a.yaml"), "none", [(Path("b.yaml"), topology)])


def test_image_limit_and_max_model_len() -> None:
    by_name = {p.name: load(p) for p in TOPOLOGIES}
    assert image_limit(by_name["cpu-demo.yaml"]) == 2
    assert image_limit(by_name["qwen2_5-vl-2e2pd-tp2.yaml"]) == 8
    assert max_model_len(by_name["cpu-demo.yaml"]) == 512
    bare = parse_topology({"name": "x", "model": "m", "roles": {"prefill_decode": {}}})
    assert image_limit(bare) is None and max_model_len(bare) is None
