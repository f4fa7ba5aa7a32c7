"""The fake instance's batching on a virtual clock: step times add up as the cost model says."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from epdctl.sim.costmodel import CostModel
from epdctl.sim.scheduler import Job, Scheduler
from epdctl.sim.sharing import GpuShare


class Clock:
    """Virtual time: a sleep advances it and yields, nothing waits for real."""

    def __init__(self) -> None:
        self.now = 0.0

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


def cost(**sections: dict) -> CostModel:
    return CostModel.model_validate(sections)


async def _run(scheduler: Scheduler, jobs: list[Job]) -> None:
    task = asyncio.create_task(scheduler.run())
    for job in jobs:
        scheduler.submit(job)
    for job in jobs:
        while await job.events.get():
            pass
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_decode_batch_shares_steps() -> None:
    clock = Clock()
    model = cost(decode={"fixed_ms": 10, "per_seq_ms": 1, "per_kctx_ms": 0})
    s = Scheduler(model, sleep=clock.sleep, clock=lambda: clock.now)
    jobs = [Job(prompt_tokens=10, output_tokens=4, needs_prefill=False) for _ in range(3)]
    asyncio.run(_run(s, jobs))
    for job in jobs:  # 3 in a batch: 13 ms a step, one token each
        assert job.token_times == pytest.approx([0.013, 0.026, 0.039, 0.052])
    assert s.kv_used == 0 and not s.running


def test_prefill_then_decode_in_one_loop() -> None:
    clock = Clock()
    model = cost(prefill={"fixed_ms": 5, "per_token_ms": 0.1, "per_ktoken2_ms": 0},
                 decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    s = Scheduler(model, sleep=clock.sleep, clock=lambda: clock.now, keep_steps=True)
    job = Job(prompt_tokens=100, output_tokens=3)
    asyncio.run(_run(s, [job]))
    # prefill step 5 + 10 ms gives token 1; two decode steps of 10 ms follow
    assert job.token_times == pytest.approx([0.015, 0.025, 0.035])
    assert [(st.prefills, st.decodes) for st in s.steps] == [(1, 0), (0, 1), (0, 1)]


def test_encoder_batches_up_to_its_limit() -> None:
    clock = Clock()
    model = cost(encode={"fixed_ms": 4, "per_image_ms": 1, "per_mpixel_ms": 0, "max_batch": 4})
    s = Scheduler(model, sleep=clock.sleep, clock=lambda: clock.now, keep_steps=True)
    jobs = [Job(mpixels=[0.25, 0.25]) for _ in range(3)]
    asyncio.run(_run(s, jobs))
    assert [st.images for st in s.steps] == [4, 2]
    assert [st.ms for st in s.steps] == pytest.approx([8.0, 6.0])


def test_kv_capacity_holds_requests_back() -> None:
    clock = Clock()
    model = cost(decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    s = Scheduler(model, sleep=clock.sleep, clock=lambda: clock.now, kv_tokens=30,
                  keep_steps=True)
    jobs = [Job(prompt_tokens=10, output_tokens=2, needs_prefill=False) for _ in range(3)]
    asyncio.run(_run(s, jobs))
    assert [st.decodes for st in s.steps] == [2, 2, 1, 1]  # 12 tokens each, 30 fit two
    with pytest.raises(ValueError, match="does not fit"):
        s.submit(Job(prompt_tokens=40, output_tokens=1))


def test_tensor_parallel_and_time_scale() -> None:
    clock = Clock()
    model = cost(time_scale=0.5, tensor_parallel={"efficiency": 1.0},
                 decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    s = Scheduler(model, tp=2, sleep=clock.sleep, clock=lambda: clock.now)
    job = Job(prompt_tokens=1, output_tokens=1, needs_prefill=False)
    asyncio.run(_run(s, [job]))
    assert job.token_times == pytest.approx([0.0025])


def test_busy_neighbour_on_a_shared_gpu_slows_steps(tmp_path: Path) -> None:
    clock = Clock()
    model = cost(sharing={"slowdown": 0.5},
                 decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    neighbour = GpuShare(tmp_path, ["0"], pid=os.getppid())  # a live process, not us
    neighbour.busy(True)
    mine = GpuShare(tmp_path, ["0", "1"])
    s = Scheduler(model, share=mine, sleep=clock.sleep, clock=lambda: clock.now,
                  keep_steps=True)
    job = Job(prompt_tokens=1, output_tokens=2, needs_prefill=False)
    asyncio.run(_run(s, [job]))
    assert [st.neighbours for st in s.steps] == [1, 1]
    assert job.token_times == pytest.approx([0.015, 0.030])
    assert not list(tmp_path.glob("gpu-1/*.busy"))  # my marks are gone once idle
    neighbour.busy(False)
    assert mine.neighbours() == 0


def test_dead_neighbours_do_not_count(tmp_path: Path) -> None:
    (tmp_path / "gpu-0").mkdir()
    (tmp_path / "gpu-0" / "999999999.busy").touch()
    assert GpuShare(tmp_path, ["0"]).neighbours() == 0


def test_aborted_job_leaves() -> None:
    clock = Clock()
    model = cost(decode={"fixed_ms": 10, "per_seq_ms": 0, "per_kctx_ms": 0})
    s = Scheduler(model, sleep=clock.sleep, clock=lambda: clock.now)

    async def main() -> None:
        task = asyncio.create_task(s.run())
        job = Job(prompt_tokens=1, output_tokens=100, needs_prefill=False)
        s.submit(job)
        assert await job.events.get()
        job.is_aborted = True
        while await job.events.get():
            pass
        assert job.generated < 100 and s.kv_used == 0
        task.cancel()

    asyncio.run(main())
