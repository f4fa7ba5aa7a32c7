"""benchmarks/tune.py's figures: rank correlation and the aggregated call."""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_tune", Path(__file__).parents[1] / "benchmarks" / "tune.py")
assert SPEC and SPEC.loader
bench_tune = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_tune)


def test_spearman() -> None:
    assert bench_tune.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert bench_tune.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert bench_tune.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(bench_tune.spearman([1], [1]))


def test_agg_call() -> None:
    sweep = {"a": ("aggregated", 5.0), "b": ("e-pd", 7.0)}
    assert bench_tune.agg_call_right(sweep, "e-pd")
    assert bench_tune.agg_call_right(sweep, "epd")
    assert not bench_tune.agg_call_right(sweep, "aggregated")
    tie = {"a": ("aggregated", 2.909), "b": ("epd", 2.954)}  # 1.5 % apart: a tie
    assert bench_tune.agg_call_right(tie, "aggregated") and bench_tune.agg_call_right(tie, "epd")
    apart = {"a": ("aggregated", 2.7), "b": ("epd", 2.954)}  # 9 %: not
    assert not bench_tune.agg_call_right(apart, "aggregated")


class _Point:
    def __init__(self, index: int, throughput: float, share: float) -> None:
        self.index = index
        self.figures = {"request_throughput": throughput, "request_goodput": throughput * share}


def _search(most: float, holds_up_to: float, missed: float = 0.5) -> list[float]:
    """The rates the sweep runs on a candidate serving `most` req/s at once and holding the
    SLO up to `holds_up_to` req/s (above it, a share `missed` of requests within the SLO;
    none where nothing holds), driven as run_arms drives `wanted`."""
    done: list[_Point] = []
    for index, rate in enumerate(bench_tune.SEARCH):
        if bench_tune.wanted(index, done):
            share = 1.0 if rate <= holds_up_to else missed if holds_up_to else 0.0
            done.append(_Point(index, min(rate, most), share))
    return [bench_tune.SEARCH[p.index] for p in done]


@pytest.mark.parametrize(("most", "holds", "expected"), [
    (11.0, 40.0, [math.inf, 5.657, 8.0, 11.314, 16.0, 22.627, 32.0, 45.255]),  # up, a burst
    (11.0, 6.0, [math.inf, 5.657, 8.0]),  # up: the first miss brackets it
    (12.0, 1.5, [math.inf, 8.0, 5.657, 4.0, 2.828, 2.0, 1.414]),  # the first missed: down
    (200.0, 1000.0, [math.inf, 128.0, 181.019, 256.0]),  # every rate holds: the top
    (1.0, 0.1, [math.inf, 0.5]),  # even the lowest misses: nothing lower to try
    (6.0, 0.0, [math.inf, 4.0, 1.414]),  # no request holds, nor at X/4: stop
    (1.5, 0.0, [math.inf, 1.0, 0.5]),  # X/4 below the ladder: its foot
])
def test_the_sweep_brackets_each_knee_in_one_pass(most: float, holds: float,
                                                   expected: list[float]) -> None:
    assert _search(most, holds) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(("holds", "expected"), [
    (4.5, [math.inf, 8.0, 2.828, 4.0, 5.657]),  # X/4 held: up again, to the first miss
    (3.0, [math.inf, 8.0, 2.828, 4.0]),  # up again, missed at once
])
def test_not_one_request_held_goes_straight_to_a_quarter_of_x(
        holds: float, expected: list[float]) -> None:
    """A cliff: every request misses above `holds`. The rates between the first miss and X/4
    are skipped, and the knee is bracketed by neighbouring rates all the same."""
    from epdctl.tune.decide import knee

    rates = _search(12.0, holds, missed=0.0)
    assert rates == pytest.approx(expected, rel=1e-3)
    finite = sorted(r for r in rates if math.isfinite(r))
    held = max(r for r in finite if r <= holds)
    assert finite[finite.index(held) + 1] == pytest.approx(held * 2 ** 0.5)  # neighbours
    points = [(r, 1.0 if r <= holds else 0.0) for r in finite]
    assert knee(points) == pytest.approx(knee([(held, 1.0), (held * 2 ** 0.5, 0.0)]))


