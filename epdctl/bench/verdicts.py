"""Verdicts from intervals: an arm is better or worse than the reference only where the
interval of a ratio lies wholly outside "on par" (within SAME of 1). Every ratio judged in
one report counts against one 5 % error budget (Bonferroni: each interval is taken at
1 - 0.05 / m for m ratios), so an A/A run gets a verdict anywhere in at most ~5 % of runs."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from epdctl.bench.stats import Summary, expanded

SAME = 0.05
"""Ratios within 5 % of 1 count as on par."""
ERROR = 0.05
"""The chance, over the whole report, of calling a difference that is not there."""
LABELS = {"request_goodput": "goodput", "request_throughput": "req/s",
          "ttft_p50_ms": "TTFT p50", "ttft_p90_ms": "TTFT p90", "tpot_mean_ms": "TPOT"}
LATENCIES = ("ttft_p50_ms", "ttft_p90_ms", "tpot_mean_ms")
Kind = Literal["better", "worse", "mixed", "on_par", "undecided", "not_comparable", "none"]


def judged(has_slo: bool) -> tuple[str, ...]:
    """The figures a verdict weighs: throughput (goodput with an SLO) and the latencies."""
    return ("request_goodput" if has_slo else "request_throughput", *LATENCIES)


@dataclass(frozen=True)
class Comparison:
    """One arm against the reference at one load point."""

    point: int
    load: str
    arm: str
    ref: str
    mine: Summary
    theirs: Summary
    failed: dict[str, int] = field(default_factory=dict)
    """Arm -> failed requests (either failing makes it not comparable)."""


def ratio_interval(mine: Summary, theirs: Summary, name: str, level: float
                   ) -> tuple[float, float] | None:
    """The interval of mine / theirs on the log scale: the log ratio of the estimates plus or
    minus z times the spread of the two arms' (independent) log bootstrap replicates."""
    a, b = mine.estimate.get(name), theirs.estimate.get(name)
    reps = [[math.log(v) for v in s.replicates.get(name) or [] if v > 0] for s in (mine, theirs)]
    if not a or not b or a <= 0 or b <= 0 or min(len(r) for r in reps) < 2:
        return None
    spread = math.sqrt(sum(statistics.pvariance(r) for r in reps))
    n = min(mine.n, theirs.n)  # small samples: t, and the bootstrap's narrowness undone
    z = statistics.NormalDist().inv_cdf(1.0 - (1.0 - expanded(level, n)) / 2.0)
    centre = math.log(a / b)
    return math.exp(centre - z * spread), math.exp(centre + z * spread)


def _fmt(name: str, ratio: float, ci: tuple[float, float]) -> str:
    return f"{LABELS[name]} {ratio:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"


def judge(comparisons: Sequence[Comparison], has_slo: bool, same: float = SAME,
          error: float = ERROR) -> list[dict[str, Any]]:
    """One verdict per comparison, the error budget shared by every ratio judged."""
    names = judged(has_slo)
    tests = {(i, n) for i, c in enumerate(comparisons) if not c.failed for n in names
             if c.mine.replicates.get(n) and c.theirs.replicates.get(n)}
    level = 1.0 - error / max(len(tests), 1)
    out = []
    for index, c in enumerate(comparisons):
        figures: dict[str, dict[str, Any]] = {}
        for name in names:
            if (index, name) not in tests:
                continue
            bounds = ratio_interval(c.mine, c.theirs, name, level)
            est_a, est_b = c.mine.estimate[name], c.theirs.estimate[name]
            if bounds is None or est_a is None or not est_b:
                continue
            lo, hi = bounds
            up = name not in LATENCIES
            side = ("better" if up else "worse") if lo > 1 + same else \
                ("worse" if up else "better") if hi < 1 - same else \
                "same" if lo >= 1 - same and hi <= 1 + same else "undecided"
            figures[name] = {"ratio": round(est_a / est_b, 4),
                             "ci": [round(lo, 4), round(hi, 4)], "side": side}
        kind, text = _text(c, figures, same)
        n = min(c.mine.n, c.theirs.n)
        out.append({"point": c.point, "load": c.load, "arm": c.arm, "reference": c.ref,
                    "kind": kind, "decided": kind not in ("undecided", "none"), "n": n,
                    "level": round(level, 5), "figures": figures, "text": text})
    return out


def _text(c: Comparison, figures: dict[str, dict[str, Any]], same: float) -> tuple[Kind, str]:
    if c.failed:
        which = ", ".join(f"`{n}` {k} failed" for n, k in c.failed.items())
        return "not_comparable", f"`{c.arm}` vs `{c.ref}`: not comparable ({which})"
    if not figures:
        return "none", f"`{c.arm}` vs `{c.ref}`: no figures to compare"
    n = min(c.mine.n, c.theirs.n)
    said = {s: [_fmt(k, f["ratio"], tuple(f["ci"])) for k, f in figures.items()  # type: ignore[arg-type]
                if f["side"] == s] for s in ("better", "worse")}
    if said["better"] and said["worse"]:
        return "mixed", (f"`{c.arm}` vs `{c.ref}`: mixed, better {'; '.join(said['better'])}, "
                         f"worse {'; '.join(said['worse'])}")
    if said["better"]:
        return "better", f"`{c.arm}` is better than `{c.ref}` here: {'; '.join(said['better'])}"
    if said["worse"]:
        return "worse", f"`{c.ref}` is better than `{c.arm}` here: {'; '.join(said['worse'])}"
    shown = "; ".join(_fmt(k, f["ratio"], tuple(f["ci"])) for k, f in figures.items())  # type: ignore[arg-type]
    if all(f["side"] == "same" for f in figures.values()):
        return "on_par", (f"`{c.arm}` vs `{c.ref}`: no significant difference at n={n}, "
                          f"on par (within {same:.0%}): {shown}")
    return "undecided", f"`{c.arm}` vs `{c.ref}`: no significant difference at n={n}: {shown}"
