"""`epdctl tune` against an exhaustive sweep, on the simulated machine.

    .venv/bin/python benchmarks/tune.py [--models encode-heavy,decode-heavy,sharing-sensitive
        | --random N [--seed S]] [--gpus 4,8] [--num-prompts 60] [--point-seconds S]
        [--budget 15m] [--sweep N] [--out DIR] [--port-offset N] [--sweep-only [--shard I/N]]
        [--check-alone N]

For each cost model of examples/sim/ (or random machine) and each fake-GPU count: `epdctl
tune` runs on the base, workload and SLO (its pick, predictions and wall time); then every
candidate `tune` considered is run through bench's runner (the sweep: one start per
candidate, every request at once, then Poisson rates around the rate that gave, a factor
sqrt(2) apart, until the knee is bracketed: its measured goodput, and the sweep's wall
time). Load comes from the simulated `vllm bench serve` (epdctl.sim.loadgen), for tune and
the sweep alike.

`--random N --seed S` runs, in place of the named cost models, N machines tune has never
seen: epdctl.sim.machines.draw(S), draw(S+1), ... draw(S+N-1), each written to
<out>/random-<seed>-<gpus>/random-<seed>.yaml and run as a named model is (the same SLO,
stretched as theirs is: slo_for). docs/tune.md "Random machines" says what they vary.

Ends with one line: pick_ratio= (measured goodput of tune's pick / the sweep's best, worst
over the runs; both measured again by one method, alternating: OneMeasure) cost_ratio=
(tune's wall time / the sweep's, worst) rank_spearman= (predicted vs measured goodput over
the swept candidates, worst) agg_call= (aggregated vs disaggregated called right, n/n).
Goal: pick_ratio >= 0.9, cost_ratio <= 0.2, rank_spearman >= 0.8. A second line gives their
spread over the runs: worst and median of each (pick_ratio_worst= pick_ratio_median=
rank_spearman_worst= ... agg_call=n/n).

The full sweep is hundreds of candidates (29 on 4 GPUs, ~140 on 8, per cost model) at 80-140
s each on two cores (4 GPUs, every candidate, 2026-12-04: 39-69 min a cost model, results in
benchmarks/results/tune): `--sweep N` sweeps N of them per run (evenly spread over the
enumeration, the first, aggregated, included), plus tune's pick.
Its pick_ratio is then against the best *of the sample* (an upper bound of the true
ratio), and cost_ratio is tune's time over the full sweep's, extrapolated from the
sample's mean time per candidate (both said in each run's line: `swept`, `sweep_s_full`).

A run can be stopped and started again with the same --out: tune's result (tune.json) and
each swept candidate (sweep-progress.json) are kept, and only what is missing is run, so
the hours of an exhaustive 8-GPU sweep can be spread over several sittings. With --sweep 0
the sweep runs first and tune after it (tune's wall time is measured in one go, so it wants
a sitting with its --budget to spare; the sweep can be stopped anywhere). `--sweep-only
--shard I/N` sweeps every Nth candidate from the Ith: N runs of one cost model side by side
(each with its own --port-offset) share its sweep-progress.json. The default
--out, benchmarks/results/tune, keeps those files (and settings.json, sweep.json) in git,
for a sitting on another machine; the rest of a run (topology state, logs, bench's files,
tune's profiles) is ignored there.

Every run process keeps its EC store in a private directory of its own under /dev/shm
(made 0700 on first use, removed when the process exits, Ctrl+C included), so that runs
side by side never find each other's encoder entries under the same candidate names.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _beside(name: str) -> Any:
    """The benchmark module `name`.py beside this file (run as a script or loaded by path)."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


tune_trace = _beside("tune_trace")
SLO = {"encode-heavy": "ttft=3000,tpot=60", "decode-heavy": "ttft=3000,tpot=60",
       "sharing-sensitive": "ttft=3000,tpot=60"}
"""Each cost model's SLO (ms) at its own time scale, on REFERENCE_GPUS GPUs (slo_for)."""
RANDOM_SLO = "ttft=3000,tpot=60"
"""The SLO of a random machine (epdctl.sim.machines), as the named ones'."""
LADDER = tuple(0.5 * 2 ** (k / 2) for k in range(19))
"""req/s, 0.5 to 256 by sqrt(2)."""
REFERENCE_GPUS = 4
"""A cost model's time_scale is for this many GPUs; on more, every wait is as many times
longer (_scaled), so that the best candidates' knees stay where 4 GPUs put them, within what
two cores of proxy and load generator carry (~0.5-1 ms of CPU a streamed token)."""


