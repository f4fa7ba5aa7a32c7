"""What the confirmation runs decide: a measured knee from bench's load points, whether one
candidate beats another (the one place that decides it), and when to stop confirming."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from epdctl.tune.model import ATTAINMENT

MARGIN = 0.05
"""Without intervals, a goodput must be this much higher to count as better."""


@dataclass(frozen=True)
class Measured:
    """A confirmed candidate's goodput at its knee, with an interval where bench gives one."""

    name: str
    goodput: float
    low: float | None = None
    high: float | None = None
    points: tuple[tuple[float, float], ...] = ()
    """(request rate, share of requests within the SLO) per load point run."""


def attainment(figures: Mapping[str, float | int | None]) -> float | None:
    """Share of a load point's requests within the SLO (vLLM's goodput over throughput)."""
    good, total = figures.get("request_goodput"), figures.get("request_throughput")
    if good is None or not total:
        return None
    return min(float(good) / float(total), 1.0)


def knee(points: Sequence[tuple[float, float]], target: float = ATTAINMENT) -> float:
    """The highest rate whose attainment is at least `target`, interpolated towards the next
    rate that misses it; 0 when even the lowest misses."""
    ordered = sorted(points)
    best = 0.0
    for i, (rate, share) in enumerate(ordered):
        if share < target:
            if i and ordered[i - 1][1] >= target:
                (r0, s0), (r1, s1) = ordered[i - 1], (rate, share)
                best = max(best, r0 + (r1 - r0) * (s0 - target) / (s0 - s1))
            break
        best = rate
    return best


def is_better(a: Measured, b: Measured) -> bool | None:
    """True: a beats b; False: b beats a; None: not decided. With intervals, they must not
    overlap; without, one goodput must be MARGIN higher. (Where bench's verdicts land, they
    replace this body: every decision of tune goes through here.)"""
    if None not in (a.low, a.high, b.low, b.high):
        assert a.low is not None and a.high is not None and b.low is not None \
            and b.high is not None
        if a.low > b.high:
            return True
        if b.low > a.high:
            return False
        return None
    if a.goodput > b.goodput * (1 + MARGIN):
        return True
    if b.goodput > a.goodput * (1 + MARGIN):
        return False
    return None


@dataclass(frozen=True)
class Decision:
    stop: bool
    reason: str
    next: str | None = None
    left_out: tuple[str, ...] = field(default_factory=tuple)
    """Candidates not confirmed when it stopped."""


def next_step(predicted: Sequence[tuple[str, float]], measured: Mapping[str, Measured], *,
              must: Sequence[str] = (), elapsed_s: float, budget_s: float,
              cost_s: float, max_confirm: int = 4, min_confirm: int = 2) -> Decision:
    """Whom to confirm next, or why to stop.

    `predicted` is (name, predicted goodput), best first. The candidates in `must` (the
    aggregated one) are confirmed first. Stops when the next run would not fit in the
    budget; when `max_confirm` have run; or, once `min_confirm` have run, when no
    unconfirmed candidate could beat the best measured one even if the model underrates it
    as much as it underrated any confirmed candidate.
    """
    pending = [n for n in must if n not in measured] + [
        n for n, _ in predicted if n not in measured and n not in must]
    if not pending:
        return Decision(True, "every candidate is confirmed")
    if elapsed_s + cost_s > budget_s:
        return Decision(True, f"the budget is spent ({elapsed_s:.0f} s of {budget_s:.0f} s; "
                        f"a run takes ~{cost_s:.0f} s)", left_out=tuple(pending))
    if len(measured) >= max_confirm and not set(must) - set(measured):
        return Decision(True, f"{len(measured)} candidates confirmed", left_out=tuple(pending))
    if pending[0] in must or len(measured) < min_confirm:
        return Decision(False, "confirm next", pending[0])
    guess = dict(predicted)
    ratios = [m.goodput / guess[n] for n, m in measured.items() if guess.get(n)]
    optimistic = max(ratios, default=1.0)
    best = max(measured.values(), key=lambda m: m.goodput)
    top = pending[0]
    if guess.get(top, 0.0) * optimistic <= best.goodput:
        return Decision(True, f"decided: `{best.name}` measured {best.goodput:.3g} req/s; no "
                        "unconfirmed candidate is predicted to beat it", left_out=tuple(pending))
    return Decision(False, "confirm next", top)
