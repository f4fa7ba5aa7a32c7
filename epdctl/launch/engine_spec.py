"""One engine instance as a LaunchSpec: its place (EngineSlot: role, replica, ports, GPUs)
and what every instance of a run shares (Engines) made into its argv's parts and env. plan()
places a whole topology with it; launch.change places one more instance of a running one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from epdctl.engines.guard import KEY_ENV
from epdctl.host import ipc
from epdctl.launch.connectors import Connector
from epdctl.launch.spec import LaunchSpec
from epdctl.topology.model import ROLE_PREFIX, RoleName, Topology

CPU_ENGINE_COMMAND = ("{python}", "-m", "epdctl.engines.vllm_cpu", "serve")
GPU_ENGINE_COMMAND = ("vllm", "serve")


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


def engine_command(topology: Topology, python: str) -> list[str]:
    if topology.engine.command:
        return list(topology.engine.command)
    base = CPU_ENGINE_COMMAND if topology.device == "cpu" else GPU_ENGINE_COMMAND
    return [python if part == "{python}" else part for part in base]


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


@dataclasses.dataclass(frozen=True)
class EngineSlot:
    """One engine instance's place: its role, replica, ports and GPUs."""

    role_name: RoleName
    replica: int
    index: int
    port: int
    side_port: int | None
    ec_ports: tuple[int, ...]
    gpus: tuple[str, ...] = ()
    start_after: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{ROLE_PREFIX[self.role_name]}-{self.replica}"


def engine_env(topology: Topology, connector: Connector, state_dir: Path, slot: EngineSlot,
                cpu_count: int, instances: int, internal_key: str | None) -> dict[str, str]:
    role = topology.roles[slot.role_name]
    env = {**topology.engine.env, **role.env}
    # vLLM's IPC sockets and temp files in a private directory of the run (epdctl.host.ipc).
    env = {**ipc.engine_env(state_dir, slot.name), **env}
    if "encode" in topology.roles:
        env.update(connector.engine_env(slot.role_name, slot.ec_ports))
    if slot.side_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(slot.side_port)
    if topology.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(slot.gpus)
        # Indices mean what nvidia-smi and NVML show, not CUDA's fastest-first order.
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    else:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                       _cpu_binding(slot.index, instances, cpu_count))
        env.setdefault(*CPU_IN_PROCESS_WORKER)  # `device: cpu` is TP1 only
    if internal_key:
        env[KEY_ENV] = internal_key
    return env


@dataclasses.dataclass(frozen=True)
class Engines:
    """What every engine instance of one plan shares."""

    topology: Topology
    connector: Connector
    state_dir: Path
    namespace: str
    command: tuple[str, ...]
    quiet_paths: tuple[str, ...]
    is_key_required: bool


def engine_spec(engines: Engines, slot: EngineSlot, env: dict[str, str]) -> LaunchSpec:
    topology, name = engines.topology, slot.name
    role = topology.roles[slot.role_name]
    ec = None
    if "encode" in topology.roles:
        ec = engines.connector.transfer_config(topology.cache, slot.role_name,
                                               f"{topology.name}-{name}", engines.namespace,
                                               slot.ec_ports)
    kv = None
    if slot.role_name in ("prefill", "decode"):
        kv = kv_transfer_config(topology, slot.role_name, engines.state_dir)
    return LaunchSpec(
        name=name, role=slot.role_name, command=(*engines.command, topology.model),
        port=slot.port, log_path=engines.state_dir / "logs" / f"{name}.log",
        args=(*topology.engine.args, *role.args), served_model_name=topology.served_model_name,
        tensor_parallel=role.tensor_parallel,
        gpu_memory_utilization=role.gpu_memory_utilization, ec_config=ec, kv_config=kv,
        env=env, gpus=slot.gpus, side_channel_port=slot.side_port,
        start_after=slot.start_after, ec_ports=slot.ec_ports,
        is_key_required=engines.is_key_required, quiet_paths=engines.quiet_paths,
        log_requests=topology.engine.log_requests,
    )
