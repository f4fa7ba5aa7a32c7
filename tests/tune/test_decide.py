"""The measured knee, the better-than decision and the stop rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from epdctl.bench.samples import Request, Round
from epdctl.tune.decide import (
    MAX_CONFIRM,
    Measured,
    above_knee,
    attainment,
    best_measured,
    corrected,
    is_better,
    knee,
    knee_rate,
    leading_families,
    next_step,
)


def test_attainment_and_knee() -> None:
    assert attainment({"request_goodput": 1.8, "request_throughput": 2.0}) == pytest.approx(0.9)
    assert attainment({"request_goodput": None, "request_throughput": 2.0}) is None
    assert knee([(1.0, 1.0), (2.0, 0.95), (4.0, 0.85)]) == pytest.approx(3.0)
    assert knee([(1.0, 1.0), (2.0, 1.0)]) == 2.0
    assert knee([(1.0, 0.5)]) == 0.0
    assert knee([(4.0, 0.5), (1.0, 0.92), (2.0, 0.9)]) == pytest.approx(2.0)


def test_is_better_with_and_without_intervals() -> None:
    a, b = Measured("a", 10.0), Measured("b", 9.0)
    assert is_better(a, b) is True and is_better(b, a) is False
    assert is_better(a, Measured("c", 9.8)) is None
    wide = Measured("a", 10.0, 8.0, 12.0)
    assert is_better(wide, Measured("b", 9.0, 8.5, 9.5)) is None
    assert is_better(Measured("a", 10.0, 9.6, 10.4), Measured("b", 9.0, 8.5, 9.5)) is True


PRED = [("x", 10.0), ("y", 8.0), ("agg", 5.0), ("z", 4.0)]


def test_aggregated_first_then_the_best_predicted() -> None:
    step = next_step(PRED, {}, must=["agg"], elapsed_s=0, budget_s=100, cost_s=10)
    assert (step.stop, step.next) == (False, "agg")
    step = next_step(PRED, {"agg": Measured("agg", 5.0)}, must=["agg"], elapsed_s=10,
                     budget_s=100, cost_s=10)
    assert (step.stop, step.next) == (False, "x")


def test_stops_when_decided() -> None:
    # x measured as predicted, agg too: y (8) cannot beat x (10) at a ratio of 1.0
    measured = {"agg": Measured("agg", 5.0), "x": Measured("x", 10.0)}
    step = next_step(PRED, measured, must=["agg"], elapsed_s=20, budget_s=100, cost_s=10)
    assert step.stop and "decided" in step.reason and step.left_out == ("y", "z")
    # the model underrated agg by 2x: y might be 16, so it runs
    measured["agg"] = Measured("agg", 10.0)
    step = next_step(PRED, measured, must=["agg"], elapsed_s=20, budget_s=100, cost_s=10)
    assert (step.stop, step.next) == (False, "y")


def test_stops_at_the_budget_and_says_what_it_left_out() -> None:
    step = next_step(PRED, {"agg": Measured("agg", 5.0)}, must=["agg"], elapsed_s=95,
                     budget_s=100, cost_s=10)
    assert step.stop and "budget" in step.reason and step.left_out == ("x", "y", "z")
    step = next_step(PRED, {n: Measured(n, g) for n, g in PRED}, elapsed_s=0, budget_s=1,
                     cost_s=10)
    assert step.stop and step.reason == "every candidate is confirmed"


def test_stops_after_max_confirm() -> None:
    measured = {"agg": Measured("agg", 20.0), "x": Measured("x", 30.0)}
    step = next_step(PRED, measured, must=["agg"], elapsed_s=0, budget_s=100, cost_s=1,
                     max_confirm=2)
    assert step.stop and step.left_out == ("y", "z")


def test_by_default_goes_on_past_four_while_one_could_still_win() -> None:
    """The 8-GPU case: four confirmed alike, all far under their predictions and under the
    aggregated one, and the fifth predicted could still beat it, so a fifth runs; at
    MAX_CONFIRM it stops."""
    many = [(f"c{i}", 18.0 - i / 10) for i in range(MAX_CONFIRM + 2)] + [("agg", 7.7)]
    measured = {"agg": Measured("agg", 9.8), **{f"c{i}": Measured(f"c{i}", 8.4)
                                                for i in range(4)}}
    step = next_step(many, measured, must=["agg"], elapsed_s=0, budget_s=1000, cost_s=1)
    assert (step.stop, step.next) == (False, "c4")
    measured.update({f"c{i}": Measured(f"c{i}", 8.4) for i in range(MAX_CONFIRM - 1)})
    step = next_step(many, measured, must=["agg"], elapsed_s=0, budget_s=1000, cost_s=1)
    assert step.stop and str(MAX_CONFIRM) in step.reason


def test_confirms_at_least_two() -> None:
    # agg measured far above every prediction: still one more is confirmed
    step = next_step(PRED, {"agg": Measured("agg", 50.0)}, must=["agg"], elapsed_s=0,
                     budget_s=100, cost_s=1)
    assert (step.stop, step.next) == (False, "x")


def rounds(rate: float, good: int, n: int = 40, latency_ms: float = 800.0,
           jitter_ms: float = 0.0) -> tuple[Round, ...]:
    """One round of `n` requests at `rate` req/s, `good` of them within the SLO."""
    requests = tuple(Request(100.0, 20.0, latency_ms + jitter_ms * ((i * 7) % 5 - 2),
                             i < good) for i in range(n))
    return (Round(n / rate, rate, requests),)


def test_knee_rate_is_the_last_point_before_the_first_miss() -> None:
    assert knee_rate([(4.0, 0.5), (1.0, 0.95), (2.0, 0.91)]) == 2.0
    assert knee_rate([(1.0, 0.95), (2.0, 0.5), (4.0, 0.95)]) == 1.0
    assert knee_rate([(1.0, 0.5)]) is None


def test_is_better_takes_benchs_verdict_where_there_are_samples() -> None:
    fast = Measured("fast", 10.0, samples=rounds(10.0, 40))
    slow = Measured("slow", 5.0, samples=rounds(5.0, 40))
    assert is_better(fast, slow) is True and is_better(slow, fast) is False
    # 10 % apart in the point estimates (MARGIN alone would call it) but 40 requests with
    # 36 vs 40 within the SLO: the goodput ratio's interval spans 1, so not decided
    a = Measured("a", 10.0, samples=rounds(10.0, 40, jitter_ms=200))
    b = Measured("b", 9.0, samples=rounds(10.0, 36, jitter_ms=200))
    assert is_better(a, b) is None and is_better(b, a) is None
    assert is_better(Measured("a", 10.0), Measured("b", 9.0)) is True
    # the verdict is on the samples, not on the goodput field
    same = rounds(8.0, 40)
    assert is_better(Measured("x", 10.0, samples=same), Measured("y", 5.0, samples=same)) \
        is None


def test_is_better_without_samples_on_one_side_uses_the_point_estimates() -> None:
    assert is_better(Measured("a", 10.0, samples=rounds(10.0, 40)), Measured("b", 8.0)) \
        is True


def test_predictions_corrected_by_the_measurements() -> None:
    predicted = {"agg": 10.0, "e1": 8.0, "e2": 6.0, "epd": 5.0}
    kinds = {"agg": "aggregated", "e1": "e-pd", "e2": "e-pd", "epd": "epd"}
    got = corrected(predicted, (kinds,), {"agg": Measured("agg", 5.0),
                                      "e1": Measured("e1", 12.0)})
    assert got["agg"] == 5.0 and got["e1"] == 12.0  # measured: the measurement
    assert got["e2"] == pytest.approx(6.0 * 1.5)  # its kind's ratio
    assert got["epd"] == pytest.approx(5.0 * (0.5 * 1.5) ** 0.5)  # no kin: every ratio's
    assert corrected(predicted, (kinds,), {}) == predicted
    # a run that measured nothing does not zero its kind
    assert corrected(predicted, (kinds,), {"e1": Measured("e1", 0.0)})["e2"] > 0


def test_a_stage_unmeasured_borrows_its_engines_ratio_before_its_kinds() -> None:
    """random-107: the aggregated candidates' PD (pd+enc-tp1) measured 1.5x its prediction,
    and so did the E|PD candidates' PD (pd-tp1) in the sweep; corrected by kind (no E|PD
    confirmed: by every ratio, the E|P|D ones' 0.85) they stayed underrated."""
    from epdctl.tune.model import engine_of

    predicted = {"agg": 10.0, "epd": 30.0, "e-pd": 12.0}
    stages = {"agg": "pd+enc-tp1", "epd": "decode-tp1", "e-pd": "pd-tp1"}
    kinds = {"agg": "aggregated", "epd": "epd", "e-pd": "e-pd"}
    measured = {"agg": Measured("agg", 15.0), "epd": Measured("epd", 25.5)}
    engines = {n: engine_of(s) for n, s in stages.items()}
    assert engines == {"agg": "pd-tp1", "epd": "decode-tp1", "e-pd": "pd-tp1"}
    got = corrected(predicted, (stages, engines, kinds), measured)
    assert got["e-pd"] == pytest.approx(12.0 * 1.5)
    without = corrected(predicted, (stages, kinds), measured)
    assert without["e-pd"] == pytest.approx(12.0 * (1.5 * 0.85) ** 0.5)