def test_an_interrupted_sweep_goes_on_where_it_stopped(tmp_path: Path) -> None:
    progress = bench_tune.Progress.load(tmp_path)
    assert progress.done == {}
    progress.add("sim-4pd", "aggregated", 4.4, 80.0)
    progress.add("sim-1e-3pd", "e-pd", 0.0, 200.0)
    again = bench_tune.Progress.load(tmp_path)  # a new run of the same --out
    assert again.done == {"sim-4pd": ("aggregated", 4.4, 80.0),
                          "sim-1e-3pd": ("e-pd", 0.0, 200.0)}
    assert again.knees(["sim-4pd"]) == {"sim-4pd": ("aggregated", 4.4)}
    assert again.seconds(["sim-4pd", "sim-1e-3pd"]) == 280.0
    assert not (tmp_path / "sweep-progress.tmp").exists()


def test_a_rerun_keeps_the_tune_it_is_measured_against(tmp_path: Path) -> None:
    import json

    doc = {"best": "sim-4pd", "candidates": []}
    (tmp_path / "tune.json").write_text(json.dumps({"doc": doc, "tune_s": 368.0}))
    # No tune runs (its arguments would fail): the kept one comes back.

    args = argparse.Namespace(budget="15m", num_prompts=60, point_seconds=10.0)
    assert bench_tune._tuned(tmp_path, tmp_path / "none.yaml", "encode-heavy", 4,
                             tmp_path / "none.yaml", args) == (doc, 368.0)
    (tmp_path / "tune.json").write_text(json.dumps({"doc": doc, "tune_s": 368.0,
                                                    "budget": "15m"}))
    (tmp_path / "tune").mkdir()
    args.budget = "30m"  # another budget: tune runs again, afresh (and fails on none.yaml)
    with pytest.raises(SystemExit, match="tune failed"):
        bench_tune._tuned(tmp_path, tmp_path / "none.yaml", "encode-heavy", 4,
                          tmp_path / "none.yaml", args)
    assert not (tmp_path / "tune").exists()
    # On 8 GPUs the budget is twice as long, as every wait is: a kept "30m" tune is that one.
    (tmp_path / "tune.json").write_text(json.dumps({"doc": doc, "tune_s": 900.0,
                                                    "budget": "30m"}))
    args.budget = "15m"
    assert bench_tune._tuned(tmp_path, tmp_path / "none.yaml", "encode-heavy", 8,
                             tmp_path / "none.yaml", args) == (doc, 900.0)
    assert bench_tune.budget_for("15m", 4) == "15m" and bench_tune.budget_for("90s", 12) == "4.5m"


def test_more_gpus_than_four_run_the_cost_model_slower(tmp_path: Path) -> None:
    import yaml

    cost = tmp_path / "encode-heavy.yaml"
    cost.write_text("time_scale: 4\ngpu: {memory: 80GiB}\n")
    assert bench_tune._scaled(cost, 4, tmp_path / "run") == cost
    (tmp_path / "run").mkdir()
    scaled = bench_tune._scaled(cost, 8, tmp_path / "run")
    assert yaml.safe_load(scaled.read_text()) == {"time_scale": 8.0, "gpu": {"memory": "80GiB"}}


def test_a_resumed_run_keeps_its_settings(tmp_path: Path) -> None:
    import json

    args = argparse.Namespace(num_prompts=60, point_seconds=10.0, budget="15m")
    bench_tune._same_settings(tmp_path, args, "encode-heavy", 8)
    args.budget = "30m"  # tune is made again for it; the sweep stands
    bench_tune._same_settings(tmp_path, args, "encode-heavy", 8)
    bench_tune._same_settings(tmp_path, args, "encode-heavy", 8)  # the same: goes on
    with pytest.raises(SystemExit, match="was begun with"):
        bench_tune._same_settings(tmp_path, argparse.Namespace(**{**vars(args),
                                                                  "point_seconds": 0.0}),
                                  "encode-heavy", 8)
    # a run begun before the SLO was kept had the unstretched one: on 4 GPUs it goes on,
    # on 8 it was another SLO than the stretched one
    older = {"num_prompts": 60, "point_seconds": 10.0, "ladder_top": 256.0,
             "reference_gpus": 4}
    (tmp_path / "settings.json").write_text(json.dumps(older))
    bench_tune._same_settings(tmp_path, args, "encode-heavy", 4)
    (tmp_path / "settings.json").write_text(json.dumps(older))
    with pytest.raises(SystemExit, match="was begun with"):
        bench_tune._same_settings(tmp_path, args, "encode-heavy", 8)