def dilation(gpus: int) -> float:
    """How many times slower than its file a cost model runs on `gpus` fake GPUs."""
    return gpus / REFERENCE_GPUS if gpus > REFERENCE_GPUS else 1.0


def slo_for(model: str, gpus: int) -> str:
    """The SLO a run holds its candidates to: stretched as its waits are (dilation), so that
    8 GPUs are the same machine seen slower, not a slower machine (a 60 ms TPOT against
    decode steps twice as long ruled out every candidate decoding at TP1)."""
    factor = dilation(gpus)
    return ",".join(f"{name}={float(ms) * factor:g}"
                    for name, ms in (part.split("=") for part in
                                     SLO.get(model, RANDOM_SLO).split(",")))


def budget_for(budget: str, gpus: int) -> str:
    """tune's --budget on `gpus` fake GPUs: stretched as the waits are (dilation), so that
    `--budget 15m` is 15 minutes on 4 GPUs and 30 on 8 (profiling a stage there takes twice
    as long)."""
    from epdctl.topology.sections import parse_duration

    factor = dilation(gpus)
    return budget if factor == 1.0 else f"{parse_duration(budget) * factor / 60:g}m"


SEARCH = (math.inf, *LADDER, *LADDER[::-1], *LADDER)
"""The sweep's load points in the order they may run: all at once, the ladder up, the ladder
down, the ladder up again (_sweep_one runs those `wanted` picks)."""


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Rank correlation (average ranks for ties); nan for fewer than two."""
    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else float("nan")


AGG_TIE = 0.05
"""Within this share of each other, the sweep's best aggregated and best disaggregated
candidates are a tie: tune's MARGIN (decide.MARGIN), where a tie goes to aggregated."""


def agg_call_right(sweep: dict[str, tuple[str, float]], pick_kind: str) -> bool:
    """Whether tune's pick is aggregated exactly when the sweep's best is; where the best of
    each are within AGG_TIE of each other, either call is right (one random machine's best
    disaggregated knee was 1.5 % above its best aggregated one: a tie by tune's rule)."""
    best = max(sweep.values(), key=lambda kv: kv[1])
    agg = max((g for kind, g in sweep.values() if kind == "aggregated"), default=0.0)
    disagg = max((g for kind, g in sweep.values() if kind != "aggregated"), default=0.0)
    if agg and disagg and abs(agg - disagg) <= AGG_TIE * max(agg, disagg):
        return True
    return (best[0] == "aggregated") == (pick_kind == "aggregated")


def _scaled(cost: Path, gpus: int, run_dir: Path) -> Path:
    """The cost model as the run uses it: time_scale x dilation (from 4 GPUs up; the file
    itself on fewer)."""
    import yaml

    if dilation(gpus) == 1.0:
        return cost
    data = yaml.safe_load(cost.read_text())
    data["time_scale"] = float(data.get("time_scale", 1.0)) * dilation(gpus)
    path = run_dir / cost.name
    if path == cost:  # a random machine is written in its run dir: keep it as drawn
        path = run_dir / f"{cost.stem}-x{dilation(gpus):g}.yaml"
    _write(path, yaml.safe_dump(data, sort_keys=False))  # shards write it side by side
    return path


_STORE: list[Path] = []
"""This process's private EC store root, once made (_store_dir)."""


def _store_dir() -> Path:
    """This process's own EC store root: made once (mkdtemp: 0700, a name nobody can guess)
    under /dev/shm, removed when the process exits (atexit runs on Ctrl+C's
    KeyboardInterrupt too). Two runs side by side used to share the default root, and so
    the namespaces of candidates of one name: one run's proxy found the entries the other
    run's E wrote."""
    if not _STORE:
        import atexit
        import shutil
        import tempfile

        shm = Path("/dev/shm")
        path = Path(tempfile.mkdtemp(prefix="epdctl-tune-bench-",
                                     dir=shm if shm.is_dir() else None))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _STORE.append(path)
    return _STORE[0]


