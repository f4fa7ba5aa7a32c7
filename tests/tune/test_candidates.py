"""Candidate enumeration: shapes, heads, memory and packing rules; each a valid topology."""

from __future__ import annotations

from pathlib import Path

import pytest

from epdctl.launch.plan import plan
from epdctl.topology.model import parse_topology
from epdctl.tune.candidates import (
    GIB,
    Limits,
    Pool,
    Shape,
    candidates,
    limits_for,
    misfit,
    request_tokens,
    shapes,
    tp_sizes,
)
from epdctl.tune.facts import ModelFacts, from_config, from_file

BASE = parse_topology({
    "name": "sim", "model": "sim-model", "device": "cuda",
    "engine": {"command": ["python", "-m", "epdctl.sim.engine"],
               "args": ["--max-model-len", "4096"]},
    "kv": {"connector": "ExampleConnector"},
    "roles": {"encode": {"args": ["--enforce-eager"]},
              "prefill_decode": {"args": ["--max-num-seqs", "64"]}},
})
FACTS = ModelFacts(heads=32, weights=16 * GIB, encoder_weights=GIB, kv_per_token=512 << 10)


def test_two_gpus_give_seven_shapes() -> None:
    labels = sorted(s.label for s in shapes(2, [1, 2]))
    assert labels == sorted(["2PD", "1PD(TP2)", "1E+1PD", "1E~2PD", "2E~2PD", "1E~1PD(TP2)",
                             "1E~1P+1D"])
    for shape in shapes(6, [1, 2]):
        assert shape.gpus == 6


def test_heads_decide_the_tp_sizes() -> None:
    assert tp_sizes(8, 32) == [1, 2, 4, 8]
    assert tp_sizes(8, 6) == [1, 2]
    assert tp_sizes(3, None) == [1, 2]
    assert all(p.tp in (1, 2) for s in shapes(8, tp_sizes(8, 6))
               for p in (s.pd, s.prefill, s.decode))


def test_cpu_shapes_have_no_tp_and_no_sharing() -> None:
    got = shapes(3, [1, 2], is_cpu=True)
    assert sorted(s.label for s in got) == ["1E+1P+1D", "1E+2PD", "2E+1PD", "3PD"]


def test_memory_weights_and_kv() -> None:
    big = ModelFacts(heads=8, weights=100 * GIB, encoder_weights=GIB, kv_per_token=1 << 20)
    limits = Limits(gpu_memory=80 * GIB, kv_tokens=4096)
    assert "weights" in (misfit(Shape("aggregated", pd=Pool(2, 1)), big, limits) or "")
    assert misfit(Shape("aggregated", pd=Pool(1, 2)), big, limits) is None
    # 0.9 * 80 - 70 GiB leaves 2 GiB: 2048 tokens of 1 MiB, fewer than 4096
    tight = ModelFacts(weights=70 * GIB, kv_per_token=1 << 20)
    assert "KV" in (misfit(Shape("aggregated", pd=Pool(1, 1)), tight, limits) or "")
    # a shared E takes its share from PD's GPU
    edge = ModelFacts(weights=62 * GIB, kv_per_token=1 << 20)
    shared = Limits(80 * GIB, 4096, encoder_fraction=0.1)
    assert misfit(Shape("e-pd", 1, False, pd=Pool(1, 1)), edge, shared) is None
    assert "KV" in (misfit(Shape("e-pd", 1, True, pd=Pool(1, 1)), edge, shared) or "")
    assert misfit(Shape("aggregated", pd=Pool(1, 1)), big, Limits(None, 10**9)) is None


def test_limits_follow_the_workload() -> None:
    tokens = request_tokens(FACTS, 2, (1000, 1000), 128, 64)
    assert tokens == 128 + 64 + 2 * 1275
    limits = limits_for(BASE, FACTS, 80 * GIB, tokens)
    assert limits.kv_tokens == max(4096, tokens * 4)
    assert 0.05 <= limits.encoder_fraction <= 0.1


