"""The EC connector a topology names (`cache.connector`), one object each: epdctl's store, one
of vLLM's own, or `module.path:ClassName`. Each says what it needs in ports and env, which
settings cannot work with it, each instance's --ec-transfer-config, the proxy's knobs for it
and what `up --dry-run` says of it. Pure; it knows the `cache` section, never a Topology (the
schema asks it for its refusals; the names alone: topology/ec_names.py)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epdctl.launch.spec import HOST
from epdctl.topology.ec_names import CPU, EXAMPLE, MOONCAKE, OURS, split
from epdctl.units import format_bytes

if TYPE_CHECKING:
    from epdctl.launch.spec import LaunchSpec
    from epdctl.topology.sections import Cache

# ECExampleConnector keeps each item under this path (see epdctl.cache.example_files).
EXAMPLE_PATH_KEY = "shared_storage_path"
# ECCPUConnector: E's side channel (vllm/envs.py), and the runner it demands (cpu/connector.py).
SIDE_HOST_ENV = "VLLM_EC_SIDE_CHANNEL_HOST"
SIDE_PORT_ENV = "VLLM_EC_SIDE_CHANNEL_PORT"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
MOONCAKE_EXTRA: Mapping[str, Any] = {"mooncake_protocol": "tcp"}
_WHERE = "cache -> connector"
_UNUSED = "cache.capacity, ttl and grace do not apply (epdctl's janitor does not run)"


class Connector:
    """A connector vLLM loads by name, with nothing of epdctl's around it (the base)."""

    uses_store = True
    """Whether it keeps items under `cache.dir` (epdctl's store, ECExampleConnector's files,
    or possibly one of your own): then `up` makes and checks the namespace's directory
    before any engine starts. Mooncake and ECCPU keep nothing there."""
    planned_keys: Mapping[str, str] = {}
    """What epdctl plans itself in ec_connector_extra_config: the setting it comes from."""

    def __init__(self, name: str) -> None:
        self.name = name

    def problems(self, extra_config: Mapping[str, object], device: str, roles: Collection[str],
                 encode_tensor_parallel: int | None) -> list[str]:
        """Settings that cannot work, one line each (empty: fine). `roles`: the topology's
        role names; `encode_tensor_parallel`: None without an encode role."""
        return [f"cache -> extra_config: {key} is planned by epdctl for {self.name} ("
                f"{'under' if field == 'cache.dir' else 'from'} {field}); set {field} instead"
                for key, field in self.planned_keys.items() if key in extra_config]

    def port_count(self, role: str, tensor_parallel: int) -> int:
        """Ports the connector binds on one instance of `role`."""
        return 0

    def engine_env(self, role: str, ec_ports: Sequence[int]) -> dict[str, str]:
        """What the connector needs in an instance's environment."""
        return {}

    def transfer_config(self, cache: Cache, role: str, engine_id: str, namespace: str,
                        ec_ports: Sequence[int] = ()) -> dict:
        """The --ec-transfer-config of one instance: producer on E, consumer on the others."""
        module, name = split(self.name)
        config: dict[str, Any] = {"ec_connector": name}
        if module is not None:
            config["ec_connector_module_path"] = module
        is_producer = role == "encode"
        config["ec_role"] = "ec_producer" if is_producer else "ec_consumer"
        config["engine_id"] = engine_id
        if not is_producer:
            config.update(self._consumer_config(ec_ports))
        extra = {**self._extra_config(cache, namespace), **cache.extra_config}
        if extra:
            config["ec_connector_extra_config"] = extra
        return config

    def _consumer_config(self, ec_ports: Sequence[int]) -> dict[str, Any]:
        return {}

    def _extra_config(self, cache: Cache, namespace: str) -> dict[str, Any]:
        """What epdctl plans in ec_connector_extra_config (the topology's goes over it)."""
        return {}

    def proxy_knobs(self, cache: Cache, roles: Collection[str], instances: Sequence[LaunchSpec],
                    namespace: str = "") -> dict[str, Any]:
        """ProxyConfig knobs the connector asks for."""
        return {}

    def notes(self, cache: Cache, roles: Collection[str], store_dir: Path,
              instances: Sequence[LaunchSpec]) -> list[str]:
        """What `up --dry-run` says about the connector (one line each)."""
        if "encode" not in roles:
            return [f"cache.connector {self.name} is not used: there is no encode role"]
        return self._notes(cache, store_dir, instances)

    def _notes(self, cache: Cache, store_dir: Path,
               instances: Sequence[LaunchSpec]) -> list[str]:
        module, name = split(self.name)
        return [f"EC transfer: {name} from `{module}` (your connector; cache.extra_config is "
                "its ec_connector_extra_config). epdctl's namespace does not reach it: unless "
                "the storage you give it is per model, another model's entry could be hit; "
                f"{_UNUSED}; `verify` cannot see its hits, `cache inspect/clean` do not know "
                "its storage, and vLLM imports the module only when the engines start "
                "(`epdctl doctor` checks it sooner)."]


