"""The plan before a bench runs: turns, starts, the rounds a verdict needs, the time left."""

from __future__ import annotations

import pytest

from epdctl.bench.schedule import clock, describe, fewest_rounds, starts, time_left, turns

TWO = ["epd", "aggregated"]


def test_turns_and_starts_follow_the_alternating_order() -> None:
    assert turns(TWO, 2) == [(0, "epd", True), (0, "aggregated", True),
                             (1, "aggregated", False), (1, "epd", True)]
    assert starts(TWO, 1) == {"epd": 1, "aggregated": 1}
    assert starts(TWO, 2) == {"epd": 2, "aggregated": 1}  # A B, B A: one degree of freedom
    assert starts(TWO, 4) == {"epd": 3, "aggregated": 2}
    assert starts(["a", "b", "c"], 2) == {"a": 2, "b": 2, "c": 1}


@pytest.mark.parametrize(("arms", "rounds"), [(1, 1), (2, 2), (3, 2), (6, 2)])
def test_the_fewest_rounds_for_a_verdict_bring_an_arm_up_twice(arms: int, rounds: int) -> None:
    assert fewest_rounds(arms) == rounds


def test_the_default_plan_says_its_cost_and_that_one_round_gives_no_verdict() -> None:
    assert describe(TWO, [100, 100, 100], 2, 3) == [
        "plan: 2 rounds, arms in turn: epd aggregated | aggregated epd; 3 starts (`epd` 2, "
        "`aggregated` 1), each followed by 3 warm-up requests; 12 load-point runs (3 points x "
        "2 arms x 2) of 100 requests",
        "plan: a verdict weighs how far one start of an arm lands from the next (measured by "
        "bringing `epd` up again); 2 rounds are the fewest that give one, more decide smaller "
        "differences; --rounds 1: 2 starts and 6 runs, figures without a verdict"]


def test_one_round_says_it_gives_figures_only() -> None:
    assert describe(TWO, [20, 200], 1, 0) == [
        "plan: 1 round, arms in turn: epd aggregated; 2 starts (`epd` 1, `aggregated` 1); "
        "4 load-point runs (2 points x 2 arms x 1) of 20/200 requests",
        "plan: one start per arm: figures only, no verdict (how far one start of an arm "
        "lands from the next is not measured; --rounds 2 for one)"]
    until = describe(TWO, [20], 1, 0, max_rounds=3)
    assert until[0].endswith("; then up to 3 rounds while a verdict is undecided (at most 4 "
                             "starts and 6 runs)")
    assert until[1].startswith("plan: a verdict weighs")
    assert describe(["epd"], [20], 1, 0)[1] == "plan: one arm: figures only, nothing to compare"


def test_time_left_counts_the_starts_and_points_still_to_run() -> None:
    point_s = {("epd", 0): 10.0, ("epd", 1): 20.0, ("aggregated", 0): 30.0}
    start_s = {"epd": [40.0, 60.0], "aggregated": [70.0]}
    # round 2: aggregated stays up (two points: its own 30, epd's 20 for the second), then
    # epd is brought up again (its starts' mean, 50) and runs 10 + 20
    assert time_left(TWO, 2, 1, start_s, point_s, 2) == 30 + 20 + 50 + 10 + 20
    assert time_left(TWO, 2, 2, start_s, point_s, 2) == 0.0
    assert time_left(TWO, 2, 1, {"aggregated": [70.0]}, point_s, 2) is None  # epd's unknown
    assert time_left(TWO, 2, 1, start_s, point_s, 3) is None  # nothing ran point 3 yet
    assert [clock(s) for s in (59.7, 60.0, 3725.0, None)] == ["59s", "1m00s", "62m05s", "?"]
