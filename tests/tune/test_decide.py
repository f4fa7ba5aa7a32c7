"""The measured knee, the better-than decision and the stop rule."""

from __future__ import annotations

import pytest

from epdctl.tune.decide import Measured, attainment, is_better, knee, next_step


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


def test_confirms_at_least_two() -> None:
    # agg measured far above every prediction: still one more is confirmed
    step = next_step(PRED, {"agg": Measured("agg", 50.0)}, must=["agg"], elapsed_s=0,
                     budget_s=100, cost_s=1)
    assert (step.stop, step.next) == (False, "x")