class Ours(Connector):
    """epdctl's shared-memory store (cache/, connector/)."""

    planned_keys = {"store_dir": "cache.dir", "namespace": "cache.dir",
                    "capacity_bytes": "cache.capacity"}

    def _extra_config(self, cache: Cache, namespace: str) -> dict[str, Any]:
        # The capacity: E keeps spare pre-faulted files within it (cache/_prefault.py).
        return {"store_dir": str(cache.dir), "namespace": namespace,
                "capacity_bytes": cache.capacity}

    def proxy_knobs(self, cache: Cache, roles: Collection[str], instances: Sequence[LaunchSpec],
                    namespace: str = "") -> dict[str, Any]:
        """With a namespace: where the proxy looks items up before E."""
        if namespace and "encode" in roles:
            return {"store_dir": str(cache.dir), "namespace": namespace}
        return {}

    def notes(self, cache: Cache, roles: Collection[str], store_dir: Path,
              instances: Sequence[LaunchSpec]) -> list[str]:
        return []


class Example(Connector):
    """vLLM's ECExampleConnector: one safetensors file per item under the namespace."""

    planned_keys = {EXAMPLE_PATH_KEY: "cache.dir"}

    def _extra_config(self, cache: Cache, namespace: str) -> dict[str, Any]:
        return {EXAMPLE_PATH_KEY: str(cache.dir / namespace)}

    def _notes(self, cache: Cache, store_dir: Path,
               instances: Sequence[LaunchSpec]) -> list[str]:
        return [f"EC transfer: {EXAMPLE}, one safetensors file per item under {store_dir} "
                "(the namespace is in the path, so another model's files are never hit); "
                f"nothing is evicted: {_UNUSED}; `down` removes the files unless "
                "cache.keep_on_down."]


