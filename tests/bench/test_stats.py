"""The intervals against known distributions, the A/A false-verdict rate, the verdict rule."""

from __future__ import annotations

import random

import pytest

from epdctl.bench import stats, verdicts
from epdctl.bench.samples import parse_round
from epdctl.bench.stats import needs, percentile, summarize
from epdctl.bench.verdicts import Comparison, judge
from epdctl.errors import BenchError
from tests.bench.synthetic import make_round, true_figures

SEEDS = 100
RESAMPLES = 300  # enough for a 95 % interval; the tests run many seeds
AA_RESAMPLES = 150  # the ratio's interval needs only the replicates' spread


def test_percentile_is_numpy_s_linear_one() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([5.0], 99) == 5.0
    assert [needs(q) for q in (50, 90, 99)] == [20, 100, 1000]


@pytest.mark.parametrize("rounds", [2, 3])
def test_95_percent_intervals_cover_the_truth_about_95_percent_of_the_time(rounds: int) -> None:
    """Over requests (2 rounds) and over rounds (3): each interval holds the true value in
    0.9-0.99 of the seeds."""
    truth = true_figures()
    names = ("ttft_p50_ms", "ttft_p90_ms", "tpot_mean_ms", "request_throughput")
    covered = dict.fromkeys(names, 0)
    for seed in range(SEEDS):
        rng = random.Random(seed)
        summary = summarize([make_round(rng, 200 // rounds) for _ in range(rounds)],
                            False, seed, RESAMPLES)
        for name in names:
            ci = summary.ci[name]
            assert ci is not None
            covered[name] += ci[0] <= truth[name] <= ci[1]
    rates = {k: v / SEEDS for k, v in covered.items()}
    assert all(0.9 <= r <= 0.99 for r in rates.values()), rates


def synthetic_runs(scale: float, n: int = 24, points: int = 2) -> list[list[Comparison]]:
    """Synthetic bench runs of 2 rounds x `points` load points, arm a's latencies `scale`
    times arm b's."""
    runs = []
    for seed in range(SEEDS):
        rng = random.Random(1000 + seed)
        comparisons = []
        for point in range(points):
            mine = summarize([make_round(rng, n, scale) for _ in range(2)], True,
                             seed * 7 + point, AA_RESAMPLES)
            theirs = summarize([make_round(rng, n) for _ in range(2)], True,
                               seed * 7 + point + 3, AA_RESAMPLES)
            comparisons.append(Comparison(point, f"p{point}", "a", "b", mine, theirs))
        runs.append(comparisons)
    return runs


def flagged(runs: list[list[Comparison]], same: float) -> float:
    """The share of runs with a verdict anywhere."""
    return sum(any(v["kind"] in ("better", "worse", "mixed") for v in judge(c, True, same=same))
               for c in runs) / len(runs)


def test_an_a_a_run_gets_a_verdict_in_at_most_5_percent_of_runs() -> None:
    """Even without the 5 % band (same=0): the correction alone keeps the whole report's
    false verdicts at 5 %; with the band, fewer still."""
    runs = synthetic_runs(1.0)
    assert flagged(runs, same=0.0) <= 0.05
    assert flagged(runs, same=verdicts.SAME) <= 0.05


def test_a_real_difference_is_found() -> None:
    """The same rule is not blind: latencies 1.5x the other arm's, 48 requests per arm."""
    assert flagged(synthetic_runs(1.5), same=verdicts.SAME) >= 0.9


def fixed(value: float, spread: float, n: int = 100) -> stats.Summary:
    """A summary whose every figure is `value`, its replicates `spread` (relative) apart."""
    rng = random.Random(int(value * 1000 + spread * 1e6))
    reps = [value * rng.lognormvariate(0.0, spread) for _ in range(200)]
    names = stats.FIGURES
    return stats.Summary(n, dict.fromkeys(names, value), dict.fromkeys(names, (value, value)),
                         {}, dict.fromkeys(names, reps))


def test_on_par_is_decided_and_still_no_difference() -> None:
    """Tight intervals within the 5 % band: on par, said as no significant difference."""
    (found,) = judge([Comparison(0, "c1", "x", "y", fixed(1.01, 0.004), fixed(1.0, 0.004))],
                     False)
    assert found["kind"] == "on_par" and found["decided"] is True
    assert found["text"].startswith("`x` vs `y`: no significant difference at n=100, on par")
    assert "req/s 1.01x [1.00, 1.02]" in found["text"]


def test_mixed_when_figures_disagree() -> None:
    mine, theirs = fixed(2.0, 0.01), fixed(1.0, 0.01)  # more req/s, and slower latencies
    (found,) = judge([Comparison(0, "c1", "x", "y", mine, theirs)], False)
    assert found["kind"] == "mixed"
    assert found["text"].startswith("`x` vs `y`: mixed, better req/s 2.00x [")
    assert ", worse TTFT p50 2.00x [" in found["text"]


def summary(seed: int, scale: float, n: int = 300, chunked: bool = True) -> stats.Summary:
    rng = random.Random(seed)
    return summarize([make_round(rng, n, scale, chunked) for _ in range(2)], False, seed,
                     RESAMPLES)


def test_verdicts_better_worse_undecided() -> None:
    faster, base, slower = summary(1, 0.7), summary(2, 1.0), summary(3, 1.4)
    small_a, small_b = summary(4, 1.0, n=10), summary(5, 1.03, n=10)
    found = judge([Comparison(0, "c1", "epd", "agg", faster, base),
                   Comparison(1, "c4", "epd", "agg", slower, base),
                   Comparison(2, "c16", "epd", "agg", small_a, small_b)], False)
    assert [v["kind"] for v in found] == ["better", "worse", "undecided"]
    assert found[0]["text"].startswith("`epd` is better than `agg` here: req/s 1.")
    assert "TTFT p50 0.7" in found[0]["text"] and "TPOT 0.7" in found[0]["text"]
    assert found[1]["text"].startswith("`agg` is better than `epd` here: req/s 0.")
    assert found[2]["text"].startswith("`epd` vs `agg`: no significant difference at n=20: "
                                       "req/s ")
    assert found[2]["decided"] is False and found[0]["decided"] is True
    assert "TTFT p90" not in found[2]["text"]  # 20 requests support no p90: not judged
    lo, hi = found[0]["figures"]["tpot_mean_ms"]["ci"]
    assert lo <= found[0]["figures"]["tpot_mean_ms"]["ratio"] <= hi < 0.95


def test_tpot_of_one_chunk_outputs_is_n_a_not_zero() -> None:
    s = summary(8, 1.0, chunked=False)
    assert s.unsupported["tpot_mean_ms"] == "n/a"
    assert s.estimate["tpot_mean_ms"] is None and s.ci["tpot_mean_ms"] is None
    (found,) = judge([Comparison(0, "c1", "x", "y", s, summary(9, 1.0, chunked=False))], False)
    assert "tpot_mean_ms" not in found["figures"]


def test_a_detailed_result_becomes_requests() -> None:
    """vLLM's --save-detailed lists; a one-chunk output (no ITLs) has no TPOT; a failed
    request is left out; goodput follows vLLM's rule."""
    data = {"duration": 2.0, "request_throughput": 1.0, "failed": 1,
            "ttfts": [0.1, 0.2, 0.0], "itls": [[0.01, 0.01], [], []],
            "latencies": [0.12, 0.2, 0.0], "output_lens": [3, 3, 0],
            "errors": ["", "", "boom"]}
    r = parse_round(data, (("ttft", 150.0),))
    assert [(q.ttft_ms, q.tpot_ms, q.good) for q in r.requests] == [
        (100.0, pytest.approx(10.0), True), (200.0, None, False)]
    assert r.failed == 1 and r.duration_s == 2.0
    assert type(r).from_json(r.as_json()) == r
    with pytest.raises(BenchError, match="--save-detailed"):
        parse_round({"duration": 1.0, "completed": 3})
