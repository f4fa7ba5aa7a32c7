"""`epdctl tune` against an exhaustive sweep, on the simulated machine.

    .venv/bin/python benchmarks/tune.py [--models encode-heavy,decode-heavy,sharing-sensitive]
        [--gpus 4,8] [--num-prompts 60] [--budget 20m] [--max-candidates N] [--out DIR]

For each cost model of examples/sim/ and each fake-GPU count: every candidate `tune` would
consider is run through bench's runner at a doubling rate ladder until its goodput SLO
fails (the sweep: measured goodput per candidate, and its wall time); then `epdctl tune`
runs on the same base, workload and SLO (its pick, predictions and wall time). Needs the
tiny LLaVA for `vllm bench serve`'s tokenizer (`python -m epdctl.dev.tiny_models llava`).

Ends with one line: pick_ratio= (measured goodput of tune's pick / the sweep's best, worst
over the runs) cost_ratio= (tune's wall time / the sweep's, worst) rank_spearman= (predicted
vs measured goodput over all candidates, worst) agg_call= (aggregated vs disaggregated
called right, n/n). Goal: pick_ratio >= 0.9, cost_ratio <= 0.2, rank_spearman >= 0.8.
`--max-candidates` limits the sweep for a smoke run (its figures then mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLO = {"encode-heavy": "ttft=3000,tpot=60", "decode-heavy": "ttft=3000,tpot=60",
       "sharing-sensitive": "ttft=3000,tpot=60"}
LADDER = tuple(0.25 * 2 ** k for k in range(10))


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


def agg_call_right(sweep: dict[str, tuple[str, float]], pick_kind: str) -> bool:
    """Whether tune's pick is aggregated exactly when the sweep's best is."""
    best = max(sweep.values(), key=lambda kv: kv[1])
    return (best[0] == "aggregated") == (pick_kind == "aggregated")


def _base(tmp: Path, cost: Path) -> Path:
    text = (ROOT / "examples" / "sim" / "base.yaml").read_text()
    text = text.replace("command: [python, -m, epdctl.sim.engine]",
                        f"command: [{sys.executable!r}, -m, epdctl.sim.engine, --cost-model, "
                        f"{str(cost)!r}]")
    path = tmp / "base.yaml"
    path.write_text(text)
    return path


def _sweep_one(candidate, workload, state_root: Path, out: Path) -> float:  # type: ignore[no-untyped-def]
    """The candidate's measured knee: one bench run per rate of LADDER, up to the first
    rate that misses the SLO."""
    from epdctl.tune.decide import knee
    from epdctl.tune.live import LiveConfirmer

    points: list[tuple[float, float]] = []
    confirm = LiveConfirmer(workload, state_root, out, timeout_s=120, progress=_Err())
    for rate in LADDER:
        got = confirm.measure(candidate, [rate])
        share = min((s for _, s in got.points), default=0.0)
        points.append((rate, share))
        if share < 0.9:
            break
    return knee(points)


class _Err:
    def line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)


def run_one(model: str, gpus: int, args: argparse.Namespace, out: Path) -> dict:
    from epdctl.bench.workload import LoadPoint, Workload, parse_slo
    from epdctl.topology import load_topology
    from epdctl.tune.candidates import candidates, limits_for, request_tokens
    from epdctl.tune.facts import from_file

    cost = ROOT / "examples" / "sim" / f"{model}.yaml"
    run_dir = out / f"{model}-{gpus}"
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ["EPDCTL_FAKE_GPUS"] = str(gpus)
    os.environ.pop("EPDCTL_PROXY_COMMAND", None)
    base_path = _base(run_dir, cost)
    base = load_topology(base_path)
    facts = from_file(cost)
    workload = Workload(points=(LoadPoint(),), num_prompts=args.num_prompts, images=1,
                        image_size=(512, 512), input_len=64, output_len=32,
                        slo=parse_slo(SLO[model]))
    tokens = request_tokens(facts, 1, (512, 512), 64, 32)
    limits = limits_for(base, facts, 80 << 30, tokens)
    kept, _ = candidates(base, list(range(gpus)), facts, limits)
    kept = kept[: args.max_candidates] if args.max_candidates else kept
    started = time.monotonic()
    sweep = {c.name: (c.shape.kind, _sweep_one(c, workload, run_dir / "state",
                                               run_dir / "sweep")) for c in kept}
    sweep_s = time.monotonic() - started
    started = time.monotonic()
    import subprocess

    tuned = subprocess.run(
        [sys.executable, "-m", "epdctl", "--state-dir", str(run_dir / "state"), "tune",
         str(base_path), "--gpus", ",".join(map(str, range(gpus))), "--slo", SLO[model],
         "--images", "1", "--image-size", "512x512", "--input-len", "64", "--output-len", "32",
         "--num-prompts", str(args.num_prompts), "--budget", args.budget, "--model-facts",
         str(cost), "--out", str(run_dir / "tune"), "--json"],
        capture_output=True, text=True, check=False)
    tune_s = time.monotonic() - started
    if tuned.returncode != 0:
        raise SystemExit(f"tune failed on {model} x {gpus}: {tuned.stderr[-2000:]}")
    doc = json.loads(tuned.stdout)
    pick = next(c for c in doc["candidates"] if c["name"] == doc["best"])
    best = max(g for _, g in sweep.values())
    both = [(c["predicted_goodput"], sweep[c["name"]][1]) for c in doc["candidates"]
            if c["name"] in sweep and c["predicted_goodput"] is not None]
    return {"model": model, "gpus": gpus, "sweep_s": sweep_s, "tune_s": tune_s,
            "pick": pick["name"], "pick_ratio": sweep.get(pick["name"], ("", 0.0))[1] / best
            if best else 0.0, "cost_ratio": tune_s / sweep_s if sweep_s else float("inf"),
            "rank_spearman": spearman([a for a, _ in both], [b for _, b in both]),
            "agg_call": agg_call_right(sweep, pick["kind"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="encode-heavy,decode-heavy,sharing-sensitive")
    parser.add_argument("--gpus", default="4,8")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--budget", default="20m")
    parser.add_argument("--max-candidates", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/epdctl-bench-tune"))
    args = parser.parse_args()
    results = [run_one(m, int(g), args, args.out) for m in args.models.split(",")
               for g in args.gpus.split(",")]
    for r in results:
        print(json.dumps(r))
    print(f"pick_ratio={min(r['pick_ratio'] for r in results):.3f} "
          f"cost_ratio={max(r['cost_ratio'] for r in results):.3f} "
          f"rank_spearman={min(r['rank_spearman'] for r in results):.3f} "
          f"agg_call={sum(r['agg_call'] for r in results)}/{len(results)}")


if __name__ == "__main__":
    main()
