"""Checks of this machine: GPUs (NVML), their free memory, the placement, /dev/shm, ports."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from epdctl.cache import CONNECTOR_NAME, default_store_root
from epdctl.cache.capacity import DiskUsage, capacity_problem
from epdctl.errors import PlanError
from epdctl.host.gpus import GpuInfo
from epdctl.host.private import dir_problem
from epdctl.host.shm import SHM
from epdctl.launch.plan import Plan
from epdctl.launch.preflight import Check
from epdctl.topology.ec_names import EXAMPLE
from epdctl.topology.model import Topology
from epdctl.units import format_bytes

# What vLLM 0.32 takes of a GPU when a role sets no gpu_memory_utilization (CacheConfig).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
_MOUNTS = Path("/proc/self/mounts")

Gpus = list[GpuInfo] | PlanError
"""What NVML said: the visible GPUs, or why there are none."""


def check_gpus(device: str | None, gpus: Gpus) -> Check:
    """NVML lists the visible GPUs (device None: no topology, so none needed is a warning)."""
    if device == "cpu":
        return Check("gpus", "skip", "`device: cpu`: no GPU needed")
    if isinstance(gpus, PlanError):
        return Check("gpus", "fail" if device == "cuda" else "warn", str(gpus))
    listed = ", ".join(f"{g.id} {g.name}" + (f" ({format_bytes(g.free_bytes)} free of "
                                              f"{format_bytes(g.total_bytes)})"
                                              if g.free_bytes is not None
                                              and g.total_bytes is not None else "")
                       for g in gpus)
    return Check("gpus", "ok", f"{len(gpus)} visible: {listed}")


def check_gpu_memory(topology: Topology, plan: Plan | None, gpus: Gpus) -> Check:
    """Each GPU has the fractions its instances will ask vLLM for free right now."""
    if topology.device == "cpu":
        return Check("gpu-memory", "skip", "`device: cpu`: no GPU memory needed")
    if isinstance(gpus, PlanError) or plan is None:
        return Check("gpu-memory", "skip", "no GPU placement to check (see `gpus`, `placement`)")
    info = {g.id: g for g in gpus}
    asked: dict[str, float] = {
        name: role.gpu_memory_utilization or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
        for name, role in topology.roles.items()
    }
    problems, fits = [], []
    for device in dict.fromkeys(d for spec in plan.instances for d in spec.gpus):
        users = [s for s in plan.instances if device in s.gpus]
        fraction = sum(asked[s.role] for s in users)
        gpu = info.get(device)
        if gpu is None or gpu.total_bytes is None or gpu.free_bytes is None:
            fits.append(f"GPU {device} memory unknown")
            continue
        need = fraction * gpu.total_bytes
        names = ", ".join(f"`{s.name}`" for s in users)
        if gpu.free_bytes < need:
            problems.append(
                f"GPU {device} ({gpu.name}): {names} need {fraction:.2f} x "
                f"{format_bytes(gpu.total_bytes)} = {format_bytes(need)}, "
                f"{format_bytes(gpu.free_bytes)} free")
        else:
            fits.append(f"GPU {device}: {format_bytes(need)} of {format_bytes(gpu.free_bytes)} "
                        "free")
    if problems:
        return Check("gpu-memory", "fail", "; ".join(problems),
                     "free the GPU (`nvidia-smi` shows what holds it) or lower the roles' "
                     "gpu_memory_utilization")
    return Check("gpu-memory", "ok", "; ".join(fits))


def check_placement(topology: Topology, placed: Plan | PlanError, gpus: Gpus,
                    cpu_count: int) -> Check:
    """The roles fit this machine: GPU indices, counts, tensor_parallel, shared fractions."""
    if topology.device == "cuda" and isinstance(gpus, PlanError):
        return Check("placement", "skip", "no GPU to place the roles on (see `gpus`)")
    if isinstance(placed, PlanError):
        return Check("placement", "fail", "; ".join(str(placed).splitlines()),
                     "change the roles' gpus, replicas or tensor_parallel, or make more GPUs "
                     "visible")
    if topology.device == "cpu":
        where = ", ".join(f"{s.name} on CPU {s.env.get('VLLM_CPU_OMP_THREADS_BIND', '?')}"
                          for s in placed.instances)
        if len(placed.instances) > cpu_count:
            return Check("placement", "warn", f"{len(placed.instances)} instances on "
                         f"{cpu_count} CPU(s) share cores: {where}",
                         "fewer replicas, or a machine with more cores")
        return Check("placement", "ok", where)
    return Check("placement", "ok", ", ".join(f"{s.name} on GPU {','.join(s.gpus)}"
                                              for s in placed.instances))


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding path (the longest mount point above it)."""
    try:
        lines = _MOUNTS.read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    target = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def is_writable(path: Path) -> bool:
    """Whether this user may create files in directory path."""
    return os.access(path, os.W_OK | os.X_OK)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_ec_store(topology: Topology | None, disk_usage: DiskUsage,
                   fs_type: Callable[[Path], str | None],
                   writable: Callable[[Path], bool]) -> Check:
    """cache.dir (/dev/shm without a topology) is writable, on tmpfs, and holds the budget."""
    if topology is not None and "encode" not in topology.roles:
        return Check("ec-store", "skip", "no encode role: the EC store is not used")
    connector = topology.cache.connector if topology is not None else None
    if connector not in (None, CONNECTOR_NAME, EXAMPLE):
        return Check("ec-store", "skip", f"cache.connector is {connector}: it keeps nothing "
                     "in cache.dir")
    root = SHM if topology is None else topology.cache.dir
    base = _existing(root)
    if topology is None and not root.is_dir():
        return Check("ec-store", "fail", f"{root} does not exist",
                     "mount a tmpfs there, or give topologies a `cache: {dir: ...}` on tmpfs")
    if not base.is_dir() or not writable(base):
        return Check("ec-store", "fail", f"{base} is not a directory this user can write to "
                     f"(the store goes to {root})",
                     "fix its permissions, or set cache.dir to a directory you own on tmpfs")
    if topology is not None and base == root:
        unsafe = dir_problem(root)  # the rule `up` and the engines refuse a store by
        if unsafe is not None:
            why, _, fix = unsafe.partition("; ")
            if root == Path(default_store_root()):  # store_root.resolve_root
                return Check("ec-store", "warn", f"{root}: {why}; `up` uses a fresh private "
                             "root of its own instead", fix)
            return Check("ec-store", "fail", f"{root}: {why}",
                         f"{fix}, or set cache.dir to a directory of your own")
    kind = fs_type(base) or "an unknown filesystem"
    if topology is None:
        usage = disk_usage(base)
        detail = (f"{root}: {kind}, {format_bytes(usage.free)} free of "
                  f"{format_bytes(usage.total)}")
        return Check("ec-store", "ok", detail)
    usage = disk_usage(base)
    if connector == EXAMPLE:
        detail = (f"{root}: {kind}, {format_bytes(usage.free)} free ({EXAMPLE}'s files, no "
                  "budget: they stay until `down`)")
    else:
        problem = capacity_problem(root, topology.cache.capacity, disk_usage)
        if problem:
            return Check("ec-store", "fail", problem)
        detail = (f"{root}: {kind}, {format_bytes(usage.free)} free for a "
                  f"{format_bytes(topology.cache.capacity)} budget")
    if kind != "tmpfs":
        return Check("ec-store", "warn", f"{detail}; not tmpfs, so saves and loads may wait "
                     "on the disk", "set cache.dir to a directory under /dev/shm")
    return Check("ec-store", "ok", detail)


def check_ports(plan: Plan | None, check: Callable[[Plan], None]) -> Check:
    """Every planned port (instances, NIXL side channels, proxy) can be bound now."""
    if plan is None:
        return Check("ports", "skip", "no plan (see `placement`)")
    ports = [s.port for s in plan.instances]
    ports += [s.side_channel_port for s in plan.instances if s.side_channel_port is not None]
    ports += [port for s in plan.instances for port in s.ec_ports]
    ports.append(plan.proxy.port)
    try:
        check(plan)
    except PlanError as exc:
        fix = "stop what holds them (`ss -ltnp` shows it), or move ports.base / proxy.port"
        if (plan.state_dir / "state.json").exists():
            fix = f"it may be `{plan.name}` itself: `epdctl status --name {plan.name}`; or {fix}"
        return Check("ports", "fail", "; ".join(str(exc).splitlines()), fix)
    return Check("ports", "ok", f"{len(ports)} free: {', '.join(map(str, ports))}")
