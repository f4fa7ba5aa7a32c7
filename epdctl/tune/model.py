"""The queue model: a candidate's stages as batching queues, simulated over the workload's
arrivals (Poisson at a rate, or closed-loop concurrency) with *profiled* step costs, and its
predicted goodput: the highest rate at which the SLO holds for >= 90 % of requests."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.des import Instance, Job, Sim, StepCost, alone_s, least_outstanding

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
    image_work: tuple[float, ...] = ()
    """Per image, its encoding work in images of the profiled size (empty: one each)."""

    def work(self, image: int) -> float | None:
        """Image `image`'s work for its Job (None: one profiled image)."""
        return self.image_work[image] if self.image_work else None

    @property
    def all_work(self) -> float | None:
        return sum(self.image_work) if self.image_work else None


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, ttft_s: float, tpot_s: float) -> bool:
        return (self.ttft_ms is None or ttft_s * 1000 <= self.ttft_ms) and (
            self.tpot_ms is None or tpot_s * 1000 <= self.tpot_ms)


@dataclass
class Outcome:
    """One simulated run: per request TTFT and TPOT (s), per role utilization; for a trace,
    per request its shape class and what each role it visited delayed it (delays)."""

    ttft: list[float]
    tpot: list[float]
    utilization: dict[str, float]
    duration_s: float
    classes: list[str] = field(default_factory=list)
    delays: list[dict[str, float]] = field(default_factory=list)
    """Per request and role: its time there less what the same work takes on an idle
    instance (queueing, and steps stretched by the batch and neighbours)."""

    def _of(self, shape_class: str | None) -> list[int]:
        if shape_class is None:
            return list(range(len(self.ttft)))
        return [i for i, c in enumerate(self.classes) if c == shape_class]

    def attainment(self, slo: Slo, shape_class: str | None = None) -> float:
        if shape_class is None:
            met = sum(1 for a, b in zip(self.ttft, self.tpot, strict=True) if slo.met(a, b))
            return met / len(self.ttft) if self.ttft else 0.0
        mine = self._of(shape_class)
        met = sum(1 for i in mine if slo.met(self.ttft[i], self.tpot[i]))
        return met / len(mine) if mine else 0.0

    def percentile(self, values: str, q: float, shape_class: str | None = None) -> float:
        every = getattr(self, values)
        data = sorted(every if shape_class is None else
                      [every[i] for i in self._of(shape_class)])
        if not data:
            return math.nan
        return data[min(len(data) - 1, max(0, math.ceil(q / 100 * len(data)) - 1))]

    def delay_by_role(self, shape_class: str | None = None) -> dict[str, float]:
        """Mean delay (s) per role over the class's requests (0 where one skipped it)."""
        mine = self._of(shape_class) if self.delays else []
        total: dict[str, float] = {}
        for i in mine:
            for role, s in self.delays[i].items():
                total[role] = total.get(role, 0.0) + s
        return {role: s / len(mine) for role, s in total.items()}


