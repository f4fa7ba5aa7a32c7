"""A trace workload's figures per shape class (`bench --trace`, `--mix`): each result row's
requests of one class summarized as the row is (estimates and 95 % intervals over its
rounds, epdctl.bench.estimates), their ratios to the reference's same class, and one
comparison per class for the verdicts. Those are judged with the rows' own, so every class
ratio counts in the report's one error budget (epdctl.bench.verdicts: Bonferroni)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from epdctl.bench.estimates import FIGURES, Summary, summarize
from epdctl.bench.samples import Round
from epdctl.bench.verdicts import TOO_FEW, Comparison

RATIOS = ("request_goodput", "request_throughput", "ttft_p50_ms", "ttft_p90_ms",
          "tpot_mean_ms")
SEEDS = 1000
"""Bootstrap seeds a row's classes take (after the rows' own)."""
MIN_REQUESTS = 20
"""A class is judged where each arm completed this many of its requests (as many as a TTFT
p50 needs): on fewer a bootstrap says little, and a few requests are no verdict's basis."""


def summaries(row: Mapping[str, Any], has_slo: bool, seed: int) -> dict[str, Summary]:
    """Each class's summary over the row's rounds, the most frequent class first ({}: no
    classes in its samples, a workload other than a trace)."""
    saved = [x.get("samples") for x in row["rounds"]]
    if not saved or any(s is None for s in saved):
        return {}
    rounds = [Round.from_json(s) for s in saved if s is not None]
    tally = Counter(c for r in rounds for c in r.classes)
    if not tally:
        return {}
    starts = [int(x.get("start") or 0) for x in row["rounds"]]
    names = sorted(tally, key=lambda n: (-tally[n], n))
    # A round with no completed request has no classes: none of any class, then.
    return {name: summarize([r.of_class(name) if r.classes else Round(r.duration_s, 0.0, ())
                             for r in rounds], has_slo, seed + k, starts=starts)
            for k, name in enumerate(names)}


def figures(summary: Summary) -> dict[str, Any]:
    """The summary's estimates, each with its interval (`<figure>_ci`)."""
    out: dict[str, Any] = {}
    for name in FIGURES:
        out[name] = summary.estimate[name]
        ci = summary.ci[name]
        out[f"{name}_ci"] = [round(ci[0], 4), round(ci[1], 4)] if ci else None
    return out


def rows(by: Mapping[str, Summary]) -> list[dict[str, Any]]:
    """A result row's `classes`: per class, its requests (completed, over every round),
    figures and what cannot be shown."""
    return [{"class": name, "n": s.n, "figures": figures(s), "unsupported": dict(s.unsupported),
             "ratios": None} for name, s in by.items()]


def add_ratios(row: dict[str, Any], theirs: Mapping[str, Any]) -> None:
    """Each class's figures over the same class's in the reference row."""
    ref = {c["class"]: c["figures"] for c in theirs.get("classes") or []}
    for entry in row.get("classes") or []:
        other = ref.get(entry["class"])
        if other is None:
            continue
        entry["ratios"] = {key: _ratio(entry["figures"].get(key), other.get(key))
                           for key in RATIOS}


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 4) if isinstance(a, int | float) and isinstance(b, int | float) \
        and b else None


def comparisons(base: Comparison, mine: Mapping[str, Summary], theirs: Mapping[str, Summary]
                ) -> tuple[list[Comparison], list[dict[str, Any]]]:
    """The row's comparison (`base`) again, per class both arms have enough requests of
    (MIN_REQUESTS), and a verdict of `none` for each other class; nothing for one class (it
    is the row's own comparison, already judged)."""
    if len(mine) < 2:
        return [], []
    judged, skipped = [], []
    for name, s in mine.items():
        other = theirs.get(name)
        n = min(s.n, other.n if other else 0)
        if other is not None and n >= MIN_REQUESTS:
            judged.append(Comparison(base.point, base.load, base.arm, base.ref, s, other,
                                     base.failed, shape=name))
            continue
        skipped.append({"point": base.point, "load": base.load, "arm": base.arm,
                        "reference": base.ref, "kind": "none", "decided": False, "n": n,
                        "reason": TOO_FEW, "level": None, "figures": {},
                        "text": f"`{base.arm}` vs `{base.ref}`: not judged, {n} request(s) of "
                        f"this class, {MIN_REQUESTS} needed", "starts_measured": False,
                        "starts": {base.arm: s.starts, base.ref: other.starts if other else 0},
                        "class": name})
    return judged, skipped


def label(verdicts: Sequence[dict[str, Any]], judged: Sequence[Comparison]) -> None:
    """Name each class verdict's class (judge returns one verdict per comparison)."""
    for verdict, comparison in zip(verdicts, judged, strict=True):
        if comparison.shape:
            verdict["class"] = comparison.shape
