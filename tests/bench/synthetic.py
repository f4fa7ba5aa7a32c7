"""Synthetic `vllm bench serve` rounds from known distributions (for the statistics tests)."""

from __future__ import annotations

import math
import random

from epdctl.bench.samples import Request, Round

CONCURRENCY = 4
TTFT_MU, TTFT_SIGMA = math.log(200.0), 0.5
"""TTFT ~ lognormal: the true median is 200 ms."""
TPOT_MEAN, TPOT_SD = 20.0, 4.0
OUTPUT = 16


def true_figures(scale: float = 1.0) -> dict[str, float]:
    """What the estimators estimate, for latencies `scale` times the base."""
    z90, z99 = 1.2815515655446004, 2.3263478740408408
    ttft_mean = math.exp(TTFT_MU + TTFT_SIGMA ** 2 / 2) * scale
    latency = ttft_mean + TPOT_MEAN * scale * (OUTPUT - 1)
    return {"ttft_p50_ms": math.exp(TTFT_MU) * scale,
            "ttft_p90_ms": math.exp(TTFT_MU + z90 * TTFT_SIGMA) * scale,
            "ttft_p99_ms": math.exp(TTFT_MU + z99 * TTFT_SIGMA) * scale,
            "tpot_mean_ms": TPOT_MEAN * scale, "request_throughput": CONCURRENCY * 1000 / latency}


def make_round(rng: random.Random, n: int, scale: float = 1.0, chunked: bool = True,
               slo_ttft_ms: float = 300.0) -> Round:
    """n requests at a fixed concurrency: duration = total latency / concurrency."""
    requests = []
    for _ in range(n):
        ttft = rng.lognormvariate(TTFT_MU, TTFT_SIGMA) * scale
        tpot = max(rng.gauss(TPOT_MEAN, TPOT_SD), 1.0) * scale
        latency = ttft + tpot * (OUTPUT - 1)
        requests.append(Request(ttft, tpot if chunked else None, latency, ttft <= slo_ttft_ms))
    duration = sum(r.latency_ms for r in requests) / CONCURRENCY / 1000.0
    return Round(duration, n / duration, tuple(requests))
