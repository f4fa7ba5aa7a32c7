"""benchmarks/rebalance.py's parts that decide its figures: the shifting trace (its phases
in order, each its own mix, at the rate asked), what counts as a flap, and the rebalanced
arm's topology (the pick with a valid `rebalance:` section on tune's profiles)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from epdctl.topology.model import load_topology
from epdctl.traces.classes import shape_class
from epdctl.traces.format import Trace

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
SPEC = importlib.util.spec_from_file_location("bench_rebalance", BENCHMARKS / "rebalance.py")
assert SPEC and SPEC.loader
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def test_the_trace_shifts_phase_by_phase_at_the_rate_asked() -> None:
    requests = bench.shifting_trace(200, 4.0)
    assert len(requests) == 600 and all(r.stream for r in requests)
    phases = [Counter(shape_class(r) for r in requests[i * 200:(i + 1) * 200])
              for i in range(3)]
    assert [p.most_common(1)[0][0] for p in phases] == ["image4", "text", "image"]
    assert phases[2] == Counter({"image": 200})
    assert Trace(tuple(requests)).rate == pytest.approx(4.0, rel=0.15)
    times = [r.timestamp_ms for r in requests]
    assert times == sorted(times)


def test_a_flap_is_a_switch_undone_within_the_interval() -> None:
    def move(at: float, old: str, new: str) -> dict:
        return {"at": at, "remove": [old], "add": [new]}

    there, back = move(0, "pd-2", "encode-1"), move(100, "encode-1", "pd-2")
    assert bench.flaps([there, back], 150) == 1
    assert bench.flaps([there, back], 60) == 0  # undone after a whole interval: a shift
    assert bench.flaps([there, move(50, "pd-1", "encode-2")], 150) == 0  # the same way twice


def test_the_rebalanced_arm_is_the_pick_with_a_section_on_tunes_profiles(tmp_path: Path
                                                                          ) -> None:
    pick = tmp_path / "pick.yaml"
    pick.write_text("name: sim\nmodel: sim-model\nroles:\n  encode: {gpus: [0]}\n"
                    "  prefill_decode: {gpus: [1, 2, 3], replicas: 3}\n")
    topology = load_topology(bench.rebalanced(pick, tmp_path, "encode-heavy", 150.0))
    section = topology.rebalance
    assert section.enabled and section.profiles == tmp_path / "tune"
    assert (section.every, section.window, section.interval, section.min_gap) == (
        bench.EVERY_S, bench.WINDOW_S, 150.0, bench.MIN_GAP_S)
    assert section.slo == "ttft=3000,tpot=60"


def test_another_start_is_the_base_split_as_asked(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("name: sim\nmodel: sim-model\nroles:\n  prefill_decode: {gpus: [0]}\n")
    topology = load_topology(bench.split_topology(base, "1E+3PD", tmp_path))
    assert topology.name == "sim-1e-3pd"
    assert (topology.roles["encode"].gpus, topology.roles["prefill_decode"].gpus) == (
        [0], [1, 2, 3])
    with pytest.raises(SystemExit, match="expected nE"):
        bench.split_topology(base, "2PD", tmp_path)


def test_the_bound_is_what_the_best_split_of_each_phase_serves_over_the_start(
        tmp_path: Path) -> None:
    """On the real profiles of the simulated encode-heavy machine: albums at 6 req/s need
    encoders, which an aggregated start has none of and cannot reach by a switch; the split
    that would serve the most throughout is never beaten by more than the bound says."""
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "profiles.json").write_bytes(
        (Path(__file__).parent / "data" / "rebalance" / "encode-heavy" /
         "profiles.json").read_bytes())
    bench.cost_file("encode-heavy", tmp_path)
    requests = bench.shifting_trace(300, 6.0)
    got = bench.bound(tmp_path, "encode-heavy", requests, "4PD")
    assert got["bound"] > 1.25 and got["reach"] == 1.0  # 4PD: no encoder to switch in
    assert "E" in got["best"][0] and got["static"] != "4PD"
    assert bench.bound(tmp_path, "encode-heavy", requests, got["static"])["bound"] == \
        got["static_bound"] >= 1.0
