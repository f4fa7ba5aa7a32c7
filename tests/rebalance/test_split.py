"""The splits a switch reaches from a running topology, and the moves between them."""

from __future__ import annotations

import pytest

from epdctl.errors import PlanError
from epdctl.launch.state import RunState, Settings
from epdctl.rebalance.split import moves, reachable, running_shape, without
from epdctl.tune.candidates import Pool, Shape
from tests.planning import demo_plan, demo_topology


def engines(roles: dict) -> list:
    return RunState.of(demo_plan(demo_topology(roles)), "/t.yaml", Settings()).engines


def test_the_running_split_is_read_off_its_instances() -> None:
    shape = running_shape(engines({"encode": {"gpus": [0]},
                                   "prefill_decode": {"gpus": 4, "replicas": 2,
                                                      "tensor_parallel": 2}}))
    assert shape == Shape("e-pd", 1, pd=Pool(2, 2))
    epd = running_shape(engines({"encode": {"gpus": 2, "replicas": 2},
                                 "prefill": {"gpus": 1}, "decode": {"gpus": 2, "replicas": 2}}))
    assert epd.label == "2E+1P+2D"
    shared = engines({"encode": {"gpus": [0], "gpu_memory_utilization": 0.2},
                      "prefill_decode": {"gpus": [0], "gpu_memory_utilization": 0.6}})
    with pytest.raises(PlanError, match="shares a GPU"):
        running_shape(shared)


def test_a_switch_reaches_every_split_of_one_instance_size() -> None:
    labels = [s.label for s in reachable(Shape("e-pd", 1, pd=Pool(3, 1)))]
    assert labels == ["1E+3PD", "2E+2PD", "3E+1PD"]  # the running one first
    epd = sorted(s.label for s in reachable(Shape("epd", 1, prefill=Pool(1, 1),
                                                   decode=Pool(2, 1))))
    assert epd == ["1E+1P+2D", "1E+2P+1D", "2E+1P+1D"]
    # PD(TP2) and E (one GPU) do not trade instances: nothing else is reachable
    assert reachable(Shape("e-pd", 1, pd=Pool(2, 2))) == [Shape("e-pd", 1, pd=Pool(2, 2))]
    assert len(reachable(Shape("aggregated", pd=Pool(4, 1)))) == 1


def test_the_moves_pair_what_a_split_loses_with_what_it_gains() -> None:
    now, then = Shape("e-pd", 1, pd=Pool(3, 1)), Shape("e-pd", 3, pd=Pool(1, 1))
    assert moves(now, then) == [("prefill_decode", "encode")] * 2
    assert moves(then, now) == [("encode", "prefill_decode")] * 2
    assert moves(now, now) == []
    assert without(now, ["prefill_decode"]) == Shape("e-pd", 1, pd=Pool(2, 1))
