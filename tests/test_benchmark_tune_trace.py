"""benchmarks/tune.py --trace: the mixed trace it is run on (benchmarks/tune_trace.py), and a
run's flow: the sweep replays the trace from TRACE_TOP, `tune --trace` is what is scored,
and the trace tuned as its average shape is compared by one measure."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path
from typing import Any

import pytest

from epdctl.traces.classes import counts
from epdctl.traces.format import read_trace

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
SPEC = importlib.util.spec_from_file_location("bench_tune_t", BENCHMARKS / "tune.py")
assert SPEC and SPEC.loader
bench_tune = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_tune)
tune_trace = bench_tune.tune_trace
TRACE = BENCHMARKS / "traces" / "mixed.jsonl"


def test_the_mixed_trace_is_three_classes_in_bursts_and_the_file_is_it(tmp_path: Path
                                                                       ) -> None:
    trace = tune_trace.mixed_trace()
    assert counts(trace.requests) == {"image": 48, "text": 48, "image4": 24}
    assert all(r.stream for r in trace.requests)
    times = [r.timestamp_ms for r in trace.requests]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) >= 0 and statistics.pstdev(gaps) / statistics.mean(gaps) > 1.5  # bursts
    assert tune_trace.average_shape(trace) == {"images": 1, "input_len": 186,
                                               "output_len": 67}
    # the committed file is what the generator writes (a rerun replays the same trace)
    assert read_trace(TRACE).requests == trace.requests


def test_a_trace_run_sweeps_it_tunes_it_and_its_average_shape(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EPDCTL_FAKE_GPUS", "EPDCTL_BENCH_COMMAND"):
        monkeypatch.setenv(name, "")  # restored after: run_one sets them
    searches: list[tuple[float, ...]] = []

    def sweep(candidate: Any, job: Any, state: Path, out: Path) -> float:
        searches.append(job.search)
        return 3.0 if candidate.name == "sim-2e-2pd" else 1.0

    tuned: list[tuple[str, list[str]]] = []

    def tune(run_dir: Path, base: Path, model: str, gpus: int, cost: Path,
             args: argparse.Namespace, name: str = "tune", workload: Any = ()
             ) -> tuple[dict[str, Any], float]:
        tuned.append((name, list(workload)))
        best = "sim-2e-2pd" if name == "tune" else "sim-4pd"
        return {"best": best, "candidates": [
            {"name": "sim-2e-2pd", "kind": "e-pd", "predicted_goodput": 3.0},
            {"name": "sim-4pd", "kind": "aggregated", "predicted_goodput": 1.0}]}, 10.0

    measured: list[tuple[str, str, str]] = []

    def one_measure(run_dir: Path, job: Any, pick: str, best: str, sweep: Any,
                    kind: Any = None, sub: str = "remeasure") -> tuple[float, dict]:
        measured.append((pick, best, sub))
        return (0.5 if sub == "avg-remeasure" else 1.0), {}

    monkeypatch.setattr(bench_tune, "_sweep_one", sweep)
    monkeypatch.setattr(bench_tune, "_tuned", tune)
    monkeypatch.setattr(bench_tune, "_one_measure", one_measure)
    args = argparse.Namespace(num_prompts=60, point_seconds=10.0, budget="15m", sweep=0,
                              port_offset=0, sweep_only=False, check_alone=0, shard=(0, 1),
                              trace=TRACE)
    row = bench_tune.run_one("encode-heavy", 4, args, tmp_path)
    assert row is not None and (tmp_path / "encode-heavy-4-mixed" / "settings.json").exists()
    assert len(searches) == 29 and searches[0][0] == tune_trace.TRACE_TOP
    assert searches[0][1:] == bench_tune.SEARCH[1:]
    assert [name for name, _ in tuned] == ["tune", "tune-avg"]
    assert tuned[1][1][:2] == ["--images", "1"] and "186" in tuned[1][1]
    assert measured == [("sim-2e-2pd", "sim-2e-2pd", "remeasure"),  # the pick is the best
                        ("sim-4pd", "sim-2e-2pd", "avg-remeasure")]
    assert row["pick"] == "sim-2e-2pd" and row["avg_pick"] == "sim-4pd"
    assert row["avg_ratio"] == 0.5 and row["pick_ratio"] == 1.0


def test_a_run_of_another_trace_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text(TRACE.read_text().replace('"input_length": 64', '"input_length": 65'))
    args = argparse.Namespace(num_prompts=60, point_seconds=10.0, budget="15m", trace=TRACE)
    bench_tune._same_settings(tmp_path, args, "encode-heavy", 4)
    bench_tune._same_settings(tmp_path, args, "encode-heavy", 4)  # the same trace: goes on
    args.trace = other
    with pytest.raises(SystemExit, match="was begun with"):
        bench_tune._same_settings(tmp_path, args, "encode-heavy", 4)
