"""One fake instance's continuous batching: steps over queued jobs, timed by the cost model.

Every step admits waiting jobs first come first served (their images are encoded and their
prompts prefilled in that step, within the step's image, token, sequence and KV limits) and
gives every running job one more token, as vLLM's scheduler does. With chunked prefill
(`prefill.chunk_tokens`) a step prefills at most that many prompt tokens: the prompts left
part done by earlier steps first, then new ones; a prompt's first token comes with its last
chunk, and the running decodes share every step. A step's time comes from the cost model, so
requests in flight on one instance share steps and queue for real.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from epdctl.sim.costmodel import CostModel
from epdctl.sim.sharing import GpuShare

Sleep = Callable[[float], Awaitable[None]]


@dataclass
class Job:
    """One request's work on this instance."""

    mpixels: list[float] = field(default_factory=list)
    """Images this instance encodes (megapixels each)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    """Tokens to generate (0: encode only; 1: a prefill for a remote decode)."""
    needs_prefill: bool = True
    """False on D: the KV came from P, the job starts decoding at once."""
    prefilled: int = 0
    """Prompt tokens prefilled so far (all of them at once unless prefill is chunked)."""
    generated: int = 0
    token_times: list[float] = field(default_factory=list)
    """The clock at each generated token."""
    events: asyncio.Queue[bool] = field(default_factory=asyncio.Queue)
    """True per token, then False once the job is done."""
    is_aborted: bool = False
    """The client went away: the job leaves at the end of the next step (or is not admitted)."""

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def is_prefilling(self) -> bool:
        """Part of its prompt (or all of it) is still to be prefilled here."""
        return self.needs_prefill and self.prefilled < self.prompt_tokens

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens if self.output_tokens else 0


@dataclass(frozen=True)
class Step:
    """What one step ran (for /metrics and tests)."""

    started: float
    ms: float
    images: int
    prefills: int
    prefill_tokens: int
    decodes: int
    neighbours: int


class Scheduler:
    """The step loop of one instance; `submit` jobs, `run` it as a task."""

    def __init__(self, cost: CostModel, *, tp: int = 1, max_seqs: int | None = None,
                 kv_tokens: int | None = None, share: GpuShare | None = None,
                 sleep: Sleep = asyncio.sleep, clock: Callable[[], float] = time.monotonic,
                 keep_steps: bool = False) -> None:
        self.cost = cost
        self.tp = tp
        self.max_seqs = min(max_seqs or cost.decode.max_batch, cost.decode.max_batch)
        self.kv_tokens = kv_tokens
        self.share = share
        self.sleep = sleep
        self.clock = clock
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.kv_used = 0
        self.steps: list[Step] = []
        self.keep_steps = keep_steps
        self.step_count = 0
        self.busy_s = 0.0
        self.tokens_out = 0
        self.tokens_in = 0
        self._wake = asyncio.Event()
        self._is_marked = False

    def submit(self, job: Job) -> None:
        if self.kv_tokens is not None and job.kv_tokens > self.kv_tokens:
            raise ValueError(f"a request of {job.kv_tokens} tokens does not fit in the KV "
                             f"cache ({self.kv_tokens} tokens)")
        self.waiting.append(job)
        self._wake.set()

    def _admit(self, budget: int | None) -> list[Job]:
        """Waiting jobs this step takes, first come first served. `budget`: prompt tokens
        left to this step under chunked prefill (None: unchunked, max_batch_tokens holds);
        a job needing a prefill waits while none is left, it does not go ahead of others."""
        admitted: list[Job] = []
        images = tokens = 0
        while self.waiting:
            job = self.waiting[0]
            if job.is_aborted:
                self.waiting.popleft()
                job.events.put_nowait(False)
                continue
            n_img, n_tok = len(job.mpixels), job.prompt_tokens if job.needs_prefill else 0
            if admitted and images + n_img > self.cost.encode.max_batch:
                break
            if budget is None and admitted and \
                    tokens + n_tok > self.cost.prefill.max_batch_tokens:
                break
            if budget is not None and n_tok and tokens >= budget:
                break
            if job.output_tokens and len(self.running) + len(admitted) >= self.max_seqs:
                break
            if self.kv_tokens is not None and self.kv_used + job.kv_tokens > self.kv_tokens:
                break
            self.waiting.popleft()
            self.kv_used += job.kv_tokens
            admitted.append(job)
            images, tokens = images + n_img, tokens + n_tok
        return admitted

    async def run(self) -> None:
        """Step while there is work; wait for a submit otherwise. Runs until cancelled."""
        try:
            while True:
                if not self.waiting and not self.running:
                    self._mark(False)
                    self._wake.clear()
                    await self._wake.wait()
                self._mark(True)
                await self._step()
        finally:
            self._mark(False)

    def _mark(self, is_busy: bool) -> None:
        """This instance's busy mark on its fake GPUs, written only when it changes."""
        if self.share is not None and is_busy != self._is_marked:
            self.share.busy(is_busy)
            self._is_marked = is_busy

    def _chunks(self, jobs: list[Job]) -> list[int]:
        """The prompt tokens each of these prefilling jobs gets this step, in order: the
        rest of its prompt, within the chunk budget when prefill is chunked."""
        left = self.cost.prefill.chunk_tokens
        chunks = []
        for job in jobs:
            n = job.prompt_tokens - job.prefilled
            n = n if left is None else min(n, left)
            left = None if left is None else left - n
            chunks.append(n)
        return chunks

    async def _step(self) -> None:
        carried = [j for j in self.running if j.is_prefilling]
        budget = self.cost.prefill.chunk_tokens
        if budget is not None:
            budget -= sum(self._chunks(carried))
        admitted = self._admit(budget)
        decoding = [j for j in self.running if not j.is_prefilling] + \
            [j for j in admitted if not j.needs_prefill]
        prefilled = carried + [j for j in admitted if j.needs_prefill]
        chunks = self._chunks(prefilled)
        neighbours = self.share.neighbours() if self.share is not None else 0
        ms = self.cost.step_ms(
            mpixels=[mp for j in admitted for mp in j.mpixels],
            tokens=[n for n in chunks if n], starts=[j.prefilled for j, n in
                                                      zip(prefilled, chunks, strict=True) if n],
            batch=len(decoding), context=sum(j.context for j in decoding),
            tp=self.tp, busy_neighbours=neighbours)
        started = self.clock()
        await self.sleep(ms / 1000.0 * self.cost.time_scale)
        self.step_count += 1
        self.busy_s += self.clock() - started
        if self.keep_steps:
            self.steps.append(Step(started, ms, sum(len(j.mpixels) for j in admitted),
                                   len(prefilled), sum(chunks), len(decoding), neighbours))
        now = self.clock()
        self.tokens_in += sum(chunks)
        for job, n in zip(prefilled, chunks, strict=True):
            job.prefilled += n
        for job in prefilled + decoding:
            if job.is_prefilling:
                continue  # its first token comes with its last chunk
            if job.output_tokens > job.generated and not job.is_aborted:
                job.generated += 1
                job.token_times.append(now)
                self.tokens_out += 1
                job.events.put_nowait(True)
        self.running = []
        for job in prefilled + decoding:
            if job.is_aborted or (job.generated >= job.output_tokens
                                  and not job.is_prefilling):
                self.kv_used -= job.kv_tokens
                job.events.put_nowait(False)
            else:
                self.running.append(job)
