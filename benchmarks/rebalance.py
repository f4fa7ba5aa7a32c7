"""`up --rebalance` against the best static topology, on the simulated machine.

    .venv/bin/python benchmarks/rebalance.py [--models encode-heavy,decode-heavy,sharing-sensitive]
        [--phase-seconds 150] [--budget 15m] [--out DIR] [--port-offset N] [--also 2E+2PD]

For each cost model of examples/sim/ on 4 fake GPUs (its engines paying STARTUP_S to start:
loading weights, what a switch costs):

1. a shifting trace (shifting_trace: PHASES, one after the other, each the same number of
   streamed requests at one Poisson rate: four-image albums that load the encoder, text
   chats that decode long answers, one-image questions) is tuned whole: `epdctl tune
   --trace` picks the best static topology for it, and keeps its profiles;
2. the same phases are written at the rate that pick was confirmed to hold (its measured
   knee on the whole trace), each lasting --phase-seconds, and replayed (epdctl.bench.replay,
   at their own arrival times) against (a) the pick, and (b) the pick started with
   `--rebalance` (every EVERY_S on the last WINDOW_S of traffic, min_gap MIN_GAP_S, a move
   to pay back within one phase), one after the other.

Each run's row: goodput (requests within the SLO per second over the trace) of both, their
ratio, requests without an answer, the rebalancer's switches and flaps (a switch undone
within one interval), and `model_bound` (bound(): by tune's queue model on the kept
profiles, what each phase's best split would serve over the pick, switches free: no
rebalancer gains more). Ends with one line: bound= (that, worst over the models)
gain_vs_static= (b / a, worst over the models;
goal >= 1.25) lost= (requests without an answer in (b), all models; goal 0) switches=
flaps= (goal 0). `--also 2E+2PD` runs that start too, static and rebalanced (whole GPUs, which
a switch moves: a pick that is aggregated, or shares GPUs between E and PD, leaves the
rebalancer nothing to move), its figures in the row as `from_2E+2PD` and in a line of its
own before the last.

A run can be stopped and started again with the same --out: tune's result and each arm's
result are kept (tune.json, static.json, rebalanced.json) and only what is missing runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tune as tune_bench  # noqa: E402  (benchmarks/tune.py: the base, the SLO, the store)

from epdctl.traces.format import MediaItem, TraceRequest, write_trace  # noqa: E402

PHASES = (("albums", {"image4": 0.8, "image": 0.2}), ("chats", {"text": 0.9, "image": 0.1}),
          ("photos", {"image": 1.0}))
"""The trace's phases in order: what each class's share is while it lasts."""
CLASSES = {"text": (384, 128, 0), "image": (64, 32, 1), "image4": (32, 16, 4)}
"""class: (prompt text tokens, answer tokens, 512x512 images), as benchmarks/tune_trace.py."""
TUNE_REQUESTS = 120
"""Requests per phase of the trace tune sees (at 1 req/s: a mean rate tune scales)."""
STARTUP_S = 10.0
EVERY_S, WINDOW_S, MIN_GAP_S = 10.0, 60.0, 60.0
GOAL = 1.25


def shifting_trace(per_phase: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """PHASES one after the other, `per_phase` streamed requests each, Poisson at `rate`."""
    rng, at, out = random.Random(seed), 0.0, []
    for _, mix in PHASES:
        for _ in range(per_phase):
            name = rng.choices(list(mix), weights=list(mix.values()))[0]
            text, answer, images = CLASSES[name]
            out.append(TraceRequest(round(at * 1000, 3), text, answer,
                                    (MediaItem("image", 512, 512),) * images, stream=True))
            at += rng.expovariate(rate)
    return out


def write(path: Path, requests: list[TraceRequest]) -> Path:
    write_trace(path, requests)
    return path


def cost_file(model: str, run_dir: Path) -> Path:
    """The cost model with STARTUP_S to start an engine."""
    import yaml

    data = yaml.safe_load((ROOT / "examples" / "sim" / f"{model}.yaml").read_text())
    data["startup_s"] = STARTUP_S
    path = run_dir / f"{model}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli(state: Path, *args: str, timeout_s: float = 3600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EPDCTL_FAKE_GPUS": "4"}
    env.pop("EPDCTL_PROXY_COMMAND", None)
    return subprocess.run([sys.executable, "-m", "epdctl", "--state-dir", str(state), *args],
                          env=env, text=True, capture_output=True, timeout=timeout_s)


def tuned(run_dir: Path, model: str, base: Path, cost: Path, budget: str) -> dict[str, Any]:
    """tune --trace on the shifting trace (kept in tune.json): its pick written to pick.yaml,
    and the rate the pick was confirmed to hold."""
    kept = run_dir / "tune.json"
    if kept.exists():
        return dict(json.loads(kept.read_text()))
    trace = write(run_dir / "tune-trace.jsonl", shifting_trace(TUNE_REQUESTS, 1.0))
    started = time.monotonic()
    done = cli(run_dir / "state", "tune", str(base), "--gpus", "0,1,2,3", "--slo",
               tune_bench.slo_for(model, 4), "--trace", str(trace), "--image-size", "512x512",
               "--budget", budget, "--model-facts", str(cost), "--out", str(run_dir / "tune"),
               "--write", str(run_dir / "pick.yaml"), "--json")
    if done.returncode != 0:
        raise SystemExit(f"tune failed on {model}: {done.stderr[-2000:]}")
    doc = json.loads(done.stdout)
    if doc.get("best") is None:
        raise SystemExit(f"tune picked nothing on {model} ({doc.get('stop_reason')}): a "
                         "larger --budget")
    pick = next(c for c in doc["candidates"] if c["name"] == doc["best"])
    rate = pick.get("measured_goodput") or pick.get("predicted_goodput")
    out = {"pick": doc["best"], "shape": pick["shape"], "rate": rate,
           "tune_s": round(time.monotonic() - started)}
    kept.write_text(json.dumps(out))
    return out


def split_topology(base: Path, split: str, run_dir: Path) -> Path:
    """The base as `split` (`2E+2PD`: encoders and PDs of one GPU each, in that order)."""
    import re

    import yaml

    match = re.fullmatch(r"(\d+)E\+(\d+)PD", split)
    if match is None:
        raise SystemExit(f"--also {split}: expected nE+mPD")
    e, pd = int(match[1]), int(match[2])
    data = yaml.safe_load(base.read_text())
    data["name"] = f"sim-{split.lower().replace('+', '-')}"
    data["roles"] = {"encode": {"gpus": list(range(e)), "replicas": e},
                     "prefill_decode": {"gpus": list(range(e, e + pd)), "replicas": pd}}
    path = run_dir / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def rebalanced(pick: Path, run_dir: Path, model: str, phase_s: float) -> Path:
    """The pick with a `rebalance:` section on tune's profiles (enabled: as --rebalance)."""
    import yaml

    data = yaml.safe_load(pick.read_text())
    data["rebalance"] = {"enabled": True, "profiles": str(run_dir / "tune"),
                         "slo": tune_bench.slo_for(model, 4), "every": EVERY_S,
                         "window": WINDOW_S, "interval": phase_s, "min_gap": MIN_GAP_S,
                         "model_facts": str(run_dir / f"{model}.yaml")}
    path = pick.with_name(f"{pick.stem}-rebalanced.yaml")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def arm(name: str, make: Callable[[], Path], run_dir: Path, trace: Path, model: str
        ) -> dict[str, Any]:
    """Up the topology `make` writes, the trace replayed at its own times, down (kept in
    <name>.json): the replay's figures, and the rebalancer's moves where it ran."""
    kept = run_dir / f"{name}.json"
    if kept.exists():
        return dict(json.loads(kept.read_text()))
    import yaml

    topology = make()

    state = run_dir / f"state-{name}"
    run = state / yaml.safe_load(topology.read_text())["name"]
    up = cli(state, "up", str(topology), "-d", "--timeout", "600")
    if up.returncode != 0:
        raise SystemExit(f"{name}: up failed: {up.stderr[-2000:]}")
    try:
        doc = json.loads((run / "state.json").read_text())
        url = f"http://127.0.0.1:{next(s for s in doc['specs'] if s['role'] == 'proxy')['port']}"
        slo = [f"{k}:{v}" for k, v in (p.split("=") for p in
                                       tune_bench.slo_for(model, 4).split(","))]
        replay = subprocess.run(
            [sys.executable, "-m", "epdctl.bench.replay", "--trace", str(trace),
             "--base-url", url, "--model", "sim-model", "--goodput", *slo,
             "--result-dir", str(run_dir), "--result-filename", f"{name}-replay.json"],
            text=True, capture_output=True, check=False)
        if replay.returncode != 0:
            raise SystemExit(f"{name}: replay failed: {replay.stderr[-2000:]}")
        changes = _lines(run / "changes.jsonl")
    finally:
        cli(state, "down")
    figures = json.loads((run_dir / f"{name}-replay.json").read_text())
    out = {"goodput": figures["request_goodput"], "completed": figures["completed"],
           "requests": figures["num_prompts"], "duration": figures["duration"],
           "moves": [{"at": c["at"], "remove": c["remove"], "add": c["add"],
                      "reason": c["reason"]} for c in changes
                     if c.get("reason", "").startswith("rebalance: ")]}
    kept.write_text(json.dumps(out))
    return out