def test_the_corrected_predictions_order_what_is_confirmed_next() -> None:
    pred = [("x", 10.0), ("x2", 9.5), ("y", 9.0), ("agg", 5.0)]
    kinds = {"x": "e-pd", "x2": "e-pd", "y": "epd", "agg": "aggregated"}
    measured = {"agg": Measured("agg", 10.0), "x": Measured("x", 5.0)}
    order = corrected(dict(pred), (kinds,), measured)
    step = next_step(pred, measured, must=["agg"], elapsed_s=0, budget_s=100, cost_s=1)
    assert step.next == "x2"  # by the raw predictions
    step = next_step(pred, measured, must=["agg"], elapsed_s=0, budget_s=100, cost_s=1,
                     order=order)
    assert step.next == "y"  # E|PD was overrated 2x; y's kind was not seen


KINDS = {"epd": "epd", "e-pd": "e-pd", "agg": "aggregated", "agg2": "aggregated"}


def test_the_best_measured_is_disaggregated_only_where_it_is_decided_to_beat_aggregated() -> None:
    agg = Measured("agg", 6.3)
    # 3 % higher: not decided (MARGIN 5 %), so the simpler topology is recommended.
    assert best_measured([Measured("e-pd", 6.49), agg], KINDS) is agg
    decided = Measured("epd", 20.2)
    assert best_measured([agg, decided, Measured("e-pd", 6.49)], KINDS) is decided
    # The best aggregated one is what a tie goes to; among aggregated ones, the highest.
    agg2 = Measured("agg2", 6.0)
    assert best_measured([Measured("e-pd", 6.49), agg2, agg], KINDS) is agg
    assert best_measured([agg2, agg], KINDS) is agg
    # Nothing aggregated measured: the highest goodput; nothing measured: None.
    assert best_measured([Measured("e-pd", 6.49), Measured("epd", 6.3)], KINDS).name == "e-pd"
    assert best_measured([], KINDS) is None


