"""Verdicts from intervals: an arm is better or worse than the reference only where the
interval of a ratio lies wholly outside "on par" (within SAME of 1). Every ratio judged in
one report counts against one 5 % error budget (Bonferroni: each interval is taken at
1 - 0.05 / m for m ratios), so an A/A run gets a verdict anywhere in at most ~5 % of runs.

A ratio's spread has two parts. Within: each arm's bootstrap over its requests. Between:
how far one start of an arm lands from another start of the same arm at the same load point
beyond what its requests explain (another placement in memory, a warmer engine, a machine
that drifted between the two); a bootstrap within rounds cannot see it, and with two rounds
an A/A run on a CPU machine found a 0.46x "difference" without it. It is a random effect of
each start: its variance is pooled over every arm and load point of the report (log scale,
one degree of freedom per start beyond an arm's first; rounds an arm stayed up for are one
start), divided by each arm's starts, and the interval takes Student's t at the
degrees of freedom of that estimate, so a variance estimated from few starts widens the
interval as much as it should (two rounds, A B then B A, give A two starts and B one: one
degree of freedom, and a verdict only for a very large difference; --rounds 4 or
--until-significant for more). With one start per arm nothing measures it, and a verdict
from the requests alone would be right no more often than chance (two identical topologies
on one CPU machine came out 2.30x apart on req/s between starts): every comparison is then
`undecided`, "one start per arm", its ratios shown as figures only. So is a comparison
where no round of an arm completed two requests ("too few requests"): a request resampled
alone shows no spread, and no interval stands on it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from epdctl.bench.estimates import Summary, expanded_z, t_quantile

SAME = 0.05
"""Ratios within 5 % of 1 count as on par."""
ERROR = 0.05
"""The chance, over the whole report, of calling a difference that is not there."""
ONE_START = "one start per arm"
"""Why a comparison is undecided where nothing measured the spread between starts."""
TOO_FEW = "too few requests"
"""Why a comparison is undecided where an arm's requests support no interval: none of its
rounds completed two (`Summary.has_spread`)."""
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
    shape: str = ""
    """A trace's shape class: the two arms' requests of that class alone ("": all)."""


@dataclass(frozen=True)
class Between:
    """A figure's between-start variance (log scale) beyond its requests' own, pooled over a
    report, and the degrees of freedom of its estimate (0: nothing measured it)."""

    variance: float = 0.0
    df: int = 0


def _logs(values: Sequence[float]) -> list[float]:
    return [math.log(v) for v in values if v > 0]


def between(summaries: Sequence[tuple[str, Summary]], name: str) -> Between:
    """From (arm, summary) pairs (each arm at each load point once), over the cells with two
    starts or more: the variance of a cell's starts' log estimates less what its bootstrap
    says one start's sampling alone gives, averaged with weights (k - 1) / that sampling
    variance (a weighted method-of-moments estimate of the between-start variance, in the
    spirit of DerSimonian-Laird's but not their estimator: theirs weights each study by its
    inverse variance and corrects by the weights' spread; here a cell of few requests,
    whose rounds scatter by sampling alone, simply says little about the rest), never
    below 0. Its degrees of
    freedom are counted per arm, not per cell: an arm's load points share its starts, so
    their deviations are not independent."""
    excess = weights = 0.0
    per_arm: dict[str, int] = {}
    for arm, s in summaries:
        logs, reps = _logs(s.by_start.get(name) or []), _logs(s.replicates.get(name) or [])
        # Rounds of one request each: a bootstrap variance of 0 says nothing of what
        # sampling gives, and weighted by its inverse such a cell would outweigh every other.
        if len(logs) < 2 or len(reps) < 2 or not s.has_spread:
            continue
        # The bootstrap variance of the estimate over k starts; one start's is k times it.
        sampling = max(statistics.pvariance(reps) * len(logs), 1e-12)
        weight = (len(logs) - 1) / sampling
        excess += weight * (statistics.variance(logs) - sampling)
        weights += weight
        per_arm[arm] = max(per_arm.get(arm, 0), len(logs) - 1)
    return Between(max(0.0, excess / weights), sum(per_arm.values())) if weights else Between()


def ratio_interval(mine: Summary, theirs: Summary, name: str, level: float,
                   spread_between: Between = Between()) -> tuple[float, float] | None:
    """The interval of mine / theirs on the log scale: the log ratio of the estimates plus or
    minus t times the spread of the two arms' (independent) log bootstrap replicates and of
    the between-start effect (its variance over each arm's starts)."""
    a, b = mine.estimate.get(name), theirs.estimate.get(name)
    reps = [_logs(s.replicates.get(name) or []) for s in (mine, theirs)]
    if not a or not b or a <= 0 or b <= 0 or min(len(r) for r in reps) < 2:
        return None
    within = sum(statistics.pvariance(r) for r in reps)
    extra = spread_between.variance * (1.0 / mine.starts + 1.0 / theirs.starts)
    n = min(mine.n, theirs.n)  # small samples: t, and the bootstrap's narrowness undone
    p = 1.0 - (1.0 - level) / 2.0
    # The expanded z itself, not the level it stands for: on few requests that level is 1.0
    # in floating point, and no normal quantile answers it.
    z = expanded_z(level, n)
    if spread_between.df:
        # Student's t at the between part's own degrees of freedom, however small its
        # estimate came out: a variance from one or two starts can come out near 0 by
        # chance (Welch-Satterthwaite would then trust it, and an A/A run with one start of
        # B and two of A got 12 % false verdicts so).
        z = max(z, t_quantile(p, spread_between.df))
    spread = math.sqrt(within + extra)
    centre = math.log(a / b)
    return math.exp(centre - z * spread), math.exp(centre + z * spread)


def _bound(value: float) -> str:
    """A ratio's bound as a person reads it: beyond 0.01 or 100 only the side it is on (an
    interval from one degree of freedom can reach 1e7)."""
    return "<0.01" if value < 0.01 else ">100" if value > 100 else f"{value:.2f}"


def _fmt(name: str, ratio: float, ci: tuple[float, float]) -> str:
    return f"{LABELS[name]} {ratio:.2f}x [{_bound(ci[0])}, {_bound(ci[1])}]"


def judge(comparisons: Sequence[Comparison], has_slo: bool, same: float = SAME,
          error: float = ERROR, should_judge_one_start: bool = False) -> list[dict[str, Any]]:
    """One verdict per comparison, the error budget shared by every ratio judged. A figure
    whose spread between starts nothing measured (one start per arm) has no side: its
    interval covers the requests alone. `should_judge_one_start`: give it one anyway, from
    the requests (tune's choice between candidates run once each; never bench's)."""
    names = judged(has_slo)
    tests = {(i, n) for i, c in enumerate(comparisons) if not c.failed and _has_spread(c)
             for n in names if c.mine.replicates.get(n) and c.theirs.replicates.get(n)}
    level = 1.0 - error / max(len(tests), 1)
    # How far starts land apart is measured on whole load points; a class's requests are
    # a subset of its point's, on the same starts, and take the same spread.
    whole = [c for c in comparisons if not c.shape]
    cells = list({(c.arm, c.point): c.mine for c in whole}.items()) + \
        list({(c.ref, c.point): c.theirs for c in whole}.items())
    unique = list({(arm, point): s for (arm, point), s in cells}.items())
    spread = {name: between([(arm, s) for (arm, _), s in unique], name) for name in names}
    out = []
    for index, c in enumerate(comparisons):
        figures: dict[str, dict[str, Any]] = {}
        lacks_spread = not c.failed and not _has_spread(c)
        for name in names:
            if lacks_spread:  # figures only: no interval, no side, no share of the budget
                figures.update(_ratio_only(c, name, spread[name]))
                continue
            if (index, name) in tests and (got := _figure(c, name, level, spread[name], same,
                                                          should_judge_one_start)):
                figures[name] = got
        measured = any(spread[k].df for k in figures)
        is_too_few = lacks_spread and bool(figures)
        is_one_start = bool(figures) and not measured and not c.failed and not is_too_few
        kind, text = _text(c, figures, same)
        if is_one_start and not should_judge_one_start:
            kind, text = "undecided", _one_start_text(c, figures)
        elif is_one_start:
            text += " (one start per arm: how far a start lands from the next is not measured)"
        elif kind == "undecided" and not is_too_few:
            df = max(spread[k].df for k in figures)
            text += (f" (starts: `{c.arm}` {c.mine.starts}, `{c.ref}` {c.theirs.starts}, "
                     f"{df} degree{'s' if df > 1 else ''} of freedom between them; more "
                     "rounds narrow it)")
        n = min(c.mine.n, c.theirs.n)
        out.append({"point": c.point, "load": c.load, "arm": c.arm, "reference": c.ref,
                    "kind": kind, "decided": kind not in ("undecided", "none"), "n": n,
                    "reason": TOO_FEW if is_too_few else
                    ONE_START if is_one_start and kind == "undecided" else None,
                    "level": None if is_too_few else round(level, 5), "figures": figures,
                    "text": text,
                    "starts_measured": measured,
                    "starts": {c.arm: c.mine.starts, c.ref: c.theirs.starts}})
    return out


def _figure(c: Comparison, name: str, level: float, spread: Between, same: float,
            should_judge_one_start: bool) -> dict[str, Any] | None:
    """One figure's ratio, interval and side (None: no interval can be had)."""
    bounds = ratio_interval(c.mine, c.theirs, name, level, spread)
    est_a, est_b = c.mine.estimate[name], c.theirs.estimate[name]
    if bounds is None or est_a is None or not est_b:
        return None
    lo, hi = bounds
    up = name not in LATENCIES
    side = ("better" if up else "worse") if lo > 1 + same else \
        ("worse" if up else "better") if hi < 1 - same else \
        "same" if lo >= 1 - same and hi <= 1 + same else "undecided"
    if not spread.df and not should_judge_one_start:
        side = "undecided"
    return {"ratio": round(est_a / est_b, 4), "ci": [round(lo, 4), round(hi, 4)],
            "side": side, "between_df": spread.df}


def _has_spread(c: Comparison) -> bool:
    return c.mine.has_spread and c.theirs.has_spread


def _ratio_only(c: Comparison, name: str, spread: Between) -> dict[str, dict[str, Any]]:
    """A ratio as a figure without an interval (nothing where an arm has no estimate)."""
    a, b = c.mine.estimate.get(name), c.theirs.estimate.get(name)
    if a is None or not b or not c.mine.replicates.get(name) \
            or not c.theirs.replicates.get(name):
        return {}
    return {name: {"ratio": round(a / b, 4), "ci": None, "side": "undecided",
                   "between_df": spread.df}}


def _too_few_text(c: Comparison, figures: dict[str, dict[str, Any]]) -> str:
    """The ratios, said as figures and not as a verdict: an arm's requests show no spread."""
    shown = "; ".join(f"{LABELS[k]} {f['ratio']:.2f}x" for k, f in figures.items())
    who = " and ".join(f"`{arm}`" for arm, s in ((c.arm, c.mine), (c.ref, c.theirs))
                       if not s.has_spread)
    return (f"`{c.arm}` vs `{c.ref}`: undecided ({TOO_FEW}); figures only, not a verdict: "
            f"{shown} (no round of {who} completed two requests: one request resamples to "
            "itself and shows no spread, so no interval stands on it; more requests per load "
            "point for one)")


def _one_start_text(c: Comparison, figures: dict[str, dict[str, Any]]) -> str:
    """The ratios, said as figures and not as a verdict: one start per arm."""
    shown = "; ".join(_fmt(k, f["ratio"], tuple(f["ci"])) for k, f in figures.items())  # type: ignore[arg-type]
    return (f"`{c.arm}` vs `{c.ref}`: undecided ({ONE_START}); figures only, not a verdict: "
            f"{shown} (intervals over requests within one start; how far one start of an arm "
            "lands from the next is not measured: --rounds 2 or more for a verdict)")


def _text(c: Comparison, figures: dict[str, dict[str, Any]], same: float) -> tuple[Kind, str]:
    if c.failed:
        which = ", ".join(f"`{n}` {k} failed" for n, k in c.failed.items())
        return "not_comparable", f"`{c.arm}` vs `{c.ref}`: not comparable ({which})"
    if not figures:
        return "none", f"`{c.arm}` vs `{c.ref}`: no figures to compare"
    if not _has_spread(c):
        return "undecided", _too_few_text(c, figures)
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