def bound(run_dir: Path, model: str, requests: list[TraceRequest], start: str
          ) -> dict[str, Any]:
    """What any rebalancer could gain at most, by tune's queue model on the kept profiles:
    each phase (its requests at their times, queues empty at its start) served by the best
    split of the 4 GPUs for it, switches free, over the start served throughout (`bound`:
    requests within the SLO, the ratio); `reach`: the same among the splits a switch reaches
    from the start; `best`: each phase's best split; `static`: the split that would serve
    the most throughout, and `static_bound` the same ratio over it."""
    from epdctl.bench.workload import parse_slo
    from epdctl.rebalance.split import reachable
    from epdctl.traces.format import Trace
    from epdctl.tune.candidates import shapes
    from epdctl.tune.facts import model_facts
    from epdctl.tune.model import Slo
    from epdctl.tune.runner import saved_profile
    from epdctl.tune.tracemodel import simulate_trace
    from epdctl.tune.workload import ProfiledShape, from_trace

    profile, _ = saved_profile(run_dir / "tune")
    limits = dict(parse_slo(tune_bench.slo_for(model, 4)))
    slo = Slo(limits.get("ttft"), limits.get("tpot"))
    splits = {s.label: s for s in shapes(4, [1, 2, 4]) if not profile.missing(s)}
    per = len(requests) // len(PHASES)
    tokens = model_facts("sim-model", run_dir / f"{model}.yaml").image_tokens_per_mpixel
    phases = [from_trace(Trace(tuple(requests[i * per:(i + 1) * per])),
                         ProfiledShape((512, 512), tokens)) for i in range(len(PHASES))]
    served = {label: [simulate_trace(shape, profile, w, rate=w.rate).attainment(slo) * per
                      for w in phases] for label, shape in splits.items()}
    near = [s.label for s in reachable(splits[start]) if s.label in splits] \
        if start in splits else []

    def most(labels: list[str]) -> float:
        return sum(max((served[x][i] for x in labels), default=0.0)
                   for i in range(len(PHASES)))

    def over(top: float, base: float) -> float | None:  # None: the start serves none
        return round(top / base, 3) if base else None

    own = sum(served[start]) if start in served else 0.0
    static = max(splits, key=lambda x: sum(served[x]))
    return {"bound": over(most(list(splits)), own), "reach": over(most(near), own),
            "best": [max(splits, key=lambda x: served[x][i]) for i in range(len(PHASES))],
            "static": static, "static_bound": over(most(list(splits)), sum(served[static]))}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() \
        else []


