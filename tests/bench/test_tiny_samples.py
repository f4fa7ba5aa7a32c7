"""Figures and verdicts from a few requests per load point under many ratios (Bonferroni):
wide intervals or an honest `undecided`, never a traceback; and the paths beside it (one
request a round, a round with none completed, every request failed, a class of one request,
`bench compare` of two such runs)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench import estimates as stats
from epdctl.bench import report, verdicts
from epdctl.bench.compare import compare, load
from epdctl.bench.estimates import summarize
from epdctl.bench.runner import ArmRun, PointRun
from epdctl.bench.samples import Request, Round
from epdctl.bench.verdicts import Comparison, judge
from epdctl.bench.workload import LoadPoint, Workload
from tests.bench import test_by_class
from tests.bench.synthetic import make_round
from tests.bench.test_report import ARMS


def sample(seed: int, n: int, failed: int = 0, same: bool = False) -> Round:
    """n completed requests (`same`: all alike) and `failed` failed ones."""
    if same:
        return Round(n * 0.4, 2.5, (Request(100.0, 20.0, 400.0, True),) * n, failed)
    drawn = make_round(random.Random(seed), n) if n else Round(1.0, 0.0, ())
    return Round(drawn.duration_s, drawn.request_throughput, drawn.requests, failed)


def arm_run(index: int, rounds: list[list[Round]]) -> ArmRun:
    """rounds[r][point]; in turn A B | B A: arm 0 brought up each round, arm 1 kept up."""
    order = [(r, p) for r in range(len(rounds)) for p in range(len(rounds[r]))]
    points = [PointRun(p, ["vllm", "bench", "serve"], {"completed": len(s.requests),
                                                       "failed": s.failed}, {}, None, 1.0,
                       round=r, samples=s, seq=10 * r + 2 * p + (index == r % 2),
                       start=r if index == 0 else 0)
              for r, p in order for s in [rounds[r][p]]]
    return ArmRun(ARMS[index], [], [], points, starts=len(rounds) if index == 0 else 1)


def bench(n: int, points: int = 6, rounds: int = 2, same: bool = False,
          epd: dict[tuple[int, int], Round] | None = None) -> dict[str, Any]:
    """A report of `points` load points of n requests each, `rounds` rounds; `epd`:
    (round, point) -> the epd arm's round there in place of n requests."""
    runs = [arm_run(index, [[(epd or {}).get((r, p)) if index == 0 and (r, p) in (epd or {})
                             else sample(1000 * index + 10 * r + p, n, same=same)
                             for p in range(points)] for r in range(rounds)])
            for index in (0, 1)]
    load_points = tuple(LoadPoint(float(rate)) for rate in range(1, points + 1))
    return report.build(runs, Workload(points=load_points, num_prompts=n), [])


def test_two_requests_take_an_interval_however_many_ratios() -> None:
    """Two requests per arm at 95 %: the expanded interval takes z = sqrt(2) t(0.975, 1) =
    18, whose level is 1.0 in floating point; no normal quantile answers that."""
    a, b = (summarize([make_round(random.Random(seed), 2)], False, seed) for seed in (1, 2))
    bounds = verdicts.ratio_interval(a, b, "request_throughput", 0.95)
    assert bounds is not None
    ratio = a.estimate["request_throughput"] / b.estimate["request_throughput"]
    assert 0 < bounds[0] < ratio < bounds[1] < math.inf
    assert stats.expanded(0.95, 2) == 1.0
    assert stats.expanded_z(0.95, 2) == pytest.approx(math.sqrt(2) * 12.7062, rel=1e-4)
    (v,) = judge([Comparison(0, "c1", "x", "y", a, b)], False)
    assert (v["kind"], v["reason"]) == ("undecided", "one start per arm")
    assert all(f["ci"] is not None for f in v["figures"].values())