def test_on_more_gpus_the_slo_stretches_with_the_time() -> None:
    """8 fake GPUs run every wait twice as long: the SLO too, so TP1 decoding (8 ms steps at
    time_scale 4: 32 ms, at 8: 64 ms) meets a 60 ms TPOT on 4 GPUs and its 120 ms on 8."""
    assert bench_tune.slo_for("encode-heavy", 4) == "ttft=3000,tpot=60"
    assert bench_tune.slo_for("encode-heavy", 8) == "ttft=6000,tpot=120"
    assert bench_tune.dilation(8) == 2.0 and bench_tune.dilation(2) == 1.0


@pytest.mark.parametrize(("size", "first"), [(0, "sweep"), (3, "tune")])
def test_an_exhaustive_sweep_runs_before_tune_a_sample_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, first: str) -> None:
    """--sweep 0 sweeps every candidate first (a sitting may stop it anywhere), then tunes;
    a sample needs tune's pick, so tune comes first."""

    calls: list[str] = []
    for name in ("EPDCTL_FAKE_GPUS", "EPDCTL_BENCH_COMMAND"):
        monkeypatch.setenv(name, "")  # restored after: run_one sets them
    monkeypatch.setattr(bench_tune, "_sweep_one",
                        lambda c, *a: calls.append("sweep") or 1.0)

    def tuned(*a: object) -> tuple[dict, float]:
        calls.append("tune")
        return {"best": "sim-4pd", "candidates": [
            {"name": "sim-4pd", "kind": "aggregated", "predicted_goodput": 1.0}]}, 10.0

    monkeypatch.setattr(bench_tune, "_tuned", tuned)
    args = argparse.Namespace(num_prompts=60, point_seconds=10.0, budget="15m", sweep=size,
                              port_offset=0, sweep_only=False, check_alone=0, shard=(0, 1))
    row = bench_tune.run_one("encode-heavy", 4, args, tmp_path)
    assert calls[0] == first and calls.count("tune") == 1
    assert calls.count("sweep") == row["swept"] == (29 if size == 0 else size)
    assert row["pick"] == "sim-4pd" and row["pick_ratio"] == 1.0
    if size == 0:  # --sweep-only: the same sweep (kept), then no tune
        calls.clear()
        args.sweep_only = True
        assert bench_tune.run_one("encode-heavy", 4, args, tmp_path) is None
        assert calls == []  # every candidate was kept from the run above
        (tmp_path / "encode-heavy-4" / "sweep-progress.json").unlink()
        assert bench_tune.run_one("encode-heavy", 4, args, tmp_path) is None
        assert calls == ["sweep"] * 29


