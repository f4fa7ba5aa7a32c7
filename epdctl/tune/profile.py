"""Profiling: short closed-loop runs against single instances at the workload's sizes, and
the step costs fitted from them (E: latency against images in flight; prefill: against
prompt tokens in flight; decode: time per token against requests in flight; D's KV pull;
the EC hand-off, the proxy's hop from E's answer to PD).

Measurement goes through a `Send` (one timed request), so the sweep and the fits are
tested without a server; epdctl.tune.probes gives the HTTP one.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from epdctl.tune.des import StepCost

LEVELS = (1, 2, 4, 8)
"""Requests in flight at which each stage is timed."""
MAX_DECODE_LEVEL = 64
"""The most requests a decode profile sends at once while it looks for the batch the TPOT
limit allows (decode_levels)."""
ROUNDS = 3
"""Requests each worker sends per level (the first round fills the batch)."""
DECODE_TOKENS = 16
"""Tokens a decode-profile request generates, and one more for each request of its level
(decode_tokens)."""
STEADY_INTERVALS = 4
"""Token intervals per request a level's steady window must hold to be used."""
HANDOFF_ROUNDS = 5
"""E-fed requests timed through the proxy, and as many twins timed without it."""


@dataclass(frozen=True)
class Timing:
    start: float
    first: float
    """The first token's arrival (the end, for an answer that is not streamed)."""
    end: float
    tokens: int
    token_times: tuple[float, ...] = ()
    """Each streamed token's arrival, where the Send records them (decode_level's window)."""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else None


Send = Callable[[str, dict[str, Any]], Awaitable[Timing]]
"""(instance URL, body) -> its timing; streamed bodies time each token."""
Body = Callable[[int], dict[str, Any]]
"""Request number -> its body (each its own image, so no cache hit)."""
Timed = Callable[[int], Awaitable[float]]
"""Request number -> the seconds it took, end to end (however many hops)."""


async def closed_loop(send: Send, url: str, body: Body, concurrency: int,
                      rounds: int = ROUNDS, start: int = 0) -> list[Timing]:
    """`concurrency` workers, each sending `rounds` requests one after another; the timings
    of every round but the first (it fills the batch), or all when there is one round."""
    async def worker(w: int) -> list[Timing]:
        return [await send(url, body(start + w * rounds + r)) for r in range(rounds)]

    results = await asyncio.gather(*(worker(w) for w in range(concurrency)))
    keep = slice(1, None) if rounds > 1 else slice(None)
    return [t for per in results for t in per[keep]]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x, both kept at 0 or more."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    a = my - b * mx
    if a < 0:  # through the origin instead
        sxx0 = sum(x * x for x in xs)
        return 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sxx0 if sxx0 else 0.0
    return a, b


