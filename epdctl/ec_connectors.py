"""The EC connector a topology names (`cache.connector`): epdctl's store, one of vLLM's own,
or `module.path:ClassName`; what each needs in --ec-transfer-config, env and ports (pure)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epdctl import cache
from epdctl.spec import HOST
from epdctl.units import format_bytes

if TYPE_CHECKING:
    from epdctl.spec import LaunchSpec
    from epdctl.topology import Topology

OURS = cache.CONNECTOR_NAME
EXAMPLE = "ECExampleConnector"
MOONCAKE = "ECMooncakeConnector"
CPU = "ECCPUConnector"
BUILTIN = (EXAMPLE, MOONCAKE, CPU)
"""vLLM's own (vllm/distributed/ec_transfer/ec_connector/factory.py registers them)."""
NAMES = (OURS, *BUILTIN)
# ECExampleConnector keeps each item under this path (see epdctl.cache.example_files).
EXAMPLE_PATH_KEY = "shared_storage_path"
# ECCPUConnector: E's side channel (vllm/envs.py), and the runner it demands (cpu/connector.py).
SIDE_HOST_ENV = "VLLM_EC_SIDE_CHANNEL_HOST"
SIDE_PORT_ENV = "VLLM_EC_SIDE_CHANNEL_PORT"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
MOONCAKE_EXTRA: Mapping[str, Any] = {"mooncake_protocol": "tcp"}
# What epdctl plans itself in ec_connector_extra_config, per connector: the setting it comes
# from.
_PLANNED_KEYS = {
    OURS: {"store_dir": "cache.dir", "namespace": "cache.dir", "capacity_bytes": "cache.capacity"},
    EXAMPLE: {EXAMPLE_PATH_KEY: "cache.dir"},
}
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CUSTOM = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT})")


def check_name(value: str) -> str:
    """cache.connector's syntax: a name epdctl knows, or module.path:ClassName."""
    if value in NAMES:
        return value
    match = _CUSTOM.fullmatch(value)
    if match is None:
        raise ValueError(f"expected {', '.join(NAMES)} or module.path:ClassName, got `{value}`")
    module, name = match.groups()
    if name in NAMES:
        # vLLM's factory looks names up in its registry first and would ignore the module.
        whose = "epdctl's" if name == OURS else "vLLM's"
        raise ValueError(f"`{name}` is {whose} own connector name, so vLLM would load that "
                         f"one and ignore `{module}`; give your class another name")
    return value


def split(connector: str) -> tuple[str | None, str]:
    """(module path, class name); no module for a name vLLM registers itself."""
    module, sep, name = connector.rpartition(":")
    if sep:
        return module, name
    return (cache.CONNECTOR_MODULE if connector == OURS else None), connector


def is_custom(connector: str) -> bool:
    return ":" in connector


def uses_store(connector: str) -> bool:
    """Whether the connector keeps items under `cache.dir` (epdctl's store,
    ECExampleConnector's files, or possibly one of your own): then `up` makes and checks the
    namespace's directory before any engine starts. Mooncake and ECCPU keep nothing there."""
    return connector not in (MOONCAKE, CPU)


def problems(topology: Topology) -> list[str]:
    """Connector settings that cannot work, one line each (empty: fine)."""
    c, where = topology.cache, "cache -> connector"
    lines = [f"cache -> extra_config: {key} is planned by epdctl for {c.connector} ("
             f"{'under' if field == 'cache.dir' else 'from'} {field}); set {field} instead"
             for key, field in _PLANNED_KEYS.get(c.connector, {}).items()
             if key in c.extra_config]
    encode = topology.roles.get("encode")
    if c.connector == MOONCAKE:
        if topology.device == "cpu":
            lines.append(f"{where}: {MOONCAKE} is planned for `device: cuda` only (its "
                         "transfer buffers are CUDA memory); on CPU use " + EXAMPLE)
        elif encode is not None and "prefill" in topology.roles:
            # vLLM's example proxy refuses P|D too: a push lands on the one consumer named
            # before E runs, and its consumer routing is defined for E+PD only.
            lines.append(f"{where}: {MOONCAKE} works with E|PD only (vLLM's Mooncake consumer "
                         f"routing does not cover P|D); use {CPU}, {EXAMPLE} or {OURS}")
        if encode is not None and encode.tensor_parallel > 1:
            lines.append(f"roles -> encode -> tensor_parallel: {MOONCAKE} producers need 1, "
                         f"not {encode.tensor_parallel}; use more encode replicas instead")
    if c.connector == CPU and topology.device == "cpu":
        lines.append(f"{where}: {CPU} cannot run on `device: cpu`: it needs vLLM's V2 model "
                     "runner and CUDA (streams, events, cudaHostRegister; see vLLM's "
                     f"ec_connector/cpu/); use {EXAMPLE}")
    return lines


def port_count(connector: str, role: str, tensor_parallel: int) -> int:
    """Ports the connector binds on one instance of `role`."""
    if connector == MOONCAKE and role != "encode":
        return tensor_parallel  # a consumer's control socket per TP rank, from ec_port on
    if connector == CPU and role == "encode":
        return 1  # the producer's side channel that consumers pull through
    return 0


