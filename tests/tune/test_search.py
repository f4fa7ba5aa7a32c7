"""A confirmation's load points: the ones around the predicted knee, then more up (or down)
until a rate that holds the SLO has one above it that misses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from epdctl.tune.decide import knee
from epdctl.tune.search import (
    CONFIRM_POINTS,
    GRID_STEP,
    KNEE_FACTORS,
    KNEE_STEP,
    KNEE_STEPS,
    LOWEST_RATE,
    bracketing,
    confirmation_rates,
    grid_index,
    grid_rate,
    grid_seed,
)


@dataclass
class Point:
    """What bracketing reads of bench's PointRun."""

    index: int
    figures: dict[str, float | int | None]


def run(rates: Sequence[float], first: int, steps: int, true_knee: float,
        above: float = 0.5, capacity: float = float("inf")) -> list[tuple[float, float]]:
    """The points run_arms would run, in its order, against a server that holds the SLO up
    to `true_knee` req/s (every request) and misses it above (a share `above` of them),
    serving at most `capacity` req/s."""
    wanted = bracketing(rates, first, steps)
    done: list[Any] = []  # Points: what bracketing reads of PointRuns
    for index, rate in enumerate(rates):
        if wanted(index, done):
            share = 1.0 if rate <= true_knee else above
            served = min(rate, capacity)
            done.append(Point(index, {"request_goodput": share * served,
                                      "request_throughput": served}))
    return [(rates[p.index], p.figures["request_goodput"] / p.figures["request_throughput"])
            for p in done]


AROUND_10 = (6.7272, 8.0, 9.5137, 11.3137)
"""The grid rates KNEE_FACTORS[4] puts around a knee predicted at 10 req/s (2^(13/4) is the
grid rate nearest 10)."""


def test_rates_are_the_factors_then_steps_up_then_down_all_on_the_grid() -> None:
    rates = confirmation_rates(10.0, KNEE_FACTORS[4], 2)
    assert rates[:4] == pytest.approx(AROUND_10, abs=1e-4)
    assert rates[4:6] == pytest.approx((AROUND_10[-1] * KNEE_STEP,
                                        AROUND_10[-1] * KNEE_STEP ** 2), abs=1e-3)
    assert rates[6:8] == pytest.approx((AROUND_10[0] / KNEE_STEP,
                                        AROUND_10[0] / KNEE_STEP ** 2), abs=1e-3)
    # then on down the grid to the lowest rate (for a jump), then up again to the factors
    down = rates[6:6 + rates[6:].index(min(rates)) + 1]
    assert list(down) == sorted(down, reverse=True)
    assert min(rates) == grid_rate(grid_index(LOWEST_RATE))
    again = rates[6 + len(down):]
    assert list(again) == sorted(again) and max(again) < AROUND_10[0]
    assert set(again) == set(down) - {min(rates)}
    for rate in rates:
        assert grid_rate(grid_index(rate)) == rate
    # a knee predicted at 0 still runs, from the lowest rate's grid point
    assert confirmation_rates(0.0, (0,), 0) == pytest.approx((0.05,), rel=GRID_STEP - 1)


def test_candidates_predicted_apart_share_the_grid_and_its_seeds() -> None:
    """Two candidates confirmed near 10 and 12 req/s run some of the same rates, with the
    same requests there; within one run every rate has requests of its own."""
    a, b = confirmation_rates(10.0, KNEE_FACTORS[4], 4), confirmation_rates(12.0,
                                                                           KNEE_FACTORS[4], 4)
    shared = set(a) & set(b)
    assert len(shared) >= 3
    assert {grid_seed(r) for r in a if r in shared} == {grid_seed(r) for r in b if r in shared}
    assert len({grid_seed(r) for r in a}) == len(set(a))
    assert grid_seed(8.0) != grid_seed(8.0 * GRID_STEP)


def test_a_knee_inside_the_factors_adds_nothing() -> None:
    rates = confirmation_rates(10.0, KNEE_FACTORS[4], 4)
    points = run(rates, 4, 4, true_knee=9.0)
    assert [r for r, _ in points] == list(AROUND_10)
    assert 8.0 <= knee(points) <= AROUND_10[2]


