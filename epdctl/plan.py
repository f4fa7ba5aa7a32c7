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

from epdctl import cache, ipc, plan_ec
from epdctl import ec_connectors as ec_conn
from epdctl.engines.guard import KEY_ENV
from epdctl.errors import PlanError
from epdctl.keys import has_api_key
from epdctl.proxy.config import ProxyConfig
from epdctl.spec import HOST, PROBE_PATHS, PROXY_ROLE, LaunchSpec, Plan
from epdctl.topology import (
    NAMESPACE_FLAGS,
    ROLE_NAMES,
    ROLE_PREFIX,
    Role,
    Topology,
    canonical_flag,
    flag_value,
)

__all__ = [
    "HOST", "NAMESPACE_FLAGS", "LaunchSpec", "Plan", "compute_namespace", "ec_transfer_config",
    "flag_value", "kv_transfer_config", "plan", "proxy_config",
]

CPU_ENGINE_COMMAND = ("{python}", "-m", "epdctl.engines.vllm_cpu", "serve")
GPU_ENGINE_COMMAND = ("vllm", "serve")
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


def ec_transfer_config(topology: Topology, role: str, namespace: str, engine_id: str,
                       ec_ports: Sequence[int] = ()) -> dict:
    """The --ec-transfer-config for one instance, for the topology's cache.connector."""
    return plan_ec.transfer_config(topology, role, engine_id, namespace, ec_ports)


def kv_transfer_config(topology: Topology, role: str, state_dir: Path) -> dict:
    """The --kv-transfer-config for a prefill (producer) or decode (consumer) instance."""
    default = "ExampleConnector" if topology.device == "cpu" else "NixlConnector"
    connector = topology.kv.connector or default
    extra = dict(topology.kv.extra_config)
    if connector == "ExampleConnector":
        extra.setdefault("shared_storage_path", str(state_dir / "kv"))
    config: dict = {
        "kv_connector": connector,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
    }
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def _engine_command(topology: Topology, python: str) -> list[str]:
    if topology.engine.command:
        return list(topology.engine.command)
    base = CPU_ENGINE_COMMAND if topology.device == "cpu" else GPU_ENGINE_COMMAND
    return [python if part == "{python}" else part for part in base]


def _ports(start: int, count: int, taken: set[int], what: str) -> list[int]:
    """count ports from start, skipping taken ones."""
    ports: list[int] = []
    port = start
    while len(ports) < count:
        if port > 65535:
            raise PlanError(f"{what}: {count} port(s) from {start} do not fit below 65536")
        if port not in taken:
            ports.append(port)
        port += 1
    return ports


def _port_blocks(start: int, sizes: Sequence[int], taken: set[int], what: str
                 ) -> list[tuple[int, ...]]:
    """Per size, that many consecutive ports from start on (none for 0), skipping taken ones."""
    blocks: list[tuple[int, ...]] = []
    port = start
    for size in sizes:
        while size and any(p in taken for p in range(port, port + size)):
            port += 1
        if port + size - 1 > 65535:
            raise PlanError(f"{what}: {sum(sizes)} port(s) from {start} do not fit below 65536")
        blocks.append(tuple(range(port, port + size)))
        port += size
    return blocks