def test_knee_points_at_one_rate_are_judged_at_the_rate_above() -> None:
    """Both held 9.5 req/s (every request good); EPD's longer tail made its knee point's
    goodput lower, but at 11.3 it kept 73 of 114 requests within the SLO, aggregated 21."""
    points_epd = ((8.0, 1.0), (9.5, 1.0), (11.3, 73 / 114))
    points_agg = ((8.0, 1.0), (9.5, 1.0), (11.3, 21 / 114))
    assert above_knee(points_epd) == 11.3 and above_knee(((1.0, 1.0),)) is None
    assert above_knee(((1.0, 0.5), (2.0, 0.2))) is None
    knee_epd = (Round(15.9, 6.0, rounds(9.5, 96, n=96)[0].requests),)
    knee_agg = (Round(13.0, 7.4, rounds(9.5, 96, n=96)[0].requests),)
    epd = Measured("epd", 10.0, points=points_epd, samples=knee_epd,
                   above=rounds(6.7, 73, n=114))
    agg = Measured("agg", 9.7, points=points_agg, samples=knee_agg,
                   above=rounds(9.6, 21, n=114))
    assert is_better(epd, agg) is True and is_better(agg, epd) is False
    assert best_measured([agg, epd], {"epd": "epd", "agg": "aggregated"}) is epd
    # without the rate above, the knee points decide (and there aggregated is ahead)
    assert is_better(replace(epd, above=()), agg) is False
    # a tie above: the knee points decide
    even = replace(epd, above=agg.above)
    assert is_better(even, agg) is False
    # knee points at different rates: those decide; the rate above is not looked at
    low = replace(agg, points=((8.0, 1.0), (9.5, 0.5), (11.3, 0.1)),
                  samples=(Round(15.9, 5.0, rounds(8.0, 80, n=80)[0].requests),),
                  above=rounds(9.5, 48, n=96))
    assert above_knee(low.points) == 9.5
    assert is_better(replace(epd, above=rounds(1.0, 1, n=114)), low) is True


def _confirm_all(predicted: dict[str, float], truth: dict[str, float],
                 stages: dict[str, str], families: dict[str, str] | None) -> list[str]:
    """tune's confirmation loop (runner._confirm) on a machine that measures `truth`."""
    measured: dict[str, Measured] = {}
    ranked = sorted(predicted.items(), key=lambda kv: -kv[1])
    while True:
        order = corrected(predicted, (stages,), measured)
        step = next_step(ranked, measured, must=["agg"], elapsed_s=0, budget_s=1e9, cost_s=1,
                         order=order, families=families, groups=(stages,), tie=0.05)
        if step.stop:
            return list(measured)
        assert step.next is not None
        measured[step.next] = Measured(step.next, truth[step.next])