def test_shards_split_the_sweep_and_keep_it_in_one_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--shard I/N: two runs of one cost model sweep disjoint halves (each in its own state
    dir, on its own base), and the one sweep-progress.json ends with every candidate, though
    each run kept its own copy of it in memory."""
    swept: list[tuple[str, str]] = []
    for name in ("EPDCTL_FAKE_GPUS", "EPDCTL_BENCH_COMMAND"):
        monkeypatch.setenv(name, "")  # restored after: run_one sets them
    monkeypatch.setattr(bench_tune, "_sweep_one",
                        lambda c, w, state, out: swept.append((c.name, state.name)) or 1.0)
    args = argparse.Namespace(num_prompts=60, point_seconds=10.0, budget="15m", sweep=0,
                              port_offset=0, sweep_only=True, check_alone=0, shard=(0, 2))
    first = bench_tune.Progress.load(tmp_path / "encode-heavy-4")  # a run begun before
    assert bench_tune.run_one("encode-heavy", 4, args, tmp_path) is None
    half = {name for name, _ in swept}
    assert {state for _, state in swept} == {"state"} and len(half) == 15
    first.add("sim-late", "e-pd", 2.0, 1.0)  # a stale copy loses nothing
    swept.clear()
    args.shard, args.port_offset = (1, 2), 100
    assert bench_tune.run_one("encode-heavy", 4, args, tmp_path) is None
    assert {state for _, state in swept} == {"state-1"} and len(swept) == 14
    assert not half & {name for name, _ in swept}
    done = bench_tune.Progress.load(tmp_path / "encode-heavy-4").done
    assert len(done) == 30 and "sim-late" in done
    assert (tmp_path / "encode-heavy-4" / "base-1.yaml").exists()


@pytest.mark.parametrize("text", ["1", "2/2", "a/b", "-1/2"])
def test_a_shard_is_i_of_n(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench_tune._shard(text)
    assert bench_tune._shard("1/3") == (1, 3)


def test_the_base_with_its_ports_moved(tmp_path: Path) -> None:
    """--port-offset: a second run beside the first gets ports of its own, and the base is
    still a topology `up` takes, on this venv's fake engine and the given cost model."""
    from epdctl.topology.model import load_topology

    cost = tmp_path / "cost.yaml"
    topology = load_topology(bench_tune._base(tmp_path, cost, 100))
    assert topology.proxy.port == 8300
    assert (topology.ports.base, topology.ports.side_channel_base) == (8310, 5800)
    assert topology.engine.command[-1] == str(cost)
    moved = load_topology(bench_tune._base(tmp_path, cost))
    assert moved.proxy.port == 8200


def test_the_fastest_are_swept_again_alone(tmp_path: Path) -> None:
    """--check-alone 2: the two highest knees (a zero is never one), swept again once (kept
    in alone.json), and how far the two sweeps differ."""
    progress = bench_tune.Progress.load(tmp_path)
    for name, knee in (("a", 4.0), ("b", 9.0), ("c", 0.0), ("d", 8.0)):
        progress.add(name, "e-pd", knee, 60.0)
    alone = bench_tune.Alone.load(tmp_path)
    assert alone.figures(progress, 2) == {}
    assert alone.wanted(progress, 2) == ["b", "d"]
    alone.add("b", 9.9, 50.0)
    alone.add("d", 7.6, 50.0)
    again = bench_tune.Alone.load(tmp_path)
    assert again.wanted(progress, 2) == [] and again.wanted(progress, 3) == ["a"]
    got = again.figures(progress, 2)
    assert got["alone"] == {"b": (9.0, 9.9), "d": (8.0, 7.6)}
    assert got["alone_dev"] == pytest.approx(0.1)
    assert bench_tune.Alone.fastest(progress, 9) == ["b", "d", "a"]


def test_the_pick_and_the_sweeps_best_are_measured_again_by_one_method(
        tmp_path: Path) -> None:
    """The one-measure rule: two candidates with one knee, measured on a machine whose
    speed drifts (each run 2 % slower than the last), come out at 1.0 in the alternating
    order; an interrupted run keeps what it measured."""
    runs: list[str] = []
    knee = {"pick": 9.0, "best": 9.0}

    def measure(name: str) -> float:
        runs.append(name)
        return knee[name] * (1 - 0.02 * len(runs))

    one = bench_tune.OneMeasure.load(tmp_path)
    ratio, means = one.ratio("pick", "best", measure, rounds=2)
    assert runs == ["pick", "best", "best", "pick"]
    assert ratio == pytest.approx(1.0) and set(means) == {"pick", "best"}
    runs.clear()
    assert bench_tune.OneMeasure.load(tmp_path).ratio("pick", "best", measure)[0] \
        == pytest.approx(ratio)  # kept in remeasured.json: nothing run again
    assert runs == []
    assert one.ratio("same", "same", measure) == (1.0, {})
    assert bench_tune.alternating("a", "b", 3) == ["a", "b", "b", "a", "a", "b"]
