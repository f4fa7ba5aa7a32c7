"""The tune loop: candidates, profiles (kept in --out, reused), predictions, confirmation
runs until the stop rule says so, and the result. Profiling and confirming are passed in,
so the loop is tested without servers; epdctl.tune.live gives the real ones."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from epdctl.bench.samples import Round
from epdctl.bench.workload import Workload
from epdctl.errors import BenchError
from epdctl.topology.model import Topology
from epdctl.tune.candidates import Candidate, Shape, candidates, limits_for, request_tokens
from epdctl.tune.decide import (
    MARGIN,
    MAX_CONFIRM,
    Decision,
    Measured,
    best_measured,
    corrected,
    next_step,
)
from epdctl.tune.des import StepCost
from epdctl.tune.facts import ModelFacts
from epdctl.tune.model import (
    Prediction,
    Profile,
    RequestShape,
    Slo,
    binding_stage,
    engine_of,
    predict,
)
from epdctl.tune.probes import HANDOFF, Measurements, probe_shapes
from epdctl.tune.profile import mean
from epdctl.tune.traced import TraceTune
from epdctl.tune.tracemodel import TracePrediction, predict_trace

PROFILES = "profiles.json"
CONFIRMED = "confirmed.json"


class Progress(Protocol):
    def line(self, text: str) -> None: ...


Profiler = Callable[[Shape, Topology, Mapping[str, StepCost | None]], Measurements]
"""Bring a probe topology up, profile it (but for the stage keys given: profiled already,
with their costs), take it down."""
Confirmer = Callable[[Candidate, float], Measured]
"""Run bench on a candidate around a predicted knee (req/s); its measured goodput."""


@dataclass(frozen=True)
class Settings:
    base: Topology
    gpus: tuple[int, ...]
    workload: Workload
    slo: Slo
    facts: ModelFacts
    gpu_memory: int | None
    out_dir: Path
    budget_s: float = 45 * 60.0
    max_confirm: int = MAX_CONFIRM
    sim_requests: int = 300
    trace: TraceTune | None = None
    """`--trace`/`--mix`: predicted over the trace (predict_trace), confirmed by replaying it;
    `workload` is then the shape profiled (the trace's typical image-bearing request)."""


@dataclass
class Row:
    candidate: Candidate
    prediction: Prediction | None = None
    measured: Measured | None = None
    corrected: float | None = None
    """The prediction corrected by the measurements (decide.corrected)."""
    missing: list[str] = field(default_factory=list)
    traced: TracePrediction | None = None
    """Over a trace: its speed at the knee and per class (`prediction` is its overall)."""

    @property
    def stage(self) -> str | None:
        """The stage the prediction finds binding (model.binding_stage; None: unpredicted)."""
        return binding_stage(self.candidate.shape, self.prediction) if self.prediction \
            else None

    def as_json(self) -> dict[str, Any]:
        p, m = self.prediction, self.measured
        error = (round(p.goodput / m.goodput - 1, 3) if p and m and m.goodput else None)
        return {"name": self.candidate.name, "shape": self.candidate.shape.label,
                "kind": self.candidate.shape.kind, "family": self.candidate.shape.family,
                "gpus": self.candidate.shape.gpus,
                "predicted_goodput": p.goodput if p else None,
                "corrected_goodput": self.corrected,
                "ttft_ms": p.ttft_ms if p else None, "tpot_ms": p.tpot_ms if p else None,
                "utilization": p.utilization if p else None,
                "bottleneck": p.bottleneck if p else None,
                "binding_stage": self.stage,
                "measured_goodput": m.goodput if m else None,
                "measured_interval": [m.low, m.high] if m and m.low is not None else None,
                "measured_points": [list(p) for p in m.points] if m else None,
                "prediction_error": error, "not_profiled": self.missing,
                **(_classes(self.traced) if self.traced else {})}


def _classes(traced: TracePrediction) -> dict[str, Any]:
    """A trace prediction's speed and per-class figures, for report.json."""
    return {"speed": traced.speed, "classes": {
        name: {"requests": c.requests, "attainment": c.attainment, "ttft_ms": c.ttft_ms,
               "tpot_ms": c.tpot_ms, "delay_ms": c.delay_ms,
               "binding_stage": c.binding_stage} for name, c in traced.classes.items()}}


def _load(path: Path, key: str) -> dict[str, Any]:
    """A store of --out, when it was made for the same workload and SLO (else empty)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("key") != key:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _save(path: Path, key: str, entries: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "entries": entries}, indent=2))
    tmp.replace(path)


def store_key(settings: Settings) -> str:
    """What profiles depend on: the workload's shape (a trace's: the one profiled), the SLO,
    the base."""
    shape = {k: v for k, v in settings.workload.as_json().items() if k != "points"}
    return json.dumps({"workload": shape, "slo": [settings.slo.ttft_ms, settings.slo.tpot_ms],
                       "base": settings.base.model_dump(mode="json")}, sort_keys=True)


def confirm_key(settings: Settings) -> str:
    """What confirmations depend on: store_key's, and the trace they replayed."""
    if settings.trace is None:
        return store_key(settings)
    return json.dumps([store_key(settings), settings.trace.as_json()], sort_keys=True)


