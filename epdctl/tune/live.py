"""The real profiler and confirmer of the tune loop: probe topologies brought up through
the run API and profiled over HTTP; candidates run through bench's runner (`vllm bench
serve`) at rates around their predicted knee."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epdctl.bench.samples import Round
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.host.interrupts import unwinding
from epdctl.launch.state import RunState
from epdctl.topology.model import Topology
from epdctl.tune.candidates import Candidate, Shape
from epdctl.tune.decide import Measured, above_knee, attainment, knee, knee_rate
from epdctl.tune.probes import Bodies, Known, Measurements, profile_running
from epdctl.tune.profile import LEVELS
from epdctl.tune.runner import Progress
from epdctl.tune.search import (
    CONFIRM_POINTS,
    KNEE_FACTORS,
    KNEE_STEPS,
    bracketing,
    confirmation_rates,
    grid_seed,
)

if TYPE_CHECKING:
    from epdctl.bench.runner import ArmRun, PointRun

POINTS = "points.json"
"""Per candidate, in --out's bench/<name>/: the load points its confirmation ran."""


def use_sim_bench_command() -> None:
    """On the simulated machine, the simulated `vllm bench serve` (epdctl.sim.loadgen: the
    engines are fake, and vLLM's own would import vLLM and torch at every load point),
    unless $EPDCTL_BENCH_COMMAND says otherwise."""
    import os
    import shlex
    import sys

    from epdctl.bench.workload import BENCH_COMMAND_ENV
    from epdctl.host.gpus import fake_gpu_count

    if fake_gpu_count() is not None and not os.environ.get(BENCH_COMMAND_ENV):
        os.environ[BENCH_COMMAND_ENV] = shlex.join(
            [sys.executable, "-m", "epdctl.sim.loadgen"])


def write_topology(topology: Topology, path: Path) -> Path:
    """A topology as YAML that `epdctl up` reads back the same."""
    import yaml

    from epdctl.topology.model import parse_topology

    data = topology.model_dump(mode="json", exclude_defaults=True)
    data.setdefault("name", topology.name)
    parse_topology(data, str(path))  # what is written must load
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass
class _RunnerProgress:
    """bench's runner Progress, on tune's."""

    progress: Progress

    def line(self, text: str) -> None:
        self.progress.line(text)

    def tick(self, text: str) -> None:
        pass

    def on_change(self, state: RunState) -> None:
        pass

    def done_starting(self) -> None:
        pass


class LiveProfiler:
    def __init__(self, state_root: Path, out_dir: Path, bodies: Bodies, tokens: int, *,
                 timeout_s: float, levels: Sequence[int] = LEVELS,
                 tpot_ms: float | None = None) -> None:
        self.state_root, self.out_dir = state_root, out_dir
        self.bodies, self.tokens, self.timeout_s, self.levels = bodies, tokens, timeout_s, levels
        self.tpot_ms = tpot_ms
        """The SLO's TPOT limit: decoders are profiled up to the batch it allows."""

    @unwinding()  # SIGTERM and SIGHUP too take the probe topology down
    def __call__(self, shape: Shape, topology: Topology, known: Known = ()) -> Measurements:
        from epdctl.launch.run import prepare, start_detached, stop

        path = write_topology(topology, self.out_dir / "probes" / f"{topology.name}.yaml")
        run = prepare(path, self.state_root, topology=topology)
        state = start_detached(run, self.timeout_s)
        try:
            return asyncio.run(profile_running(state, shape, self.bodies, self.tokens,
                                               self.levels, known, self.tpot_ms))
        finally:
            stop(run.sdir, run.sdir.read())


