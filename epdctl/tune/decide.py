"""What the confirmation runs decide: a measured knee from bench's load points, whether one
candidate beats another (the one place that decides it), and when to stop confirming."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from epdctl.bench.samples import Round
from epdctl.tune.model import ATTAINMENT

MARGIN = 0.05
"""Without samples or intervals, a goodput must be this much higher to count as better."""
VERDICT_SEED = 0
"""The bootstrap's seed for is_better's summaries: the same samples, the same decision."""
RATIO_BOUNDS = (0.05, 20.0)
"""A measured/predicted ratio is clamped to this before it corrects other predictions (a
run that measured 0 must not zero every other prediction of its kind)."""


@dataclass(frozen=True)
class Measured:
    """A confirmed candidate's goodput at its knee, with an interval where bench gives one."""

    name: str
    goodput: float
    low: float | None = None
    high: float | None = None
    points: tuple[tuple[float, float], ...] = ()
    """(request rate, share of requests within the SLO) per load point run."""
    samples: tuple[Round, ...] = ()
    """The per-request samples of its knee point (the highest rate before the first one that
    misses the SLO share), one Round per run of it: what is_better judges."""
    above: tuple[Round, ...] = ()
    """The samples of the rate just above the knee point (the first that misses): where two
    knee points are at one rate, is_better judges there."""


def attainment(figures: Mapping[str, float | int | None]) -> float | None:
    """Share of a load point's requests within the SLO (vLLM's goodput over throughput)."""
    good, total = figures.get("request_goodput"), figures.get("request_throughput")
    if good is None or not total:
        return None
    return min(float(good) / float(total), 1.0)


def knee_rate(points: Sequence[tuple[float, float]], target: float = ATTAINMENT
              ) -> float | None:
    """The rate of the knee point: the highest rate before the first that misses `target`
    (None: even the lowest misses)."""
    best = None
    for rate, share in sorted(points):
        if share < target:
            break
        best = rate
    return best


def above_knee(points: Sequence[tuple[float, float]], target: float = ATTAINMENT
               ) -> float | None:
    """The rate just above the knee point (the first that misses `target`; None: none
    misses, or even the lowest does)."""
    at = knee_rate(points, target)
    return None if at is None else min((r for r, _ in points if r > at), default=None)


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
    """True: a beats b; False: b beats a; None: not decided. Every decision of tune goes
    through here.

    With both knee points' samples: bench's verdict (`judge`) on the goodput (good
    requests/s) of a's knee point over b's: better or worse only where its interval lies
    wholly outside 5 % of 1. Only goodput is weighed: the two points may run at different
    rates, so their latencies do not compare. Where both knee points are at one rate, both
    carried the same arrivals with nearly every request good, so goodput there differs by
    little more than how long the last requests took; the rate just above it (where both
    ran it) decides first: the one that keeps more requests within the SLO there has the
    higher knee (the grid's steps, ~19 %, are too coarse to tell 10 % apart by the knee
    point). Else, with intervals, they must not overlap; else one goodput must be MARGIN
    higher."""
    if a.samples and b.samples:
        if a.above and b.above and knee_rate(a.points) == knee_rate(b.points) \
                and above_knee(a.points) == above_knee(b.points):
            verdict = _verdict(a.name, a.above, b.name, b.above)
            if verdict is not None:
                return verdict
        return _verdict(a.name, a.samples, b.name, b.samples)
    if a.low is not None and a.high is not None and b.low is not None \
            and b.high is not None:
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


def _verdict(a: str, mine: Sequence[Round], b: str, theirs: Sequence[Round]) -> bool | None:
    from epdctl.bench.estimates import summarize
    from epdctl.bench.verdicts import Comparison, judge

    # Candidates run once each: a choice must still be made, so the requests alone judge
    # (bench says `undecided` there).
    (verdict,) = judge([Comparison(0, "knee", a, b, summarize(mine, True, VERDICT_SEED),
                                   summarize(theirs, True, VERDICT_SEED))], has_slo=True,
                       should_judge_one_start=True)
    side = (verdict["figures"].get("request_goodput") or {}).get("side")
    return True if side == "better" else False if side == "worse" else None