def _base(tmp: Path, cost: Path, port_offset: int = 0, suffix: str = "") -> Path:
    """examples/sim/base.yaml with this venv's fake engine on `cost`, every port moved by
    `port_offset` (so that runs of two cost models, or two shards, can go on side by side),
    and this process's own EC store (_store_dir); written to base{suffix}.yaml."""
    import yaml

    data = yaml.safe_load((ROOT / "examples" / "sim" / "base.yaml").read_text())
    data["engine"]["command"] = [sys.executable, "-m", "epdctl.sim.engine", "--cost-model",
                                 str(cost)]
    data["cache"] = {**(data.get("cache") or {}), "dir": str(_store_dir())}
    data["proxy"]["port"] += port_offset
    data["ports"] = {k: v + port_offset for k, v in data["ports"].items()}
    path = tmp / f"base{suffix}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wanted_in(search: Sequence[float]) -> Any:
    """`wanted` over another SEARCH (a trace's: its first point a burst, TRACE_TOP)."""
    return lambda index, done: wanted(index, done, search)


def wanted(index: int, done: Sequence[Any], search: Sequence[float] = SEARCH) -> bool:
    """Whether the sweep runs search[index] (SEARCH's by default), given the points it ran so far
    (PointRuns): all at once first (the most req/s it serves then, X); then up from X/2 by
    sqrt(2) until a rate misses the SLO for more than 10 % of its requests; then, only if
    even the first of those missed, down until one holds it (or until not one request holds
    it at a quarter of X or less: no load is light enough then). A rate far below the knee
    would take num_prompts / rate to pass, a rate far above it about num_prompts / X to
    miss; so where not one request of a rate held the SLO, the rates down to X/4 are skipped
    (the candidates with no goodput at all, more than half of them on 8 GPUs, spent most of
    the sweep there), and should X/4 hold, the ladder up again runs the rates skipped
    between it and the lowest that missed, until one misses: the same bracket as one step at
    a time."""
    from epdctl.tune.decide import ATTAINMENT, attainment

    if index == 0:
        return True
    top = float(done[0].figures.get("request_throughput") or 0.0)
    ran = [(search[p.index], attainment(p.figures) or 0.0) for p in done[1:]]
    rate = search[index]
    if index <= len(LADDER):  # going up
        return rate >= top / 2 and all(share >= ATTAINMENT for _, share in ran)
    if index <= 2 * len(LADDER):  # going down
        lowest = min(ran, default=(math.inf, 0.0))
        if lowest[1] >= ATTAINMENT or rate >= lowest[0]:
            return False
        if lowest[1] == 0.0:  # not one request held: X/4 next (or the ladder's foot)
            return lowest[0] > top / 4 and rate <= max(top / 4, LADDER[0])
        return True
    held = [r for r, share in ran if share >= ATTAINMENT]  # up again, where down skipped
    if not held:
        return False
    missed = [r for r, share in ran if share < ATTAINMENT and r > max(held)]
    return max(held) < rate < min(missed, default=math.inf)


class ShapeJob:
    """What the sweep, tune and the one measure of a run send for one request shape (a
    trace's: tune_trace.TraceJob): the workload, the candidates tune considers, the sweep's
    load points."""

    def __init__(self, workload: Any, kept: list[Any]) -> None:
        self.workload, self.kept = workload, kept
        self.search: tuple[float, ...] = SEARCH

    def confirmer(self, state: Path, out: Path, progress: Any) -> Any:
        from epdctl.tune.live import LiveConfirmer

        return LiveConfirmer(self.workload, state, out, timeout_s=120, progress=progress)


def _sweep_one(candidate, job, state_root: Path, out: Path) -> float:  # type: ignore[no-untyped-def]
    """The candidate's measured knee, in one start (the points of the job's search `wanted`
    picks), interpolated between the highest rate that holds the SLO and the next one up."""
    from epdctl.tune.decide import knee

    confirm = job.confirmer(state_root, out, _Err())
    return knee(confirm.measure(candidate, job.search, wanted=wanted_in(job.search)).points)


