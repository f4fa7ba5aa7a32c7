"""E and PD overlapped vs E then PD, on the real CPU topology (tiny LLaVA, no rewrite).

    .venv/bin/python benchmarks/overlap.py [--requests 40] [--levels 1,4] [--rounds 4]

Brings topologies/cpu-demo.yaml up (a private state dir and store; run it alone: it takes
both CPU cores) and puts two proxies of its own before the same E and PD, identical but for
`--overlap` / `--no-overlap`. Every request carries an image of its own (no store hits), so
each one goes to E; after a warm-up per proxy (not counted), at each concurrency level the
two arms take turns, --rounds times, in alternating order (on off, off on, ...), and their
TTFTs are pooled per arm. Prints TTFT p50/p90 per arm and level, PD's waits for pending
items, and ends with one key=value line (on / off ratios, each with its spread: `_spread=
LOW-HIGH`, the ratio of each round's two turns).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cache_reuse import _drive as drive_closed  # noqa: E402
from cache_reuse import (  # noqa: E402  (a sibling script's helpers)
    cpu_demo,
    extra_proxy,
    free_port,
    png_image,
    quantile,
    wait_http,
)

ARMS = ("on", "off")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=40, help="per arm and level")
    p.add_argument("--levels", default="1,4", help="concurrency levels (closed loop)")
    p.add_argument("--rounds", type=int, default=4, help="turns each arm takes per level")
    a = p.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    per_turn = max(1, a.requests // a.rounds)
    procs: list[subprocess.Popen[bytes]] = []
    seeds = iter(range(1_000_000))
    with cpu_demo("overlap-bench") as demo:
        try:
            urls = {}
            for arm in ARMS:
                port = free_port()
                procs.append(extra_proxy(port, demo.model, demo.urls["encode-0"],
                                         demo.urls["pd-0"], demo.store, demo.key,
                                         "--overlap" if arm == "on" else "--no-overlap"))
                urls[arm] = f"http://127.0.0.1:{port}"
                wait_http(urls[arm] + "/health")
            for arm in ARMS:  # the first image per proxy teaches it there is no metadata
                run(urls[arm], demo.model, [png_image(next(seeds)) for _ in range(2)], 1)
            ttfts: dict[tuple[str, int], list[float]] = {}
            turns: dict[tuple[str, int], list[list[float]]] = {}
            waits_before = _waits(demo.store)
            for level in levels:
                for round_ in range(a.rounds):
                    for arm in ARMS if round_ % 2 == 0 else ARMS[::-1]:  # A B, B A, ...
                        images = [png_image(next(seeds)) for _ in range(per_turn)]
                        got = run(urls[arm], demo.model, images, level)
                        ttfts.setdefault((arm, level), []).extend(got)
                        turns.setdefault((arm, level), []).append(got)
            waits = {k: v - waits_before.get(k, 0) for k, v in _waits(demo.store).items()}
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    figures = []
    for level in levels:
        rows = {}
        for arm in ARMS:
            got = sorted(ttfts[(arm, level)])
            rows[arm] = (statistics.median(got), quantile(got, 0.9))
            print(f"c={level} overlap {arm:<3}  requests={len(got)}  "
                  f"ttft_p50={rows[arm][0] * 1000:7.1f}ms  ttft_p90={rows[arm][1] * 1000:7.1f}ms",
                  flush=True)
        pairs = list(zip(turns[("on", level)], turns[("off", level)], strict=True))
        figures.append(f"ttft_p50_ratio_c{level}={rows['on'][0] / rows['off'][0]:.2f} "
                       f"ttft_p50_ratio_c{level}_spread={spread(pairs, statistics.median)} "
                       f"ttft_p90_ratio_c{level}={rows['on'][1] / rows['off'][1]:.2f} "
                       f"ttft_p90_ratio_c{level}_spread="
                       f"{spread(pairs, lambda t: quantile(sorted(t), 0.9))}")
    print(f"pd waits={waits.get('waits', 0):.0f} expired={waits.get('expired', 0):.0f} "
          f"mean_wait_ms={1000 * waits.get('wait_s', 0) / max(waits.get('waits', 0), 1):.1f}")
    print(" ".join(figures))


def spread(pairs: list[tuple[list[float], list[float]]], figure: Any) -> str:
    """LOW-HIGH of on / off over the rounds (each round's two turns)."""
    ratios = [figure(on) / figure(off) for on, off in pairs]
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def run(url: str, model: str, images: list[str], concurrency: int) -> list[float]:
    return asyncio.run(drive_closed(url, model, images, concurrency, 0.0))


def _waits(store: tuple[str, str]) -> dict[str, Any]:
    from epdctl.cache.stats import read_stats
    from epdctl.cache.store import Store

    counts, _ = read_stats(Store(*store).root)
    return {k: counts.get(k, 0) for k in ("waits", "wait_s", "expired")}


if __name__ == "__main__":
    main()