# One CPU worker runs in the engine core's process, as vLLM runs a TP1 worker on a GPU: the
# CPU platform otherwise starts it in a process of its own (the `mp` executor), a third
# process per instance that imports vLLM again (a third of a start's CPU time and ~0.7 GiB
# RSS). vLLM's CPU platform keeps the in-process (`uni`) executor when this is "0"; it is
# read nowhere else by `vllm serve`. A topology's engine/role env can set it back to "1".
CPU_IN_PROCESS_WORKER = ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _cpu_binding(index: int, instances: int, cpu_count: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: an equal slice of the CPUs per instance.

    vLLM's CPU default binds every server to the same cores, so concurrent instances
    would fight over them.
    """
    cpu_count = max(cpu_count, 1)
    per = cpu_count // instances
    if per <= 1:
        return str(index % cpu_count)
    return f"{index * per}-{index * per + per - 1}"


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
    is_key_required = internal_key is not None or has_api_key(topology.proxy)
    namespace = compute_namespace(topology, vllm_version)
    gpus = _assign_gpus(topology, visible_gpus) if topology.device == "cuda" else {}
    order = [(name, r) for name in ROLE_NAMES if name in topology.roles
             for r in range(topology.roles[name].replicas)]
    http_ports = _ports(topology.ports.base, len(order), {topology.proxy.port}, "ports -> base")
    kv_count = sum(1 for name, _ in order if name in ("prefill", "decode"))
    kv_ports = _ports(
        topology.ports.side_channel_base, kv_count, {topology.proxy.port, *http_ports},
        "ports -> side_channel_base",
    )
    side_ports = iter(kv_ports)
    # The EC connector's own ports (Mooncake control sockets, ECCPU side channels) follow.
    has_e = "encode" in topology.roles
    ec_blocks = _port_blocks(topology.ports.side_channel_base, [
        ec_conn.port_count(topology.cache.connector, name, topology.roles[name].tensor_parallel)
        if has_e else 0 for name, _ in order
    ], {topology.proxy.port, *http_ports, *kv_ports}, "ports -> side_channel_base")
    command = _engine_command(topology, python)
    quiet = PROBE_PATHS if has_quiet_probes(vllm_version) else ()
    owners: dict[str, list[tuple[str, str, Role]]] = {}
    last_user: dict[str, str] = {}
    specs: list[LaunchSpec] = []
    for index, (role_name, replica) in enumerate(order):
        role = topology.roles[role_name]
        name = f"{ROLE_PREFIX[role_name]}-{replica}"
        port = http_ports[index]
        env = {**topology.engine.env, **role.env}
        # vLLM's IPC sockets and temp files in a private directory of the run (epdctl.ipc).
        env = {**ipc.engine_env(state_dir, name), **env}
        ec = None
        if has_e:
            ec = ec_transfer_config(topology, role_name, namespace, f"{topology.name}-{name}",
                                    ec_blocks[index])
            env.update(ec_conn.engine_env(topology.cache.connector, role_name, ec_blocks[index]))
        side, kv = None, None
        if role_name in ("prefill", "decode"):
            kv = kv_transfer_config(topology, role_name, state_dir)
            side = next(side_ports)
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side)
        devices: tuple[str, ...] = ()
        after: list[str] = []
        if topology.device == "cuda":
            devices = tuple(gpus[role_name][replica])
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            # Indices mean what nvidia-smi and NVML show, not CUDA's fastest-first order.
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
            for dev in devices:
                owners.setdefault(dev, []).append((name, role_name, role))
                # vLLM checks at startup that its fraction of the GPU is free: start after
                # the previous instance on each shared GPU has taken its share.
                if dev in last_user and last_user[dev] not in after:
                    after.append(last_user[dev])
                last_user[dev] = name
        else:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", _cpu_binding(index, len(order), cpu_count))
            env.setdefault(*CPU_IN_PROCESS_WORKER)  # `device: cpu` is TP1 only
        if internal_key:
            env[KEY_ENV] = internal_key
        specs.append(LaunchSpec(
            name=name, role=role_name, command=(*command, topology.model), port=port,
            log_path=state_dir / "logs" / f"{name}.log", args=(*topology.engine.args, *role.args),
            served_model_name=topology.served_model_name,
            tensor_parallel=role.tensor_parallel,
            gpu_memory_utilization=role.gpu_memory_utilization, ec_config=ec, kv_config=kv,
            env=env, gpus=devices, side_channel_port=side, start_after=tuple(after),
            ec_ports=ec_blocks[index], is_key_required=is_key_required,
            quiet_paths=quiet, log_requests=topology.engine.log_requests,
        ))
    _check_sharing(owners)
    proxy = _proxy_spec(topology, state_dir, specs, python, namespace, internal_key)
    store_dir = topology.cache.dir / namespace
    return Plan(
        name=topology.name, mode=topology.mode, state_dir=state_dir, namespace=namespace,
        store_dir=store_dir, model_name=topology.model_name,
        instances=tuple(specs), proxy=proxy, ec_connector=topology.cache.connector,
        notes=tuple(plan_ec.notes(topology, store_dir, specs)),
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
    knobs.update(plan_ec.proxy_knobs(topology, instances, namespace))
    return ProxyConfig(models=(topology.model_name,), upstream_api_key=upstream_api_key, **knobs)


def _proxy_spec(
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
