"""What bench reads beside `vllm bench serve`: the proxy's /metrics counters, the store's
counters around each load point, the device names."""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from epdctl.bench.arms import Arm
from epdctl.errors import EpdctlError
from epdctl.launch.state import RunState

# The store's counters are flushed at most once a second by each engine.
STATS_SETTLE_S = 1.2
STATS_WAIT_S = 6.0


def _headers(state: RunState) -> dict[str, str]:
    key = state.proxy_api_key
    return {"authorization": f"Bearer {key}"} if key else {}


def proxy_counters(state: RunState) -> dict[str, float] | None:
    """The proxy's /metrics counters bench reports (None: it has no /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        reply = httpx.get(f"{state.proxy.url}/metrics", headers=_headers(state), timeout=10.0)
        if reply.status_code != 200:
            return None
        families = list(text_string_to_metric_families(reply.text))
    except (httpx.HTTPError, ValueError):
        return None
    counts: dict[str, float] = dict.fromkeys(
        ("encode_sum", "encode_count", "fallbacks", "retries", "requests_ok", "requests_failed"),
        0.0)
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if sample.name.startswith("epdctl_proxy_stage_seconds_") and \
                    labels.get("stage") == "encode" and sample.name.endswith(("_sum", "_count")):
                counts[f"encode_{sample.name.rsplit('_', 1)[1]}"] += sample.value
            elif sample.name == "epdctl_proxy_fallbacks_total":
                counts["fallbacks"] += sample.value
            elif sample.name == "epdctl_proxy_retries_total":
                counts["retries"] += sample.value
            elif sample.name == "epdctl_proxy_requests_total":
                counts["requests_ok" if labels.get("outcome") == "ok" else "requests_failed"] \
                    += sample.value
    return counts


def proxy_delta(before: dict[str, float] | None, after: dict[str, float] | None
                ) -> dict[str, float | None]:
    """Encode-stage mean time, fallbacks, retries and outcomes while one point ran."""
    keys = ("fallbacks", "retries", "requests_ok", "requests_failed")
    if before is None or after is None:
        return {"encode_mean_ms": None, **dict.fromkeys(keys)}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in (*keys, "encode_sum", "encode_count")}
    count = delta.pop("encode_count")
    total = delta.pop("encode_sum")
    mean = round(total / count * 1000.0, 3) if count else None
    return {"encode_mean_ms": mean, **{k: int(v) for k, v in delta.items()}}


def _store(ns_dir: Path | None) -> tuple[Counter[str], Counter[str]] | None:
    """The store's counters once they stop changing (engines flush them each second)."""
    from epdctl.cache.stats import read_stats

    if ns_dir is None:
        return None
    deadline = time.monotonic() + STATS_WAIT_S
    now = read_stats(ns_dir)
    while time.monotonic() < deadline:
        time.sleep(STATS_SETTLE_S)
        again = read_stats(ns_dir)
        if again == now:
            break
        now = again
    return now


def _store_delta(before: tuple[Counter[str], Counter[str]] | None,
                 ns_dir: Path) -> dict[str, int]:
    """Store counters while one point ran: saves (E), hits and misses (P/PD lookups), the
    distinct images loaded, and hits on an image already hit during the point."""
    now = _store(ns_dir)
    assert before is not None and now is not None
    counts = now[0] - before[0]
    keys = len(now[1] - before[1])  # per-key counts: lookups and loads of each image
    hits = int(counts["hits"])
    return {"saves": int(counts["saves"]), "hits": hits, "misses": int(counts["misses"]),
            "keys_hit": keys, "repeat_hits": max(hits - keys, 0),
            "load_failures": int(counts["load_failures"])}


def device_names(arms: Sequence[Arm]) -> list[str]:
    """NVML names of the GPUs (cuda), else the CPU's model name."""
    if arms and arms[0].topology.device == "cuda":
        from epdctl.host.gpus import gpu_names

        try:
            return gpu_names()
        except EpdctlError:
            return []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return [f"{line.partition(':')[2].strip()} ({os.cpu_count()} CPUs)"]
    except OSError:
        pass
    import platform

    return [platform.processor() or platform.machine()]
