"""A stand-in for `vllm bench serve` (EPDCTL_BENCH_COMMAND): asks the server for its models,
then writes a result file with the figures `--save-result` writes, from its own argv."""

from __future__ import annotations

import json
import random
import sys
import urllib.request
from pathlib import Path


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
    # Per-request data (--save-detailed) drawn around the summary figures; 4 chunks each.
    rng = random.Random(seed)
    ttfts = [rng.uniform(0.02, 0.06) + seed / 1000.0 for _ in range(count)]
    detailed = {"ttfts": ttfts, "itls": [[0.005] * 3 for _ in ttfts],
                "latencies": [t + 0.015 for t in ttfts], "output_lens": [4] * count,
                "errors": [""] * count}
    result = {**detailed,"duration": 2.0, "completed": count, "failed": 0,
              "request_throughput": count / 2.0, "output_throughput": count * 4.0,
              "request_goodput": count / 4.0 if "--goodput" in args else None,
              "mean_ttft_ms": 40.0 + seed, "median_ttft_ms": 30.0 + seed,
              "p50_ttft_ms": 30.0 + seed, "p90_ttft_ms": 60.0 + seed, "p99_ttft_ms": 90.0 + seed,
              "mean_tpot_ms": 5.0, "p90_tpot_ms": 7.0, "p99_itl_ms": 12.0, "p90_e2el_ms": 300.0}
    path = Path(value("--result-dir")) / value("--result-filename")
    path.write_text(json.dumps(result))
    print(f"fake bench: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