class LiveConfirmer:
    def __init__(self, workload: Workload, state_root: Path, out_dir: Path, *,
                 timeout_s: float, progress: Progress, points: int = CONFIRM_POINTS,
                 steps: int = KNEE_STEPS, trace_rate: float | None = None) -> None:
        self.workload, self.state_root, self.out_dir = workload, state_root, out_dir
        self.timeout_s, self.progress = timeout_s, progress
        self.factors, self.steps = KNEE_FACTORS[points], steps
        self.trace_rate = trace_rate
        """A trace's mean rate at speed 1 (workload.trace): a rate R is replayed at speed
        R / trace_rate."""

    def __call__(self, candidate: Candidate, predicted: float) -> Measured:
        """Bench near the predicted knee (the grid rates KNEE_FACTORS steps from it), then
        further up or down until the knee is bracketed (at most `steps` more points); each
        grid rate with its own requests (grid_seed), the same for every candidate. A trace
        fixes the arrivals (a grid rate is a speed of it); the grid seed still gives each
        rate its own bodies (words and pixels), the same for every candidate."""
        rates = confirmation_rates(predicted, self.factors, self.steps)
        return self.measure(candidate, rates,
                            bracketing(rates, len(self.factors), self.steps),
                            seeds=[grid_seed(r) for r in rates])

    def _point(self, rate: float, seed: int | None) -> LoadPoint:
        """A Poisson rate's load point, or the trace's at the speed of that mean rate."""
        if self.workload.trace is None:
            return LoadPoint(rate, seed=seed)
        if not self.trace_rate:
            raise ValueError("a trace's confirmation needs its rate (trace_rate)")
        return LoadPoint(speed=round(rate / self.trace_rate, 6), seed=seed)

    def measure(self, candidate: Candidate, rates: Sequence[float],
                wanted: Callable[[int, Sequence[PointRun]], bool] | None = None,
                seeds: Sequence[int] | None = None) -> Measured:
        """Bench the candidate at these rates (req/s: Poisson, or a trace at the speeds of
        these mean rates) in one start (`wanted`: run_arms'; `seeds`: each point's, else
        the workload's numbering); its measured knee (over the finite rates)."""
        from epdctl.bench.arms import Arm, image_limit
        from epdctl.bench.runner import greedy_prompts, run_arms

        workload = replace(self.workload, points=tuple(
            self._point(r, None if seeds is None else seeds[i]) for i, r in enumerate(rates)))
        path = write_topology(candidate.topology,
                              self.out_dir / "candidates" / f"{candidate.name}.yaml")
        arm = Arm(candidate.name, "extra", candidate.topology, path)
        (run,) = run_arms([arm], workload, self.state_root,
                          self.out_dir / "bench" / candidate.name, timeout_s=self.timeout_s,
                          progress=_RunnerProgress(self.progress),
                          prompts=greedy_prompts(image_limit(candidate.topology))[:1],
                          wanted=wanted or (lambda index, done: True))
        _write_points(self.out_dir / "bench" / candidate.name / POINTS, workload, rates, run)
        points = tuple((rates[p.index], share) for p in run.points
                       if (share := attainment(p.figures)) is not None
                       and math.isfinite(rates[p.index]))

        def samples_at(rate: float | None) -> tuple[Round, ...]:
            return tuple(p.samples for p in run.points
                         if p.samples is not None and rate is not None
                         and rates[p.index] == rate)

        return Measured(candidate.name, knee(points), points=points,
                        samples=samples_at(knee_rate(points)),
                        above=samples_at(above_knee(points)))


def _write_points(path: Path, workload: Workload, rates: Sequence[float], run: ArmRun) -> None:
    """What each load point run was: its rate, its load point (a trace's speed), the share
    within the SLO, and the sender's command line."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([
        {"rate": rates[p.index], **workload.points[p.index].as_json(),
         "attainment": attainment(p.figures), "argv": list(p.argv)}
        for p in sorted(run.points, key=lambda p: p.seq)], indent=2) + "\n")


def figures_of(measured: Measured) -> dict[str, Any]:
    return {"goodput": measured.goodput, "points": [list(p) for p in measured.points]}