def transfer_config(topology: Topology, role: str, engine_id: str, namespace: str,
                    ec_ports: Sequence[int] = ()) -> dict:
    """The --ec-transfer-config of one instance: producer on E, consumer on the others."""
    connector = topology.cache.connector
    module, name = split(connector)
    config: dict[str, Any] = {"ec_connector": name}
    if module is not None:
        config["ec_connector_module_path"] = module
    is_producer = role == "encode"
    config["ec_role"] = "ec_producer" if is_producer else "ec_consumer"
    config["engine_id"] = engine_id
    extra: dict[str, Any] = {}
    if connector == OURS:
        # The capacity: E keeps spare pre-faulted files within it (cache/_prefault.py).
        extra = {"store_dir": str(topology.cache.dir), "namespace": namespace,
                 "capacity_bytes": topology.cache.capacity}
    elif connector == EXAMPLE:
        extra = {EXAMPLE_PATH_KEY: str(topology.cache.dir / namespace)}
    elif connector == MOONCAKE:
        extra = dict(MOONCAKE_EXTRA)
        if not is_producer:
            config.update(ec_ip=HOST, ec_port=ec_ports[0])
    elif connector == CPU:
        extra = {"ec_cpu_bytes": topology.cache.capacity, "ec_enable_nixl": True}
    extra.update(topology.cache.extra_config)
    if extra:
        config["ec_connector_extra_config"] = extra
    return config


def engine_env(connector: str, role: str, ec_ports: Sequence[int]) -> dict[str, str]:
    """What the connector needs in an instance's environment."""
    if connector != CPU:
        return {}
    env = {V2_RUNNER_ENV: "1"}
    if role == "encode":
        env.update({SIDE_HOST_ENV: HOST, SIDE_PORT_ENV: str(ec_ports[0])})
    return env


def proxy_knobs(topology: Topology, instances: Sequence[LaunchSpec],
                namespace: str = "") -> dict[str, Any]:
    """ProxyConfig knobs the connector asks for: with epdctl's store (and a namespace), where
    the proxy looks items up before E; with Mooncake, every PD's URL with its control socket
    (first rank)."""
    if topology.cache.connector == OURS:
        if namespace and "encode" in topology.roles:
            return {"store_dir": str(topology.cache.dir), "namespace": namespace}
        return {}
    consumers = tuple(
        (s.url, f"tcp://{HOST}:{s.ec_ports[0]}") for s in instances
        if s.ec_config is not None and s.ec_config.get("ec_connector") == MOONCAKE
        and s.ec_config.get("ec_role") == "ec_consumer"
    )
    return {"ec_protocol": "mooncake", "ec_consumers": consumers} if consumers else {}


def notes(topology: Topology, store_dir: Path, instances: Sequence[LaunchSpec]) -> list[str]:
    """What `up --dry-run` says about a connector other than epdctl's (one line each)."""
    connector = topology.cache.connector
    if connector == OURS:
        return []
    if "encode" not in topology.roles:
        return [f"cache.connector {connector} is not used: there is no encode role"]
    unused = "cache.capacity, ttl and grace do not apply (epdctl's janitor does not run)"
    if connector == EXAMPLE:
        return [f"EC transfer: {EXAMPLE}, one safetensors file per item under {store_dir} "
                "(the namespace is in the path, so another model's files are never hit); "
                f"nothing is evicted: {unused}; `down` removes the files unless "
                "cache.keep_on_down."]
    if connector == MOONCAKE:
        ports = ", ".join(f"{s.name} {s.ec_ports[0]}" + (f"-{s.ec_ports[-1]}" if
                                                         len(s.ec_ports) > 1 else "")
                          for s in instances if s.ec_ports)
        return [f"EC transfer: {MOONCAKE} over tcp on {HOST}: the proxy picks the PD first "
                f"and E pushes each item into it (control ports: {ports}); nothing is kept "
                f"between requests, so epdctl's namespace is not needed; {unused}; a PD "
                "cannot encode media itself, so an encoder failure is a 502."]
    if connector == CPU:
        side = next((s.ec_ports[0] for s in instances if s.role == "encode"), None)
        return [f"EC transfer: {CPU}, one region of {format_bytes(topology.cache.capacity)} "
                "in /dev/shm per instance (cache.capacity), pulled over NIXL from E's side "
                f"channel (port {side}); V2 model runner ({V2_RUNNER_ENV}=1). It checks its own "
                "compatibility hash (vLLM version, model, dtype), not epdctl's namespace: "
                "flags such as --mm-processor-kwargs are not in it; ttl and grace do not apply."]
    module, name = split(connector)
    return [f"EC transfer: {name} from `{module}` (your connector; cache.extra_config is its "
            "ec_connector_extra_config). epdctl's namespace does not reach it: unless the "
            "storage you give it is per model, another model's entry could be hit; "
            f"{unused}; `verify` cannot see its hits, `cache inspect/clean` do not know its "
            "storage, and vLLM imports the module only when the engines start "
            "(`epdctl doctor` checks it sooner)."]
