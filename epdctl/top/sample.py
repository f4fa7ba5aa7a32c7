"""One look at a running topology for `epdctl top`: every /metrics, the EC store's counters
and NVML's memory figures, taken together."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from epdctl.top.prom import Scrape

if TYPE_CHECKING:
    from epdctl.cache.listing import NamespaceStats
    from epdctl.host.gpus import GpuInfo
    from epdctl.launch.state import RunState

FETCH_TIMEOUT_S = 2.0

Fetch = Callable[[str, Mapping[str, str]], "str | None"]


@dataclass(frozen=True)
class Sample:
    """What every source said at one moment."""

    at: float
    scrapes: dict[str, Scrape | None]
    """Each instance's /metrics (the proxy's too) by name; None where it did not answer."""
    cache: dict[str, Counter[str]] = field(default_factory=dict)
    """EC store counters per instance (its scheduler and workers summed)."""
    store: NamespaceStats | None = None
    """The namespace as `cache inspect` shows it."""
    gpu_bytes: dict[str, int] = field(default_factory=dict)
    """GPU memory per instance where NVML tells it per process."""
    gpus: tuple[GpuInfo, ...] = ()


def http_fetch(url: str, headers: Mapping[str, str]) -> str | None:
    """GET a /metrics text; None unless it answers 200 in time."""
    import httpx

    try:
        reply = httpx.get(url, headers=dict(headers), timeout=FETCH_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    return reply.text if reply.status_code == 200 else None


def _scrape(fetch: Fetch, url: str, headers: Mapping[str, str]) -> Scrape | None:
    text = fetch(url, headers)
    if text is None:
        return None
    try:
        return Scrape(text)
    except (ValueError, IndexError):  # not Prometheus text (another server on the port)
        return None


def take(state: RunState, fetch: Fetch | None = None, *, clock: Callable[[], float] = time.time,
         gpu_memory: Callable[[], dict[int, int]] | None = None,
         gpu_devices: Callable[[], list[GpuInfo]] | None = None) -> Sample:
    """Sample every source once; the /metrics requests run in parallel."""
    from epdctl.cache.listing import inspect
    from epdctl.cache.stats import read_writers

    fetch = fetch or http_fetch
    # The proxy wants its api_key; the instances, when it has one, their internal key.
    proxy_auth, engine_auth = (_bearer(state.proxy_api_key), _bearer(state.internal_key))
    with ThreadPoolExecutor(max_workers=max(1, len(state.specs))) as pool:
        futures = {s.name: pool.submit(_scrape, fetch, f"{s.url}/metrics",
                                       proxy_auth if s.is_proxy else engine_auth)
                   for s in state.specs}
        scrapes = {name: future.result() for name, future in futures.items()}
    ns_dir = Path(state.store_dir)
    store, cache = None, {}
    if state.is_our_store:  # other EC connectors keep no counters epdctl can read
        store = next((ns for ns in inspect(ns_dir.parent) if ns.namespace == state.namespace),
                     None)
        cache = _per_instance(state, read_writers(ns_dir))
    uses_gpus = any(s.gpus for s in state.engines)
    gpu_bytes = _gpu_bytes(state, (gpu_memory or _process_memory)()) if uses_gpus else {}
    gpus = tuple((gpu_devices or _devices)()) if uses_gpus else ()
    return Sample(clock(), scrapes, cache, store, gpu_bytes, gpus)


def _bearer(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def _per_instance(state: RunState, writers: dict[str, Counter[str]]) -> dict[str, Counter[str]]:
    """Writers are named `<engine id>-scheduler` and `<engine id>-worker<rank>`
    (connector/ec.py); long ids are hashed (cache/_format.name_part)."""
    from epdctl.cache.stats import name_part

    result: dict[str, Counter[str]] = {}
    for spec in state.engines:
        engine_id = (spec.ec_config or {}).get("engine_id")
        if not engine_id:
            continue
        hashed = {name_part(f"{engine_id}-{side}") for side in
                  ("scheduler", *(f"worker{r}" for r in range(spec.tensor_parallel * 8)))}
        total: Counter[str] = Counter()
        for writer, counts in writers.items():
            if writer.startswith(f"{engine_id}-") or writer in hashed:
                total.update(counts)
        result[spec.name] = total
    return result


def _gpu_bytes(state: RunState, by_pid: dict[int, int]) -> dict[str, int]:
    """Per instance: the GPU memory of its process tree (vLLM's workers are children)."""
    import psutil

    result: dict[str, int] = {}
    for name, record in state.records.items():
        try:
            root = psutil.Process(record.pid)
            pids = [root.pid, *(p.pid for p in root.children(recursive=True))]
        except psutil.Error:
            continue
        used = [by_pid[pid] for pid in pids if pid in by_pid]
        if used:
            result[name] = sum(used)
    return result


def _process_memory() -> dict[int, int]:
    from epdctl.host.gpus import process_memory

    return process_memory()


def _devices() -> list[GpuInfo]:
    from epdctl.errors import PlanError
    from epdctl.host.gpus import describe_gpus

    try:
        return describe_gpus()
    except PlanError:
        return []
