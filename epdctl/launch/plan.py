"""plan(): a topology placed on this machine, as pure data (argv, env, ports, GPUs, configs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from epdctl import cache
from epdctl.errors import PlanError
from epdctl.launch.connectors import Connector, connector_for
from epdctl.launch.engine_spec import (
    CPU_IN_PROCESS_WORKER,
    Engines,
    EngineSlot,
    engine_command,
    engine_env,
    engine_spec,
    kv_transfer_config,
)
from epdctl.launch.ports import free_ports, port_blocks
from epdctl.launch.spec import HOST, PROBE_PATHS, PROXY_ROLE, LaunchSpec, Plan
from epdctl.proxy.config import ProxyConfig
from epdctl.topology.keys import has_api_key
from epdctl.topology.model import (
    NAMESPACE_FLAGS,
    ROLE_NAMES,
    Role,
    Topology,
    canonical_flag,
    flag_value,
)

__all__ = [
    "CPU_IN_PROCESS_WORKER", "HOST", "NAMESPACE_FLAGS", "LaunchSpec", "Plan", "compute_namespace",
    "flag_value", "kv_transfer_config", "plan", "proxy_config",
]

PROXY_COMMAND = ("{python}", "-m", "epdctl.proxy")
PROXY_NAME = "proxy"
# vLLM 0.16 added --disable-access-log-for-endpoints (vllm-project/vllm#30011).
QUIET_PROBES_SINCE = (0, 16)


def model_fingerprint(model: str) -> str:
    """A local model directory is identified by its config.json, an id by itself."""
    config = Path(model) / "config.json"
    if Path(model).is_absolute() and config.is_file():
        return hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    return ""


def compute_namespace(topology: Topology, vllm_version: str) -> str:
    """Hash of everything that makes encoder outputs comparable across instances."""
    args = list(topology.engine.args)
    if "encode" in topology.roles:
        args += topology.roles["encode"].args
    material = {
        "vllm": vllm_version,
        "model": topology.model,
        "model_config": model_fingerprint(topology.model),
        "flags": {flag: canonical_flag(args, flag) for flag in NAMESPACE_FLAGS},
        "format": cache.FORMAT_VERSION,
    }
    if topology.cache.connector != cache.CONNECTOR_NAME:
        # Another connector's files must not be taken for ours, or for another one's.
        material["connector"] = topology.cache.connector
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"{topology.name}-{digest[:12]}"


def has_quiet_probes(vllm_version: str) -> bool:
    """Whether that vLLM can leave the probes out of its access log (unknown: assume so)."""
    parts = re.match(r"(\d+)\.(\d+)", vllm_version)
    return parts is None or (int(parts[1]), int(parts[2])) >= QUIET_PROBES_SINCE


def _visible(count: int) -> str:
    if count == 1:
        return "1 GPU is visible (index 0)"
    return f"{count} GPUs are visible (indices 0 to {count - 1})" if count else "no GPU is visible"


def _assign_gpus(topology: Topology, visible: Sequence[str]) -> dict[str, list[list[str]]]:
    """Per role, per replica: the device ids it gets. Counts pick GPUs no role lists."""
    problems = [
        f"roles -> {name} -> gpus: GPU {gpu} does not exist; {_visible(len(visible))}"
        for name, role in topology.roles.items() if isinstance(role.gpus, list)
        for gpu in role.gpus if gpu >= len(visible)
    ]
    listed = {
        gpu for role in topology.roles.values() if isinstance(role.gpus, list) for gpu in role.gpus
    }
    free = [i for i in range(len(visible)) if i not in listed]
    result: dict[str, list[list[str]]] = {}
    for name in ROLE_NAMES:
        role = topology.roles.get(name)
        if role is None:
            continue
        tp = role.tensor_parallel
        if isinstance(role.gpus, list):
            indices = [i for i in role.gpus if i < len(visible)]
        elif role.replicas * tp > len(free):
            need, left = role.replicas * tp, len(free)
            problems.append(
                f"roles -> {name} -> gpus: needs {need} GPU{'s' * (need != 1)} but only {left} "
                f"{'is' if left == 1 else 'are'} left unassigned; {_visible(len(visible))}"
            )
            continue
        else:
            indices, free = free[: role.replicas * tp], free[role.replicas * tp :]
        result[name] = [
            [visible[i] for i in indices[r * tp : (r + 1) * tp]] for r in range(role.replicas)
        ]
    if problems:
        raise PlanError("\n".join(problems))
    return result


def _check_sharing(owners: dict[str, list[tuple[str, str, Role]]]) -> None:
    """GPUs with several instances: every role needs a fraction, and they must fit."""
    missing: dict[str, str] = {}
    too_much: list[str] = []
    for gpu, users in owners.items():
        if len(users) < 2:
            continue
        names = ", ".join(f"`{name}`" for name, _, _ in users)
        for _, role_name, role in users:
            if role.gpu_memory_utilization is None:
                missing.setdefault(role_name, (
                    f"roles -> {role_name} -> gpu_memory_utilization: required, because "
                    f"GPU {gpu} is shared by {names}"
                ))
        fractions = [role.gpu_memory_utilization for _, _, role in users]
        if None not in fractions and sum(f or 0 for f in fractions) > 1.0 + 1e-9:
            too_much.append(
                f"GPU {gpu} is shared by {names}: their gpu_memory_utilization adds up to "
                f"{sum(f or 0 for f in fractions):.2f}, more than 1"
            )
    if missing or too_much:
        raise PlanError("\n".join([*missing.values(), *too_much]))


def _port_slots(topology: Topology, connector: Connector) -> list[EngineSlot]:
    """Each instance in role order with its HTTP port, NIXL side channel (P and D) and the EC
    connector's own ports (Mooncake control sockets, ECCPU side channels), which follow."""
    order = [(name, r) for name in ROLE_NAMES if name in topology.roles
             for r in range(topology.roles[name].replicas)]
    http_ports = free_ports(topology.ports.base, len(order), {topology.proxy.port}, "ports -> base")
    kv_count = sum(1 for name, _ in order if name in ("prefill", "decode"))
    kv_ports = free_ports(
        topology.ports.side_channel_base, kv_count, {topology.proxy.port, *http_ports},
        "ports -> side_channel_base",
    )
    side_ports = iter(kv_ports)
    has_e = "encode" in topology.roles
    ec_blocks = port_blocks(topology.ports.side_channel_base, [
        connector.port_count(name, topology.roles[name].tensor_parallel) if has_e else 0
        for name, _ in order
    ], {topology.proxy.port, *http_ports, *kv_ports}, "ports -> side_channel_base")
    return [
        EngineSlot(name, replica, index, http_ports[index],
              next(side_ports) if name in ("prefill", "decode") else None, ec_blocks[index])
        for index, (name, replica) in enumerate(order)
    ]