class Wiring:
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

    def send(self, req: RequestShape, report: Callable[[float, float, float], None],
             delays: dict[str, float] | None = None) -> None:
        """One request from now on; `report(ttft, tpot, end)` once it finishes. A request
        without images skips E, as the proxy sends a body with no media straight to PD (or
        P). With `delays`, each role's delay of it is kept there (_watched)."""
        arrived = self.sim.now

        def watched(role: str, job: Job) -> Job:
            return job if delays is None else _watched(role, job, self.roles[role][0].cost,
                                                        delays)

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
                self.pick("prefill_decode").submit(watched("prefill_decode", Job(
                    0 if self.shape.encoders else req.images, req.prompt_tokens,
                    req.output_tokens, on_token=on_token, on_done=finished,
                    image_work=None if self.shape.encoders else req.all_work)))
                return

            def to_decode(t: float) -> None:
                delay = (self.profile.kv_fixed_ms + self.profile.kv_per_ktoken_ms
                         * req.prompt_tokens / 1000) / 1000
                self.sim.at(t + delay, lambda: self.pick("decode").submit(watched("decode", Job(
                    0, req.prompt_tokens, req.output_tokens, needs_prefill=False,
                    on_token=on_token, on_done=finished))))

            self.pick("prefill").submit(watched("prefill", Job(0, req.prompt_tokens, 1,
                                                               on_done=to_decode)))

        if not self.shape.encoders or not req.images:
            generate()
            return
        left = [req.images]

        def encoded(t: float) -> None:
            left[0] -= 1
            if not left[0]:
                self.sim.at(t + self.profile.ec_handoff_ms / 1000, generate)

        for image in range(req.images):
            self.pick("encode").submit(watched("encode", Job(
                1, 0, 0, on_done=encoded, image_work=req.work(image))))

    def utilization(self, duration: float) -> dict[str, float]:
        return {role: (sum(i.busy_s for i in pool) / len(pool) / duration if duration else 0.0)
                for role, pool in self.roles.items()}


def _watched(role: str, job: Job, cost: StepCost, delays: dict[str, float]) -> Job:
    """`job`, keeping in `delays[role]` the most that role delayed the request (its
    images on E: the slowest)."""
    done = job.on_done

    def on_done(t: float) -> None:
        spent = t - job.submitted - alone_s(cost, job)
        delays[role] = max(delays.get(role, 0.0), spent)
        if done is not None:
            done(t)

    job.on_done = on_done
    return job


def simulate(shape: Shape, profile: Profile, req: RequestShape, *, rate: float | None = None,
             concurrency: int | None = None, requests: int = 300, seed: int = 0) -> Outcome:
    """Run `requests` requests: Poisson arrivals at `rate` per second, or `concurrency` in
    flight (a new one as each finishes)."""
    sim = Sim(seed)
    topo = Wiring(sim, shape, profile)
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
    return role_stage(shape, prediction.bottleneck)


def role_stage(shape: Shape, role: str) -> str:
    """The stage key of one of the shape's roles ("" for none)."""
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
    def run(rate: float) -> Outcome:
        return simulate(shape, profile, req, rate=rate, seed=seed,
                        requests=sim_requests(rate, requests, seconds))

    low, best = knee(run, slo, iterations)
    if best is None:
        best = simulate(shape, profile, req, rate=max(low, 1e-3), requests=requests, seed=seed)
    return Prediction(round(low, 4), percentiles(best, "ttft"), percentiles(best, "tpot"),
                      {r: round(u, 3) for r, u in best.utilization.items()})


KNEE_CEILING = 1e6
"""req/s: the knee search stops doubling past it (a workload no load makes miss the SLO)."""


def knee(run: Callable[[float], Outcome], slo: Slo, iterations: int = 14
         ) -> tuple[float, Outcome | None]:
    """The highest rate whose run meets `slo` for >= ATTAINMENT of its requests, and that
    run (None: not even 0.5 req/s): doubling from 0.5 req/s, then `iterations` bisections."""
    low, high = 0.0, 0.5
    best: Outcome | None = None
    while True:
        outcome = run(high)
        if outcome.attainment(slo) < ATTAINMENT:
            break
        low, best, high = high, outcome, high * 2
        if high > KNEE_CEILING:
            break
    for _ in range(iterations):
        mid = (low + high) / 2
        outcome = run(mid)
        if outcome.attainment(slo) >= ATTAINMENT:
            low, best = mid, outcome
        else:
            high = mid
    return low, best


def percentiles(outcome: Outcome, values: str, shape_class: str | None = None
                ) -> dict[str, float]:
    """p50, p90 and p99 of `ttft` or `tpot`, in ms."""
    return {f"p{q}": round(outcome.percentile(values, q, shape_class) * 1000, 3)
            for q in (50, 90, 99)}
