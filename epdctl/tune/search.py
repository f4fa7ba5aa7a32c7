"""The load points of a confirmation run: a few around the predicted knee, then more up (or
down) until the knee is bracketed. Light on imports: the CLI's option defaults come from
here."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epdctl.bench.runner import PointRun

KNEE_FACTORS = {1: (1.0,), 2: (0.8, 1.25), 3: (0.5, 1.0, 1.25), 4: (0.5, 0.8, 1.0, 1.25)}
"""Load points of a confirmation run, as multiples of the predicted knee, by their count
(`--confirm-points`: fewer is faster, the knee coarser)."""
KNEE_STEPS = 4
"""Load points a confirmation may add beyond KNEE_FACTORS to bracket the knee
(`--knee-steps`)."""
KNEE_STEP = math.sqrt(2)
"""Each added point's rate over the last one's (up), or under it (down)."""


def confirmation_rates(predicted: float, factors: Sequence[float], steps: int
                       ) -> tuple[float, ...]:
    """The rates a confirmation may run, in order: `factors` times the predicted knee; then
    `steps` up from the highest of them, KNEE_STEP apart; then `steps` down from the lowest
    (bracketing decides which of the added ones run)."""
    base = [round(max(predicted, 0.05) * f, 4) for f in factors]
    up = [round(base[-1] * KNEE_STEP ** k, 4) for k in range(1, steps + 1)]
    down = [round(base[0] / KNEE_STEP ** k, 4) for k in range(1, steps + 1)]
    return (*base, *up, *down)


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