def gather_profiles(cands: Sequence[Candidate], settings: Settings, profiler: Profiler,
                    progress: Progress, base_placed: Callable[[Shape], Topology],
                    is_spent: Callable[[], bool] = lambda: False
                    ) -> tuple[Profile, list[str]]:
    """Profile every probe shape not already in --out's profiles.json (each told the stage
    keys profiled before it, which it skips); merge into one. Once `is_spent()`, the probes
    left are skipped: returned by label (the candidates that need them go unpredicted)."""
    path = settings.out_dir / PROFILES
    key = store_key(settings)
    store = _load(path, key)
    skipped: list[str] = []
    for shape in probe_shapes([c.shape for c in cands], len(settings.gpus)):
        if shape.label in store:
            progress.line(f"profile {shape.label}: kept from {path}")
            continue
        if skipped or is_spent():
            skipped.append(shape.label)
            continue
        progress.line(f"profile {shape.label}: starting")
        known: dict[str, StepCost | None] = {
            k: StepCost(**cost) for e in store.values()
            for k, cost in e.get("stages", {}).items()}
        if _values(store, "ec_ms"):
            known[HANDOFF] = None
        got = profiler(shape, base_placed(shape), known)
        store[shape.label] = {"stages": {k: asdict(v) for k, v in got.stages.items()},
                              "series": got.series, "kv_ms": got.kv_ms,
                              "sharing_slowdown": got.sharing_slowdown, "ec_ms": got.ec_ms}
        _save(path, key, store)
    if skipped:
        progress.line(f"the budget is spent: not profiled {', '.join(skipped)}")
    return merged(store), skipped


def merged(store: dict[str, Any]) -> Profile:
    """One Profile of a profiles.json's entries (each probe's stages, the first of a key
    kept; the hand-off costs averaged)."""
    stages: dict[str, StepCost] = {}
    for entry in store.values():
        for key, cost in entry.get("stages", {}).items():
            stages.setdefault(key, StepCost(**cost))
    return Profile(stages, ec_handoff_ms=mean(_values(store, "ec_ms")),
                   kv_fixed_ms=mean(_values(store, "kv_ms")),
                   sharing_slowdown=max(_values(store, "sharing_slowdown"), default=0.0))


def saved_profile(out_dir: Path) -> tuple[Profile, dict[str, Any]]:
    """The profiles a `tune --out DIR` kept, whatever workload they were made for (the
    stages' costs do not depend on it), and that workload (its image size is what an
    image's encoding work is counted in); BenchError in one line where there are none."""
    from epdctl.errors import BenchError

    path = out_dir / PROFILES
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, dict) or not entries:
            raise ValueError("no entries")
        return merged(entries), json.loads(data["key"])["workload"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"no profiles in {path} ({exc}): give the --out of a `tune` run of "
                         "this topology's model on this machine") from None


def _values(store: dict[str, Any], name: str) -> list[float]:
    """One measurement of every probe in the store that made it."""
    return [float(e[name]) for e in store.values() if e.get(name) is not None]