@pytest.mark.parametrize("true_knee", [12.0, 17.0, 22.0])
def test_a_knee_above_every_factor_goes_on_up_until_a_rate_misses(true_knee: float) -> None:
    rates = confirmation_rates(10.0, KNEE_FACTORS[4], 4)
    points = run(rates, 4, 4, true_knee)
    ran = [r for r, _ in points]
    assert ran[:4] == list(AROUND_10) and len(ran) > 4
    assert all(r > AROUND_10[-1] for r in ran[4:])  # only up: the lowest held
    misses = [r for r, share in points if share < 0.9]
    assert misses == [max(ran)]  # it stopped at the first miss
    held = max(r for r, share in points if share >= 0.9)
    assert held <= true_knee < max(ran)
    assert held <= knee(points) < max(ran)


def test_steps_are_a_limit_a_knee_beyond_them_stays_a_lower_bound() -> None:
    rates = confirmation_rates(10.0, KNEE_FACTORS[4], 2)
    points = run(rates, 4, 2, true_knee=1000.0)
    assert len(points) == 6 and all(share == 1.0 for _, share in points)
    assert knee(points) == pytest.approx(AROUND_10[-1] * KNEE_STEP ** 2, abs=1e-3)


def test_a_knee_below_every_factor_goes_down_until_a_rate_holds() -> None:
    rates = confirmation_rates(10.0, KNEE_FACTORS[4], 4)
    points = run(rates, 4, 4, true_knee=3.5)
    ran = [r for r, _ in points]
    assert ran[:4] == list(AROUND_10)
    assert all(r < AROUND_10[0] for r in ran[4:]) and len(ran) > 4  # only down: the lowest missed
    assert [r for r, share in points if share >= 0.9] == [min(ran)]
    assert min(ran) <= 3.5 and knee(points) >= min(ran)


def test_no_steps_runs_the_factors_alone() -> None:
    rates = confirmation_rates(10.0, KNEE_FACTORS[2], 0)
    assert [r for r, _ in run(rates, 2, 0, true_knee=100.0)] == [AROUND_10[1], AROUND_10[3]]
    assert [r for r, _ in run(rates, 2, 0, true_knee=1.0)] == [AROUND_10[1], AROUND_10[3]]


def test_the_default_starts_at_the_predicted_knee_and_walks_one_step_to_bracket_it() -> None:
    """A knee between the predicted grid rate and the next: two points, not four or five."""
    rates = confirmation_rates(10.0, KNEE_FACTORS[CONFIRM_POINTS], KNEE_STEPS)
    points = run(rates, CONFIRM_POINTS, KNEE_STEPS, true_knee=10.5)
    assert [r for r, _ in points] == [AROUND_10[2], AROUND_10[3]]
    points = run(rates, CONFIRM_POINTS, KNEE_STEPS, true_knee=9.0)
    assert [r for r, _ in points] == [AROUND_10[2], AROUND_10[1]]
    assert AROUND_10[1] <= knee(points) <= AROUND_10[2]


def test_where_not_one_request_held_the_walk_jumps_to_half_of_what_was_served() -> None:
    """Predicted at 10, served at most 2 req/s and held the SLO to 1.1: one point at the
    predicted rate, one at X/2 (1 req/s) that holds, then up again from there to the first
    miss (1.19); one step at a time, six steps down would have ended at 3.4 with no bracket."""
    rates = confirmation_rates(10.0, KNEE_FACTORS[CONFIRM_POINTS], KNEE_STEPS)
    points = run(rates, CONFIRM_POINTS, KNEE_STEPS, true_knee=1.1, above=0.0, capacity=2.0)
    ran = [r for r, _ in points]
    assert ran[0] == AROUND_10[2]
    assert ran[1] == pytest.approx(1.0)  # the grid rate at X/2
    assert ran[2:] == pytest.approx([1.1892])  # up again until one misses
    assert knee(points) == pytest.approx(1.0, rel=0.2)
    assert run(rates, CONFIRM_POINTS, KNEE_STEPS, true_knee=1.1, above=0.5,
               capacity=2.0)[-1][0] == pytest.approx(3.3636)  # a share held: step by step


def test_no_request_held_at_a_quarter_of_what_was_served_ends_the_walk() -> None:
    """No load is light enough (the SLO missed by every request even alone): three points,
    X, X/2 and X/4, and a knee of 0."""
    rates = confirmation_rates(10.0, KNEE_FACTORS[CONFIRM_POINTS], KNEE_STEPS)
    points = run(rates, CONFIRM_POINTS, KNEE_STEPS, true_knee=0.0, above=0.0, capacity=4.0)
    assert [r for r, _ in points] == pytest.approx([AROUND_10[2], 2.0, 1.0])
    assert knee(points) == 0.0
