"""The figures `epdctl top` shows (and `top --once --json` prints), from a few Samples:
rates over the last RATE_WINDOW_S, latency quantiles over the last LATENCY_WINDOW_S from
histogram bucket differences, counts as /metrics and `cache inspect` show them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from epdctl.proxy.metrics import STAGES
from epdctl.top.prom import Histogram, Scrape
from epdctl.top.sample import Sample

if TYPE_CHECKING:
    from epdctl.launch.state import RunState

RATE_WINDOW_S = 5.0
LATENCY_WINDOW_S = 60.0
# The proxy's series (proxy/metrics.py; tests/top check the names against it) and vLLM's.
REQUESTS = "epdctl_proxy_requests_total"
STAGE = "epdctl_proxy_stage_seconds"
FANOUT = "epdctl_proxy_encoder_fanout_items"
FALLBACKS = "epdctl_proxy_fallbacks_total"
RETRIES = "epdctl_proxy_retries_total"
INFLIGHT = "epdctl_proxy_inflight_requests"
INSTANCE_UP = "epdctl_proxy_instance_up"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
FINISHED = "vllm:request_success_total"
LATENCY = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
CACHE_COUNTS = ("hits", "misses", "loads", "load_bytes", "saves", "save_bytes")


def _base(samples: Sequence[Sample], window_s: float | None) -> Sample | None:
    """The latest sample at least window_s old, else the oldest; None: cumulative."""
    if window_s is None or len(samples) < 2:
        return None
    now = samples[-1].at
    older = [s for s in samples[:-1] if s.at <= now - window_s]
    return older[-1] if older else samples[0]


def _rate(now: float | None, then: float | None, seconds: float) -> float | None:
    if now is None or then is None or seconds <= 0 or now < then:
        return None  # no base yet, or a counter reset by a restart
    return (now - then) / seconds


def _window(now: Histogram | None, then: Histogram | None) -> Histogram | None:
    return now if now is None or then is None else now - then


def _quantiles(hist: Histogram | None, prefix: str) -> dict[str, float | None]:
    """p50, p90 and the mean; the mean is exact where coarse buckets blur the quantiles."""
    values = {"p50": hist.quantile(0.5) if hist else None,
              "p90": hist.quantile(0.9) if hist else None, "mean": hist.mean if hist else None}
    return {f"{prefix}{k}_s": None if v is None else round(v, 6) for k, v in values.items()}


def _get(scrape: Scrape | None, name: str) -> float | None:
    return None if scrape is None else scrape.total(name)


def _hist(scrape: Scrape | None, name: str, **match: str) -> Histogram | None:
    return None if scrape is None else scrape.histogram(name, **match)


def _ratio(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses > 0 else None


def summarize(state: RunState, samples: Sequence[Sample],
              latency_window_s: float | None = LATENCY_WINDOW_S) -> dict[str, Any]:
    """The `top --once --json` document; latency_window_s None: quantiles since start."""
    now = samples[-1]
    rate_base, lat_base = _base(samples, RATE_WINDOW_S), _base(samples, latency_window_s)
    seconds = now.at - rate_base.at if rate_base else 0.0
    proxy = state.proxy.name
    instances = [_instance(spec, now, rate_base, lat_base, seconds) for spec in state.engines]
    up = _in_rotation(now.scrapes.get(proxy))
    for row in instances:
        row["in_rotation"] = up.get(row["url"])
        record = state.records.get(row["name"])
        row["is_failed"] = record is not None and record.state == "failed"  # out of restarts
    return {
        "name": state.name, "mode": state.mode,
        "time": datetime.fromtimestamp(now.at).astimezone().isoformat(timespec="seconds"),
        "rate_window_s": round(seconds, 3) if rate_base else None,
        "latency_window_s": round(now.at - lat_base.at, 3) if lat_base else None,
        "proxy": _proxy(state, now, rate_base, lat_base, seconds),
        "roles": _roles(instances),
        "instances": instances,
        "cache": _cache(state, now, rate_base, lat_base, seconds),
        "gpus": [{"id": g.id, "name": g.name, "total_bytes": g.total_bytes,
                  "used_bytes": None if g.total_bytes is None or g.free_bytes is None
                  else g.total_bytes - g.free_bytes}
                 for g in now.gpus if g.id in {d for s in state.engines for d in s.gpus}],
    }


def _proxy(state: RunState, now: Sample, rate_base: Sample | None, lat_base: Sample | None,
           seconds: float) -> dict[str, Any]:
    name = state.proxy.name
    scrape = now.scrapes.get(name)
    before = rate_base.scrapes.get(name) if rate_base else None
    then = lat_base.scrapes.get(name) if lat_base else None
    outcomes = scrape.by(REQUESTS, "outcome") if scrape else {}
    fanout = _hist(scrape, FANOUT)
    stages = {}
    for stage in STAGES:
        hist = _window(_hist(scrape, STAGE, stage=stage), _hist(then, STAGE, stage=stage))
        stages[stage] = {"count": int(hist.total) if hist else 0, **_quantiles(hist, "")}
    return {
        "name": name, "url": state.proxy.url, "up": scrape is not None,
        "inflight": _get(scrape, INFLIGHT),
        "requests": int(sum(outcomes.values())), "ok": int(outcomes.get("ok", 0)),
        "errors": int(sum(v for k, v in outcomes.items() if k != "ok")),
        "by_outcome": {k: int(v) for k, v in sorted(outcomes.items())},
        "requests_per_s": _rate(_get(scrape, REQUESTS), _get(before, REQUESTS), seconds),
        "stages": stages,
        "encoder_fanout": {
            "requests": int(fanout.total) if fanout else 0,
            "items": int(fanout.sum) if fanout else 0,
            "mean_items": fanout.mean if fanout else None,
            "items_per_s": _rate(fanout.sum if fanout else None,
                                 h.sum if (h := _hist(before, FANOUT)) else None, seconds),
        },
        "fallbacks": {k: int(v) for k, v in sorted((scrape.by(FALLBACKS, "reason")
                                                    if scrape else {}).items())},
        "retries": {k: int(v) for k, v in sorted((scrape.by(RETRIES, "stage")
                                                  if scrape else {}).items())},
    }


def _in_rotation(scrape: Scrape | None) -> dict[str, bool]:
    return {url: value > 0 for url, value in (scrape.by(INSTANCE_UP, "url") if scrape
                                               else {}).items()}


def _instance(spec: Any, now: Sample, rate_base: Sample | None, lat_base: Sample | None,
              seconds: float) -> dict[str, Any]:
    scrape = now.scrapes.get(spec.name)
    before = rate_base.scrapes.get(spec.name) if rate_base else None
    then = lat_base.scrapes.get(spec.name) if lat_base else None
    finished = _get(scrape, FINISHED)
    counts = now.cache.get(spec.name, Counter())
    past = lat_base.cache.get(spec.name, Counter()) if lat_base else Counter()
    return {
        "name": spec.name, "role": spec.role, "url": spec.url, "up": scrape is not None,
        "in_rotation": None,
        "running": _get(scrape, RUNNING), "waiting": _get(scrape, WAITING),
        "requests": None if finished is None else int(finished),
        "requests_per_s": _rate(finished, _get(before, FINISHED), seconds),
        **_quantiles(_window(_hist(scrape, LATENCY), _hist(then, LATENCY)), "latency_"),
        **_quantiles(None if spec.role == "encode" else
                     _window(_hist(scrape, TTFT), _hist(then, TTFT)), "ttft_"),
        "cache": {**{k: int(counts.get(k, 0)) for k in CACHE_COUNTS},
                  "hit_ratio": _ratio(counts["hits"] - past["hits"],
                                      counts["misses"] - past["misses"])},
        "gpu_memory_bytes": now.gpu_bytes.get(spec.name),
    }


def _roles(instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    roles: dict[str, dict[str, Any]] = {}
    for row in instances:
        role = roles.setdefault(row["role"], {"instances": 0, "up": 0, "running": 0.0,
                                              "waiting": 0.0, "requests": 0,
                                              "requests_per_s": None})
        role["instances"] += 1
        role["up"] += 1 if row["up"] else 0
        for key in ("running", "waiting", "requests"):
            role[key] += row[key] or 0
        if row["requests_per_s"] is not None:
            role["requests_per_s"] = (role["requests_per_s"] or 0.0) + row["requests_per_s"]
    return roles


def _cache(state: RunState, now: Sample, rate_base: Sample | None, lat_base: Sample | None,
           seconds: float) -> dict[str, Any]:
    total: Counter[str] = sum(now.cache.values(), Counter())
    past: Counter[str] = sum(lat_base.cache.values(), Counter()) if lat_base else Counter()
    before: Counter[str] = sum(rate_base.cache.values(), Counter()) if rate_base else Counter()
    store = now.store
    return {
        "namespace": state.namespace, "connector": state.ec_connector,
        "entries": store.entries if store else 0,
        "size_bytes": store.size_bytes if store else 0,
        "capacity_bytes": state.settings.cache_capacity_bytes,
        "hits": store.hits if store else 0, "misses": store.misses if store else 0,
        "saves": store.saves if store else 0, "loads": store.loads if store else 0,
        "hit_ratio": _ratio(total["hits"] - past["hits"], total["misses"] - past["misses"]),
        "load_bytes": int(total["load_bytes"]), "save_bytes": int(total["save_bytes"]),
        "load_bytes_per_s": _rate(total["load_bytes"], before["load_bytes"] if rate_base
                                  else None, seconds),
    }