class _Err:
    def line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def run_one(model: str, gpus: int, args: argparse.Namespace, out: Path,
            cost_file: Path | None = None) -> dict | None:
    """One cost model on `gpus` fake GPUs: its figures (None: --sweep-only). `cost_file`:
    the model's file (default examples/sim/<model>.yaml)."""
    from epdctl.bench.workload import LoadPoint, Workload, parse_slo
    from epdctl.topology.model import load_topology
    from epdctl.tune.candidates import candidates, limits_for, request_tokens
    from epdctl.tune.facts import from_file

    trace = getattr(args, "trace", None)
    run_dir = out / (f"{model}-{gpus}-{trace.stem}" if trace else f"{model}-{gpus}")
    run_dir.mkdir(parents=True, exist_ok=True)
    _same_settings(run_dir, args, model, gpus)
    cost = _scaled(cost_file or ROOT / "examples" / "sim" / f"{model}.yaml", gpus, run_dir)
    os.environ["EPDCTL_FAKE_GPUS"] = str(gpus)
    os.environ.pop("EPDCTL_PROXY_COMMAND", None)
    from epdctl.tune.live import use_sim_bench_command

    use_sim_bench_command()
    index, shards = args.shard
    suffix = f"-{index}" if index else ""  # a shard's own base, topology state and bench files
    base_path = _base(run_dir, cost, args.port_offset, suffix)
    base = load_topology(base_path)
    facts = from_file(cost)
    workload = Workload(points=(LoadPoint(),), num_prompts=args.num_prompts,
                        point_seconds=args.point_seconds, images=1,
                        image_size=(512, 512), input_len=64, output_len=32,
                        slo=parse_slo(slo_for(model, gpus)))
    if trace:
        job: Any = tune_trace.job(trace, base, gpus, facts, workload)
        job.search = (tune_trace.TRACE_TOP, *SEARCH[1:])
    else:
        tokens = request_tokens(facts, 1, (512, 512), 64, 32)
        limits = limits_for(base, facts, 80 << 30, tokens)
        job = ShapeJob(workload, candidates(base, list(range(gpus)), facts, limits)[0])
    kept = job.kept
    progress = Progress.load(run_dir)

    def sweep_all(names: Sequence[Any]) -> None:
        for c in names:
            if c.name in progress.done:
                continue  # measured by an earlier, interrupted run of this --out
            began = time.monotonic()
            goodput = _sweep_one(c, job, run_dir / f"state{suffix}",
                                 run_dir / f"sweep{suffix}")
            progress.add(c.name, c.shape.kind, goodput, time.monotonic() - began)

    if not args.sweep:  # every candidate, tune's pick among them: the hours first, tune after
        sweep_all(kept[index::shards])
        if args.sweep_only:
            return None
    alone = Alone.load(run_dir)
    for name in alone.wanted(progress, args.check_alone):
        began = time.monotonic()
        goodput = _sweep_one(next(c for c in kept if c.name == name), job,
                             run_dir / "state", run_dir / "alone")
        alone.add(name, goodput, time.monotonic() - began)
    doc, tune_s = _tuned(run_dir, base_path, model, gpus, cost, args)
    pick = next(c for c in doc["candidates"] if c["name"] == doc["best"])
    swept = sample(kept, args.sweep, pick["name"])
    sweep_all(swept)
    sweep = progress.knees([c.name for c in swept])
    sweep_s = progress.seconds([c.name for c in swept])
    sweep_full_s = sweep_s / len(swept) * len(kept)
    (run_dir / "sweep.json").write_text(json.dumps(sweep, indent=2))
    best = max(g for _, g in sweep.values())
    sweep_best = max(sweep, key=lambda n: sweep[n][1])
    ratio, means = _one_measure(run_dir, job, pick["name"], sweep_best, sweep)
    rows = {c["name"]: c for c in doc["candidates"]}
    both = [(rows[n]["predicted_goodput"], g) for n, (_, g) in sweep.items()
            if rows.get(n, {}).get("predicted_goodput") is not None]
    return {"model": model, "gpus": gpus, "candidates": len(kept), "swept": len(swept),
            "sweep_s": round(sweep_s), "sweep_s_full": round(sweep_full_s),
            "tune_s": round(tune_s), "pick": pick["name"],
            "sweep_best": sweep_best,
            "pick_ratio": ratio, "remeasured": means,
            "pick_ratio_sweep": sweep[pick["name"]][1] / best if best else 0.0,
            "cost_ratio": tune_s / sweep_full_s if sweep_full_s else float("inf"),
            "rank_spearman": spearman([a for a, _ in both], [b for _, b in both]),
            "agg_call": agg_call_right(sweep, pick["kind"]),
            **alone.figures(progress, args.check_alone),
            **(_average(run_dir, base_path, model, gpus, cost, args, job, progress,
                        pick["name"]) if trace else {})}