def tune(settings: Settings, profiler: Profiler, confirmer: Confirmer, progress: Progress,
         clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The whole method; returns the report (the caller writes it)."""
    started = clock()
    w = settings.workload
    tokens = request_tokens(settings.facts, w.images, w.image_size, w.input_len, w.output_len)
    longest = max((a.request.prompt_tokens + a.request.output_tokens
                   for a in settings.trace.model.arrivals), default=0) if settings.trace else 0
    limits = limits_for(settings.base, settings.facts, settings.gpu_memory,
                        max(tokens, longest))  # memory for the trace's longest request
    kept, left_out = candidates(settings.base, settings.gpus, settings.facts, limits)
    progress.line(f"{len(kept)} candidates on {len(settings.gpus)} device(s); "
                  f"{len(left_out)} left out (memory)")

    def placed(shape: Shape) -> Topology:
        from epdctl.tune.candidates import place

        return place(settings.base, shape, settings.gpus[: shape.gpus], limits)

    profile, not_profiled = gather_profiles(
        kept, settings, profiler, progress, placed,
        lambda: clock() - started >= settings.budget_s)
    req = RequestShape(w.images, tokens - w.output_len, w.output_len)
    rows = _predicted(kept, profile, req, settings)
    ranked = sorted((r for r in rows if r.prediction), key=lambda r: -r.prediction.goodput
                    if r.prediction else 0.0)
    progress.line(f"predicted {len(ranked)}; best {ranked[0].candidate.name} "
                  f"{ranked[0].prediction.goodput:.3g} req/s"
                  + (f" (the trace at {ranked[0].traced.speed:.3g}x)" if ranked[0].traced
                     else "") if ranked and ranked[0].prediction
                  else "nothing could be predicted")
    kinds = {r.candidate.name: r.candidate.shape.kind for r in rows}
    decision, measured = _confirm(settings, rows, ranked, not_profiled, confirmer,
                                  progress, clock, started)
    best, why = _best(measured, kinds)
    return {
        "candidates": [r.as_json() for r in ranked] + [r.as_json() for r in rows
                                                       if not r.prediction],
        "left_out": [{"shape": s.label, "reason": why} for s, why in left_out],
        "stop_reason": decision.reason, "not_confirmed": list(decision.left_out),
        "not_profiled": not_profiled,
        "best": best.name if best else None,
        "best_goodput": best.goodput if best else None,
        "best_reason": why,
        "workload": {k: v for k, v in w.as_json().items() if k != "points"},
        **({"trace": settings.trace.as_json()} if settings.trace else {}),
        "elapsed_s": round(clock() - started, 1),
        "profile": {k: asdict(v) for k, v in profile.stages.items()},
        "handoffs": {"ec_ms": round(profile.ec_handoff_ms, 3),
                     "kv_ms": round(profile.kv_fixed_ms, 3),
                     "sharing_slowdown": round(profile.sharing_slowdown, 3)},
    }


def _predicted(kept: Sequence[Candidate], profile: Profile, req: RequestShape,
               settings: Settings) -> list[Row]:
    """A row per candidate, predicted when the profile has every stage its shape needs."""
    rows = [Row(c) for c in kept]
    for row in rows:
        row.missing = profile.missing(row.candidate.shape)
        if row.missing:
            continue
        if settings.trace is not None:
            row.traced = predict_trace(row.candidate.shape, profile, settings.trace.model,
                                       settings.slo)
            row.prediction = row.traced.prediction
        else:
            row.prediction = predict(row.candidate.shape, profile, req, settings.slo,
                                     requests=settings.sim_requests,
                                     seconds=settings.workload.point_seconds)
    return rows


def _confirm(settings: Settings, rows: Sequence[Row], ranked: Sequence[Row],
             not_profiled: Sequence[str], confirmer: Confirmer,
             progress: Progress, clock: Callable[[], float], started: float
             ) -> tuple[Decision, dict[str, Measured]]:
    """Confirm the candidates next_step asks for (those kept in --out first) until it says
    stop, correcting every row's prediction by what was measured before each step."""
    by_name = {r.candidate.name: r for r in rows}
    stages = {r.candidate.name: r.stage or "" for r in rows}
    groups = (stages, {n: engine_of(s) for n, s in stages.items()},
              {r.candidate.name: r.candidate.shape.kind for r in rows})
    families = {r.candidate.name: r.candidate.shape.family for r in rows}
    aggregated = [r.candidate.name for r in ranked if r.candidate.shape.kind == "aggregated"]
    must = aggregated[:1]
    confirmed_path = settings.out_dir / CONFIRMED
    kept_runs, measured = _kept_confirmations(confirmed_path, confirm_key(settings), by_name,
                                              progress)
    predicted = [(r.candidate.name, r.prediction.goodput) for r in ranked if r.prediction]
    cost_s = 0.0
    while True:
        order = corrected(dict(predicted), groups, measured)
        for name, value in order.items():
            by_name[name].corrected = round(value, 4)
        if not_profiled:
            why = (f"the budget is spent while profiling "
                   f"({clock() - started:.0f} s of {settings.budget_s:.0f} s)")
            left_out = tuple(n for n, _ in predicted if n not in measured)
            return Decision(True, why, left_out=left_out), measured
        decision = next_step(predicted, measured, must=must, elapsed_s=clock() - started,
                             budget_s=settings.budget_s, cost_s=cost_s,
                             max_confirm=settings.max_confirm, order=order,
                             families=families, groups=groups, tie=MARGIN)
        if decision.stop or decision.next is None:
            return decision, measured
        row = by_name[decision.next]
        assert row.prediction is not None
        progress.line(f"confirm {row.candidate.name} ({row.candidate.shape.label}) near "
                      f"{row.prediction.goodput:.3g} req/s")
        t0 = clock()
        row.measured = measured[row.candidate.name] = confirmer(row.candidate,
                                                                row.prediction.goodput)
        cost_s = max(cost_s, clock() - t0)
        kept_runs[row.candidate.name] = _kept(row.measured)
        _save(confirmed_path, confirm_key(settings), kept_runs)
        spent = clock() - started
        left = min(settings.budget_s - spent,
                   cost_s * max(settings.max_confirm - len(measured), 0))
        progress.line(f"  measured {row.measured.goodput:.3g} req/s; {spent:.0f} s spent, "
                      f"at most ~{max(left, 0):.0f} s left")


def _kept_confirmations(path: Path, key: str, by_name: dict[str, Row], progress: Progress
                        ) -> tuple[dict[str, Any], dict[str, Measured]]:
    """The confirmations kept in --out's confirmed.json (all of them, to write back) and
    those of this run's candidates, set on their rows."""
    kept_runs = _load(path, key)
    measured: dict[str, Measured] = {}
    for name, entry in kept_runs.items():
        if name in by_name:
            by_name[name].measured = measured[name] = _measured(name, entry)
            progress.line(f"confirmed {name}: kept from {path}")
    return kept_runs, measured


def _best(measured: Mapping[str, Measured], kinds: Mapping[str, str]
          ) -> tuple[Measured | None, str | None]:
    """The best measured candidate, and why when it is not the top measured one."""
    best = best_measured(list(measured.values()), kinds)
    top = max(measured.values(), key=lambda m: m.goodput, default=None)
    why = None
    if best is not None and top is not None and kinds.get(best.name) == "aggregated" \
            and kinds.get(top.name) != "aggregated":  # a tie went to aggregated
        why = (f"`{top.name}` measured {top.goodput:.3g} req/s but is not decided to beat "
               f"aggregated `{best.name}` ({best.goodput:.3g}): the simpler topology")
    return best, why


def _kept(measured: Measured) -> dict[str, Any]:
    """A confirmation as confirmed.json keeps it (read back by _measured)."""
    return {"goodput": measured.goodput, "points": [list(p) for p in measured.points],
            "samples": [r.as_json() for r in measured.samples],
            "above": [r.as_json() for r in measured.above]}


def _measured(name: str, entry: dict[str, Any]) -> Measured:
    """A confirmation kept in confirmed.json (its samples dropped if they cannot be read:
    is_better then falls back to the point estimates)."""
    def rounds(key: str) -> tuple[Round, ...]:
        try:
            return tuple(Round.from_json(r) for r in entry.get(key) or ())
        except BenchError:
            return ()

    return Measured(name, float(entry["goodput"]), points=tuple(map(tuple, entry["points"])),
                    samples=rounds("samples"), above=rounds("above"))