def test_a_family_the_model_underrates_is_confirmed_before_it_stops() -> None:
    """The model puts three two-P shapes first (10.0-9.6 req/s; they measure 7.2-7.5) and a
    three-P shape at 6.9 (it measures 9.2): confirming by prediction alone stops, decided,
    without ever running the three-P family; the family rule runs its best before the stop
    rule may fire, and it is the best measured."""
    predicted = {"agg": 5.0, "a1": 10.0, "a2": 9.8, "a3": 9.6, "b1": 6.9, "b2": 6.8,
                 "c1": 4.0}
    truth = {"agg": 5.0, "a1": 7.5, "a2": 7.3, "a3": 7.2, "b1": 9.2, "b2": 9.0, "c1": 4.1}
    stages = {"agg": "pd+enc-tp1", "a1": "prefill-tp1", "a2": "prefill-tp1",
              "a3": "prefill-tp1", "b1": "decode-tp1", "b2": "decode-tp1", "c1": "pd-tp1"}
    families = {"agg": "aggregated:1PD", "a1": "epd:2P+1D(TP2)", "a2": "epd:2P+1D(TP2)",
                "a3": "epd:1P+1D", "b1": "epd:3P+1D", "b2": "epd:3P+1D", "c1": "e-pd:1PD"}
    alone = _confirm_all(predicted, truth, stages, None)
    assert "b1" not in alone and "b2" not in alone
    ruled = _confirm_all(predicted, truth, stages, families)
    # the best of each leading family (a3's is another), none a second of one; c1, at 0.4
    # of the top, leads no family
    assert ruled == ["agg", "a1", "a3", "b1"]
    assert max(ruled, key=truth.__getitem__) == "b1"


def test_leading_families() -> None:
    order = {"a1": 10.0, "a2": 9.9, "b1": 7.0, "c1": 6.6, "d1": 6.55, "e1": 6.0, "f1": 5.0}
    families = {n: n[0] for n in order}
    assert leading_families(order, families) == {"a": "a1", "b": "b1", "c": "c1"}
    assert leading_families({**order, "c1": 6.4}, families) == {"a": "a1", "b": "b1",
                                                               "d": "d1"}
    assert leading_families({"a1": 0.0}, {"a1": "a"}) == {}
    assert leading_families({"a1": 10.0, "b1": 5.0}, {"a1": "a", "b1": "b"}) == {"a": "a1"}


def test_the_stop_rule_bounds_each_candidate_by_its_kin_and_a_tie_is_not_worth_a_run() -> None:
    """Aggregated measured 1.6x its prediction, the E|P|D shapes 0.8x theirs: an E|P|D
    shape bound by an unconfirmed stage is held to its kind's error, not to aggregated's;
    and one that could at most tie the best (within `tie`) is not confirmed."""
    pred = [("x", 30.0), ("y", 28.0), ("z", 19.5), ("agg", 10.0)]
    measured = {"agg": Measured("agg", 16.0), "x": Measured("x", 24.0),
                "y": Measured("y", 22.4)}
    stages = {"agg": "pd+enc-tp1", "x": "decode-tp1", "y": "decode-tp1", "z": "decode-tp2"}
    kinds = {"agg": "aggregated", "x": "epd", "y": "epd", "z": "epd"}
    step = dict(must=["agg"], elapsed_s=0, budget_s=100, cost_s=1)
    # z at 19.5 x 1.6 (aggregated's error) = 31.2 > 24: by every confirmed one, confirm z
    assert next_step(pred, measured, **step).next == "z"  # type: ignore[arg-type]
    # by its kin (its kind: no E|P|D bound by decode-tp2 is confirmed), 19.5 x 0.8 = 15.6
    decided = next_step(pred, measured, groups=(stages, kinds), **step)  # type: ignore[arg-type]
    assert decided.stop and decided.reason.startswith("decided")
    close = [("x", 30.0), ("y", 28.0), ("z", 31.0), ("agg", 10.0)]  # 31 x 0.8 = 24.8
    assert next_step(close, measured, groups=(stages, kinds), **step).next == "z"  # type: ignore[arg-type]
    assert next_step(close, measured, groups=(stages, kinds), tie=0.05,  # type: ignore[arg-type]
                     **step).stop
