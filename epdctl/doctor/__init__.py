"""`epdctl doctor`'s checks: what `up` needs of this machine, found before anything starts.

Every probe of the outside world (subprocesses, NVML, disk usage, port binding) comes in
through `Probes`, so each check runs against fakes in the tests.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from epdctl.cache import CONNECTOR_NAME
from epdctl.cache.capacity import DiskUsage
from epdctl.doctor._host import (
    Gpus,
    check_ec_store,
    check_gpu_memory,
    check_gpus,
    check_placement,
    check_ports,
    filesystem_type,
    is_writable,
)
from epdctl.doctor._safety import check_safety
from epdctl.doctor._topology import check_combinations, check_model
from epdctl.doctor._vllm import check_plugin, check_vllm, vllm_requirement
from epdctl.errors import PlanError
from epdctl.host.gpus import GpuInfo
from epdctl.launch.plan import Plan, plan
from epdctl.launch.preflight import (
    Check,
    Completed,
    Runner,
    Status,
    check_ec_connector,
    check_kv_connector,
    connectors,
    modules,
    probe,
    run_command,
)
from epdctl.topology.model import Role, Topology, parse_topology

__all__ = ["Check", "Completed", "Probes", "Runner", "Status", "run_checks"]


def _describe_gpus() -> list[GpuInfo]:
    from epdctl.host.gpus import describe_gpus

    return describe_gpus()


def _check_plan_ports(placed: Plan) -> None:
    from epdctl.launch.ports import check_plan_ports

    check_plan_ports(placed)


@dataclass(frozen=True)
class Probes:
    """How the checks look at the world; tests replace any of them with fakes."""

    run: Runner = run_command
    which: Callable[[str], str | None] = shutil.which
    gpus: Callable[[], list[GpuInfo]] = _describe_gpus
    """Visible GPUs with names and memory; PlanError when there are none."""
    disk_usage: DiskUsage = shutil.disk_usage
    fs_type: Callable[[Path], str | None] = filesystem_type
    writable: Callable[[Path], bool] = is_writable
    check_ports: Callable[[Plan], None] = _check_plan_ports
    """Raises PlanError naming each planned port that cannot be bound."""
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    cpu_count: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    vllm_requirement: str | None = field(default_factory=vllm_requirement)


def _plans(topology: Topology, state_dir: Path, gpus: Gpus,
           cpu_count: int) -> tuple[Plan | PlanError, Plan | None, Plan]:
    """The plan on this machine's GPUs (or why there is none), one to check ports on, and one
    that shows the engine command.

    When the GPUs do not fit, planning again as if there were enough still gives the ports;
    a plan that fails either way (shared GPUs over-committed) leaves only the engine command.
    """
    visible = [] if isinstance(gpus, PlanError) else [g.id for g in gpus]
    try:
        placed = plan(topology, state_dir, visible_gpus=visible, cpu_count=cpu_count)
        return placed, placed, placed
    except PlanError as exc:
        error = exc
    roles = topology.roles.values()
    enough = [str(i) for i in range(sum(r.replicas * r.tensor_parallel for r in roles) + max(
        (g for r in roles if isinstance(r.gpus, list) for g in r.gpus), default=0) + 1)]
    try:
        assumed = plan(topology, state_dir, visible_gpus=enough, cpu_count=cpu_count)
        return error, assumed, assumed
    except PlanError:
        one = topology.model_copy(update={"roles": {"prefill_decode": Role()}})
        return error, None, plan(one, state_dir, visible_gpus=["0"], cpu_count=cpu_count)


def store_line(topology: Topology, state_dir: Path) -> str:
    """Where the run's EC store will be, and whether it is private, in a few words."""
    from epdctl.cache.store_root import resolve_root, uses_store
    from epdctl.host.private import dir_problem

    if not uses_store(topology):
        return "no EC store in cache.dir (no encode role, or a connector that keeps none)"
    root = resolve_root(topology, state_dir, is_dry_run=True)  # what `up` would use
    try:
        problem = dir_problem(root)
    except FileNotFoundError:
        return f"store private under {root} (up creates it, mode 0700)"
    except OSError as exc:
        return f"store under {root}: {exc.strerror or exc}"
    if problem is not None:
        return f"store root {root} not usable: {problem}"
    fresh = "" if root == topology.cache.dir else ", a root of its own: the default is taken"
    return f"store private under {root} (mode 0700, yours{fresh})"


def run_checks(topology: Topology | None, state_root: Path,
               probes: Probes | None = None, topology_path: Path | None = None) -> list[Check]:
    """Every check for `topology` (read from `topology_path`, for the safety check);
    without one, the environment's alone (vLLM, plugin, GPUs, /dev/shm), for the device
    NVML suggests."""
    probes = probes or Probes()
    gpus: Gpus
    try:
        gpus = probes.gpus()
    except PlanError as exc:
        gpus = exc
    target = topology or parse_topology({
        "name": "doctor", "model": "doctor", "roles": {"prefill_decode": {}},
        "device": "cpu" if isinstance(gpus, PlanError) else "cuda",
    })
    placed, ports_plan, shown = _plans(target, state_root / target.name, gpus, probes.cpu_count)
    engine = shown.instances[0]
    command = list(engine.command[:-1])  # the engine command, without the model
    env = {**probes.environ, **engine.env}
    connector, ec = connectors(topology)
    python, report = probe(engine, modules(connector, ec), probes)
    checks = [check_vllm(command, env, probes.run, probes.which, probes.vllm_requirement)]
    if topology is not None and "encode" not in topology.roles:
        checks.append(Check("plugin", "skip", "no encode role: the EC connector is not used"))
    elif ec is not None and ec != CONNECTOR_NAME:
        checks.append(Check("plugin", "skip", f"cache.connector is {ec}: epdctl's connector "
                            "plugin is not used"))
    else:
        checks.append(check_plugin(report, command))
    if topology is None:
        return [*checks, check_gpus(None, gpus),
                check_ec_store(None, probes.disk_usage, probes.fs_type, probes.writable)]
    return [
        *checks,
        check_kv_connector(connector, report),
        check_ec_connector(ec, report),
        check_gpus(topology.device, gpus),
        check_placement(topology, placed, gpus, probes.cpu_count),
        check_gpu_memory(topology, None if isinstance(placed, PlanError) else placed, gpus),
        check_ec_store(topology, probes.disk_usage, probes.fs_type, probes.writable),
        check_ports(ports_plan, probes.check_ports),
        check_model(topology, env, report.python if report else python),
        *check_combinations(topology, ports_plan),
        check_safety(topology, topology_path, store_line(topology, state_root / topology.name)),
    ]