def best_measured(measured: Sequence[Measured], kinds: Mapping[str, str]) -> Measured | None:
    """The recommendation among the confirmed: the highest goodput that nothing measured is
    decided to beat; but the best aggregated one unless that is decided to beat it (EPD's
    extra instances and hand-offs must pay for themselves: a tie goes to the simpler
    topology, as bench's "does EPD pay off?" would say)."""
    best: Measured | None = None
    for m in sorted(measured, key=lambda m: -m.goodput):
        if best is None or is_better(m, best):
            best = m
    aggregated = max((m for m in measured if kinds.get(m.name) == "aggregated"),
                     key=lambda m: m.goodput, default=None)
    if best is not None and aggregated is not None and kinds.get(best.name) != "aggregated" \
            and is_better(best, aggregated) is not True:
        return aggregated
    return best


Groups = Sequence[Mapping[str, str]]
"""Ways of grouping candidates whose predictions err alike, the closest first: by the stage
that binds them, then by the engine that stage runs on (model.engine_of), then by kind
(name -> group in each)."""


def kin(name: str, groups: Groups, among: Sequence[str]) -> list[str]:
    """The candidates of `among` in `name`'s group, by the first of `groups` that has any;
    all of `among` where none has."""
    for group in groups:
        same = [n for n in among if group.get(n) == group.get(name)]
        if same:
            return same
    return list(among)


def corrected(predicted: Mapping[str, float], groups: Groups,
              measured: Mapping[str, Measured]) -> dict[str, float]:
    """The predictions corrected by what confirmation measured: a confirmed candidate's is
    its measurement; any other's is scaled by the geometric mean of measured/predicted over
    its kin among the confirmed ones (`kin`: those bound by the same stage, e.g. `decode-tp1`:
    what the model got wrong there it got wrong for each candidate that stage binds; else
    those bound on the same engine, `pd-tp1` for `pd+enc-tp1`; else those of its kind; else
    every one); with none confirmed, unchanged. By stage first, not
    by kind: one kind held candidates the model overrated (bound by P) beside others it
    underrated (bound by one TP1 decoder), and one ratio for the kind pushed the second
    further down."""
    confirmed = [n for n in measured if predicted.get(n)]

    def gmean(names: Sequence[str]) -> float | None:
        ratios = [min(max(measured[n].goodput / predicted[n], RATIO_BOUNDS[0]),
                      RATIO_BOUNDS[1]) for n in names]
        return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None

    out: dict[str, float] = {}
    for name, guess in predicted.items():
        if name in measured:
            out[name] = measured[name].goodput
            continue
        ratio = gmean(kin(name, groups, confirmed))
        out[name] = guess * ratio if ratio is not None else guess
    return out


LEAD_SHARE = 0.65
"""A family leads when its best candidate's (corrected) prediction is at least this share of
the best one's: the model's errors between families reached ~40 % (a family predicted at
0.69 of the top measured 1.2x the top's)."""
LEAD_FAMILIES = 3
"""Families that lead at most (the best ones by their best candidate): each costs a
confirmation before the stop rule may fire."""


def leading_families(order: Mapping[str, float], families: Mapping[str, str]
                     ) -> dict[str, str]:
    """The leading families (LEAD_SHARE, LEAD_FAMILIES), each with the candidate of it
    ranked first by `order` (family -> name, best family first)."""
    heads: dict[str, str] = {}
    for name in sorted(order, key=lambda n: -order[n]):
        heads.setdefault(families.get(name, name), name)
    top = max(order.values(), default=0.0)
    return {f: n for f, n in list(heads.items())[:LEAD_FAMILIES]
            if top > 0 and order[n] >= LEAD_SHARE * top}


@dataclass(frozen=True)
class Decision:
    stop: bool
    reason: str
    next: str | None = None
    left_out: tuple[str, ...] = field(default_factory=tuple)
    """Candidates not confirmed when it stopped."""


