"""Figures with a known error: point estimates over rounds and bootstrap intervals (the
replicates drawn and computed with numpy, all of them at once: `figures` defines one, and a
test holds every replicate to it).

Over requests (R < 3 rounds): each round's requests are resampled within that round.
Over rounds (R >= 3): rounds are resampled, then the requests within each drawn round, so a
drift between rounds widens the interval (the table's intervals). What a bootstrap within
one start cannot see (how far one start of the arm lands from the next) is added where
verdicts compare arms (`epdctl.bench.verdicts`), from each start's own estimate kept here.
A round's req/s is vLLM's; a resample's is that scaled by the round's mean latency over
the resample's (at a fixed concurrency, throughput goes as 1 / latency); goodput is req/s
times the resample's share of good requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from epdctl.bench.samples import Request, Round

RESAMPLES = 2000
LEVEL = 0.95
MIN_TAIL = 10
"""A percentile needs this many requests beyond it to be shown (p90: 100, p99: 1000)."""
PERCENTILES = {"ttft_p50_ms": 50.0, "ttft_p90_ms": 90.0, "ttft_p99_ms": 99.0}
FIGURES = ("request_throughput", "request_goodput", *PERCENTILES, "tpot_mean_ms")
"""The figures given an interval (`<figure>_ci` in the report)."""
OVER_ROUNDS = 3


def percentile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values, as vLLM reports it."""
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def needs(q: float) -> int:
    """Requests a percentile needs: MIN_TAIL of them beyond it."""
    return math.ceil(MIN_TAIL / (1.0 - q / 100.0) - 1e-9)


def figures(parts: Sequence[tuple[Round, Sequence[Request]]], has_slo: bool
            ) -> dict[str, float | None]:
    """The figures of rounds with (re)sampled requests: req/s and goodput the mean over
    rounds, latencies pooled. None: no request to take it from."""
    rates, goodputs, ttfts, tpots = [], [], [], []
    for round_, drawn in parts:
        if not drawn:
            continue
        mean = sum(r.latency_ms for r in drawn) / len(drawn)
        rate = round_.request_throughput * (round_.mean_latency_ms / mean if mean else 1.0)
        rates.append(rate)
        goodputs.append(rate * sum(r.good for r in drawn) / len(drawn))
        ttfts += [r.ttft_ms for r in drawn]
        tpots += [r.tpot_ms for r in drawn if r.tpot_ms is not None]
    out: dict[str, float | None] = dict.fromkeys(FIGURES)
    if rates:
        out["request_throughput"] = sum(rates) / len(rates)
        out["request_goodput"] = sum(goodputs) / len(goodputs) if has_slo else None
        ttfts.sort()
        for name, q in PERCENTILES.items():
            out[name] = percentile(ttfts, q)
    out["tpot_mean_ms"] = sum(tpots) / len(tpots) if tpots else None
    return out


Draws = list[tuple[np.ndarray, list[np.ndarray]]]
"""A bootstrap's draws, one entry per round position: which round each replicate drew there
(an index into the rounds), and for each round the indices of its requests drawn, one row
per replicate that drew it (in the order of those replicates)."""


def draw(rounds: Sequence[Round], rng: np.random.Generator, resamples: int,
         over_rounds: bool = False) -> Draws:
    """`resamples` bootstrap replicates: the requests within each round (and the rounds
    themselves where `over_rounds`), as indices."""
    count = len(rounds)
    out: Draws = []
    for position in range(count):
        chosen = rng.integers(0, count, resamples) if over_rounds \
            else np.full(resamples, position)
        rows = []
        for number, r in enumerate(rounds):
            drew = int(np.count_nonzero(chosen == number))
            size = len(r.requests)
            rows.append(rng.integers(0, size, (drew, size), dtype=np.int32) if drew and size
                        else np.zeros((drew, 0), dtype=np.int32))
        out.append((chosen, rows))
    return out