def _average(run_dir: Path, base_path: Path, model: str, gpus: int, cost: Path,
             args: argparse.Namespace, job: Any, progress: Progress, pick: str
             ) -> dict[str, Any]:
    """The trace tuned as its average single shape (tune-avg.json): that pick, and its
    goodput on the trace over the mix-tuned pick's (AvgMeasure: both replaying the trace,
    alternating); the average pick is swept on the trace first where the sweep did not."""
    avg_args = tune_trace.average_args(args.trace, args.num_prompts, args.point_seconds)
    doc, _ = _tuned(run_dir, base_path, model, gpus, cost, args, name="tune-avg",
                    workload=avg_args)
    avg = doc["best"]
    by_name = {c.name: c for c in job.kept}
    if avg not in by_name:
        return {"avg_pick": avg, "avg_ratio": None, "avg_args": avg_args}
    if avg not in progress.done:
        began = time.monotonic()
        goodput = _sweep_one(by_name[avg], job, run_dir / "state", run_dir / "sweep")
        progress.add(avg, by_name[avg].shape.kind, goodput, time.monotonic() - began)
    knees = progress.knees([avg, pick])
    ratio, means = _one_measure(run_dir, job, avg, pick, knees, AvgMeasure, "avg-remeasure")
    return {"avg_pick": avg, "avg_ratio": ratio, "avg_remeasured": means,
            "avg_args": avg_args}


def _one_measure(run_dir: Path, job: Any, pick: str, best: str,
                 sweep: dict[str, tuple[str, float]], kind: type[OneMeasure] | None = None,
                 sub: str = "remeasure") -> tuple[float, dict[str, float]]:
    """pick_ratio by the one-measure rule (OneMeasure, or `kind`): both confirmed as tune
    confirms, around one centre (the geometric mean of their swept knees), so that they run
    the same grid rates with the same arrivals."""
    by_name = {c.name: c for c in job.kept}
    centre = math.sqrt(max(sweep[pick][1], 0.05) * max(sweep[best][1], 0.05))
    confirm = job.confirmer(run_dir / "state", run_dir / sub, _Err())
    return (kind or OneMeasure).load(run_dir).ratio(
        pick, best, lambda name: confirm(by_name[name], centre).goodput)


def random_machine(seed: int, gpus: int, out: Path) -> tuple[str, Path]:
    """Random machine `seed` (epdctl.sim.machines.draw), written to
    <out>/random-<seed>-<gpus>/random-<seed>.yaml: its name and file. A resumed run's file
    must be the same machine (another RANGES would draw another one)."""
    from epdctl.sim.costmodel import load_cost_model
    from epdctl.sim.machines import draw, write

    model = draw(seed)
    run_dir = out / f"{model.name}-{gpus}"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{model.name}.yaml"
    if path.exists() and load_cost_model(path) != model:
        raise SystemExit(f"{path} is not the machine seed {seed} draws now: another --out")
    return model.name, write(model, path)


def spread(results: Sequence[dict[str, Any]]) -> str:
    """The distribution line: worst and median of pick_ratio, rank_spearman (nan left out)
    and cost_ratio over the runs, and the aggregated calls right."""
    import statistics

    parts = []
    for key, worst in (("pick_ratio", min), ("rank_spearman", min), ("cost_ratio", max)):
        values = [float(r[key]) for r in results if not math.isnan(float(r[key]))]
        low, mid = (worst(values), statistics.median(values)) if values else (math.nan,) * 2
        parts.append(f"{key}_worst={low:.3f} {key}_median={mid:.3f}")
    return " ".join(parts) + f" agg_call={sum(r['agg_call'] for r in results)}/{len(results)}"


