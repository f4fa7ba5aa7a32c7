"""A stand-in for `vllm bench serve` (EPDCTL_BENCH_COMMAND): asks the server for its models,
then writes a result file with the figures `--save-result` writes, from its own argv.

FAKE_BENCH_START_SCALES, JSON {"arm": [s1, s2, ...]}: every latency of the arm's k-th start
is sk times its own (the duration too), as a start that lands elsewhere in memory or on a
warmer engine is slower or faster throughout; its last scale holds for later starts. Which
start an arm is on, the warm-up bench runs after each start says (`<arm>-warmup-<k>.json`)."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import urllib.request
from pathlib import Path


def start_scale(result_dir: Path, name: str) -> float:
    scales = json.loads(os.environ.get("FAKE_BENCH_START_SCALES") or "{}")
    warmup = re.fullmatch(r"(.+)-warmup-(\d+)\.json", name)
    if warmup:
        arm, start = warmup[1], int(warmup[2])
        (result_dir / f".fake-start-{arm}").write_text(str(start))
    else:
        point = re.fullmatch(r"(.+)-\d+(?:-r\d+)?\.json", name)
        arm = point[1] if point else name
        marker = result_dir / f".fake-start-{arm}"
        start = int(marker.read_text()) if marker.exists() else 1
    table = scales.get(arm) or [1.0]
    return float(table[min(start, len(table)) - 1])


def main() -> None:
    args = sys.argv[1:]

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    with urllib.request.urlopen(f"{value('--base-url')}/v1/models", timeout=10) as reply:
        served = json.load(reply)["data"][0]["id"]
    if served != value("--served-model-name"):
        sys.exit(f"fake bench: the server serves {served}, not {value('--served-model-name')}")
    count = int(value("--num-prompts"))
    seed = int(value("--seed"))
    path = Path(value("--result-dir")) / value("--result-filename")
    k = start_scale(path.parent, path.name)
    # Per-request data (--save-detailed) drawn around the summary figures; 4 chunks each.
    rng = random.Random(seed)
    ttfts = [(rng.uniform(0.02, 0.06) + seed / 1000.0) * k for _ in range(count)]
    detailed = {"ttfts": ttfts, "itls": [[0.005 * k] * 3 for _ in ttfts],
                "latencies": [t + 0.015 * k for t in ttfts], "output_lens": [4] * count,
                "errors": [""] * count}
    result = {**detailed, "duration": 2.0 * k, "completed": count, "failed": 0,
              "request_throughput": count / 2.0 / k, "output_throughput": count * 4.0 / k,
              "request_goodput": count / 4.0 / k if "--goodput" in args else None,
              "mean_ttft_ms": (40.0 + seed) * k, "median_ttft_ms": (30.0 + seed) * k,
              "p50_ttft_ms": (30.0 + seed) * k, "p90_ttft_ms": (60.0 + seed) * k,
              "p99_ttft_ms": (90.0 + seed) * k, "mean_tpot_ms": 5.0 * k, "p90_tpot_ms": 7.0 * k,
              "p99_itl_ms": 12.0 * k, "p90_e2el_ms": 300.0 * k}
    path.write_text(json.dumps(result))
    print(f"fake bench: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
