"""The EC connector's part of a plan: each instance's --ec-transfer-config, the proxy's
knobs for it, and what `up --dry-run` says of it (the connectors' own facts:
ec_connectors.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from epdctl.ec_connectors import (
    CPU,
    EXAMPLE,
    EXAMPLE_PATH_KEY,
    MOONCAKE,
    MOONCAKE_EXTRA,
    OURS,
    V2_RUNNER_ENV,
    split,
)
from epdctl.spec import HOST
from epdctl.units import format_bytes

if TYPE_CHECKING:
    from epdctl.spec import LaunchSpec
    from epdctl.topology import Topology


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