def _same_settings(run_dir: Path, args: argparse.Namespace, model: str, gpus: int) -> None:
    """A resumed run goes on only with the workload and SLO it began with (settings.json;
    one written before the SLO was kept there had the unstretched one); another --budget
    re-runs tune only (_tuned), the sweep does not depend on it."""
    settings = {"num_prompts": args.num_prompts, "point_seconds": args.point_seconds,
                "ladder_top": LADDER[-1], "reference_gpus": REFERENCE_GPUS,
                "slo": slo_for(model, gpus)}
    if getattr(args, "trace", None):  # the trace, by its bytes
        settings["trace"] = tune_trace.digest(args.trace)
    path = run_dir / "settings.json"
    before = json.loads(path.read_text()) if path.exists() else settings
    if {"slo": SLO.get(model, RANDOM_SLO), **before} != settings:
        raise SystemExit(f"{run_dir} was begun with {before}, not {settings}: "
                         "another --out, or the same options")
    _write(path, settings)


def _tuned(run_dir: Path, base_path: Path, model: str, gpus: int, cost: Path,
           args: argparse.Namespace, name: str = "tune", workload: Sequence[str] = ()
           ) -> tuple[dict[str, Any], float]:
    """`epdctl tune`'s --json document and wall time; kept in <name>.json, so that a rerun
    of an interrupted sweep (the same --out) keeps the tune it is measured against; one of
    another --budget is made again (in <name>/ afresh). `workload`: tune's workload options
    (default: --trace's, else the one shape's)."""
    import shutil
    import subprocess

    budget = budget_for(args.budget, gpus)
    kept = run_dir / f"{name}.json"
    if kept.exists():
        saved = json.loads(kept.read_text())
        if saved.get("budget", budget) == budget:
            return saved["doc"], saved["tune_s"]
        shutil.rmtree(run_dir / name, ignore_errors=True)
    trace = getattr(args, "trace", None)
    if not workload:
        workload = (tune_trace.tune_args(trace) if trace else
                    ["--images", "1", "--image-size", "512x512", "--input-len", "64",
                     "--output-len", "32", "--num-prompts", str(args.num_prompts),
                     "--point-seconds", str(args.point_seconds)])
    started = time.monotonic()
    tuned = subprocess.run(
        [sys.executable, "-m", "epdctl", "--state-dir", str(run_dir / "state"), "tune",
         str(base_path), "--gpus", ",".join(map(str, range(gpus))), "--slo", slo_for(model, gpus),
         *workload, "--budget", budget, "--model-facts",
         str(cost), "--out", str(run_dir / name), "--json"],
        capture_output=True, text=True, check=False)
    tune_s = time.monotonic() - started
    (run_dir / f"{name}.stderr").write_text(tuned.stderr)
    if tuned.returncode != 0:
        raise SystemExit(f"tune failed on {model} x {gpus}: {tuned.stderr[-2000:]}")
    doc = json.loads(tuned.stdout)
    kept.write_text(json.dumps({"doc": doc, "tune_s": tune_s, "budget": budget}))
    return doc, tune_s


class Progress:
    """The sweep so far (sweep-progress.json, rewritten after each candidate): each swept
    candidate's kind, knee and the seconds it took. A run stopped part way (Ctrl+C, a
    session's end) goes on from here when started again with the same --out."""

    FILE = "sweep-progress.json"

    def __init__(self, path: Path, done: dict[str, tuple[str, float, float]]) -> None:
        self.path, self.done = path, done

    @classmethod
    def load(cls, run_dir: Path) -> Progress:
        path = run_dir / cls.FILE
        if not path.exists():
            return cls(path, {})
        data = json.loads(path.read_text())
        return cls(path, {k: (v[0], v[1], v[2]) for k, v in data.items()})

    def add(self, name: str, kind: str, goodput: float, seconds: float) -> None:
        """Kept at once, with what other shards of the sweep kept meanwhile (the file is
        read again under a lock, so that two runs of one --out lose nothing)."""
        import fcntl

        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.done.update(Progress.load(self.path.parent).done)
            self.done[name] = (kind, goodput, seconds)
            _write(self.path, self.done)

    def knees(self, names: Sequence[str]) -> dict[str, tuple[str, float]]:
        return {n: self.done[n][:2] for n in names}

    def seconds(self, names: Sequence[str]) -> float:
        return sum(self.done[n][2] for n in names)