def _gpu_slots(topology: Topology, slots: list[EngineSlot],
               gpus: dict[str, list[list[str]]]) -> list[EngineSlot]:
    """The slots with their GPUs, and on a shared GPU the instance each starts after."""
    owners: dict[str, list[tuple[str, str, Role]]] = {}
    last_user: dict[str, str] = {}
    placed = []
    for slot in slots:
        devices = tuple(gpus[slot.role_name][slot.replica])
        after: list[str] = []
        for dev in devices:
            owners.setdefault(dev, []).append(
                (slot.name, slot.role_name, topology.roles[slot.role_name]))
            # vLLM checks at startup that its fraction of the GPU is free: start after the
            # previous instance on each shared GPU has taken its share.
            if dev in last_user and last_user[dev] not in after:
                after.append(last_user[dev])
            last_user[dev] = slot.name
        placed.append(dataclasses.replace(slot, gpus=devices, start_after=tuple(after)))
    _check_sharing(owners)
    return placed


def plan(
    topology: Topology,
    state_dir: Path,
    *,
    visible_gpus: Sequence[str] = (),
    vllm_version: str = "unknown",
    python: str = sys.executable,
    cpu_count: int = 1,
    internal_key: str | None = None,
) -> Plan:
    """Place the topology: one LaunchSpec per instance plus the proxy. Pure.

    The instances require a key (their VLLM_API_KEY, every route but /health), so nobody on
    the machine goes around the proxy to them: `internal_key`, the run's own (`up` makes one
    for every run), is put in each instance's env and the proxy's. Without one (render), the
    instances require a key only when the proxy has an api_key, and the env is left to
    whoever supplies it (a Secret).
    """
    connector = connector_for(topology.cache.connector)
    namespace = compute_namespace(topology, vllm_version)
    gpus = _assign_gpus(topology, visible_gpus) if topology.device == "cuda" else None
    slots = _port_slots(topology, connector)
    if gpus is not None:
        slots = _gpu_slots(topology, slots, gpus)
    engines = Engines(
        topology, connector, state_dir, namespace, tuple(engine_command(topology, python)),
        PROBE_PATHS if has_quiet_probes(vllm_version) else (),
        internal_key is not None or has_api_key(topology.proxy),
    )
    specs = [
        engine_spec(engines, slot, engine_env(topology, connector, state_dir, slot, cpu_count,
                                                len(slots), internal_key))
        for slot in slots
    ]
    proxy = proxy_spec(topology, state_dir, specs, python, namespace, internal_key)
    store_dir = topology.cache.dir / namespace
    return Plan(
        name=topology.name, mode=topology.mode, state_dir=state_dir, namespace=namespace,
        store_dir=store_dir, model_name=topology.model_name,
        instances=tuple(specs), proxy=proxy, ec_connector=topology.cache.connector,
        notes=tuple(connector.notes(topology.cache, topology.roles, store_dir, specs)),
    )


def proxy_config(topology: Topology, instances: Sequence[LaunchSpec],
                 upstream_api_key: str | None = None, namespace: str = "") -> ProxyConfig:
    """The proxy's knobs: topology.proxy mapped by name (`x` or `x_s`), plus the instances
    (and the key they require) and, given the namespace, what it needs of the EC connector
    (the store it looks items up in, Mooncake's sockets)."""
    names = {f.name for f in dataclasses.fields(ProxyConfig)}
    knobs: dict[str, Any] = {}
    for key, value in topology.proxy.model_dump(exclude={"api_key_file"}).items():
        knobs[key if key in names else f"{key}_s"] = value
    for spec in instances:  # each role's instances go to the ProxyConfig field of its name
        knobs[spec.role] = (*knobs.get(spec.role, ()), spec.url)
    connector = connector_for(topology.cache.connector)
    knobs.update(connector.proxy_knobs(topology.cache, topology.roles, instances, namespace))
    return ProxyConfig(models=(topology.model_name,), upstream_api_key=upstream_api_key, **knobs)


def proxy_spec(
    topology: Topology, state_dir: Path, specs: list[LaunchSpec], python: str, namespace: str,
    internal_key: str | None,
) -> LaunchSpec:
    config = proxy_config(topology, specs, internal_key, namespace)
    return LaunchSpec(
        name=PROXY_NAME, role=PROXY_ROLE,
        command=tuple(python if part == "{python}" else part for part in PROXY_COMMAND),
        host=config.host, port=config.port, args=tuple(config.to_argv(exclude=("host", "port"))),
        env=config.env(), log_path=state_dir / "logs" / f"{PROXY_NAME}.log",
    )
