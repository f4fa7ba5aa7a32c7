"""The EC connector a topology names (`cache.connector`): epdctl's store, one of vLLM's own,
or `module.path:ClassName`: their names, what each needs in env and ports, and the settings
that cannot work (pure; a plan's --ec-transfer-config and notes: plan_ec.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from epdctl import cache
from epdctl.spec import HOST

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


def problems(connector: str, extra_config: Mapping[str, object], device: str,
             roles: Sequence[str], encode_tensor_parallel: int | None) -> list[str]:
    """Connector settings that cannot work, one line each (empty: fine). `roles`: the
    topology's role names; `encode_tensor_parallel`: None without an encode role."""
    where = "cache -> connector"
    lines = [f"cache -> extra_config: {key} is planned by epdctl for {connector} ("
             f"{'under' if field == 'cache.dir' else 'from'} {field}); set {field} instead"
             for key, field in _PLANNED_KEYS.get(connector, {}).items()
             if key in extra_config]
    has_encode = encode_tensor_parallel is not None
    if connector == MOONCAKE:
        if device == "cpu":
            lines.append(f"{where}: {MOONCAKE} is planned for `device: cuda` only (its "
                         "transfer buffers are CUDA memory); on CPU use " + EXAMPLE)
        elif has_encode and "prefill" in roles:
            # vLLM's example proxy refuses P|D too: a push lands on the one consumer named
            # before E runs, and its consumer routing is defined for E+PD only.
            lines.append(f"{where}: {MOONCAKE} works with E|PD only (vLLM's Mooncake consumer "
                         f"routing does not cover P|D); use {CPU}, {EXAMPLE} or {OURS}")
        if encode_tensor_parallel is not None and encode_tensor_parallel > 1:
            lines.append(f"roles -> encode -> tensor_parallel: {MOONCAKE} producers need 1, "
                         f"not {encode_tensor_parallel}; use more encode replicas instead")
    if connector == CPU and device == "cpu":
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


def engine_env(connector: str, role: str, ec_ports: Sequence[int]) -> dict[str, str]:
    """What the connector needs in an instance's environment."""
    if connector != CPU:
        return {}
    env = {V2_RUNNER_ENV: "1"}
    if role == "encode":
        env.update({SIDE_HOST_ENV: HOST, SIDE_PORT_ENV: str(ec_ports[0])})
    return env
