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
"""Load points of a confirmation run, as grid steps from the predicted knee's grid rate
(4: ~0.71x, 0.84x, 1x, 1.19x), by their count (`--confirm-points`: fewer is faster, the knee
coarser)."""
KNEE_STEPS = 4
"""Load points a confirmation may add beyond KNEE_FACTORS to bracket the knee
(`--knee-steps`)."""
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
    """The rates a confirmation may run, in order, all on the grid: `factors` grid steps
    from the predicted knee's grid rate; then `steps` up from the highest of them,
    KNEE_STEP apart; then `steps` down from the lowest (bracketing decides which of the
    added ones run)."""
    at = grid_index(max(predicted, LOWEST_RATE))
    top, low = at + max(factors), at + min(factors)
    return (*(grid_rate(at + f) for f in factors),
            *(grid_rate(top + KNEE_GRID_STEPS * k) for k in range(1, steps + 1)),
            *(grid_rate(low - KNEE_GRID_STEPS * k) for k in range(1, steps + 1)))


def bracketing(rates: Sequence[float], first: int, steps: int
               ) -> Callable[[int, Sequence[PointRun]], bool]:
    """run_arms' `wanted` for confirmation_rates: the `first` points always; an added point
    up only while every point so far held the SLO (the knee is above them all: what they
    measured is a lower bound); an added point down only while the lowest rate run so far
    missed it (the knee is below them all). So a confirmation ends with a rate that holds
    the SLO and the next one up missing it, or at the end of the steps."""
    from epdctl.tune.decide import attainment
    from epdctl.tune.model import ATTAINMENT

    def wanted(index: int, done: Sequence[PointRun]) -> bool:
        if index < first:
            return True
        shares = [(rates[p.index], attainment(p.figures) or 0.0) for p in done]
        if index < first + steps:
            return bool(shares) and all(share >= ATTAINMENT for _, share in shares)
        return bool(shares) and min(shares)[1] < ATTAINMENT

    return wanted
