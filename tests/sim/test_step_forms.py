"""The cost model's other step forms: a decode step super-linear in its batch
(`decode.batch_exponent`) and chunked prefill (`prefill.chunk_tokens`), on a virtual clock
with step and token times worked out by hand; and the defaults leave a machine as it was."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from epdctl.sim.costmodel import CostModel
from epdctl.sim.scheduler import Job, Scheduler
from tests.sim.test_scheduler import Clock, _run, cost

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"


def _scheduler(model: CostModel) -> tuple[Scheduler, Clock]:
    clock = Clock()
    return Scheduler(model, sleep=clock.sleep, clock=lambda: clock.now, keep_steps=True), clock


def test_a_decode_step_grows_as_the_batch_to_its_exponent() -> None:
    model = cost(decode={"fixed_ms": 10, "per_seq_ms": 1, "per_kctx_ms": 0,
                         "batch_exponent": 1.5})
    assert model.decode_ms(4, 0) == pytest.approx(18.0)  # 10 + 4^1.5
    s, _ = _scheduler(model)
    jobs = [Job(prompt_tokens=10, output_tokens=2, needs_prefill=False) for _ in range(4)]
    asyncio.run(_run(s, jobs))
    for job in jobs:
        assert job.token_times == pytest.approx([0.018, 0.036])
    one, _ = _scheduler(model)
    alone = Job(prompt_tokens=10, output_tokens=1, needs_prefill=False)
    asyncio.run(_run(one, [alone]))
    assert alone.token_times == pytest.approx([0.011])  # 1^1.5: a batch of one as before


def test_a_long_prompt_is_prefilled_in_chunks_and_costs_what_it_does_whole() -> None:
    model = cost(prefill={"fixed_ms": 5, "per_token_ms": 0.1, "per_ktoken2_ms": 1000,
                          "chunk_tokens": 40},
                 decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    s, _ = _scheduler(model)
    job = Job(prompt_tokens=100, output_tokens=3)
    asyncio.run(_run(s, [job]))
    # chunks 40, 40, 20: 5 + 4 + 1000 * 0.04^2 = 10.6; 5 + 4 + 1000 * (0.08^2 - 0.04^2) =
    # 13.8; 5 + 2 + 1000 * (0.1^2 - 0.08^2) = 10.6; token 1 with the last (35 ms), then
    # two decode steps of 10 ms
    assert [st.prefill_tokens for st in s.steps] == [40, 40, 20, 0, 0]
    assert [st.ms for st in s.steps] == pytest.approx([10.6, 13.8, 10.6, 10.0, 10.0])
    assert job.token_times == pytest.approx([0.035, 0.045, 0.055])
    whole = model.prefill_ms([100]) - model.prefill.fixed_ms
    chunked = model.prefill_ms([40, 40, 20], [0, 40, 80]) - model.prefill.fixed_ms
    assert chunked == pytest.approx(whole)  # 10 + 10 ms of tokens and attention
    assert s.tokens_in == 100 and s.kv_used == 0 and not s.running


def test_a_chunk_shares_its_step_with_the_running_decodes() -> None:
    model = cost(prefill={"fixed_ms": 5, "per_token_ms": 0.1, "per_ktoken2_ms": 0,
                          "chunk_tokens": 60},
                 decode={"fixed_ms": 10, "per_seq_ms": 1, "per_kctx_ms": 0})
    s, _ = _scheduler(model)
    decoding = Job(prompt_tokens=10, output_tokens=3, needs_prefill=False)
    prefill = Job(prompt_tokens=100, output_tokens=1)  # P's job: one token, then D
    asyncio.run(_run(s, [decoding, prefill]))
    # step 1: chunk 60 (5 + 6) beside a decode of one (10 + 1), one fixed cost (10): 17;
    # step 2: chunk 40 (5 + 4) and the decode: 15, P's token; step 3: the decode alone, 11
    assert [(st.prefills, st.prefill_tokens, st.decodes) for st in s.steps] == [
        (1, 60, 1), (1, 40, 1), (0, 0, 1)]
    assert decoding.token_times == pytest.approx([0.017, 0.032, 0.043])
    assert prefill.token_times == pytest.approx([0.032])
    assert prefill.prefilled == 100 and s.kv_used == 0


def test_the_chunk_budget_is_shared_first_come_first_served() -> None:
    model = cost(prefill={"fixed_ms": 5, "per_token_ms": 0.1, "per_ktoken2_ms": 0,
                          "chunk_tokens": 40},
                 decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    s, _ = _scheduler(model)
    jobs = [Job(prompt_tokens=30, output_tokens=1) for _ in range(3)]
    asyncio.run(_run(s, jobs))
    # 30 + 10 (9 ms), the rest of the second + 20 of the third (9 ms), the third's 10 (6 ms)
    assert [(st.prefills, st.prefill_tokens) for st in s.steps] == [(2, 40), (2, 40), (1, 10)]
    assert [j.token_times for j in jobs] == [pytest.approx([t]) for t in (0.009, 0.018, 0.024)]


def test_an_encode_only_job_is_not_held_by_chunking() -> None:
    model = cost(encode={"fixed_ms": 4, "per_image_ms": 1, "per_mpixel_ms": 0},
                 prefill={"chunk_tokens": 16})
    s, clock = _scheduler(model)
    job = Job(mpixels=[0.25])
    asyncio.run(_run(s, [job]))
    assert [st.ms for st in s.steps] == pytest.approx([5.0])
    assert clock.now == pytest.approx(0.005) and job.token_times == []


def _old_prefill_ms(m: CostModel, tokens: list[int]) -> float:
    p = m.prefill
    return p.fixed_ms + sum(p.per_token_ms * n + p.per_ktoken2_ms * (n / 1000) ** 2
                            for n in tokens) if tokens else 0.0


def _old_decode_ms(m: CostModel, batch: int, context: int) -> float:
    d = m.decode
    return d.fixed_ms + d.per_seq_ms * batch + d.per_kctx_ms * context / 1000 if batch else 0.0


@pytest.mark.parametrize("name", ["encode-heavy", "decode-heavy", "sharing-sensitive", None])
def test_the_defaults_leave_a_machine_exactly_as_it_was(name: str | None) -> None:
    """The formulas before the new forms, to the last bit, on the examples and the default
    model; and an unchunked step takes a prompt over max_batch_tokens whole."""
    from epdctl.sim.costmodel import load_cost_model

    model = load_cost_model(EXAMPLES / f"{name}.yaml") if name else CostModel()
    assert model.prefill.chunk_tokens is None and model.decode.batch_exponent == 1.0
    for tokens in ([], [1], [64, 700], [8192], [123, 4567, 89]):
        assert model.prefill_ms(tokens) == _old_prefill_ms(model, tokens)
    for batch, context in itertools.product((0, 1, 7, 256), (0, 96, 40000)):
        assert model.decode_ms(batch, context) == _old_decode_ms(model, batch, context)
    s, _ = _scheduler(model)
    job = Job(prompt_tokens=10000, output_tokens=2)
    asyncio.run(_run(s, [job]))
    assert [st.prefill_tokens for st in s.steps] == [10000, 0]
    assert s.steps[0].ms == model.step_ms(tokens=[10000])