def replicate_figures(rounds: Sequence[Round], draws: Draws, resamples: int, has_slo: bool
                      ) -> dict[str, np.ndarray]:
    """`figures` of every replicate at once (NaN where it gives None)."""
    columns = [_columns(r) for r in rounds]
    has_tpot = [int(np.count_nonzero(~np.isnan(c[2]))) for c in columns]
    rates = np.full((resamples, len(draws)), np.nan)
    goodputs = np.full((resamples, len(draws)), np.nan)
    sizes = np.array([len(r.requests) for r in rounds], dtype=np.int64)
    # Each request's TTFT by its rank among every round's: a replicate's pooled TTFTs are
    # then counts per rank, and a percentile's order statistic a search in their running sum.
    ttfts = np.concatenate([c[1] for c in columns]) if columns else np.empty(0)
    order = np.argsort(ttfts, kind="stable")
    rank = np.empty(len(ttfts), dtype=np.int64)
    rank[order] = np.arange(len(ttfts))
    starts = np.concatenate(([0], np.cumsum(sizes)))
    picked: list[np.ndarray] = []  # replicate * len(ttfts) + rank, for every request drawn
    filled = np.zeros(resamples, dtype=np.int64)
    tpot_sum, tpot_n = np.zeros(resamples), np.zeros(resamples)
    for position, (chosen, by_round) in enumerate(draws):
        for number, idx in enumerate(by_round):
            if not idx.size:
                continue
            rows = np.flatnonzero(chosen == number)
            r, (latency, _, tpot, good) = rounds[number], columns[number]
            mean = latency[idx].mean(axis=1)
            scale = np.divide(r.mean_latency_ms, mean, out=np.ones_like(mean), where=mean != 0)
            rate = r.request_throughput * scale
            rates[rows, position] = rate
            if has_slo:
                goodputs[rows, position] = rate * good[idx].mean(axis=1)
            ranks = rank[starts[number]:starts[number + 1]]
            picked.append(((rows * len(ttfts))[:, None] + ranks[idx]).ravel())
            filled[rows] += idx.shape[1]
            if has_tpot[number] == idx.shape[1]:  # every request has one: no mask
                tpot_sum[rows] += tpot[idx].sum(axis=1)
                tpot_n[rows] += idx.shape[1]
            elif has_tpot[number]:
                drawn_tpot = tpot[idx]
                valid = ~np.isnan(drawn_tpot)
                tpot_sum[rows] += np.where(valid, drawn_tpot, 0.0).sum(axis=1)
                tpot_n[rows] += valid.sum(axis=1)
    out: dict[str, np.ndarray] = {}
    has_any = filled > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        out["request_throughput"] = _mean_of_drawn(rates, has_any)
        out["request_goodput"] = _mean_of_drawn(goodputs, has_any) if has_slo \
            else np.full(resamples, np.nan)
        out.update(_percentiles(ttfts[order], picked, filled))
        out["tpot_mean_ms"] = np.where(tpot_n > 0, tpot_sum / np.maximum(tpot_n, 1), np.nan)
    return out


def _columns(r: Round) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A round's requests as arrays: latency, TTFT, TPOT (NaN: none) and good (0 or 1)."""
    reqs = r.requests
    return (np.array([q.latency_ms for q in reqs], dtype=float),
            np.array([q.ttft_ms for q in reqs], dtype=float),
            np.array([np.nan if q.tpot_ms is None else q.tpot_ms for q in reqs], dtype=float),
            np.array([q.good for q in reqs], dtype=float))


def _mean_of_drawn(values: np.ndarray, has_any: np.ndarray) -> np.ndarray:
    """The mean over the round positions that drew requests (NaN: a round with none)."""
    drawn = ~np.isnan(values)
    total = np.where(drawn, values, 0.0).sum(axis=1)
    return np.where(has_any, total / np.maximum(drawn.sum(axis=1), 1), np.nan)


