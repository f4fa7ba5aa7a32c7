"""Live changes planned (launch.change's Placer, launch.rollout's steps), on a fixed fake
machine: a new instance's name, GPUs and ports; what an edited topology restarts; what a
running topology cannot change."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from epdctl.errors import PlanError
from epdctl.launch.change import Placer
from epdctl.launch.rollout import apply_steps, scale_steps, switch_steps
from epdctl.launch.state import RunState, Settings
from epdctl.topology.model import Topology
from tests.planning import GPUS, PY, SHIPPED, STATE, VLLM, demo_plan, demo_topology, load_shipped

KEY = "internal-key"


def placer_for(running: Topology, given: Topology | None = None,
               gpus: list[str] = GPUS) -> Placer:
    """The Placer of `given` (default: `running`) over a run of `running` planned on the
    fake machine (`gpus` visible)."""
    plan = demo_plan(running, internal_key=KEY, visible_gpus=gpus)
    state = RunState.of(plan, "/topologies/demo.yaml", Settings())
    state.phase = "running"
    return Placer(given or running, state, STATE, tuple(gpus), 16, PY, VLLM)


def epd(replicas: int = 1, **pd: Any) -> Topology:
    return demo_topology({"encode": {"gpus": [0]},
                          "prefill_decode": {"gpus": replicas, "replicas": replicas, **pd}})


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_a_running_topology_replans_as_it_runs(path: Path) -> None:
    """The invariant every live change rests on: each running instance, planned again in its
    place, is what runs (else `scale` would call the unedited file edited, and `apply`
    would restart what did not change)."""
    topology = load_shipped(path)
    if topology.proxy.api_key_file is not None:
        pytest.skip("its key is read from a file")
    placer = placer_for(topology)
    assert placer.changed() == []
    placer.check_fixed()
    assert placer.proxy() == demo_plan(topology, internal_key=KEY).proxy
    assert apply_steps(placer) == []


def test_an_added_instance_takes_a_free_gpu_free_ports_and_a_free_name() -> None:
    placer = placer_for(epd())
    used = {p for s in placer.engines for p in (s.port, *s.ec_ports)} | {
        placer.state.proxy.port}
    (step,) = scale_steps(placer, {"prefill_decode": 2})
    new = step.new
    assert step.kind == "add" and new is not None
    assert (new.name, new.role, new.gpus) == ("pd-1", "prefill_decode", ("2",))
    assert new.env["CUDA_VISIBLE_DEVICES"] == "2" and new.port not in used
    assert new.ec_config is not None and new.ec_config["engine_id"] == "demo-pd-1"
    pd0 = placer.engine("pd-0")  # the same definition as its peer, in another place
    assert dataclasses.replace(new, name="pd-0", port=pd0.port, gpus=pd0.gpus,
                               log_path=pd0.log_path, env=pd0.env, ec_config=pd0.ec_config
                               ) == pd0
    assert new.url in step.proxy.args and pd0.url in step.proxy.args


def test_scaling_down_removes_the_newest_and_keeps_one() -> None:
    placer = placer_for(epd(replicas=3))
    steps = scale_steps(placer, {"prefill_decode": 1})
    assert [(s.kind, s.name) for s in steps] == [("remove", "pd-2"), ("remove", "pd-1")]
    assert placer.engine("pd-0").url in steps[-1].proxy.args
    gone = {s.name: s.url for s in placer.state.specs}
    assert gone["pd-1"] not in steps[-1].proxy.args and gone["pd-2"] not in steps[0].proxy.args
    with pytest.raises(PlanError, match="keeps at least one instance"):
        scale_steps(placer, {"prefill_decode": 0})


def test_a_role_grows_onto_free_gpus_and_no_further() -> None:
    placer = placer_for(demo_topology({"encode": {"gpus": [0]},
                                       "prefill_decode": {"gpus": [2]}}), gpus=["0", "1", "2"])
    (step,) = scale_steps(placer, {"prefill_decode": 2})
    assert step.new is not None and step.new.gpus == ("1",)
    with pytest.raises(PlanError, match=r"no room for another encode instance: it needs 1 "
                       r"free GPU\(s\), 0 are free; `epdctl switch`"):
        scale_steps(placer, {"encode": 2})


def test_a_switch_gives_the_same_gpus_to_the_other_role() -> None:
    placer = placer_for(epd(replicas=2))
    (step,) = switch_steps(placer, "pd-1", "encode")
    assert step.old is not None and step.new is not None
    assert (step.new.name, step.new.role, step.new.gpus) == ("encode-1", "encode",
                                                             step.old.gpus)
    with pytest.raises(PlanError, match="the only prefill_decode instance"):
        switch_steps(placer, "pd-0", "encode")


def test_a_switch_refuses_another_tensor_parallel_size() -> None:
    placer = placer_for(demo_topology({"encode": {"gpus": [0]},
                                       "prefill_decode": {"gpus": [1, 2, 3, 4], "replicas": 2,
                                                          "tensor_parallel": 2}}))
    with pytest.raises(PlanError, match="has 2 GPU"):
        switch_steps(placer, "pd-1", "encode")


def test_apply_restarts_only_what_the_file_defines_otherwise() -> None:
    running = epd(replicas=2)
    edited = epd(2, args=["--max-num-seqs", "8"])
    placer = placer_for(running, edited)
    steps = apply_steps(placer)
    assert [(s.kind, s.name) for s in steps] == [("replace", "pd-0"), ("replace", "pd-1")]
    for step in steps:  # in place: the same name, port and GPUs, the new args
        assert step.old is not None and step.new is not None
        assert (step.new.port, step.new.gpus) == (step.old.port, step.old.gpus)
        assert step.new.args[-2:] == ("--max-num-seqs", "8")
    grown = placer_for(running, epd(replicas=3))
    assert [(s.kind, s.name) for s in apply_steps(grown)] == [("add", "pd-2")]


@pytest.mark.parametrize(("edited", "message"), [
    (demo_topology({"encode": {"gpus": [0]}, "prefill": {"gpus": 1}, "decode": {"gpus": 1}}),
     "the roles differ"),
    (demo_topology({"encode": {"gpus": [0]}, "prefill_decode": {"gpus": 1}},
                   model="other/model"), "namespace differs"),
    (demo_topology({"encode": {"gpus": [0]}, "prefill_decode": {"gpus": 1}},
                   proxy={"max_inflight": 3}), "the proxy's settings differ"),
    (demo_topology({"encode": {"gpus": [0]}, "prefill_decode": {"gpus": 1}},
                   engine={"args": ["--mm-processor-kwargs", '{"a": 1}']}),
     "namespace differs"),
])
def test_apply_refuses_what_a_running_topology_cannot_change(edited: Topology,
                                                             message: str) -> None:
    with pytest.raises(PlanError, match=message):
        apply_steps(placer_for(epd(), edited))