def test_six_load_points_of_two_requests_each() -> None:
    """The report that crashed: 6 points x 2 requests x 2 rounds, each interval at
    1 - 0.05 / 12 (req/s and TPOT at each point; 4 requests support no TTFT p50). Every
    ratio is shown with its (very wide) interval, and nothing is decided."""
    doc = bench(2)
    assert len(doc["verdicts"]) == 6
    for v in doc["verdicts"]:
        assert (v["kind"], v["decided"], v["reason"]) == ("undecided", False, None), v
        assert v["level"] == pytest.approx(1 - 0.05 / 12, abs=1e-5)
        assert set(v["figures"]) == {"request_throughput", "tpot_mean_ms"}
        for f in v["figures"].values():
            assert f["side"] == "undecided" and f["ci"][0] < f["ratio"] < f["ci"][1]
        assert v["text"].startswith("`epd` vs `aggregated`: no significant difference at n=4: "
                                    "req/s ")
    assert all(r["figures"]["request_throughput_ci"] for r in doc["results"])


@pytest.mark.parametrize(("rounds", "same"), [(2, False), (2, True), (1, False)],
                         ids=["two-rounds", "all-alike", "one-round"])
def test_one_request_a_round_gives_figures_and_too_few_requests(rounds: int,
                                                                same: bool) -> None:
    """A request resampled alone shows no spread: no interval, so no verdict, whatever the
    starts say (all alike, its ratios came out [1.00, 1.00], "on par")."""
    doc = bench(1, rounds=rounds, same=same)
    for v in doc["verdicts"]:
        assert (v["kind"], v["decided"], v["reason"], v["level"]) == (
            "undecided", False, "too few requests", None), v
        assert {k: (f["ci"], f["side"]) for k, f in v["figures"].items()} == {
            k: (None, "undecided") for k in ("request_throughput", "tpot_mean_ms")}
        assert v["text"].startswith("`epd` vs `aggregated`: undecided (too few requests); "
                                    "figures only, not a verdict: req/s ")
        assert v["text"].endswith("(no round of `epd` and `aggregated` completed two "
                                  "requests: one request resamples to itself and shows no "
                                  "spread, so no interval stands on it; more requests per "
                                  "load point for one)")
        assert not report.is_undecided({"verdicts": [v]})  # more rounds would not help
    for row in doc["results"]:  # the figures, without an interval
        assert row["figures"]["request_throughput"] > 0
        assert row["figures"]["request_throughput_ci"] is None
    assert "too few requests" in report.markdown(doc)


def test_rounds_with_none_completed_or_every_request_failed() -> None:
    """epd, point 0: a round with nothing completed (nothing failed either), then one of 2;
    point 1: a round whose 2 requests failed; point 2: every request failed."""
    doc = bench(2, points=3, epd={(0, 0): sample(0, 0), (0, 1): sample(1, 0, failed=2),
                                  (0, 2): sample(2, 0, failed=2),
                                  (1, 2): sample(3, 0, failed=2)})
    empty, failed, dead = doc["verdicts"]
    assert (empty["kind"], empty["n"]) == ("undecided", 2) and empty["figures"]
    assert failed["kind"] == dead["kind"] == "not_comparable"
    assert dead["text"] == "`epd` vs `aggregated`: not comparable (`epd` 4 failed)"
    row = doc["results"][4]
    assert (row["arm"], row["n"], row["figures"]["request_throughput"]) == ("epd", 0, None)


def test_a_class_of_one_request_a_round_is_shown_without_an_interval() -> None:
    doc = test_by_class.build({"text": 30, "video": 1}, rounds=1)
    for row in doc["results"]:
        video = next(c for c in row["classes"] if c["class"] == "video")
        assert video["n"] == 1 and video["figures"]["request_throughput"] > 0
        assert video["figures"]["request_throughput_ci"] is None
    assert {v["kind"] for v in doc["verdicts"] if v.get("class") == "video"} == {"none"}


@pytest.mark.parametrize("n", [1, 2])
def test_bench_compare_of_two_runs_of_few_requests(n: int, tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(bench(n)))
    out = compare(load(tmp_path / "a"), load(tmp_path / "b"))
    assert len(out["verdicts"]) == 12  # 6 points x 2 arms
    for v in out["verdicts"]:
        assert v["kind"] == "undecided" and v["figures"], v
        assert v["reason"] == ("too few requests" if n == 1 else None)
