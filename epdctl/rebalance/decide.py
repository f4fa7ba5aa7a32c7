"""Whether to move a running topology to another split of its devices, for the traffic it
has now: every split a switch reaches (split.reachable), each predicted by tune's queue
model (its profiles) on the recent requests at their own arrival times: the share of them
within the SLO, and the knee (the highest rate of this mix it would hold).

The move pays when the requests it is predicted to serve within the SLO over the next
`interval_s` (while each switch drains and starts, `switch_s` each, the split is short of
the instance that moves; then the new split) beat staying by more than `margin`. The margin
is the hysteresis: a split barely better by the model is not worth a move, nor the move
back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from epdctl.rebalance.split import counts, moves, reachable, with_counts, without
from epdctl.traces.format import TraceError
from epdctl.tune.candidates import Shape
from epdctl.tune.model import Profile, Slo
from epdctl.tune.tracemodel import predict_trace, simulate_trace
from epdctl.tune.workload import TraceWorkload

MARGIN = 0.05
"""A move must be predicted to serve this much more within the SLO than staying."""


@dataclass(frozen=True)
class Option:
    shape: Shape
    share: float
    """Predicted share of the recent requests within the SLO, at their own rate."""
    knee: float
    """Predicted goodput of this mix (req/s): the rate it holds the SLO to (inf: any rate of
    these few requests; null in JSON)."""

    def as_json(self) -> dict[str, Any]:
        return {"split": self.shape.label, "share": round(self.share, 4),
                "knee": None if math.isinf(self.knee) else round(self.knee, 4)}


@dataclass(frozen=True)
class Decision:
    rate: float
    """The recent requests' mean rate (req/s)."""
    current: Option
    best: Option
    options: list[Option]
    moves: list[tuple[str, str]] = field(default_factory=list)
    """The switches to `best`: (from role, to role), one instance each."""
    stay: float = 0.0
    move: float = 0.0
    """Requests predicted within the SLO over the interval: staying, and moving."""
    act: bool = False
    why: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"rate": round(self.rate, 4), "current": self.current.as_json(),
                "best": self.best.as_json(), "options": [o.as_json() for o in self.options],
                "moves": [list(m) for m in self.moves], "stay": round(self.stay, 1),
                "move": round(self.move, 1), "act": self.act, "why": self.why}


def option(shape: Shape, profile: Profile, workload: TraceWorkload, slo: Slo, rate: float
           ) -> Option:
    share = simulate_trace(shape, profile, workload, rate=rate).attainment(slo)
    try:
        knee = predict_trace(shape, profile, workload, slo).goodput
    except TraceError:  # a mix it holds at any speed: no knee to show
        knee = float("inf")
    return Option(shape, share, knee)


def decide(current: Shape, profile: Profile, workload: TraceWorkload, slo: Slo, *,
           switch_s: float, interval_s: float, margin: float = MARGIN) -> Decision:
    """The best reachable split for the recent requests, and whether to move there."""
    rate = workload.rate
    splits = [s for s in reachable(current) if not profile.missing(s)]
    if current not in splits:
        raise ValueError(f"the profiles have no cost for the running split "
                         f"{current.label} ({', '.join(profile.missing(current))})")
    options = [option(s, profile, workload, slo, rate) for s in splits]
    now = options[0]
    best = max(options, key=lambda o: (round(o.share, 3), o.knee))
    stay = now.share * rate * interval_s
    if len(options) == 1:
        return Decision(rate, now, best, options, stay=stay, move=stay,
                        why=f"a switch reaches no other split of {current.label} (whole "
                        "GPUs move between roles of one instance size)")
    if best.shape == current:
        return Decision(rate, now, best, options, stay=stay, move=stay,
                        why=f"the running split {current.label} is predicted best for this "
                        f"traffic ({now.share:.0%} within the SLO)")
    steps = moves(current, best.shape)
    during, shape = 0.0, current
    for a, b in steps:  # one switch at a time: its instance away while it drains and starts
        away = option(without(shape, [a]), profile, workload, slo, rate).share
        during += away * rate * switch_s
        new = counts(shape)
        new[a], new[b] = new[a] - 1, new.get(b, 0) + 1
        shape = with_counts(shape, new)
    left = max(interval_s - switch_s * len(steps), 0.0)
    move = during + best.share * rate * left
    act = move > stay * (1 + margin) and left > 0
    gain = f"{best.share:.0%} within the SLO instead of {now.share:.0%}"
    why = (f"{best.shape.label} serves {gain}; over {interval_s:g}s that is {move:.0f} "
           f"requests within the SLO instead of {stay:.0f}, with {len(steps)} switch(es) of "
           f"{switch_s:g}s" + ("" if act else f": not more than {margin:.0%} better, stay"))
    return Decision(rate, now, best, options, steps, stay, move, act, why)
