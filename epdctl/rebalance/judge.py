"""A rebalance on a running topology, for `epdctl rebalance` and the rebalancer loop alike:
the policy, the recent traffic read from the proxy's log as the model's workload, the
decision, and the switches that carry it out."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdctl.errors import BenchError
from epdctl.launch.state import RunState, StateDir
from epdctl.rebalance.decide import MARGIN, Decision, decide
from epdctl.rebalance.split import running_shape
from epdctl.tune.workload import TraceWorkload

DEFAULT_SWITCH_S = 60.0
"""A switch's cost where no running instance has a measured start."""


@dataclass(frozen=True)
class Policy:
    profiles: Path
    slo: str
    window_s: float
    interval_s: float
    margin: float = MARGIN
    switch_s: float | None = None
    image_size: tuple[int, int] | None = None
    facts_file: Path | None = None

    @classmethod
    def of(cls, section: Any) -> Policy:
        """From a topology's `rebalance:` section (BenchError without profiles or SLO)."""
        if section.profiles is None or section.slo is None:
            raise BenchError("rebalance needs `rebalance: {profiles: DIR, slo: ttft=MS,"
                             "tpot=MS}` in the topology (profiles: a `tune --out`)")
        return cls(section.profiles, section.slo, section.window, section.interval,
                   section.margin, section.switch_seconds, None, section.model_facts)


def judge(sdir: StateDir, state: RunState, policy: Policy) -> tuple[Decision, list[str]]:
    """The decision on the traffic of the last `window_s`, and its switches as commands;
    BenchError in one line where it cannot be judged (no profiles, too few requests)."""
    from epdctl.bench.workload import parse_slo
    from epdctl.topology.model import load_topology
    from epdctl.tune.facts import model_facts
    from epdctl.tune.model import Slo
    from epdctl.tune.runner import saved_profile

    limits = dict(parse_slo(policy.slo))
    profile, profiled = saved_profile(policy.profiles)
    size = policy.image_size or tuple(profiled.get("image_size") or (512, 512))
    facts = model_facts(load_topology(state.topology_path).model, policy.facts_file)
    workload = recent(sdir.logs_dir / "proxy.log", policy.window_s, size, facts)  # type: ignore
    try:
        decision = decide(running_shape(state.engines), profile, workload,
                          Slo(limits.get("ttft"), limits.get("tpot")),
                          switch_s=switch_seconds(state, policy), interval_s=policy.interval_s,
                          margin=policy.margin)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    return decision, switches(state, decision.moves)


def switch_seconds(state: RunState, policy: Policy) -> float:
    """The policy's, else the longest start (spawn to ready) of the running engines."""
    if policy.switch_s is not None:
        return policy.switch_s
    starts = [r.ready_at - r.started_at for r in state.records.values()
              if r.ready_at is not None and r.name != state.proxy.name]
    return max(starts, default=DEFAULT_SWITCH_S)


def recent(proxy_log: Path, window_s: float, size: tuple[int, int], facts: Any
           ) -> TraceWorkload:
    """The requests of the last `window_s` as the model's workload; BenchError in one line
    where there are too few to judge."""
    from epdctl.logs.export import read_requests
    from epdctl.traces.format import Trace
    from epdctl.tune.traced import sized
    from epdctl.tune.workload import ProfiledShape, from_trace

    if not proxy_log.is_file():
        raise BenchError(f"no proxy log at {proxy_log}")
    requests = read_requests(proxy_log, time.time() - window_s).requests
    if len(requests) < 2:
        raise BenchError(f"{len(requests)} request(s) in the last {window_s:g}s: too few to "
                         "judge the traffic")
    trace = sized(Trace(tuple(requests), source=f"the last {window_s:g}s"), size)
    return from_trace(trace, ProfiledShape(size, facts.image_tokens_per_mpixel))


def switches(state: RunState, moves: list[tuple[str, str]]) -> list[str]:
    """`epdctl switch NAME ROLE` for each move (the newest instance of the role it leaves)."""
    left = {s.name: s.role for s in state.engines}
    out = []
    for a, b in moves:
        name = max((n for n, r in left.items() if r == a), key=lambda n: int(n.split("-")[-1]))
        del left[name]
        out.append(f"epdctl switch {name} {b}")
    return out


def switch_plan(decision: Decision) -> Callable[[Any, Any], list[Any]]:
    """The rollout's steps for the decision's moves, planned on a Placer of the run."""
    from epdctl.launch.rollout import replica, switch_steps

    def plan(placer: Any, state: Any) -> list[Any]:
        steps = []
        for a, b in decision.moves:
            newest = max((s for s in placer.engines if s.role == a), key=replica)
            steps += switch_steps(placer, newest.name, b)
        return steps

    return plan
