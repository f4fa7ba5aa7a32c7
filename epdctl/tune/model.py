"""The queue model: a candidate's stages as batching queues, simulated over the workload's
arrivals (Poisson at a rate, or closed-loop concurrency) with *profiled* step costs, and its
predicted goodput: the highest rate at which the SLO holds for >= 90 % of requests."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.des import Instance, Job, Sim, StepCost, least_outstanding

ATTAINMENT = 0.9
"""Share of requests that must meet the SLO."""
MAX_SIM_REQUESTS = 4000
"""The most requests one simulated run sends (a point's seconds at a high rate)."""


def stage_key(role: str, tp: int, encodes: bool = False) -> str:
    """Which profile serves an instance: `encode`, `pd-tp2`, `pd+enc-tp1` (aggregated PD
    encodes its images itself), `prefill-tp1`, `decode-tp4`."""
    if role == "encode":
        return "encode"
    short = {"prefill_decode": "pd", "prefill": "prefill", "decode": "decode"}[role]
    return f"{short}{'+enc' if encodes else ''}-tp{tp}"


def engine_of(stage: str) -> str:
    """The instance a stage key runs on, whether or not it encodes its own images:
    `pd+enc-tp1` and `pd-tp1` are one engine doing one job but for the encoder. Where the
    model errs on a PD instance's steps (prefill chunks beside decodes, say), it errs alike
    for both: on one machine the aggregated candidates' PD measured 1.5x its prediction,
    and so did every E|PD candidate's, which a correction by kind left underrated."""
    return stage.replace("+enc", "")


@dataclass(frozen=True)
class Profile:
    """What profiling measured, per kind of instance, and the hand-off costs."""

    stages: Mapping[str, StepCost]
    ec_handoff_ms: float = 0.0
    """From E's answer to PD (or P) having the request: the proxy's hop."""
    kv_fixed_ms: float = 0.0
    kv_per_ktoken_ms: float = 0.0
    """D pulling P's KV: fixed + per thousand prompt tokens."""
    sharing_slowdown: float = 0.0
    """Each busy neighbour on a shared GPU stretches a step by this."""
    kv_tokens: Mapping[str, int] = field(default_factory=dict)
    """KV cache tokens per instance kind (absent: unlimited)."""

    def missing(self, shape: Shape) -> list[str]:
        """The stage keys the shape needs that this profile lacks."""
        return [k for k in needed_stages(shape) if k not in self.stages]


def needed_stages(shape: Shape) -> list[str]:
    keys = ["encode"] if shape.encoders else []
    if shape.pd.replicas:
        keys.append(stage_key("prefill_decode", shape.pd.tp, encodes=not shape.encoders))
    if shape.prefill.replicas:
        keys += [stage_key("prefill", shape.prefill.tp), stage_key("decode", shape.decode.tp)]
    return keys


@dataclass(frozen=True)
class RequestShape:
    """One request of the workload as the stages see it."""

    images: int
    prompt_tokens: int
    """Text plus image tokens."""
    output_tokens: int


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return (self.ttft_ms is None or ttft_s * 1000 <= self.ttft_ms) and (
            self.tpot_ms is None or tpot_s * 1000 <= self.tpot_ms)


@dataclass
class Outcome:
    """One simulated run: per request TTFT and TPOT (s), per role utilization."""

    ttft: list[float]
    tpot: list[float]
    utilization: dict[str, float]
    duration_s: float

    def attainment(self, slo: Slo) -> float:
        met = sum(1 for a, b in zip(self.ttft, self.tpot, strict=True) if slo.met(a, b))
        return met / len(self.ttft) if self.ttft else 0.0

    def percentile(self, values: str, q: float) -> float:
        data = sorted(getattr(self, values))
        if not data:
            return math.nan
        return data[min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))]


class _Topology:
    """A shape's instances in a Sim, wired as the proxy sends requests."""

    def __init__(self, sim: Sim, shape: Shape, profile: Profile) -> None:
        self.sim, self.shape, self.profile = sim, shape, profile
        self.roles: dict[str, list[Instance]] = {}
        self.turn = 0

        def make(role: str, pool: Pool, encodes: bool = False) -> list[Instance]:
            key = stage_key(role, pool.tp, encodes)
            return [Instance(sim, profile.stages[key], profile.kv_tokens.get(key),
                             profile.sharing_slowdown) for _ in range(pool.replicas)]

        if shape.encoders:
            self.roles["encode"] = make("encode", Pool(shape.encoders, 1))
        if shape.pd.replicas:
            self.roles["prefill_decode"] = make("prefill_decode", shape.pd,
                                                encodes=not shape.encoders)
        if shape.prefill.replicas:
            self.roles["prefill"] = make("prefill", shape.prefill)
            self.roles["decode"] = make("decode", shape.decode)
        if shape.shared:
            host = self.roles["prefill_decode" if shape.kind == "e-pd" else "prefill"]
            for e, h in zip(self.roles["encode"], host, strict=False):
                e.neighbours.append(h)
                h.neighbours.append(e)

    def pick(self, role: str) -> Instance:
        self.turn += 1
        return least_outstanding(self.roles[role], self.turn)

    def send(self, req: RequestShape, report: Callable[[float, float, float], None]) -> None:
        """One request from now on; `report(ttft, tpot, end)` once it finishes."""
        arrived = self.sim.now
        first: list[float] = []

        def on_token(t: float) -> None:
            if not first:
                first.append(t)

        def finished(t: float) -> None:
            ttft = first[0] - arrived
            tpot = (t - first[0]) / (req.output_tokens - 1) if req.output_tokens > 1 else 0.0
            report(ttft, tpot, t)

        def generate() -> None:
            if "prefill_decode" in self.roles:
                self.pick("prefill_decode").submit(Job(
                    0 if self.shape.encoders else req.images, req.prompt_tokens,
                    req.output_tokens, on_token=on_token, on_done=finished))
                return

            def to_decode(t: float) -> None:
                delay = (self.profile.kv_fixed_ms + self.profile.kv_per_ktoken_ms
                         * req.prompt_tokens / 1000) / 1000
                self.sim.at(t + delay, lambda: self.pick("decode").submit(Job(
                    0, req.prompt_tokens, req.output_tokens, needs_prefill=False,
                    on_token=on_token, on_done=finished)))

            self.pick("prefill").submit(Job(0, req.prompt_tokens, 1, on_done=to_decode))

        if not self.shape.encoders or not req.images:
            generate()
            return
        left = [req.images]

        def encoded(t: float) -> None:
            left[0] -= 1
            if not left[0]:
                self.sim.at(t + self.profile.ec_handoff_ms / 1000, generate)

        for _ in range(req.images):
            self.pick("encode").submit(Job(1, 0, 0, on_done=encoded))

    def utilization(self, duration: float) -> dict[str, float]:
        return {role: (sum(i.busy_s for i in pool) / len(pool) / duration if duration else 0.0)
                for role, pool in self.roles.items()}


