"""render_k8s(): a topology as Kubernetes manifests, from the same plan `up` runs locally."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from epdctl import cache
from epdctl.errors import RenderError
from epdctl.launch.plan import LaunchSpec, plan, proxy_config
from epdctl.launch.spec import transfer_args
from epdctl.render import _manifests as m
from epdctl.render import _volumes
from epdctl.render._notes import notes as _notes
from epdctl.render.options import K8sOptions
from epdctl.topology.keys import literal_key
from epdctl.topology.model import ROLE_NAMES, ROLE_PREFIX, RoleName, Topology

MOONCAKE_PORT = 14579
# Env the local plan uses to share one machine; pods get whole GPUs and their own ports.
_LOCAL_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_EC_SIDE_CHANNEL_HOST",
    "VLLM_EC_SIDE_CHANNEL_PORT",
    "VLLM_RPC_BASE_PATH",  # a directory of the local run, and its temp files (epdctl.host.ipc)
    "TMPDIR",
    "TORCHINDUCTOR_CACHE_DIR",
)


@dataclass(frozen=True)
class Rendering:
    """The manifests, and how they differ from what `up` would start locally."""

    objects: tuple[dict[str, Any], ...]
    notes: tuple[str, ...] = field(default=())


def escape(value: str) -> str:
    """Keep kubelet from expanding `$(VAR)` in a user's argument: the plan passes it literally."""
    return value.replace("$(", "$$(")


def _ec_config(local: Mapping[str, Any], connector: str, topology: Topology
               ) -> tuple[dict, list]:
    """The cluster EC config for one instance, and the env it needs."""
    config: dict[str, Any] = {
        "ec_connector": connector,
        "ec_role": local["ec_role"],
        "engine_id": "$(POD_NAME)",
    }
    env: list[dict[str, Any]] = []
    if connector == "ECMooncakeConnector":
        # The consumer's control socket must be reachable from E on another node.
        config.update(ec_ip="$(POD_IP)", ec_port=MOONCAKE_PORT)
        config["ec_connector_extra_config"] = {"mooncake_protocol": "tcp"}
    elif connector == "ECCPUConnector":
        config["ec_connector_extra_config"] = {
            "ec_cpu_bytes": topology.cache.capacity,
            "ec_enable_nixl": True,
        }
        env.append(m.env_value("VLLM_EC_SIDE_CHANNEL_HOST", "$(POD_IP)"))
    if connector == topology.cache.connector and topology.cache.extra_config:
        # The topology's own connector: its extra config goes to the pods as it goes locally.
        config["ec_connector_extra_config"] = {**config.get("ec_connector_extra_config", {}),
                                               **topology.cache.extra_config}
    return config, env


def _kv_config(local: Mapping[str, Any]) -> tuple[dict, list]:
    """The cluster KV config: file-based ExampleConnector cannot cross pods, NIXL can."""
    config = dict(local)
    if config["kv_connector"] == "ExampleConnector":
        config["kv_connector"] = "NixlConnector"
        config.pop("kv_connector_extra_config", None)
    env: list[dict[str, Any]] = []
    if config["kv_connector"].startswith("Nixl"):
        env = [m.env_value("VLLM_NIXL_SIDE_CHANNEL_HOST", "$(POD_IP)"),
               m.env_value("VLLM_NIXL_SIDE_CHANNEL_PORT", str(m.NIXL_PORT))]
    return config, env