def test_every_candidate_is_a_topology_that_plans(tmp_path: Path) -> None:
    limits = limits_for(BASE, FACTS, 80 * GIB, 1000)
    kept, left_out = candidates(BASE, [0, 1, 2, 3], FACTS, limits)
    assert not left_out and len(kept) > 20
    names = [c.name for c in kept]
    assert len(set(names)) == len(names)
    for cand in kept:
        placed = plan(cand.topology, tmp_path / cand.name, visible_gpus=["0", "1", "2", "3"])
        assert sorted({g for s in placed.instances for g in s.gpus}) == ["0", "1", "2", "3"]
        assert cand.topology.engine == BASE.engine and cand.topology.kv == BASE.kv
        if "encode" in cand.topology.roles:
            assert cand.topology.roles["encode"].args == ["--enforce-eager"]
    shared = next(c for c in kept if c.shape.label == "2E~2PD(TP2)")
    roles = shared.topology.roles
    assert roles["encode"].gpus == [0, 2] and roles["prefill_decode"].gpus == [0, 1, 2, 3]
    assert roles["encode"].gpu_memory_utilization + \
        roles["prefill_decode"].gpu_memory_utilization <= 1.0
    epd = next(c for c in kept if c.shape.label == "1E+1P+2D")
    assert epd.topology.roles["decode"].args == ["--max-num-seqs", "64"]
    assert epd.topology.mode == "epd"


def test_memory_leaves_shapes_out_with_a_reason() -> None:
    heavy = ModelFacts(heads=32, weights=100 * GIB, encoder_weights=GIB, kv_per_token=1 << 20)
    kept, left_out = candidates(BASE, [0, 1, 2, 3], heavy, limits_for(BASE, heavy, 80 * GIB, 500))
    assert kept and left_out
    assert all(p.tp >= 2 for c in kept for p in (c.shape.pd, c.shape.prefill, c.shape.decode)
               if p.replicas)
    assert all("weights" in why or "KV" in why for _, why in left_out)


def test_cpu_demo_candidates() -> None:
    from epdctl.topology.model import load_topology

    base = load_topology(Path(__file__).parents[2] / "topologies" / "cpu-demo.yaml")
    kept, _ = candidates(base, [0, 1], ModelFacts(), Limits(None, 0))
    assert sorted(c.shape.label for c in kept) == ["1E+1PD", "2PD"]
    assert all(r.gpus is None for c in kept for r in c.topology.roles.values())


def test_facts_from_a_config_and_a_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"text_config": {"num_attention_heads": 16, "num_key_value_heads": 4, '
        '"hidden_size": 1024, "num_hidden_layers": 10, "torch_dtype": "bfloat16"}}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    facts = from_config(tmp_path)
    assert facts is not None and facts.heads == 16
    assert facts.kv_per_token == 2 * 10 * 4 * 64 * 2 and facts.weights == 1000
    path = tmp_path / "cost.yaml"
    path.write_text("model: {heads: 12, weights: 2GiB, kv_per_token: 1KiB}\nencode: {}\n")
    assert from_file(path) == ModelFacts(heads=12, weights=2 * GIB, kv_per_token=1024,
                                         source=str(path))
    path.write_text("encode: {}\n")
    with pytest.raises(Exception, match="no `model:` section"):
        from_file(path)


def test_a_family_is_the_split_of_the_language_model_devices() -> None:
    from epdctl.tune.candidates import Pool, Shape

    def epd(e: int, p: Pool, d: Pool, shared: bool = True) -> str:
        return Shape("epd", e, shared, prefill=p, decode=d).family

    assert epd(1, Pool(2), Pool(1, 2)) == epd(2, Pool(2), Pool(1, 2)) == "epd:2P+1D(TP2)"
    assert epd(1, Pool(1), Pool(1), False) == epd(2, Pool(2), Pool(2)) == "epd:1P+1D"
    assert epd(3, Pool(3), Pool(1)) == "epd:3P+1D"
    assert Shape("e-pd", 2, pd=Pool(2)).family == Shape("e-pd", 1, pd=Pool(3)).family \
        == "e-pd:1PD"
    assert Shape("e-pd", 1, pd=Pool(1, 2)).family == "e-pd:1PD(TP2)"
    assert Shape("aggregated", pd=Pool(4)).family == "aggregated:1PD"


def test_a_candidate_is_measured_without_the_bases_rebalancer() -> None:
    """tune starts each candidate as placed: a base that rebalances (`rebalance.enabled`)
    must not move a candidate's GPUs while it is measured."""
    from epdctl.topology.model import parse_topology
    from epdctl.tune.candidates import Limits, Pool, Shape, place

    base = parse_topology({"name": "b", "model": "m", "roles": {"prefill_decode": {}},
                           "rebalance": {"enabled": True, "profiles": "/p", "slo": "ttft=1"}})
    placed = place(base, Shape("e-pd", 1, pd=Pool(1, 1)), [0, 1], Limits(None, 1024))
    assert base.rebalance.enabled and not placed.rebalance.enabled