def flaps(moves: list[dict[str, Any]], interval_s: float) -> int:
    """Switches undone within `interval_s`: a move from role a to b, then one from b to a."""
    def roles(move: dict[str, Any]) -> tuple[str, str]:
        return move["remove"][0].split("-")[0], move["add"][0].split("-")[0]

    return sum(1 for i, m in enumerate(moves) for later in moves[i + 1:]
               if later["at"] - m["at"] <= interval_s and roles(later) == roles(m)[::-1])


def run_one(model: str, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = args.out / f"{model}-4"
    run_dir.mkdir(parents=True, exist_ok=True)
    cost = cost_file(model, run_dir)
    base = tune_bench._base(run_dir, cost, args.port_offset)
    pick = tuned(run_dir, model, base, cost, args.budget)
    rate = float(pick["rate"])
    per_phase = max(math.ceil(rate * args.phase_seconds), 2)
    requests = shifting_trace(per_phase, rate)
    trace = write(run_dir / "shifting.jsonl", requests)
    pick_file = run_dir / "pick.yaml"
    static = arm("static", lambda: pick_file, run_dir, trace, model)
    moved = arm("rebalanced", lambda: rebalanced(pick_file, run_dir, model, args.phase_seconds),
                run_dir, trace, model)
    row = {"model": model, "pick": pick["pick"], "shape": pick["shape"],
           "rate": round(rate, 3), "requests": per_phase * len(PHASES),
           **_pair(static, moved, args.phase_seconds),
           "model_bound": bound(run_dir, model, requests, pick["shape"])}
    for split in args.also:  # another start, whole GPUs a switch can move: static vs not
        start = split_topology(base, split, run_dir)
        tag = split.lower().replace("+", "-")
        there = arm(f"static-{tag}", partial(Path, start), run_dir, trace, model)
        moving = arm(f"rebalanced-{tag}",
                     partial(rebalanced, start, run_dir, model, args.phase_seconds),
                     run_dir, trace, model)
        row[f"from_{split}"] = {**_pair(there, moving, args.phase_seconds),
                                "model_bound": bound(run_dir, model, requests, split)}
    return row


def _pair(static: dict[str, Any], moved: dict[str, Any], interval_s: float
          ) -> dict[str, Any]:
    """One start static and rebalanced: goodputs, gain, lost, switches, flaps."""
    gain = moved["goodput"] / static["goodput"] if static["goodput"] else \
        None if not moved["goodput"] else math.inf  # None: neither served any in the SLO
    return {"goodput_static": static["goodput"], "goodput_rebalanced": moved["goodput"],
            "gain": gain,
            "lost": moved["requests"] - moved["completed"],
            "lost_static": static["requests"] - static["completed"],
            "switches": sum(len(m["add"]) for m in moved["moves"]),
            "flaps": flaps(moved["moves"], interval_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="encode-heavy,decode-heavy,sharing-sensitive")
    parser.add_argument("--phase-seconds", type=float, default=150.0)
    parser.add_argument("--budget", default="15m")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                        "rebalance")
    parser.add_argument("--port-offset", type=int, default=0)
    parser.add_argument("--also", action="append", default=[], metavar="nE+mPD",
                        help="another start as well (whole GPUs: what a switch moves), static "
                        "and rebalanced; its figures beside the row's (from_nE+mPD)")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        row = run_one(model, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    for split in args.also:
        pairs = [r[f"from_{split}"] for r in rows]
        print(f"from {split}: gain={_worst(p['gain'] for p in pairs)} "
              f"lost={sum(p['lost'] for p in pairs)} "
              f"switches={sum(p['switches'] for p in pairs)} "
              f"flaps={sum(p['flaps'] for p in pairs)}")
    for r in rows:
        if (r["model_bound"]["bound"] or math.inf) < GOAL:
            print(f"{r['model']}: by the model no rebalancer gains {GOAL} over {r['shape']} "
                  f"on this trace (each phase's best split, switches free: "
                  f"{r['model_bound']['bound']})")
    print(f"bound={_worst(r['model_bound']['bound'] for r in rows)} "
          f"gain_vs_static={_worst(r['gain'] for r in rows)} "
          f"lost={sum(r['lost'] for r in rows)} switches={sum(r['switches'] for r in rows)} "
          f"flaps={sum(r['flaps'] for r in rows)}")


def _worst(gains: Any) -> str:
    """The lowest gain of those defined (`none`: no run served a request within the SLO)."""
    known = [g for g in gains if g is not None]
    return f"{min(known):.3f}" if known else "none"


if __name__ == "__main__":
    main()
