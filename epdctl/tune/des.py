"""A discrete-event simulation of serving instances: an event heap, and instances that run
continuous-batching steps whose times come from profiled step costs (pure, no I/O)."""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepCost:
    """A profiled instance's step time: a linear fit over what the step runs (ms)."""

    fixed_ms: float = 0.0
    per_image_ms: float = 0.0
    """Per image the step encodes (at the workload's image size)."""
    per_token_ms: float = 0.0
    """Per prompt token the step prefills."""
    per_seq_ms: float = 0.0
    """Per running request the step decodes a token for."""
    per_seq2_ms: float = 0.0
    """Per running request squared (a decode step that grows faster than its batch)."""
    per_kctx_ms: float = 0.0
    """Per thousand tokens of context among the decoding requests."""
    max_images: int = 16
    max_tokens: int = 8192
    max_seqs: int = 256
    is_exponential: bool = False
    """Draw each step's time from an exponential of that mean (M/M/1 checks)."""
    prefill_fixed_ms: float | None = None
    """PD: the fixed cost of a step that prefills (or encodes), where it differs from a
    decode-only step's `fixed_ms`; such a step pays the larger. A decode-only step never
    pays it (vLLM's and the fake engine's steps pay for the work they do)."""

    def ms(self, images: float, tokens: int, seqs: int, context: int) -> float:
        if not (images or tokens or seqs):
            return 0.0
        fixed = self.fixed_ms
        if self.prefill_fixed_ms is not None and (images or tokens):
            fixed = max(fixed, self.prefill_fixed_ms)
        return (fixed + self.per_image_ms * images + self.per_token_ms * tokens
                + self.per_seq_ms * seqs + self.per_seq2_ms * seqs * seqs
                + self.per_kctx_ms * context / 1000)


class Sim:
    """Virtual time and the events due at it."""

    def __init__(self, seed: int = 0) -> None:
        self.now = 0.0
        self.rng = random.Random(f"service-{seed}")  # not the arrivals' stream
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (time, next(self._seq), action))

    def run(self, until: float = float("inf")) -> None:
        while self._heap and self._heap[0][0] <= until:
            time, _, action = heapq.heappop(self._heap)
            self.now = time
            action()


@dataclass
class Job:
    """One request's work on one instance."""

    images: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    needs_prefill: bool = True
    on_token: Callable[[float], None] | None = None
    on_done: Callable[[float], None] | None = None
    submitted: float = 0.0
    started: float | None = None
    """When its first step began (the end of its queueing)."""
    generated: int = 0
    image_work: float | None = None
    """Its images' encoding work in images of the profiled size (None: `images`); the step
    limit counts `images` (E takes images, not pixels, a step)."""

    @property
    def work(self) -> float:
        return self.images if self.image_work is None else self.image_work

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens if self.output_tokens else 0


@dataclass
class Instance:
    """One instance of a role: FCFS admission within the step's limits, a token per step for
    each running request (as epdctl.sim's fake engine and vLLM do)."""

    sim: Sim
    cost: StepCost
    kv_tokens: int | None = None
    slowdown: float = 0.0
    """Each busy neighbour (another instance on one of its GPUs) stretches a step by this."""
    neighbours: list[Instance] = field(default_factory=list)
    waiting: deque[Job] = field(default_factory=deque)
    running: list[Job] = field(default_factory=list)
    is_busy: bool = False
    busy_s: float = 0.0
    kv_used: int = 0
    outstanding: int = 0

    def submit(self, job: Job) -> None:
        job.submitted = self.sim.now
        self.outstanding += 1
        self.waiting.append(job)
        if not self.is_busy:
            self._step()

    def _admit(self) -> list[Job]:
        admitted: list[Job] = []
        images = tokens = 0
        c = self.cost
        while self.waiting:
            job = self.waiting[0]
            n_tok = job.prompt_tokens if job.needs_prefill else 0
            if admitted and (images + job.images > c.max_images or tokens + n_tok > c.max_tokens):
                break
            if job.output_tokens and len(self.running) + len(admitted) >= c.max_seqs:
                break
            if self.kv_tokens is not None and admitted and \
                    self.kv_used + job.kv_tokens > self.kv_tokens:
                break
            self.waiting.popleft()
            self.kv_used += job.kv_tokens
            job.started = self.sim.now
            admitted.append(job)
            images, tokens = images + job.images, tokens + n_tok
        return admitted

    def _step(self) -> None:
        admitted = self._admit()
        decoding = self.running + [j for j in admitted if not j.needs_prefill]
        prefilled = [j for j in admitted if j.needs_prefill]
        if not decoding and not prefilled:
            self.is_busy = False
            return
        ms = self.cost.ms(sum(j.work for j in admitted),
                          sum(j.prompt_tokens for j in prefilled), len(decoding),
                          sum(j.prompt_tokens + j.generated for j in decoding))
        if self.cost.is_exponential:
            ms = self.sim.rng.expovariate(1.0 / ms) if ms > 0 else 0.0
        busy = sum(1 for n in self.neighbours if n.is_busy)
        seconds = ms / 1000.0 * (1 + self.slowdown * busy)
        self.is_busy = True
        self.busy_s += seconds
        self.sim.at(self.sim.now + seconds, lambda: self._finish(prefilled + decoding))

    def _finish(self, jobs: list[Job]) -> None:
        now = self.sim.now
        self.running = []
        for job in jobs:
            if job.output_tokens > job.generated:
                job.generated += 1
                if job.on_token is not None:
                    job.on_token(now)
            if job.generated >= job.output_tokens:
                self.kv_used -= job.kv_tokens
                self.outstanding -= 1
                if job.on_done is not None:
                    job.on_done(now)
            else:
                self.running.append(job)
        self._step()


def least_outstanding(pool: list[Instance], turn: int = 0) -> Instance:
    """The proxy's pick: fewest outstanding requests, ties in turn."""
    best = min(i.outstanding for i in pool)
    ties = [i for i in pool if i.outstanding == best]
    return ties[turn % len(ties)]


def alone_s(cost: StepCost, job: Job) -> float:
    """A job's time on an idle instance (s): its first step (a prefill, or a decode step),
    then a decode step of one request for each further token (a closed form, as the
    steps' context grows by a token each)."""
    if job.needs_prefill:
        first = cost.ms(job.work, job.prompt_tokens, 0, 0)
        start, steps = 1, max(job.output_tokens - 1, 0)
    else:
        first, start, steps = 0.0, 0, job.output_tokens
    if steps:
        base = cost.ms(0, 0, 1, 0)
        context = steps * (job.prompt_tokens + start) + steps * (steps - 1) / 2
        first += steps * base + cost.per_kctx_ms * context / 1000
    return first / 1000