def _engine_role(
    topology: Topology, role_name: RoleName, spec: LaunchSpec, options: K8sOptions
) -> m.EngineRole:
    """One role's pods, from its first replica's local launch spec."""
    role = topology.roles[role_name]
    # The pod binds every interface on the cluster's port; the transfer configs are the
    # cluster's (their `$(POD_IP)` references are meant for kubelet, so not escaped).
    # Not epdctl's guard middleware: the engine image need not have epdctl. vLLM's own
    # check of VLLM_API_KEY (from the Secret) covers the /v1 routes; see the notes.
    pod = replace(spec, host="0.0.0.0", port=m.HTTP_PORT, ec_config=None, kv_config=None,
                  is_key_required=False)
    argv = [escape(a) for a in pod.argv]
    env = [m.env_value(k, escape(v)) for k, v in spec.env.items() if k not in _LOCAL_ENV]
    env += m.engine_key_env(topology)
    storage = _volumes.pod_storage(topology, spec.env, options)
    env += storage.env
    ports = []
    ec = kv = None
    if spec.ec_config is not None:
        ec, ec_env = _ec_config(spec.ec_config, options.ec_connector, topology)
        env += ec_env
        if options.ec_connector == "ECMooncakeConnector":
            ports.append(("ec-control", MOONCAKE_PORT))
    if spec.kv_config is not None:
        kv, kv_env = _kv_config(spec.kv_config)
        env += kv_env
        if kv_env:
            ports.append(("nixl", m.NIXL_PORT))
    argv += transfer_args(ec, kv)
    per_node = options.gpus_per_node or role.tensor_parallel
    nodes = max(1, role.tensor_parallel // per_node)
    return m.EngineRole(
        role=spec.role, name=f"{topology.name}-{ROLE_PREFIX[spec.role]}", replicas=role.replicas,
        argv=tuple(argv), env=tuple(env), ports=tuple(ports),
        gpus=min(per_node, role.tensor_parallel), nodes=nodes,
        volumes=storage.volumes, mounts=storage.mounts,
    )


def _check(topology: Topology, options: K8sOptions) -> None:
    if topology.device == "cpu":
        raise RenderError(
            f"`{topology.name}` is a `device: cpu` topology: it runs on one machine only "
            "(shared-memory EC store, file-based KV); use `epdctl up`, or set `device: cuda`"
        )
    if not topology.name[0].isalpha():
        raise RenderError(
            f"name: `{topology.name}` must start with a letter to name Kubernetes Services"
        )
    if options.ec_connector == cache.CONNECTOR_NAME and "encode" in topology.roles:
        raise RenderError(
            f"--ec-connector {cache.CONNECTOR_NAME}: epdctl's shared-memory store does not "
            "cross nodes; pick a network connector such as ECMooncakeConnector"
        )
    encode = topology.roles.get("encode")
    is_split = "prefill" in topology.roles or "decode" in topology.roles
    if options.ec_connector == "ECMooncakeConnector" and encode and is_split:
        # vLLM's example proxy refuses P|D too: a push lands on the one consumer named
        # before E runs, and its consumer routing is defined for E+PD only.
        raise RenderError(
            f"`{topology.name}` is E|P|D: ECMooncakeConnector works with E|PD only (vLLM's "
            "Mooncake consumer routing does not cover P|D); render it with "
            "--ec-connector ECCPUConnector"
        )
    if options.ec_connector == "ECMooncakeConnector" and encode and encode.tensor_parallel > 1:
        raise RenderError(
            f"roles -> encode -> tensor_parallel: ECMooncakeConnector producers need 1, "
            f"not {encode.tensor_parallel}; use more encode replicas instead"
        )
    gpn = options.gpus_per_node
    for name, role in topology.roles.items():
        if gpn and role.tensor_parallel > gpn and role.tensor_parallel % gpn:
            raise RenderError(
                f"roles -> {name} -> tensor_parallel: {role.tensor_parallel} does not split "
                f"into nodes of {gpn} GPU(s) (--gpus-per-node)"
            )
    _volumes.check(topology, options)


def render_k8s(topology: Topology, source_text: str, options: K8sOptions) -> Rendering:
    """Every Kubernetes object the topology needs, and notes on what differs from `up`."""
    _check(topology, options)
    gpus = sum(r.replicas * r.tensor_parallel for r in topology.roles.values())
    explicit = [g for r in topology.roles.values() if isinstance(r.gpus, list) for g in r.gpus]
    visible = [str(i) for i in range(max([gpus, *(g + 1 for g in explicit)]))]
    local = plan(topology, Path("/epdctl"), visible_gpus=visible, python="python3")
    roles: list[m.EngineRole] = []
    for role_name in ROLE_NAMES:
        specs = [s for s in local.instances if s.role == role_name]
        if specs:
            roles.append(_engine_role(topology, role_name, specs[0], options))
    # Instance `pd-1` runs as pod `<topology>-pd-1`: the proxy keeps one URL per instance.
    urls = {s.url: role.pod_url(int(s.name.rsplit("-", 1)[1]))
            for role in roles for s in local.instances if s.role == role.role}
    objects = [m.config_map(topology, _redacted(topology, source_text))]
    if literal_key(topology.proxy):  # else its user creates the Secret (see the notes)
        objects.append(m.api_key_secret(topology))
    for role in roles:
        objects += m.engine_objects(topology, role, options.image)
    objects += m.proxy_objects(topology, _proxy_argv(topology, local.instances, roles, urls,
                                                     options), options.image)
    if options.namespace:
        for obj in objects:
            obj["metadata"]["namespace"] = options.namespace
    return Rendering(objects=tuple(objects), notes=tuple(_notes(topology, roles, options, local)))


def _proxy_argv(topology: Topology, instances: Sequence[LaunchSpec], roles: list[m.EngineRole],
                urls: Mapping[str, str], options: K8sOptions) -> list[str]:
    """The proxy's command in its pod: the local config with pod URLs, on every interface."""
    local = proxy_config(topology, instances)
    moved: dict[str, Any] = {role: tuple(urls[u] for u in getattr(local, role))
                             for role in ROLE_NAMES}
    # The local plan's Mooncake consumers (cache.connector) are local sockets: the cluster's
    # EC protocol follows --ec-connector alone.
    ec: dict[str, Any] = {"ec_protocol": "shared", "ec_consumers": (),
                          **_mooncake(topology, roles, options)}
    config = replace(local, host="0.0.0.0", port=m.HTTP_PORT, **moved, **ec)
    return ["python3", "-m", "epdctl.proxy", *config.to_argv()]


def _mooncake(topology: Topology, roles: list[m.EngineRole], options: K8sOptions
              ) -> dict[str, Any]:
    """Proxy knobs for Mooncake: every PD pod's URL paired with its control socket."""
    pd = next((r for r in roles if r.role == "prefill_decode"), None)
    if options.ec_connector != "ECMooncakeConnector" or "encode" not in topology.roles or not pd:
        return {}
    # E connects by DNS name; the PD pod binds ec_ip = its pod IP, which that name resolves to.
    consumers = tuple((pd.pod_url(i), f"tcp://{pd.pod_host(i)}:{MOONCAKE_PORT}")
                      for i in range(pd.replicas))
    return {"ec_protocol": "mooncake", "ec_consumers": consumers}


def _redacted(topology: Topology, source_text: str) -> str:
    """The topology text for the ConfigMap; the proxy's api_key goes to a Secret instead."""
    if not literal_key(topology.proxy):
        return source_text
    import yaml

    data = yaml.safe_load(source_text)
    data["proxy"].pop("api_key", None)
    return yaml.safe_dump(data, sort_keys=False)

