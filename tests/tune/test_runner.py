"""The tune loop with a stand-in profiler and confirmer: profiles kept and reused, the
aggregated candidate confirmed, the budget honoured, the best measured one named."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from epdctl.bench.workload import LoadPoint, Workload
from epdctl.topology.model import Topology, parse_topology
from epdctl.tune.candidates import GIB, Candidate, Shape
from epdctl.tune.decide import Measured
from epdctl.tune.des import StepCost
from epdctl.tune.facts import ModelFacts
from epdctl.tune.model import Slo
from epdctl.tune.probes import HANDOFF, Measurements
from epdctl.tune.runner import PROFILES, Settings, tune

BASE = parse_topology({"name": "b", "model": "m", "roles": {"prefill_decode": {}}})
STAGES = {"encode": StepCost(fixed_ms=5, per_image_ms=20),
          "pd-tp1": StepCost(fixed_ms=10, per_token_ms=0.01, per_seq_ms=0.2),
          "pd+enc-tp1": StepCost(fixed_ms=10, per_token_ms=0.05, per_seq_ms=0.2),
          "prefill-tp1": StepCost(fixed_ms=8, per_token_ms=0.01),
          "decode-tp1": StepCost(fixed_ms=10, per_seq_ms=0.2)}


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)


def settings(tmp_path: Path, budget_s: float = 1e9) -> Settings:
    return Settings(base=BASE, gpus=(0, 1, 2), slo=Slo(ttft_ms=500, tpot_ms=50),
                    workload=Workload(points=(LoadPoint(),), images=1, image_size=(256, 256),
                                      input_len=64, output_len=16),
                    facts=ModelFacts(heads=1, weights=GIB, encoder_weights=GIB,
                                     kv_per_token=1024),
                    gpu_memory=80 * GIB, out_dir=tmp_path / "out", budget_s=budget_s,
                    sim_requests=120)


def profiler_calls(calls: list[str], told: list[frozenset[str]] | None = None
                   ):  # type: ignore[no-untyped-def]
    def profile(shape: Shape, topology: Topology, known: frozenset[str]) -> Measurements:
        calls.append(shape.label)
        if told is not None:
            told.append(known)
        from epdctl.tune.model import needed_stages

        handoff = shape.encoders and shape.pd.replicas and HANDOFF not in known
        return Measurements({k: STAGES[k] for k in needed_stages(shape) if k not in known},
                            kv_ms=2.0, ec_ms=3.0 if handoff else None)
    return profile


def confirm(candidate: Candidate, knee: float) -> Measured:
    got = knee * (1.2 if candidate.shape.kind == "e-pd" else 0.9)
    return Measured(candidate.name, got, points=((got / 2, 1.0), (got * 2, 0.5)))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_tune_predicts_confirms_and_keeps_profiles(tmp_path: Path) -> None:
    calls: list[str] = []
    log = Log()
    report = tune(settings(tmp_path), profiler_calls(calls), confirm, log, Clock())
    assert calls and (tmp_path / "out" / PROFILES).is_file()
    rows = report["candidates"]
    assert all(r["predicted_goodput"] is not None for r in rows)
    confirmed = [r for r in rows if r["measured_goodput"] is not None]
    assert any(r["kind"] == "aggregated" for r in confirmed) and len(confirmed) >= 2
    assert report["best"] in {r["name"] for r in confirmed}
    best = max(confirmed, key=lambda r: r["measured_goodput"])
    assert report["best"] == best["name"]
    assert all(r["prediction_error"] is not None for r in confirmed)
    again: list[str] = []
    confirmed: list[str] = []

    def confirm_again(candidate: Candidate, knee: float) -> Measured:
        confirmed.append(candidate.name)
        return confirm(candidate, knee)

    second = tune(settings(tmp_path), profiler_calls(again), confirm_again, Log(), Clock())
    assert again == [] and confirmed == []  # profiles and confirmations kept in --out
    assert second["best"] == report["best"]
    other = replace(settings(tmp_path), slo=Slo(ttft_ms=900, tpot_ms=50))
    tune(other, profiler_calls(again), confirm, Log(), Clock())
    assert again  # another SLO: profiled again


def test_each_probe_is_told_what_earlier_probes_profiled(tmp_path: Path) -> None:
    """E stands in front of every E|PD and E|P|D probe: profiled in the first, skipped after;
    every candidate is still predicted from the merged profiles."""
    calls: list[str] = []
    told: list[frozenset[str]] = []
    report = tune(settings(tmp_path), profiler_calls(calls, told), confirm, Log(), Clock())
    assert len(calls) > 2 and told[0] == frozenset()
    first_with_e = next(i for i, label in enumerate(calls) if "E" in label)
    assert all("encode" in known for known in told[first_with_e + 1:])
    assert all(b >= a for a, b in zip(told, told[1:], strict=False))  # only grows
    assert all(r["predicted_goodput"] is not None for r in report["candidates"])


def test_the_ec_handoff_is_timed_once_and_reported(tmp_path: Path) -> None:
    """The first E|PD probe times the hand-off; every later probe is told (HANDOFF), and a
    rerun that keeps the profiles still has it."""
    calls: list[str] = []
    told: list[frozenset[str]] = []
    report = tune(settings(tmp_path), profiler_calls(calls, told), confirm, Log(), Clock())
    first = next(i for i, label in enumerate(calls) if "E" in label and "PD" in label)
    assert all(HANDOFF not in known for known in told[: first + 1])
    assert all(HANDOFF in known for known in told[first + 1:]) and told[first + 1:]
    assert report["handoffs"] == {"ec_ms": 3.0, "kv_ms": 2.0, "sharing_slowdown": 0.0}
    from epdctl.cli._tune_render import markdown

    assert "EC (the proxy's hop from E's answer to PD) 3 ms" in markdown(report)
    again = tune(settings(tmp_path), profiler_calls([]), confirm, Log(), Clock())
    assert again["handoffs"]["ec_ms"] == 3.0


def test_budget_stops_it_and_says_what_was_left_out(tmp_path: Path) -> None:
    clock = Clock()
    calls: list[str] = []

    def slow(candidate: Candidate, knee: float) -> Measured:
        calls.append(candidate.name)
        clock.now += 100.0  # a confirmation takes 100 s
        return confirm(candidate, knee)

    # profiling takes a few ticks; one confirmation fits in the budget, a second does not
    report = tune(settings(tmp_path, budget_s=150.0), profiler_calls([]), slow, Log(), clock)
    assert len(calls) == 1
    assert "budget is spent" in report["stop_reason"] and "a run takes ~101 s" in \
        report["stop_reason"]
    assert report["best"] == calls[0]  # what it has
    assert report["not_confirmed"] and calls[0] not in report["not_confirmed"]
    predicted = {r["name"] for r in report["candidates"] if r["predicted_goodput"]}
    assert set(report["not_confirmed"]) == predicted - set(calls)
    assert report["not_profiled"] == []


def test_plot_of_a_report(tmp_path: Path) -> None:
    import pytest

    pytest.importorskip("matplotlib")
    from epdctl.tune.plot import write_plot

    report = tune(settings(tmp_path), profiler_calls([]), confirm, Log(), Clock())
    assert write_plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert not write_plot({"candidates": []}, tmp_path / "none.png")


def test_the_measurements_correct_the_other_predictions(tmp_path: Path) -> None:
    """The stand-in machine does 1.2x the prediction for E|PD, 0.9x for the others: each
    unconfirmed candidate's prediction is scaled by what the confirmed ones bound by the
    same stage measured (else on the same engine, else by those of its kind, else by every
    confirmed one's)."""
    import math

    from epdctl.tune.model import engine_of

    report = tune(settings(tmp_path), profiler_calls([]), confirm, Log(), Clock())
    rows = {r["name"]: r for r in report["candidates"]}
    confirmed = [r for r in rows.values() if r["measured_goodput"] is not None]
    assert {r["kind"] for r in confirmed} >= {"aggregated", "e-pd"}

    def gmean(group: list[dict]) -> float:  # type: ignore[type-arg]
        ratios = [r["measured_goodput"] / r["predicted_goodput"] for r in group]
        return math.exp(sum(map(math.log, ratios)) / len(ratios))

    by_stage = 0
    for r in rows.values():
        if r["measured_goodput"] is not None:
            assert r["corrected_goodput"] == pytest.approx(r["measured_goodput"], abs=1e-3)
        elif r["predicted_goodput"]:
            same = [c for c in confirmed if c["binding_stage"] == r["binding_stage"]]
            engine = [c for c in confirmed
                      if engine_of(c["binding_stage"]) == engine_of(r["binding_stage"])]
            kind = [c for c in confirmed if c["kind"] == r["kind"]]
            by_stage += bool(same)
            assert r["corrected_goodput"] == pytest.approx(
                r["predicted_goodput"] * gmean(same or engine or kind or confirmed), rel=1e-3)
    assert by_stage  # some were corrected by their own stage's ratio


def test_a_rerun_decides_on_the_kept_samples(tmp_path: Path) -> None:
    from epdctl.bench.samples import Request, Round

    def with_samples(candidate: Candidate, knee: float) -> Measured:
        got = confirm(candidate, knee)
        good = 40 if candidate.shape.kind == "e-pd" else 30
        reqs = tuple(Request(100.0, 20.0, 800.0, i < good) for i in range(40))
        above = tuple(Request(100.0, 20.0, 800.0, i < good // 2) for i in range(50))
        return replace(got, samples=(Round(40 / got.goodput, got.goodput, reqs),),
                       above=(Round(50 / got.goodput, 50 / got.goodput, above),))

    first = tune(settings(tmp_path), profiler_calls([]), with_samples, Log(), Clock())
    kept: list[str] = []

    def never(candidate: Candidate, knee: float) -> Measured:
        kept.append(candidate.name)
        raise AssertionError("kept in confirmed.json")

    again = tune(settings(tmp_path), profiler_calls([]), never, Log(), Clock())
    assert kept == [] and again["best"] == first["best"]
    import json

    from epdctl.tune.runner import _measured

    entries = json.loads((tmp_path / "out" / "confirmed.json").read_text())["entries"]
    back = [_measured(name, e) for name, e in entries.items()]
    assert back and all(len(m.samples) == 1 and len(m.samples[0].requests) == 40
                        for m in back)
    assert all(len(m.above) == 1 and len(m.above[0].requests) == 50 for m in back)


def test_a_budget_spent_while_profiling_stops_it_there(tmp_path: Path) -> None:
    calls: list[str] = []
    clock = Clock()
    profile = profiler_calls(calls)

    def slow(shape: Shape, topology: Topology, known: frozenset[str]) -> Measurements:
        clock.now += 100.0  # a probe takes 100 s: the budget is spent after the first
        return profile(shape, topology, known)

    report = tune(settings(tmp_path, budget_s=50.0), slow, confirm, Log(), clock)
    assert len(calls) == 1 and report["not_profiled"]
    assert set(report["not_profiled"]).isdisjoint(calls)
    rows = report["candidates"]
    unpredicted = [r for r in rows if r["predicted_goodput"] is None]
    assert unpredicted and all(r["not_profiled"] for r in unpredicted)
    assert any(r["predicted_goodput"] is not None for r in rows)  # what it has
    assert "budget" in report["stop_reason"] and report["best"] is None

    from epdctl.cli._tune_render import left_out, markdown

    said = left_out(report)
    assert said[0].startswith("not profiled") and report["not_profiled"][0] in said[0]
    assert said[1].startswith("not confirmed: ")
    assert "Not profiled (so not predicted): " in markdown(report)


def test_a_disaggregated_candidate_not_decided_better_than_aggregated_is_not_recommended(
        tmp_path: Path) -> None:
    def close(candidate: Candidate, knee: float) -> Measured:
        got = 6.3 if candidate.shape.kind == "aggregated" else 6.45  # 2 % apart: no verdict
        return Measured(candidate.name, got, points=((got, 1.0), (got * 2, 0.5)))

    report = tune(settings(tmp_path), profiler_calls([]), close, Log(), Clock())
    rows = {r["name"]: r for r in report["candidates"]}
    confirmed = [r for r in rows.values() if r["measured_goodput"] is not None]
    assert any(r["kind"] != "aggregated" for r in confirmed)
    assert rows[report["best"]]["kind"] == "aggregated"
    assert "not decided to beat aggregated" in report["best_reason"]
    from epdctl.cli._tune_render import markdown

    assert "the simpler topology" in markdown(report)


def test_the_report_names_its_workload(tmp_path: Path) -> None:
    from dataclasses import replace

    from epdctl.cli._tune_render import markdown

    s = settings(tmp_path)
    s = replace(s, workload=replace(s.workload, point_seconds=10.0))
    report = tune(s, profiler_calls([]), lambda c, knee: Measured(c.name, knee),
                  Log(), Clock())
    assert report["workload"]["point_seconds"] == 10.0 and "points" not in report["workload"]
    assert f"{s.workload.num_prompts} requests per point or a rate's 10 s of them if more" \
        in markdown(report)
