"""The queue model over a trace: its requests at their own arrival times, scaled to a mean
rate, each sent through the candidate's stages by its shape; the goodput (the highest mean
rate at which the SLO holds for >= ATTAINMENT of them), and per shape class its attainment,
percentiles and the stage that binds it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from epdctl.traces.format import TraceError
from epdctl.tune.candidates import Shape
from epdctl.tune.des import Sim
from epdctl.tune.model import (
    KNEE_CEILING,
    Outcome,
    Prediction,
    Profile,
    Slo,
    Wiring,
    knee,
    percentiles,
    role_stage,
)
from epdctl.tune.workload import TraceWorkload


@dataclass(frozen=True)
class ClassPrediction:
    """One shape class at the knee."""

    requests: int
    attainment: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    delay_ms: dict[str, float]
    """Per stage key, the mean of what that stage delayed the class's requests beyond the
    same work on an idle instance (0 for a stage they skip)."""
    binding_stage: str
    """The stage of the largest delay ("" where none delayed them): its queue, or its steps
    stretched by the batch, is what the class waits on at the knee."""


@dataclass(frozen=True)
class TracePrediction:
    prediction: Prediction
    """Over all requests; its goodput is the trace's mean rate x `speed`."""
    speed: float
    classes: dict[str, ClassPrediction]
    """The most frequent class first."""

    @property
    def goodput(self) -> float:
        return self.prediction.goodput


def simulate_trace(shape: Shape, profile: Profile, workload: TraceWorkload, *, rate: float,
                   seed: int = 0) -> Outcome:
    """Send every request of `workload` at its arrival time, the trace sped up so that it
    arrives at `rate` req/s on average; the Outcome is per request in trace order, with its
    class and delays."""
    sim = Sim(seed)
    wiring = Wiring(sim, shape, profile)
    arrivals = workload.arrivals_at(rate)
    n = len(arrivals)
    ttft, tpot = [math.nan] * n, [math.nan] * n
    delays: list[dict[str, float]] = [{} for _ in range(n)]
    ends: list[float] = []
    speed = workload.speed(rate)

    def send(i: int) -> None:
        arrival, arrived = arrivals[i], sim.now

        def report(first_s: float, per_token_s: float, end: float) -> None:
            if not arrival.is_stream:  # answered whole: vLLM's goodput counts its latency
                first_s, per_token_s = end - arrived, 0.0
            ttft[i], tpot[i] = first_s, per_token_s
            ends.append(end)

        wiring.send(arrival.request, report, delays[i])

    for i, arrival in enumerate(arrivals):
        sim.at(arrival.at_s / speed, partial(send, i))
    sim.run()
    duration = max(ends, default=0.0)
    return Outcome(ttft, tpot, wiring.utilization(duration), duration,
                   [a.shape_class for a in arrivals], delays)


def predict_trace(shape: Shape, profile: Profile, workload: TraceWorkload, slo: Slo, *,
                  seed: int = 0, iterations: int = 14) -> TracePrediction:
    """The highest mean rate (req/s: the trace's rate x a speed) whose run meets `slo` for
    >= ATTAINMENT of all its requests (model.knee: the bisection of `predict`), with each
    class's attainment, percentiles and binding stage at that rate."""
    def run(rate: float) -> Outcome:
        return simulate_trace(shape, profile, workload, rate=rate, seed=seed)

    low, best = knee(run, slo, iterations)
    if low >= KNEE_CEILING / 2:
        raise TraceError(
            f"the trace's {len(workload.arrivals)} requests meet the SLO however fast they "
            "arrive: too few to load a topology; give --point-seconds S (a rate then sends "
            "at least rate x S requests, the trace played again from its start)")
    if best is None:
        best = run(max(low, 1e-3))
    overall = Prediction(round(low, 4), percentiles(best, "ttft"), percentiles(best, "tpot"),
                         {r: round(u, 3) for r, u in best.utilization.items()})
    classes = {name: _class(shape, best, name, n, slo) for name, n in workload.counts().items()}
    return TracePrediction(overall, round(workload.speed(low), 6), classes)


def _class(shape: Shape, outcome: Outcome, name: str, n: int, slo: Slo) -> ClassPrediction:
    delays = {role_stage(shape, role): round(s * 1000, 3)
              for role, s in outcome.delay_by_role(name).items()}
    for role in outcome.utilization:
        delays.setdefault(role_stage(shape, role), 0.0)
    worst = max(delays, key=lambda k: delays[k]) if delays else ""
    return ClassPrediction(n, round(outcome.attainment(slo, name), 4),
                           percentiles(outcome, "ttft", name), percentiles(outcome, "tpot", name),
                           delays, worst if delays.get(worst, 0.0) > 0 else "")
