"""Profiling sweeps and fits, against the fake engine's scheduler on a virtual clock (no
server, no real time): the fits recover the cost model's figures."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from epdctl.sim.costmodel import CostModel
from epdctl.sim.engine import Engine
from epdctl.sim.options import parse_options
from epdctl.sim.requests import parse_work
from epdctl.sim.scheduler import Scheduler
from epdctl.tune.profile import (
    Send,
    Timing,
    closed_loop,
    combine,
    decode_levels,
    decoding_beside,
    fit_curve,
    fit_line,
    profile_decode,
    profile_encode,
    profile_handoff,
    profile_prefill,
    slowdown,
)

COST = CostModel.model_validate({
    "encode": {"fixed_ms": 5, "per_image_ms": 3, "per_mpixel_ms": 0, "max_batch": 16},
    "prefill": {"fixed_ms": 8, "per_token_ms": 0.02, "per_ktoken2_ms": 0},
    "decode": {"fixed_ms": 12, "per_seq_ms": 0.5, "per_kctx_ms": 0},
})


class VirtualEngines:
    """Fake engines by URL, stepping on one virtual clock; streamed tokens' times recorded
    (as probes.Http records them) where `token_times`."""

    def __init__(self, roles: dict[str, list[str]], cost: CostModel = COST,
                 token_times: bool = False) -> None:
        self.now = 0.0
        self.cost, self.token_times = cost, token_times
        self.engines = {url: Engine(cost, parse_options(argv, {}), Scheduler(
            cost, sleep=self.sleep, clock=lambda: self.now)) for url, argv in roles.items()}

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)

    async def send(self, url: str, body: dict[str, Any]) -> Timing:
        engine = self.engines[url]
        job = engine.job(parse_work(body, True, self.cost.model), body)
        start = self.now
        engine.scheduler.submit(job)
        while await job.events.get():
            pass
        first = job.token_times[0] if job.token_times else self.now
        return Timing(start, first, self.now, job.generated,
                      tuple(job.token_times) if self.token_times else ())

    def run(self, coro: Any) -> Any:
        async def main() -> Any:
            tasks = [asyncio.create_task(e.scheduler.run()) for e in self.engines.values()]
            try:
                return await coro
            finally:
                for t in tasks:
                    t.cancel()

        return asyncio.run(main())


def body(max_tokens: int | None, text: int = 400) -> Any:
    def make(n: int) -> dict[str, Any]:
        content = [{"type": "text", "text": "x" * text}]
        if max_tokens is None:
            content = [{"type": "image_url", "image_url": {"url": f"https://i/{n}.png"}}]
        return {"messages": [{"role": "user", "content": content}],
                **({"max_tokens": max_tokens} if max_tokens is not None else {})}
    return make


def test_fit_line() -> None:
    assert fit_line([1, 2, 4], [3, 5, 9]) == pytest.approx((1.0, 2.0))
    assert fit_line([1, 2], [-1, 4]) == pytest.approx((0.0, 7 / 5))  # through the origin
    assert fit_line([2, 2], [1, 3]) == (2.0, 0.0)


def test_encoder_profile_recovers_the_step_cost() -> None:
    fake = VirtualEngines({"e": ["m", "--ec-transfer-config", '{"ec_role": "ec_producer"}']})
    cost, series = fake.run(profile_encode(fake.send, "e", body(None)))
    assert series.levels == (1, 2, 4, 8)
    assert cost.fixed_ms == pytest.approx(5.0, rel=0.01)
    assert cost.per_image_ms == pytest.approx(3.0, rel=0.01)


def test_prefill_and_decode_profiles_of_pd() -> None:
    fake = VirtualEngines({"pd": ["m"]})
    tokens = 100  # 400 characters
    prefill, _ = fake.run(profile_prefill(fake.send, "pd", body(1), tokens))
    assert prefill.fixed_ms == pytest.approx(8.0, rel=0.05)
    assert prefill.per_token_ms == pytest.approx(0.02, rel=0.05)
    fake = VirtualEngines({"pd": ["m"]})  # a scheduler lives in one event loop
    decode, series = fake.run(profile_decode(fake.send, "pd", body(16)))
    assert decode.fixed_ms == pytest.approx(12.0, rel=0.02)
    assert decode.per_seq_ms == pytest.approx(0.5, rel=0.02)
    pd = combine(prefill, decode, max_seqs=64)
    assert (pd.fixed_ms, pd.per_token_ms, pd.max_seqs) == (decode.fixed_ms,
                                                          prefill.per_token_ms, 64)


def test_a_pd_decode_step_is_timed_apart_from_the_prefill_chunks_beside_it() -> None:
    """A PD whose prefill is chunked (400-token prompts, 600 tokens a step): a level's
    requests get their first tokens over several steps, and the first ones decode beside
    the others' chunks. Over the window where all decode, the fitted step at 32 is the
    decode step's own (within 3 %); each answer's mean TPOT (no token times) puts it a
    fifth and more above (the chunks' time; 2-3x on random-107's PD)."""
    cost = COST.model_copy(update={"prefill": COST.prefill.model_copy(
        update={"chunk_tokens": 600, "per_token_ms": 0.2})})
    truth = cost.decode.fixed_ms + cost.decode.per_seq_ms * 32
    fitted = {}
    for times in (True, False):
        fake = VirtualEngines({"pd": ["m"]}, cost, token_times=times)
        decode, series = fake.run(profile_decode(fake.send, "pd", body(32), (1, 2, 4, 8, 16,
                                                                             32)))
        fitted[times] = decode.ms(0, 0, 32, 0)
        assert series.levels == (1, 2, 4, 8, 16, 32)
    assert fitted[True] == pytest.approx(truth, rel=0.03)
    assert fitted[False] > 1.2 * truth


def test_closed_loop_keeps_the_full_rounds() -> None:
    calls: list[int] = []

    async def send(url: str, b: dict[str, Any]) -> Timing:
        calls.append(b["n"])
        return Timing(0.0, 0.0, 1.0, 1)

    fn: Send = send
    timings = asyncio.run(closed_loop(fn, "u", lambda n: {"n": n}, 3, rounds=2, start=10))
    assert len(timings) == 3 and sorted(calls) == list(range(10, 16))


def test_the_handoff_is_the_median_extra_time_through_the_proxy() -> None:
    """Pairs of requests, each its own: the proxy's extra 7 ms is found past an outlier
    (a request that met a busy E); a proxy no slower than its twins (noise) gives 0."""
    numbers: list[int] = []

    def timed(seconds: float, outlier: float = 0.0):  # type: ignore[no-untyped-def]
        async def send(n: int) -> float:
            numbers.append(n)
            return seconds + (outlier if n == 0 else 0.0)
        return send

    ms, series = asyncio.run(profile_handoff(timed(0.107, outlier=0.5), timed(0.100)))
    assert ms == pytest.approx(7.0)
    assert len(series["through_ms"]) == len(series["direct_ms"]) == 5
    assert sorted(numbers) == list(range(10))  # every request its own images
    ms, _ = asyncio.run(profile_handoff(timed(0.100), timed(0.103)))
    assert ms == 0.0


def test_slowdown() -> None:
    assert slowdown(0.010, 0.015) == pytest.approx(0.5)
    assert slowdown(0.010, 0.009) == 0.0
    assert slowdown(0.0, 1.0) == 0.0


def test_pd_pays_the_prefill_fixed_cost_only_on_steps_that_prefill() -> None:
    from epdctl.tune.des import StepCost

    pd = combine(StepCost(fixed_ms=50.0, per_token_ms=0.1),
                 StepCost(fixed_ms=10.0, per_seq_ms=1.0))
    assert pd.ms(0, 0, 4, 0) == pytest.approx(14.0)  # decode only: decode's fixed cost
    assert pd.ms(0, 100, 4, 0) == pytest.approx(50.0 + 10.0 + 4.0)  # the larger one
    assert combine(StepCost(fixed_ms=5.0), StepCost(fixed_ms=10.0)).ms(0, 100, 0, 0) \
        == pytest.approx(10.0)


def test_decode_is_fitted_against_the_batch_it_decoded_in() -> None:
    """Requests reach a decoder one after another (E and P before it), so a level of 8 never
    decodes 8 at a time; each one's step time follows the batch it actually decoded in.
    Fitted against the level, per_seq came out well under the truth."""
    fixed, per_seq, gap, tokens = 0.060, 0.002, 0.3, 16
    levels = (1, 2, 4, 8)
    starts = {sum(levels[:i]): level for i, level in enumerate(levels)}

    def level_timings(level: int) -> list[Timing]:
        firsts = [k * gap for k in range(level)]
        spans = [(tokens - 1) * fixed] * level
        for _ in range(50):  # each span from the batch the spans give it
            got = [Timing(0.0, f, f + s, tokens) for f, s in zip(firsts, spans, strict=True)]
            spans = [(tokens - 1) * (fixed + per_seq * b) for b in decoding_beside(got)]
        return got

    async def send(url: str, b: dict[str, Any]) -> Timing:
        first = max(s for s in starts if s <= b["n"])
        return level_timings(starts[first])[b["n"] - first]

    cost, series = asyncio.run(profile_decode(send, "d", lambda n: {"n": n}, levels))
    assert series.batch[0] == 1.0 and series.batch[-1] < 6  # 8 sent, fewer at a time
    assert cost.per_seq_ms == pytest.approx(per_seq * 1000, rel=0.02)
    assert cost.fixed_ms == pytest.approx(fixed * 1000, rel=0.02)
    assert series.as_json()["batch"] == [round(b, 3) for b in series.batch]
    by_level = fit_line(series.levels, series.values)[1] * 1000
    assert by_level < 0.8 * per_seq * 1000  # what fitting against the level gave


def test_decoding_beside() -> None:
    together = [Timing(0.0, 1.0, 2.0, 5)] * 3
    assert decoding_beside(together) == [3.0, 3.0, 3.0]
    apart = [Timing(0.0, 0.0, 1.0, 5), Timing(0.0, 0.5, 1.5, 5), Timing(0.0, 2.0, 3.0, 5)]
    assert decoding_beside(apart) == [1.5, 1.5, 1.0]
    assert decoding_beside([Timing(0.0, 1.0, 1.0, 1)]) == [1.0]


def test_fit_curve_keeps_every_term_at_zero_or_more() -> None:
    xs = [1, 2, 4, 8, 16]
    assert fit_curve(xs, [3 + 2 * x for x in xs]) == pytest.approx((3.0, 2.0, 0.0))
    assert fit_curve(xs, [3 + 0.5 * x + 0.1 * x * x for x in xs]) \
        == pytest.approx((3.0, 0.5, 0.1))
    a, b, c = fit_curve(xs, [10 - 0.2 * x for x in xs])  # falling: a constant, not b < 0
    assert (b, c) == (0.0, 0.0) and a == pytest.approx(10 - 0.2 * 6.2)
    assert fit_curve([], []) == (0.0, 0.0, 0.0)


def _together(step: Any, tokens: int = 16):  # type: ignore[no-untyped-def]
    """A Send to a decoder that gets each level's requests at once (level i starts at
    request sum(levels before it)): each decodes in a batch of the level, every step
    `step(batch)` seconds long."""
    sent: list[int] = []

    async def send(url: str, b: dict[str, Any]) -> Timing:
        sent.append(b["n"])
        return Timing(0.0, 0.0, (tokens - 1) * step(b["level"]), tokens)

    return send, sent


def _leveled(n: int) -> dict[str, Any]:
    level, first = 1, 0
    while n >= first + level:
        first, level = first + level, 2 * level
    return {"n": n, "level": level}


def test_decode_is_profiled_up_to_the_batch_the_tpot_limit_allows() -> None:
    """A decoder whose steps stay under the TPOT limit at every level up to 8 is timed at
    16, 32, ... until one level's step reaches the limit; never past max-num-seqs; without
    a limit, at the levels given."""
    send, sent = _together(lambda b: 0.012 + 0.0005 * b)
    _, series = asyncio.run(profile_decode(send, "d", _leveled, limit_ms=22.0))
    assert series.levels == (1, 2, 4, 8, 16, 32)  # 20 ms at 16 < 22, 28 ms at 32
    assert sorted(sent) == list(range(63))  # every request its own
    _, series = asyncio.run(profile_decode(send, "d", _leveled, limit_ms=22.0, max_seqs=16))
    assert series.levels == (1, 2, 4, 8, 16)
    _, series = asyncio.run(profile_decode(send, "d", _leveled))
    assert series.levels == (1, 2, 4, 8)
    assert decode_levels((1, 2), None, 22.0, None) == (1, 2)


def test_a_decode_step_super_linear_in_the_batch_is_fitted_as_one() -> None:
    """Steps that grow with the batch squared: the profile (to the limit's batch) finds
    the square term, and predicts a step at 32 within 2 %, where a line through the
    levels up to 8 is far off."""
    def step(b: float) -> float:
        return 0.010 + 0.0002 * b + 0.00004 * b * b

    send, _ = _together(step)
    cost, series = asyncio.run(profile_decode(send, "d", _leveled, limit_ms=60.0))
    assert series.levels[-1] >= 32
    assert cost.per_seq2_ms == pytest.approx(0.04, rel=0.02)
    assert cost.ms(0, 0, 32, 0) == pytest.approx(step(32) * 1000, rel=0.02)
    a, b = fit_line([1, 2, 4, 8], [step(x) for x in (1, 2, 4, 8)])
    assert abs((a + b * 32) / step(32) - 1) > 0.2


def test_each_decode_level_is_readied_upstream_then_sent_together() -> None:
    """E and P do each request's part first (untimed), all of a level's, and only then
    does the decoder get them, at once: one after another behind a slow E, 64 requests
    never decoded more than 7 at a time."""
    events: list[str] = []

    async def upstream(b: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0.001 * (b["n"] % 4))  # E finishes them out of order
        events.append(f"up {b['n']}")
        return {**b, "ready": True}

    async def send(url: str, b: dict[str, Any]) -> Timing:
        assert b["ready"]
        events.append(f"send {b['n']}")
        return Timing(0.0, 0.0, 0.015, 16)

    asyncio.run(profile_decode(send, "d", lambda n: {"n": n}, (2, 4), upstream=upstream))
    assert [e.split()[0] for e in events] == ["up"] * 2 + ["send"] * 2 + ["up"] * 4 \
        + ["send"] * 4
    assert sorted(int(e.split()[1]) for e in events if e.startswith("send")) == list(range(6))