def simulate(shape: Shape, profile: Profile, req: RequestShape, *, rate: float | None = None,
             concurrency: int | None = None, requests: int = 300, seed: int = 0) -> Outcome:
    """Run `requests` requests: Poisson arrivals at `rate` per second, or `concurrency` in
    flight (a new one as each finishes)."""
    sim = Sim(seed)
    topo = _Topology(sim, shape, profile)
    ttft: list[float] = []
    tpot: list[float] = []
    ends: list[float] = []
    sent = 0

    def report(a: float, b: float, end: float) -> None:
        nonlocal sent
        ttft.append(a)
        tpot.append(b)
        ends.append(end)
        if rate is None and sent < requests:
            sent += 1
            topo.send(req, report)

    if rate is not None:
        arrivals = random.Random(seed)
        t = 0.0
        for _ in range(requests):
            t += arrivals.expovariate(1.0)
            sim.at(t / rate, lambda: topo.send(req, report))
    else:
        if concurrency is None or concurrency < 1:
            raise ValueError("simulate needs a rate or a concurrency of 1 or more")
        for _ in range(min(concurrency, requests)):
            sent += 1
            sim.at(0.0, lambda: topo.send(req, report))
    sim.run()
    duration = max(ends, default=0.0)
    return Outcome(ttft, tpot, topo.utilization(duration), duration)


@dataclass(frozen=True)
class Prediction:
    goodput: float
    """Requests per second at the knee (0: the SLO fails even at a trickle)."""
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    utilization: dict[str, float]
    """Per role, at the knee."""

    @property
    def bottleneck(self) -> str:
        return max(self.utilization, key=lambda r: self.utilization[r]) \
            if self.utilization else ""


def binding_stage(shape: Shape, prediction: Prediction) -> str:
    """The stage key of the role the prediction finds busiest at the knee (`decode-tp1`;
    "" when it has none): where the model's error for this candidate most likely lies."""
    role = prediction.bottleneck
    if not role or role == "encode":
        return role
    pool = {"prefill_decode": shape.pd, "prefill": shape.prefill, "decode": shape.decode}[role]
    return stage_key(role, pool.tp, encodes=role == "prefill_decode" and not shape.encoders)


def sim_requests(rate: float, requests: int, seconds: float) -> int:
    """Requests a simulated run at `rate` sends: `requests`, or `seconds` of the rate's when
    more (what a bench point with --point-seconds sends), at most MAX_SIM_REQUESTS."""
    if not seconds:
        return requests
    return max(requests, min(MAX_SIM_REQUESTS, math.ceil(rate * seconds)))


def predict(shape: Shape, profile: Profile, req: RequestShape, slo: Slo, *,
            requests: int = 300, seconds: float = 0.0, seed: int = 0,
            iterations: int = 14) -> Prediction:
    """The highest Poisson rate whose simulated run meets `slo` for >= ATTAINMENT of its
    requests (doubling, then bisection; the same arrivals scaled, so the runs compare; a run
    is `requests`, or `seconds` of arrivals when more: sim_requests)."""
    def ok(rate: float) -> tuple[bool, Outcome]:
        outcome = simulate(shape, profile, req, rate=rate, seed=seed,
                           requests=sim_requests(rate, requests, seconds))
        return outcome.attainment(slo) >= ATTAINMENT, outcome

    low, high = 0.0, 0.5
    best: Outcome | None = None
    while True:
        good, outcome = ok(high)
        if not good:
            break
        low, best, high = high, outcome, high * 2
        if high > 1e6:
            break
    for _ in range(iterations):
        mid = (low + high) / 2
        good, outcome = ok(mid)
        if good:
            low, best = mid, outcome
        else:
            high = mid
    if best is None:
        best = simulate(shape, profile, req, rate=max(low, 1e-3), requests=requests, seed=seed)

    def pcts(values: str) -> dict[str, float]:
        return {f"p{q}": round(best.percentile(values, q) * 1000, 3) for q in (50, 90, 99)}

    return Prediction(round(low, 4), pcts("ttft"), pcts("tpot"),
                      {r: round(u, 3) for r, u in best.utilization.items()})