def _write(path: Path, data: dict[str, Any] | str) -> None:
    """Whole or not at all (a sitting may end anywhere, a shard read it meanwhile): `data` as
    JSON, or a text as it is."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data, indent=1))
    tmp.replace(path)


class Alone:
    """--check-alone N: the N candidates of the sweep with the highest knees swept again
    with nothing else running (alone.json: knee and seconds each). They are the ones whose
    high-rate points use the most CPU, so this shows whether sweeping beside other runs
    (--port-offset) lowered their knees; on a run swept alone it shows the run-to-run
    spread."""

    FILE = "alone.json"

    def __init__(self, path: Path, done: dict[str, tuple[float, float]]) -> None:
        self.path, self.done = path, done

    @classmethod
    def load(cls, run_dir: Path) -> Alone:
        path = run_dir / cls.FILE
        data = json.loads(path.read_text()) if path.exists() else {}
        return cls(path, {k: (v[0], v[1]) for k, v in data.items()})

    @staticmethod
    def fastest(progress: Progress, n: int) -> list[str]:
        ranked = sorted(progress.done, key=lambda k: -progress.done[k][1])
        return [k for k in ranked[:n] if progress.done[k][1] > 0]

    def wanted(self, progress: Progress, n: int) -> list[str]:
        return [k for k in self.fastest(progress, n) if k not in self.done]

    def add(self, name: str, goodput: float, seconds: float) -> None:
        self.done[name] = (goodput, seconds)
        _write(self.path, self.done)

    def figures(self, progress: Progress, n: int) -> dict[str, Any]:
        """Each checked candidate's knee in the sweep and alone, and the largest relative
        difference (none where nothing was checked)."""
        names = [k for k in self.fastest(progress, n) if k in self.done]
        if not names:
            return {}
        pairs = {k: (round(progress.done[k][1], 3), round(self.done[k][0], 3)) for k in names}
        return {"alone": pairs,
                "alone_dev": max(abs(a / s - 1) if s else math.inf for s, a in pairs.values())}


def alternating(first: str, second: str, rounds: int) -> list[str]:
    """Two names, `rounds` times each, in the order ABBA ABBA...: a drift of the machine's
    speed over the runs (another job starting, the CPU warming) falls on both alike."""
    pair = [first, second, second, first]
    return [pair[i % 4] for i in range(2 * rounds)]


class OneMeasure:
    """The one-measure rule: tune's pick and the sweep's best measured again by one method,
    alternating, before pick_ratio is computed (remeasured.json: each run's knee). The sweep
    measures on a ladder of sqrt(2) with interpolation, tune's confirmations on the grid of
    2^(k/4) with a seed per rate: two measures of one knee that disagreed by 30 % (tune
    9.77 req/s, the sweep 7.53, for one candidate), so that a ratio of one to the other said
    which method measured, not which candidate was better. Here both run tune's
    confirmation (LiveConfirmer: the same grid rates, from one centre for both, the same
    arrivals per rate, the same bracketing and interpolation)."""

    FILE = "remeasured.json"

    def __init__(self, path: Path, done: dict[str, list[float]]) -> None:
        self.path, self.done = path, done

    @classmethod
    def load(cls, run_dir: Path) -> OneMeasure:
        path = run_dir / cls.FILE
        data = json.loads(path.read_text()) if path.exists() else {}
        return cls(path, {k: list(v) for k, v in data.get("knees", {}).items()})

    def ratio(self, pick: str, best: str, measure: Any, rounds: int = 2
              ) -> tuple[float, dict[str, float]]:
        """pick's mean knee over best's, each measured `rounds` times (`measure(name)`: a
        knee), in alternating order; what an earlier, interrupted run measured is kept.
        1.0 without measuring where they are one candidate."""
        if pick == best:
            return 1.0, {}
        seen: dict[str, int] = {}
        for name in alternating(pick, best, rounds):
            seen[name] = seen.get(name, 0) + 1
            knees = self.done.setdefault(name, [])
            if len(knees) < seen[name]:
                knees.append(measure(name))
                _write(self.path, {"knees": self.done})
        means = {n: sum(self.done[n][:rounds]) / rounds for n in (pick, best)}
        return (means[pick] / means[best] if means[best] else 0.0), means


class AvgMeasure(OneMeasure):
    """The average shape's pick against the mix's, both replaying the trace (--trace)."""

    FILE = "avg-remeasured.json"


def sample(kept: Sequence[Any], size: int, pick: str) -> list[Any]:
    """`size` candidates evenly spread over the enumeration (0: all) plus tune's pick, in
    enumeration order (the first is aggregated, so one aggregated is always in)."""
    if not size or size >= len(kept):
        return list(kept)
    step = len(kept) / size
    chosen = {int(i * step) for i in range(size)}
    return [c for i, c in enumerate(kept) if i in chosen or c.name == pick]


def _shard(text: str) -> tuple[int, int]:
    """`I/N` (0 <= I < N) as (I, N)."""
    index, _, count = text.partition("/")
    try:
        pair = int(index), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N (e.g. 1/2)") from None
    if not 0 <= pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: I must be 0 to N-1")
    return pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="encode-heavy,decode-heavy,sharing-sensitive")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="in place of --models: N random machines (epdctl.sim.machines), "
                             "seeds S to S+N-1")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="with --random: the first machine's seed")
    parser.add_argument("--gpus", default="4,8")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--point-seconds", type=float, default=10.0,
                        help="a rate point sends at least rate x S requests (tune and sweep)")
    parser.add_argument("--budget", default="15m",
                        help="tune's --budget on 4 GPUs (as many times more on more: "
                             "30m on 8)")
    parser.add_argument("--sweep", type=int, default=0,
                        help="candidates swept per run (0: every one)")
    parser.add_argument("--port-offset", type=int, default=0,
                        help="move every port of the base by this much (a second run beside "
                             "the first: 100)")
    parser.add_argument("--sweep-only", action="store_true",
                        help="with --sweep 0: sweep every candidate, then stop before tune "
                             "(sweeps side by side; tune then runs alone, timed as it is)")
    parser.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N",
                        help="with --sweep-only: sweep candidates I, I+N, I+2N... (0-based), "
                             "so that N runs side by side share one cost model's sweep")
    parser.add_argument("--check-alone", type=int, default=0, metavar="N",
                        help="sweep the N candidates with the highest knees again, alone "
                             "(run with nothing else on the machine), before tune")
    parser.add_argument("--trace", type=Path, default=None, metavar="FILE",
                        help="tune --trace FILE against a sweep replaying it, and the trace "
                             "tuned as its average shape (benchmarks/tune_trace.py)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tune",
                        help="what a run keeps, per cost model and GPU count (resumed from)")
    args = parser.parse_args()
    if args.sweep_only and args.sweep:
        parser.error("--sweep-only sweeps every candidate: it goes with --sweep 0")
    if args.shard != (0, 1) and not args.sweep_only:
        parser.error("--shard splits the sweep alone: it goes with --sweep-only")
    results = []
    for g in args.gpus.split(","):
        for m, cost_file in _models(args, int(g)):
            row = run_one(m, int(g), args, args.out, cost_file)
            if row is None:
                print(f"swept={m}-{g}", flush=True)
                continue
            results.append(row)
            print(json.dumps(row), flush=True)
    if not results:
        return
    print(f"pick_ratio={min(r['pick_ratio'] for r in results):.3f} "
          f"cost_ratio={max(r['cost_ratio'] for r in results):.3f} "
          f"rank_spearman={min(r['rank_spearman'] for r in results):.3f} "
          f"agg_call={sum(r['agg_call'] for r in results)}/{len(results)}"
          + (f" alone_dev={max(devs):.3f}" if (devs := [r["alone_dev"] for r in results
                                                        if "alone_dev" in r]) else ""))
    print(spread(results), flush=True)
    if avg := [r["avg_ratio"] for r in results if r.get("avg_ratio") is not None]:
        print(f"avg_ratio_min={min(avg):.3f} avg_ratio_max={max(avg):.3f}", flush=True)


def _models(args: argparse.Namespace, gpus: int) -> list[tuple[str, Path | None]]:
    """The runs on `gpus` GPUs: --random's machines (written first), else --models'."""
    if args.random:
        return [random_machine(seed, gpus, args.out)
                for seed in range(args.seed, args.seed + args.random)]
    return [(m, None) for m in args.models.split(",")]


if __name__ == "__main__":
    main()