class Mooncake(Connector):
    """vLLM's ECMooncakeConnector: E pushes each item into the PD the proxy picked first."""

    uses_store = False

    def problems(self, extra_config: Mapping[str, object], device: str, roles: Collection[str],
                 encode_tensor_parallel: int | None) -> list[str]:
        lines = super().problems(extra_config, device, roles, encode_tensor_parallel)
        if device == "cpu":
            lines.append(f"{_WHERE}: {MOONCAKE} is planned for `device: cuda` only (its "
                         "transfer buffers are CUDA memory); on CPU use " + EXAMPLE)
        elif encode_tensor_parallel is not None and "prefill" in roles:
            # vLLM's example proxy refuses P|D too: a push lands on the one consumer named
            # before E runs, and its consumer routing is defined for E+PD only.
            lines.append(f"{_WHERE}: {MOONCAKE} works with E|PD only (vLLM's Mooncake consumer "
                         f"routing does not cover P|D); use {CPU}, {EXAMPLE} or {OURS}")
        if encode_tensor_parallel is not None and encode_tensor_parallel > 1:
            lines.append(f"roles -> encode -> tensor_parallel: {MOONCAKE} producers need 1, "
                         f"not {encode_tensor_parallel}; use more encode replicas instead")
        return lines

    def port_count(self, role: str, tensor_parallel: int) -> int:
        # A consumer's control socket per TP rank, from ec_port on.
        return tensor_parallel if role != "encode" else 0

    def _consumer_config(self, ec_ports: Sequence[int]) -> dict[str, Any]:
        return {"ec_ip": HOST, "ec_port": ec_ports[0]}

    def _extra_config(self, cache: Cache, namespace: str) -> dict[str, Any]:
        return dict(MOONCAKE_EXTRA)

    def proxy_knobs(self, cache: Cache, roles: Collection[str], instances: Sequence[LaunchSpec],
                    namespace: str = "") -> dict[str, Any]:
        """Every PD's URL with its control socket (first rank)."""
        consumers = tuple(
            (s.url, f"tcp://{HOST}:{s.ec_ports[0]}") for s in instances
            if s.ec_config is not None and s.ec_config.get("ec_connector") == MOONCAKE
            and s.ec_config.get("ec_role") == "ec_consumer"
        )
        return {"ec_protocol": "mooncake", "ec_consumers": consumers} if consumers else {}

    def _notes(self, cache: Cache, store_dir: Path,
               instances: Sequence[LaunchSpec]) -> list[str]:
        ports = ", ".join(f"{s.name} {s.ec_ports[0]}" + (f"-{s.ec_ports[-1]}" if
                                                         len(s.ec_ports) > 1 else "")
                          for s in instances if s.ec_ports)
        return [f"EC transfer: {MOONCAKE} over tcp on {HOST}: the proxy picks the PD first "
                f"and E pushes each item into it (control ports: {ports}); nothing is kept "
                f"between requests, so epdctl's namespace is not needed; {_UNUSED}; a PD "
                "cannot encode media itself, so an encoder failure is a 502."]


class Cpu(Connector):
    """vLLM's ECCPUConnector: consumers pull each item over NIXL from E's side channel."""

    uses_store = False

    def problems(self, extra_config: Mapping[str, object], device: str, roles: Collection[str],
                 encode_tensor_parallel: int | None) -> list[str]:
        lines = super().problems(extra_config, device, roles, encode_tensor_parallel)
        if device == "cpu":
            lines.append(f"{_WHERE}: {CPU} cannot run on `device: cpu`: it needs vLLM's V2 "
                         "model runner and CUDA (streams, events, cudaHostRegister; see vLLM's "
                         f"ec_connector/cpu/); use {EXAMPLE}")
        return lines

    def port_count(self, role: str, tensor_parallel: int) -> int:
        return 1 if role == "encode" else 0  # the producer's side channel consumers pull from

    def engine_env(self, role: str, ec_ports: Sequence[int]) -> dict[str, str]:
        env = {V2_RUNNER_ENV: "1"}
        if role == "encode":
            env.update({SIDE_HOST_ENV: HOST, SIDE_PORT_ENV: str(ec_ports[0])})
        return env

    def _extra_config(self, cache: Cache, namespace: str) -> dict[str, Any]:
        return {"ec_cpu_bytes": cache.capacity, "ec_enable_nixl": True}

    def _notes(self, cache: Cache, store_dir: Path,
               instances: Sequence[LaunchSpec]) -> list[str]:
        side = next((s.ec_ports[0] for s in instances if s.role == "encode"), None)
        return [f"EC transfer: {CPU}, one region of {format_bytes(cache.capacity)} "
                "in /dev/shm per instance (cache.capacity), pulled over NIXL from E's side "
                f"channel (port {side}); V2 model runner ({V2_RUNNER_ENV}=1). It checks its own "
                "compatibility hash (vLLM version, model, dtype), not epdctl's namespace: "
                "flags such as --mm-processor-kwargs are not in it; ttl and grace do not apply."]


_KINDS: dict[str, type[Connector]] = {OURS: Ours, EXAMPLE: Example, MOONCAKE: Mooncake,
                                      CPU: Cpu}


def connector_for(name: str) -> Connector:
    """The object for `cache.connector` (a checked name); `module:Class` is the base one."""
    return _KINDS.get(name, Connector)(name)
