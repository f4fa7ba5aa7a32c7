"""Probe shapes, and profiling a probe topology on the simulated machine (fake GPUs, fake
engines, started through the run API)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from epdctl.bench.workload import LoadPoint, Workload
from epdctl.topology.model import parse_topology
from epdctl.tune.candidates import GIB, Limits, Pool, Shape, candidates, place
from epdctl.tune.facts import ModelFacts
from epdctl.tune.model import needed_stages
from epdctl.tune.probes import HANDOFF, Bodies, Measurements, probe_shapes, profile_running
from tests.harness import free_ports

DELAYED_PROXY = Path(__file__).parents[1] / "delayed_proxy.py"

pytestmark = pytest.mark.timeout(180)


def _base(tmp_path: Path) -> dict:
    cost = tmp_path / "cost.yaml"
    cost.write_text("time_scale: 0.5\ngpu: {memory: 24GiB}\n"
                    "model: {weights: 4GiB, encoder_weights: 1GiB, kv_per_token: 64KiB}\n")
    base = free_ports(8)
    return {"name": "probe", "model": "sim-model", "device": "cuda",
            "engine": {"command": [sys.executable, "-m", "epdctl.sim.engine", "--cost-model",
                                   str(cost)], "args": ["--max-model-len", "2048"]},
            "cache": {"dir": str(tmp_path / "shm")}, "kv": {"connector": "ExampleConnector"},
            "ports": {"base": base, "side_channel_base": base + 5},
            "proxy": {"port": base + 4}, "roles": {"prefill_decode": {}}}


def test_probe_shapes_cover_every_stage() -> None:
    base = parse_topology({"name": "b", "model": "m", "roles": {"prefill_decode": {}}})
    facts = ModelFacts(heads=8, weights=GIB, encoder_weights=GIB, kv_per_token=1024)
    kept, _ = candidates(base, list(range(4)), facts, Limits(80 * GIB, 4096))
    probes = probe_shapes([c.shape for c in kept], 4)
    covered = {k for p in probes for k in needed_stages(p)}
    assert {k for c in kept for k in needed_stages(c.shape)} <= covered
    assert len(probes) <= 12 and all(p.gpus <= 4 for p in probes)
    assert any(p.shared for p in probes)


Run = tuple[tuple[int, ...], set[str]]
"""One profile_running of a probe: its levels, and the stage keys it is told are known."""


def _profile_twice(tmp_path: Path, data: dict, shape: Shape, images: int, first: Run,
                   second: Run) -> tuple[Measurements, Measurements]:
    """Bring the probe up on the first `shape.gpus` fake GPUs, profile it as `first` says,
    then as `second` says, and take it down."""
    from epdctl.launch.run import prepare, start_detached, stop

    topology = place(parse_topology(data), shape, list(range(shape.gpus)),
                     Limits(24 * GIB, 2048))
    run = prepare(tmp_path / "probe.yaml", tmp_path / "state", topology=topology)
    state = start_detached(run, 60.0)
    bodies = Bodies(Workload(points=(LoadPoint(),), images=images, image_size=(64, 64),
                             input_len=16, output_len=8), "sim-model")
    try:
        got, again = (asyncio.run(profile_running(state, shape, bodies, 30, levels=levels,
                                                  known=known))
                      for levels, known in (first, second))
        return got, again
    finally:
        stop(run.sdir, run.sdir.read())


def test_profile_an_epd_probe_on_fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    monkeypatch.setenv("EPDCTL_FAKE_GPUS", "3")
    monkeypatch.delenv("EPDCTL_PROXY_COMMAND", raising=False)
    shape = Shape("epd", 1, prefill=Pool(1, 1), decode=Pool(1, 1))
    # what an earlier probe profiled is skipped; D's hand-off is still timed
    got, rest = _profile_twice(tmp_path, _base(tmp_path), shape, 1, ((1, 2, 4), set()),
                               ((1, 2), {"encode", "prefill-tp1"}))
    assert set(rest.stages) == {"decode-tp1"} and set(rest.series) == {"decode"}
    assert rest.kv_ms is not None
    assert set(got.stages) == {"encode", "prefill-tp1", "decode-tp1"}
    assert got.stages["encode"].per_image_ms + got.stages["encode"].fixed_ms > 0
    assert got.stages["decode-tp1"].fixed_ms > 0
    assert got.kv_ms is not None and got.kv_ms >= 0
    assert got.series["decode"]["levels"] == [1, 2, 4]


def test_sharing_slowdown_is_profiled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPDCTL_FAKE_GPUS", "1")
    monkeypatch.delenv("EPDCTL_PROXY_COMMAND", raising=False)
    data = _base(tmp_path)
    cost = Path(data["engine"]["command"][-1])
    # a busy neighbour triples a step: far above what a loaded test machine adds
    cost.write_text(cost.read_text() + "sharing: {slowdown: 2.0}\n"
                    "encode: {fixed_ms: 10, per_image_ms: 10}\n")
    shape = Shape("e-pd", 1, True, pd=Pool(1, 1))
    # E, PD and the hand-off timed by an earlier probe: only the slowdown is measured
    got, again = _profile_twice(tmp_path, data, shape, 1, ((1, 4), set()),
                                ((1, 4), {"encode", "pd-tp1", HANDOFF}))
    assert set(got.stages) == {"encode", "pd-tp1"}
    assert got.sharing_slowdown is not None and got.sharing_slowdown > 0.5
    assert again.stages == {} and set(again.series) == {"sharing"}
    assert again.sharing_slowdown is not None and again.sharing_slowdown > 0.5


def test_the_ec_handoff_is_the_proxys_hop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """An E|PD probe times E-fed requests through its proxy and by hand: with a proxy that
    holds each chat request 300 ms, the hand-off found is about that; a later probe told
    it was timed (HANDOFF) does not time it again."""
    import shlex

    monkeypatch.setenv("EPDCTL_FAKE_GPUS", "2")
    monkeypatch.setenv("EPDCTL_PROXY_COMMAND",
                       shlex.join([sys.executable, str(DELAYED_PROXY), "300"]))
    got, again = _profile_twice(tmp_path, _base(tmp_path), Shape("e-pd", 1, pd=Pool(1, 1)), 2,
                                ((1, 2), set()), ((1, 2), {"encode", "pd-tp1", HANDOFF}))
    assert set(got.stages) == {"encode", "pd-tp1"}
    assert got.ec_ms is not None and 200 <= got.ec_ms < 2000, got.series["ec_handoff"]
    assert len(got.series["ec_handoff"]["through_ms"]) == 5
    assert again.ec_ms is None and again.stages == {} and again.series == {}


def test_a_decode_step_timed_at_a_tp_size_is_not_timed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step an earlier probe timed on TP1 (here an E-fed PD's) serves an aggregated
    PD's decode and an E|P|D's D: their prefills are profiled, their decodes are not (no
    decode series), and D's KV pull is still timed."""
    from epdctl.tune.des import StepCost
    from epdctl.tune.probes import known_decode

    monkeypatch.setenv("EPDCTL_FAKE_GPUS", "3")
    monkeypatch.delenv("EPDCTL_PROXY_COMMAND", raising=False)
    pd = StepCost(fixed_ms=7.0, per_seq_ms=0.3, per_seq2_ms=0.01, prefill_fixed_ms=50.0,
                  per_token_ms=0.2, max_seqs=99)
    decode = known_decode({"pd-tp1": pd}, 1)
    assert decode is not None and known_decode({"pd-tp1": pd}, 2) is None
    assert (decode.fixed_ms, decode.per_seq_ms, decode.per_seq2_ms) == (7.0, 0.3, 0.01)
    assert (decode.prefill_fixed_ms, decode.per_token_ms) == (None, 0.0)
    assert known_decode({"decode-tp1": None, "pd+enc-tp1": pd}, 1) == decode

    aggregated, _ = _profile_twice(tmp_path, _base(tmp_path), Shape("aggregated",
                                                                    pd=Pool(1, 1)), 1,
                                   ((1, 2), {"pd-tp1": pd}), ((1,), {"pd+enc-tp1": None}))
    cost = aggregated.stages["pd+enc-tp1"]
    assert (cost.fixed_ms, cost.per_seq_ms, cost.per_seq2_ms) == (7.0, 0.3, 0.01)
    assert cost.prefill_fixed_ms not in (None, 50.0)  # its own prefill, profiled
    assert set(aggregated.series["pd+enc-tp1"]) == {"prefill"}
    assert aggregated.series["pd+enc-tp1"]["prefill"]["levels"] == [1, 2]

    shape = Shape("epd", 1, prefill=Pool(1, 1), decode=Pool(1, 1))
    epd, _ = _profile_twice(tmp_path / "epd", _base(tmp_path), shape, 1,
                            ((1, 2), {"encode": None, "pd-tp1": pd}),
                            ((1,), {"encode": None, "prefill-tp1": None, "decode-tp1": None}))
    assert epd.stages["decode-tp1"].per_seq_ms == 0.3 and "decode" not in epd.series
    assert epd.kv_ms is not None and "prefill" in epd.series