def _percentiles(ordered: np.ndarray, picked: list[np.ndarray], filled: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """PERCENTILES of each replicate's pooled values, as `percentile` takes them: `ordered`
    every value sorted, `picked` the (replicate, rank) of each value drawn, flattened,
    `filled` how many each replicate drew."""
    resamples, size = len(filled), len(ordered)
    out = {name: np.full(resamples, np.nan) for name in PERCENTILES}
    if not size or not picked:
        return out
    counts = np.bincount(np.concatenate(picked), minlength=resamples * size)
    running = counts.reshape(resamples, size).cumsum(axis=1)
    # Rows one after another in one increasing array: a row's running sum never passes
    # its `filled`, so row b lives in [b * stride, b * stride + stride).
    stride = int(filled.max()) + 1
    shift = np.arange(resamples, dtype=np.int64) * stride
    flat = (running + shift[:, None]).ravel()
    base = np.arange(resamples, dtype=np.int64) * size

    def order_statistic(k: np.ndarray) -> np.ndarray:
        """The (k+1)-th smallest value of each row (k from 0)."""
        at = np.searchsorted(flat, k + shift, side="right") - base
        return ordered[np.clip(at, 0, size - 1)]

    for name, q in PERCENTILES.items():
        rank = (filled - 1) * q / 100.0
        low = np.clip(np.floor(rank).astype(np.int64), 0, None)
        high = np.minimum(low + 1, np.maximum(filled - 1, 0))
        below, above = order_statistic(low), order_statistic(high)
        out[name] = np.where(filled > 0, below + (above - below) * (rank - low), np.nan)
    return out


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function for a whole number of degrees of freedom, exact
    (Abramowitz & Stegun 26.7.3-4: a finite series in cos(theta), theta = atan(t / sqrt(df)))."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
    if df % 2:
        for k in range(3, df, 2):  # 1 + 2/3 c^2 + (2*4)/(3*5) c^4 ...
            term *= c2 * (k - 1) / k
            total += term
        inside = (2.0 / math.pi) * (theta + (math.sin(theta) * math.cos(theta) * total
                                             if df > 1 else 0.0))
    else:
        for k in range(2, df, 2):  # 1 + 1/2 c^2 + (1*3)/(2*4) c^4 ...
            term *= c2 * (k - 1) / k
            total += term
        inside = math.sin(theta) * total
    return 0.5 + math.copysign(inside, t) / 2.0


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: the exact distribution function inverted by bisection up to df
    400, the normal's beyond (df <= 0: the normal)."""
    if df <= 0 or df > 400:
        return statistics.NormalDist().inv_cdf(p)
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(100):
        mid = (low + high) / 2.0
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2.0


def expanded_z(level: float, n: int) -> float:
    """The normal quantile that covers `level` (two-sided) on n samples, expanded as
    `expanded` does. Kept as a z: on few samples, at the levels a report's many ratios ask
    for, it passes 8.3, where the level it stands for rounds to 1.0 (n=2 at 95 %: z=18)."""
    p = 1.0 - (1.0 - level) / 2.0
    if n < 2:
        return statistics.NormalDist().inv_cdf(p)
    return math.sqrt(n / (n - 1)) * t_quantile(p, n - 1)


def expanded(level: float, n: int) -> float:
    """The level to take a percentile interval at so that it covers `level` on n samples
    (Hesterberg's expanded percentile interval: the bootstrap is too narrow on small n)."""
    if n < 2:
        return level
    return 2.0 * statistics.NormalDist().cdf(expanded_z(level, n)) - 1.0


def interval(values: Sequence[float], level: float = LEVEL, n: int = 0) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates (expanded for n samples)."""
    ordered = sorted(values)
    tail = (1.0 - expanded(level, n)) / 2.0 * 100.0
    return percentile(ordered, tail), percentile(ordered, 100.0 - tail)


@dataclass(frozen=True)
class Summary:
    """One arm at one load point: estimates, 95 % intervals, and what cannot be shown."""

    n: int
    """Completed requests over every round."""
    estimate: dict[str, float | None]
    ci: dict[str, tuple[float, float] | None]
    unsupported: dict[str, str]
    """Figure -> why no number: `n<100` (a percentile the sample cannot support), `n/a`."""
    replicates: dict[str, list[float]]
    """Figure -> its bootstrap replicates over requests within rounds (for ratios, which add
    the variance between rounds themselves; not saved)."""
    by_start: dict[str, list[float]] = field(default_factory=dict)
    """Figure -> its estimate from each start's rounds alone (a round the arm stayed up for
    shares its start with the round before; starts with none left out)."""
    has_spread: bool = True
    """Whether a round of it completed two requests or more: one request resamples to
    itself, so over rounds of one request each a bootstrap within rounds shows no spread
    whatever the truth. No interval stands on that: a ratio's never (`verdicts`), the
    table's only where it resamples the rounds themselves (OVER_ROUNDS)."""

    @property
    def starts(self) -> int:
        """How many times the arm was brought up for these rounds (at least 1)."""
        return max((len(v) for v in self.by_start.values()), default=1) or 1


def summarize(rounds: Sequence[Round], has_slo: bool, seed: int,
              resamples: int = RESAMPLES, starts: Sequence[int] | None = None) -> Summary:
    """Estimates and intervals of FIGURES over the rounds, reproducible for a given seed;
    `starts`: which start of the arm each round came from (None: a start of its own)."""
    n = sum(len(r.requests) for r in rounds)
    has_spread = any(len(r.requests) >= 2 for r in rounds)
    estimate = figures([(r, r.requests) for r in rounds], has_slo)
    unsupported = {name: f"n<{needs(q)}" for name, q in PERCENTILES.items() if n < needs(q)}
    if estimate["tpot_mean_ms"] is None and n:
        unsupported["tpot_mean_ms"] = "n/a"
    if not has_slo:
        unsupported["request_goodput"] = "-"
    # The expansion's sample size: the fewest requests one round resamples from.
    unit = min((len(r.requests) for r in rounds), default=0)
    rng = np.random.default_rng(seed)
    empty: dict[str, np.ndarray] = {name: np.empty(0) for name in FIGURES}
    draws = replicate_figures(rounds, draw(rounds, rng, resamples), resamples, has_slo) \
        if n else empty
    over = replicate_figures(rounds, draw(rounds, rng, resamples, True), resamples, has_slo) \
        if n and len(rounds) >= OVER_ROUNDS else draws
    replicates: dict[str, list[float]] = {}
    ci: dict[str, tuple[float, float] | None] = {}
    for name in FIGURES:
        values = draws[name][~np.isnan(draws[name])].tolist()
        shown = name not in unsupported and estimate[name] is not None and values
        replicates[name] = values if shown else []
        spread = over[name][~np.isnan(over[name])].tolist()
        ci[name] = interval(spread, LEVEL, unit) if shown and spread and (
            has_spread or len(rounds) >= OVER_ROUNDS) else None
        if not shown:
            estimate[name] = None
    groups: dict[int, list[Round]] = {}
    for number, r in enumerate(rounds):
        groups.setdefault(number if starts is None else starts[number], []).append(r)
    per_start = [figures([(r, r.requests) for r in group], has_slo) for group in
                 groups.values() if any(r.requests for r in group)]
    by_start = {name: [v for f in per_start if (v := f[name]) is not None]
                for name in FIGURES if estimate[name] is not None}
    return Summary(n, estimate, ci, unsupported, replicates, by_start, has_spread)
