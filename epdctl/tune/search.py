"""The load points of a confirmation run: a few around the predicted knee, then more up (or
down) until the knee is bracketed. Light on imports: the CLI's option defaults come from
here."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epdctl.bench.runner import PointRun

GRID_STEP = 2 ** 0.25
"""Confirmation rates lie on one grid, 2^(k/4) req/s for integers k (each ~19 % above the
last), and a grid rate's requests have a seed of their own (grid_seed): candidates
confirmed at the same rate meet the same arrivals, so that what tells them apart is the
candidate, not the luck of a burst (near a knee one run's share within the SLO swings from
0.2 to 1.0 with the arrivals alone)."""
KNEE_FACTORS = {1: (0,), 2: (-1, 1), 3: (-2, 0, 1), 4: (-2, -1, 0, 1)}
"""Load points a confirmation run starts with, as grid steps from the predicted knee's grid
rate (4: ~0.71x, 0.84x, 1x, 1.19x), by their count (`--confirm-points`)."""
CONFIRM_POINTS = 1
"""The default: the predicted knee's grid rate alone, then one grid step at a time up (while
every rate held the SLO) or down (while even the lowest missed) until the knee is bracketed.
Four fixed points cost 4-5 runs per candidate where the walk costs 2-3, and bracket the knee
at the same grid step (a knee inside four fixed points left two of them telling nothing)."""
KNEE_STEPS = 6
"""Load points a confirmation may add beyond KNEE_FACTORS to bracket the knee, each way
(`--knee-steps`): from one point, 0.35x to 3.4x of the predicted knee."""
KNEE_GRID_STEPS = 1
"""Grid steps between one added point and the next: every grid rate, so that two candidates'
knees are told apart at the grid's resolution, not at that of whichever rates each ran."""
KNEE_STEP = GRID_STEP ** KNEE_GRID_STEPS
"""Each added point's rate over the last one's (up), or under it (down)."""
GRID_SEED = 1_000_000
"""grid_seed's offset: the seed of grid index k is GRID_SEED + k (positive for any rate
over 2^-250000 req/s), clear of the seeds a bench workload numbers its points with."""
LOWEST_RATE = 0.05
"""The lowest rate a confirmation starts from (a knee predicted at 0 still runs)."""


def grid_index(rate: float) -> int:
    """The grid rate nearest `rate` (> 0), as its k."""
    return round(4 * math.log2(rate))


def grid_rate(index: int) -> float:
    return round(GRID_STEP ** index, 4)


def grid_seed(rate: float) -> int:
    """The seed of a grid rate's requests, the same in every candidate's run."""
    return GRID_SEED + grid_index(rate)


def confirmation_rates(predicted: float, factors: Sequence[int], steps: int
                       ) -> tuple[float, ...]:
    """The rates a confirmation may run, in order, all on the grid (bracketing decides which
    of the added ones run): `factors` grid steps from the predicted knee's grid rate; then
    `steps` up from the highest of them, KNEE_STEP apart; then every grid rate down from the
    lowest of them to LOWEST_RATE's (at least `steps`: the walk down, or the jump to a
    quarter of what the topology served where not one request held the SLO); then, for a
    jump, every grid rate up again from the bottom to the lowest of `factors`."""
    at = grid_index(max(predicted, LOWEST_RATE))
    top, low = at + max(factors), at + min(factors)
    floor = min(grid_index(LOWEST_RATE), low - KNEE_GRID_STEPS * steps)
    down = range(low - KNEE_GRID_STEPS, floor - 1, -KNEE_GRID_STEPS) if steps else range(0)
    again = range(min(down, default=low) + KNEE_GRID_STEPS, low, KNEE_GRID_STEPS) \
        if steps else range(0)
    return (*(grid_rate(at + f) for f in factors),
            *(grid_rate(top + KNEE_GRID_STEPS * k) for k in range(1, steps + 1)),
            *(grid_rate(i) for i in down), *(grid_rate(i) for i in again))


def bracketing(rates: Sequence[float], first: int, steps: int
               ) -> Callable[[int, Sequence[PointRun]], bool]:
    """run_arms' `wanted` for confirmation_rates: the `first` points always; an added point
    up only while every point so far held the SLO (the knee is above them all: what they
    measured is a lower bound); a point down only while the lowest rate run so far missed it
    (the knee is below them all), at most `steps` of them. So a confirmation ends with a
    rate that holds the SLO and the next one up missing it, or at the end of the steps.

    Where not one request of the lowest rate held the SLO, the walk down jumps to half the
    most the topology served at any point (X, its request throughput there), then to a
    quarter (as the benchmark's sweep does): a rate far below the knee takes num_prompts /
    rate to pass, and one step at a time down from far above it took one machine's
    aggregated candidate six points and twelve minutes. Should not one request hold at X/4
    either, no load is light enough: the walk stops (goodput 0). Should a jump's rate hold,
    the rates skipped between it and the lowest that missed run up again until one misses:
    the same bracket as one step at a time."""
    from epdctl.tune.decide import attainment
    from epdctl.tune.model import ATTAINMENT

    up_end = first + steps
    down_end = up_end + sum(1 for i in range(up_end, len(rates))
                            if i == up_end or rates[i] < rates[i - 1])

    def wanted(index: int, done: Sequence[PointRun]) -> bool:
        if index < first:
            return True
        shares = [(rates[p.index], attainment(p.figures) or 0.0) for p in done]
        if not shares:
            return False
        rate = rates[index]
        if index < up_end:
            return all(share >= ATTAINMENT for _, share in shares)
        if index < down_end:
            lowest, share = min(shares)
            walked = sum(1 for p in done if up_end <= p.index < down_end)
            if share >= ATTAINMENT or rate >= lowest or walked >= steps:
                return False
            if share == 0.0:  # not one request held: X/2, then X/4, then nothing lighter
                served = max(float(p.figures.get("request_throughput") or 0.0)
                             for p in done)
                if lowest <= served / 4:
                    return False
                return rate <= (served / 2 if lowest > served / 2 else served / 4)
            return True
        held = [r for r, share in shares if share >= ATTAINMENT]
        if not held:
            return False
        missed = [r for r, share in shares if share < ATTAINMENT and r > max(held)]
        return max(held) < rate < min(missed, default=float("inf"))

    return wanted