MAX_CONFIRM = 8
"""Candidates confirmed at most (`tune --max-confirm`); the budget and the stop rule end most
runs sooner. With 4, on 8 GPUs the model's four best were alike in what it overrated (one
TP2 decoder) and the one that doubled them came sixth."""


def next_step(predicted: Sequence[tuple[str, float]], measured: Mapping[str, Measured], *,
              must: Sequence[str] = (), elapsed_s: float, budget_s: float,
              cost_s: float, max_confirm: int = MAX_CONFIRM, min_confirm: int = 2,
              order: Mapping[str, float] | None = None,
              families: Mapping[str, str] | None = None,
              groups: Groups = (), tie: float = 0.0) -> Decision:
    """Whom to confirm next, or why to stop.

    `predicted` is (name, predicted goodput), best first; `order` (the predictions as
    corrected by the measurements, see `corrected`), where given, ranks the unconfirmed
    ones instead. The candidates in `must` (the aggregated one) are confirmed first; then,
    with `families` (name -> Shape.family), the best of each leading family
    (leading_families) not confirmed yet: the model may be wrong in opposite directions for
    two families, and confirming only its top few (all of one family, once) never measures
    the other. Stops when the next run would not fit in the budget; when `max_confirm` have
    run; or, once `min_confirm` have run and every leading family has one confirmed, when
    no unconfirmed candidate could beat the best measured one by more than `tie` even if
    the model underrates it as much as it underrated any of its kin (`groups`, see `kin`;
    with none, any confirmed candidate): one that could at most tie would not be decided
    better (is_better's MARGIN), so it is not worth a run.
    """
    ranked = [n for n, _ in predicted]
    if order is not None:
        ranked.sort(key=lambda n: -order.get(n, 0.0))
    heads = _unconfirmed_heads(order or dict(predicted), families, measured)
    pending = list(dict.fromkeys([n for n in must if n not in measured] + heads + [
        n for n in ranked if n not in measured and n not in must]))
    if not pending:
        return Decision(True, "every candidate is confirmed")
    if elapsed_s + cost_s > budget_s:
        return Decision(True, f"the budget is spent ({elapsed_s:.0f} s of {budget_s:.0f} s; "
                        f"a run takes ~{cost_s:.0f} s)", left_out=tuple(pending))
    if len(measured) >= max_confirm and not set(must) - set(measured):
        return Decision(True, f"{len(measured)} candidates confirmed", left_out=tuple(pending))
    if pending[0] in must or pending[0] in heads or len(measured) < min_confirm:
        return Decision(False, "confirm next", pending[0])
    guess = dict(predicted)
    best = max(measured.values(), key=lambda m: m.goodput)
    bound = _optimistic(guess, measured, groups)
    # The bound is over the raw predictions: `order` may rank another first.
    if max(guess.get(n, 0.0) * bound(n) for n in pending) <= best.goodput * (1 + tie):
        return Decision(True, f"decided: `{best.name}` measured {best.goodput:.3g} req/s; no "
                        "unconfirmed candidate is predicted to beat it", left_out=tuple(pending))
    return Decision(False, "confirm next", pending[0])


def _optimistic(guess: Mapping[str, float], measured: Mapping[str, Measured],
                groups: Groups) -> Callable[[str], float]:
    """Name -> how much the model may underrate it: the largest measured/predicted ratio
    over its kin among the confirmed candidates (`kin`; all of them without `groups`). The
    aggregated candidate's error, ~1.6x on one machine, said nothing of an E|P|D shape's
    TP2 decoder, and held confirmation open for it."""
    ratios = {n: m.goodput / guess[n] for n, m in measured.items() if guess.get(n)}

    def bound(name: str) -> float:
        return max((ratios[n] for n in kin(name, groups, list(ratios))), default=1.0)

    return bound


def _unconfirmed_heads(order: Mapping[str, float], families: Mapping[str, str] | None,
                       measured: Mapping[str, Measured]) -> list[str]:
    """The best candidate of each leading family that has none confirmed, best first."""
    if families is None:
        return []
    done = {families.get(n, n) for n in measured}
    return [n for f, n in leading_families(order, families).items() if f not in done]