def fit_curve(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x + c x^2 with a, b and c at 0 or more: each subset of the
    three terms fitted, the best fit whose terms are all non-negative kept (an exact
    non-negative fit for three terms). A line where the points lie on one; the square term
    where steps grow faster than the batch (a decode step super-linear in it)."""
    import itertools

    import numpy as np

    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) == 0:
        return 0.0, 0.0, 0.0
    columns = (np.ones_like(x), x, x * x)
    best: tuple[float, tuple[float, float, float]] = (float(np.sum(y * y)), (0.0, 0.0, 0.0))
    for size in (1, 2, 3):
        for terms in itertools.combinations(range(3), size):
            if len(x) < size:
                continue
            design = np.stack([columns[t] for t in terms], axis=1)
            coef = np.linalg.lstsq(design, y, rcond=None)[0]
            if np.any(coef < 0):
                continue
            residual = float(np.sum((design @ coef - y) ** 2))
            if residual < best[0] - 1e-15:
                full = [0.0, 0.0, 0.0]
                for t, value in zip(terms, coef, strict=True):
                    full[t] = float(value)
                best = (residual, (full[0], full[1], full[2]))
    return best[1]


def mean(values: Sequence[float]) -> float:
    """The mean, 0 for none."""
    return sum(values) / len(values) if values else 0.0


def decoding_beside(timings: Sequence[Timing]) -> list[float]:
    """Per timing, how many of these were decoding beside it (itself included), on average
    over its own decode (first token to last): the overlap of each one's span with its own,
    over its own. Requests reach a decoder one after another (E and P before it batch and
    split them), so this is the batch it decoded in, not the number sent."""
    out = []
    for t in timings:
        span = t.end - t.first
        out.append(sum(max(min(t.end, o.end) - max(t.first, o.first), 0.0) for o in timings)
                   / span if span > 0 else 1.0)
    return out


@dataclass(frozen=True)
class Series:
    """One stage's sweep: per level, the mean of what was timed (s)."""

    levels: tuple[int, ...]
    values: tuple[float, ...]
    batch: tuple[float, ...] = ()
    """Decode only: per level, the mean batch its requests decoded in (decoding_beside)."""

    def as_json(self) -> dict[str, Any]:
        return {"levels": list(self.levels),
                "values_ms": [round(v * 1000, 4) for v in self.values],
                **({"batch": [round(b, 3) for b in self.batch]} if self.batch else {})}


async def sweep(send: Send, url: str, body: Body, measure: Callable[[Timing], float | None],
                levels: Sequence[int] = LEVELS, rounds: int = ROUNDS,
                batch: Callable[[Sequence[Timing]], float] | None = None) -> Series:
    """Per level, the mean of `measure` over the timings it measures; with `batch`, also
    what it makes of those timings (0: the level)."""
    values, batches = [], []
    start = 0
    for level in levels:
        timings = await closed_loop(send, url, body, level, rounds, start)
        start += level * rounds
        timed = [(t, v) for t in timings if (v := measure(t)) is not None]
        values.append(mean([v for _, v in timed]))
        if batch is not None:
            batches.append(batch([t for t, _ in timed]) or float(level))
    return Series(tuple(levels), tuple(values), tuple(batches))


async def profile_encode(send: Send, url: str, body: Body,
                         levels: Sequence[int] = LEVELS) -> tuple[StepCost, Series]:
    """E: a step of b images takes fixed + per_image * b (b = images in flight)."""
    series = await sweep(send, url, body, lambda t: t.latency, levels)
    fixed, per = fit_line(series.levels, series.values)
    return StepCost(fixed_ms=fixed * 1000, per_image_ms=per * 1000,
                    max_images=max(levels)), series


async def profile_prefill(send: Send, url: str, body: Body, tokens: int,
                          levels: Sequence[int] = LEVELS) -> tuple[StepCost, Series]:
    """A prefill-only request (`max_tokens` 1): fixed + per_token x tokens in flight. The
    images of the workload's requests are folded into the per-token cost."""
    series = await sweep(send, url, body, lambda t: t.latency, levels)
    fixed, per_request = fit_line(series.levels, series.values)
    return StepCost(fixed_ms=fixed * 1000, per_token_ms=per_request * 1000 / max(tokens, 1)), \
        series


Upstream = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
"""Body -> the body the timed instance gets, after the untimed work before it (E encodes
the images, P prefills and hands its KV over), as the proxy would do it."""


async def profile_decode(send: Send, url: str, body: Body, levels: Sequence[int] = LEVELS,
                         limit_ms: float | None = None, max_seqs: int | None = None,
                         upstream: Upstream | None = None) -> tuple[StepCost, Series]:
    """A streamed request's time per output token: fixed + per_seq x b + per_seq2 x b^2
    for the batch b it decoded in (context at the workload's lengths folded in; fit_curve).
    Per level, `upstream` first does each request's work before the decoder (all of them),
    then all are sent at once: their prefills (PD) share the first steps, and the time per
    token is taken over the steps after them, where all of them decode and nothing else
    runs (steady_decode; the batch is the level). Where the Send records no token times,
    or that window is too short, it is each answer's mean, and the batch is measured, not
    taken to be the level (decoding_beside): sent through E and P one by one, 8 requests
    reached a D one after another over ~2 s and decoded ~4.6 at a time (fitted against the
    level, per_seq came out at half the truth), and 64 behind one slow E never decoded more
    than 7 at a time.

    With `limit_ms` (the TPOT limit), the levels go on doubling (decode_levels) until the
    batch the limit allows is reached: fitted on batches of ~5 and extrapolated to the ~20
    the limit allowed, one machine's decoders were predicted at half their real goodput."""
    series = Series((), ())
    for level in levels:
        series = _joined(series, await decode_level(send, url, body, level,
                                                     sum(series.levels), upstream))
    while (more := decode_levels(series.levels, series, limit_ms, max_seqs)) != series.levels:
        series = _joined(series, await decode_level(send, url, body, more[-1],
                                                     sum(series.levels), upstream))
    fixed, per_seq, per_seq2 = fit_curve(series.batch, series.values)
    return StepCost(fixed_ms=fixed * 1000, per_seq_ms=per_seq * 1000,
                    per_seq2_ms=per_seq2 * 1000), series


async def decode_level(send: Send, url: str, body: Body, level: int, start: int,
                        upstream: Upstream | None) -> Series:
    """One level of profile_decode: requests start..start+level-1 readied upstream, then
    sent together; their mean time per token and the mean batch they decoded in."""
    bodies = [{**body(start + w), "max_tokens": decode_tokens(level)} for w in range(level)]
    if upstream is not None:
        bodies = list(await asyncio.gather(*(upstream(b) for b in bodies)))
    timings = await asyncio.gather(*(send(url, b) for b in bodies))
    steady = steady_decode(timings)
    if steady is not None:
        return Series((level,), (steady,), (float(len(timings)),))
    timed = [t for t in timings if t.tpot is not None]
    return Series((level,), (mean([t.tpot for t in timed if t.tpot is not None]),),
                  (mean(decoding_beside(timed)) or float(level),))


def decode_tokens(level: int) -> int:
    """Tokens each request of a decode level generates: DECODE_TOKENS, and one more per
    request of the level, so that once the last one has its first token (the level's
    prompts prefilled, in chunks of a few hundred tokens where prefill is chunked: a step
    or so per request) all of them still decode together for a while (steady_decode)."""
    return DECODE_TOKENS + level


def steady_decode(timings: Sequence[Timing]) -> float | None:
    """The time per token while every one of these requests decodes (from the last first
    token to the first end): steps that decode them all and prefill nothing. A request's
    time per token over its whole answer also pays for the steps that prefill the others
    (in chunks beside its decode where prefill is chunked): on one machine a PD's decode
    step at 32 in flight came out at 2-3x its cost that way, and every PD candidate's
    goodput at two thirds of the truth. None where the Send records no token times or the
    window is shorter than STEADY_INTERVALS per request (the answer's mean is used)."""
    if not timings or any(len(t.token_times) < 2 for t in timings):
        return None
    begin = max(t.token_times[0] for t in timings)
    end = min(t.token_times[-1] for t in timings)
    spans = intervals = 0.0
    for t in timings:
        inside = [x for x in t.token_times if begin <= x <= end]
        if len(inside) < STEADY_INTERVALS + 1:
            return None
        spans += inside[-1] - inside[0]
        intervals += len(inside) - 1
    return spans / intervals


def decode_levels(levels: Sequence[int], series: Series | None, limit_ms: float | None,
                  max_seqs: int | None) -> tuple[int, ...]:
    """The decode profile's levels: `levels`, and one more (twice the last) while the
    batches measured so far (`series`) stay below the one whose step takes `limit_ms`
    (the fit says where) and the last level still decoded a larger batch than the one
    before it (by a quarter at least), up to MAX_DECODE_LEVEL and `max_seqs`."""
    levels = tuple(levels)
    if series is None or limit_ms is None or not series.batch:
        return levels
    fixed, per_seq, per_seq2 = fit_curve(series.batch, series.values)
    reached = max(series.batch)
    if (fixed + per_seq * reached + per_seq2 * reached ** 2) * 1000 >= limit_ms:
        return levels
    if len(series.batch) > 1 and series.batch[-1] < 1.25 * series.batch[-2]:
        return levels
    more = 2 * levels[-1]
    if more > min(MAX_DECODE_LEVEL, max_seqs or MAX_DECODE_LEVEL):
        return levels
    return (*levels, more)


def _joined(a: Series, b: Series) -> Series:
    return Series(a.levels + b.levels, a.values + b.values, a.batch + b.batch)


async def profile_handoff(through: Timed, direct: Timed, rounds: int = HANDOFF_ROUNDS
                          ) -> tuple[float, dict[str, Any]]:
    """The EC hand-off (ms): how much longer an E-fed request takes through the proxy (E
    encodes, the proxy hands its answer on, PD prefills from E's entry) than its twin sent
    by hand without it (E, then PD), one request at a time so that nothing queues; the
    median of `rounds` pairs, at 0 or more. With its series, for the report."""
    pairs = []
    for n in range(rounds):
        pairs.append((await through(2 * n), await direct(2 * n + 1)))
    series = {"through_ms": [round(a * 1000, 3) for a, _ in pairs],
              "direct_ms": [round(b * 1000, 3) for _, b in pairs]}
    if not pairs:
        return 0.0, series
    return max(statistics.median(a - b for a, b in pairs) * 1000, 0.0), series


def combine(prefill: StepCost, decode: StepCost, max_seqs: int | None = None,
            max_tokens: int | None = None) -> StepCost:
    """One instance that prefills and decodes (PD): a step that prefills pays the larger
    fixed cost, a decode-only step the decode's (charging a prefill's fixed cost to every
    decode step made PD's predicted TPOT a prefill's, and its goodput near 0)."""
    cost = replace(decode, prefill_fixed_ms=prefill.fixed_ms,
                   per_token_ms=prefill.per_token_ms, per_image_ms=prefill.per_image_ms)
    if max_seqs:
        cost = replace(cost, max_seqs=max_seqs)
    if max_tokens:
        cost = replace(cost, max_tokens=max_tokens)
    return cost


def slowdown(alone: float, loaded: float) -> float:
    """The sharing factor from a stage's time alone and beside a busy neighbour."""
    return max(loaded / alone - 1.0, 0.0) if alone > 0 else 0.0
