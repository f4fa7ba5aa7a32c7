"""Kubernetes object builders for render_k8s (plain dicts, in the order kubectl prints them)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epdctl.engines.guard import KEY_ENV
from epdctl.proxy.config import API_KEY_ENV, UPSTREAM_KEY_ENV
from epdctl.topology.keys import has_api_key
from epdctl.topology.model import Topology

HTTP_PORT = 8000
NIXL_PORT = 5600
CPU_PER_GPU = 4
MEMORY_GIB_PER_GPU = 32
# vLLM's TP workers exchange tensors through /dev/shm; the container default is 64 MiB.
SHM_SIZE = "16Gi"
# Weights download and load before /health answers: give startup 30 minutes.
STARTUP_PERIOD_S = 10
STARTUP_FAILURES = 180
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
CONFIG_DIR = "/etc/epdctl"
# Topology fields added after the checksum below was first rendered.
LATER_CACHE_FIELDS = ("connector", "extra_config")
LATER_ENGINE_FIELDS = ("log_requests",)
LATER_RESTART_FIELDS = ("window", "max_backoff")

Obj = dict[str, Any]


@dataclass(frozen=True)
class EngineRole:
    """One role's pods as the cluster runs them."""

    role: str
    name: str
    """Object name: StatefulSet (or LeaderWorkerSet) and its headless Service."""
    replicas: int
    argv: tuple[str, ...]
    env: tuple[Obj, ...]
    ports: tuple[tuple[str, int], ...]
    """Extra named container ports (transfer side channels)."""
    gpus: int
    """GPUs per pod."""
    nodes: int = 1
    """Pods per replica; more than 1 means tensor parallelism across nodes (LWS)."""
    volumes: tuple[Obj, ...] = ()
    """Pod volumes besides /dev/shm (the model's, the Hugging Face cache)."""
    mounts: tuple[Obj, ...] = ()
    """The engine container's mounts of those volumes."""

    def pod_host(self, replica: int) -> str:
        """The stable per-pod DNS name: StatefulSet and LWS leaders share the scheme."""
        return f"{self.name}-{replica}.{self.name}"

    def pod_url(self, replica: int) -> str:
        return f"http://{self.pod_host(replica)}:{HTTP_PORT}"


def labels(topology: Topology, role: str | None = None) -> dict[str, str]:
    result = {"app.kubernetes.io/managed-by": "epdctl", "epdctl/topology": topology.name}
    if role:
        result["epdctl/role"] = role
    return result


def _meta(name: str, topology: Topology, role: str | None = None) -> Obj:
    return {"name": name, "labels": labels(topology, role)}


def env_value(name: str, value: str) -> Obj:
    return {"name": name, "value": value}


def _env_field(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _probes(path: str = "/health") -> Obj:
    get = {"path": path, "port": "http"}
    return {
        "startupProbe": {"httpGet": get, "periodSeconds": STARTUP_PERIOD_S,
                         "failureThreshold": STARTUP_FAILURES},
        "readinessProbe": {"httpGet": get, "periodSeconds": 10, "timeoutSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": get, "periodSeconds": 30, "timeoutSeconds": 10,
                          "failureThreshold": 5},
    }


def _resources(gpus: int) -> Obj:
    memory = f"{MEMORY_GIB_PER_GPU * gpus}Gi"
    gpu = str(gpus)
    # No CPU limit: CFS throttling stalls the engine loop; memory is capped so /dev/shm is too.
    return {
        "requests": {"cpu": str(CPU_PER_GPU * gpus), "memory": memory, "nvidia.com/gpu": gpu},
        "limits": {"memory": memory, "nvidia.com/gpu": gpu},
    }


def _engine_pod(role: EngineRole, image: str, argv: list[str], env: list[Obj],
                has_http: bool) -> Obj:
    ports = [{"name": "http", "containerPort": HTTP_PORT}] if has_http else []
    ports += [{"name": n, "containerPort": p} for n, p in role.ports]
    container: Obj = {
        "name": "vllm",
        "image": image,
        "command": argv,
        "env": [_env_field("POD_NAME", "metadata.name"), _env_field("POD_IP", "status.podIP"),
                *env],
        "ports": ports,
        "resources": _resources(role.gpus),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *role.mounts],
    }
    if has_http:
        container.update(_probes())
    return {
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
                    *role.volumes],
    }


def _template(topology: Topology, role: str, pod: Obj, extra: Mapping[str, str] = {}) -> Obj:
    # The checksum changes the pod template when the topology does, so pods roll on apply.
    # Fields added since count only when set, so an unchanged topology keeps its checksum;
    # not cache.dir: unused in the cluster, and its default differs per user (uid); not
    # rebalance: `up --rebalance` moves GPUs on one machine, nothing in the cluster reads it.
    later: dict[str, Any] = {
        "rebalance": True,
        "cache": {f for f in LATER_CACHE_FIELDS if f not in topology.cache.model_fields_set}
        | {"dir"},
        "engine": {f for f in LATER_ENGINE_FIELDS if f not in topology.engine.model_fields_set},
        "restart": {f for f in LATER_RESTART_FIELDS
                    if f not in topology.restart.model_fields_set}}
    digest = hashlib.sha256(topology.model_dump_json(exclude=later).encode()).hexdigest()[:16]
    return {
        "metadata": {"labels": {**labels(topology, role), **extra},
                     "annotations": {"epdctl/topology-sha256": digest}},
        "spec": pod,
    }


def headless_service(topology: Topology, role: EngineRole) -> Obj:
    """Gives each pod a stable DNS name (`<name>-<i>.<name>`) the proxy can address."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(role.name, topology, role.role),
        "spec": {
            "clusterIP": "None",
            "selector": labels(topology, role.role),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}],
        },
    }


def stateful_set(topology: Topology, role: EngineRole, image: str) -> Obj:
    pod = _engine_pod(role, image, list(role.argv), list(role.env), has_http=True)
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": _meta(role.name, topology, role.role),
        "spec": {
            "serviceName": role.name,
            "replicas": role.replicas,
            # Replicas are independent engines: no reason to start them one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(topology, role.role)},
            "template": _template(topology, role.role, pod),
        },
    }


def leader_worker_set(topology: Topology, role: EngineRole, image: str) -> Obj:
    """One vLLM engine spread over `nodes` pods: rank 0 serves HTTP, the rest run headless."""
    multi = ["--nnodes", str(role.nodes), "--node-rank", "$(NODE_RANK)",
             "--master-addr", "$(LWS_LEADER_ADDRESS)"]
    env = [_env_field("NODE_RANK", f"metadata.labels['{LWS_WORKER_INDEX}']"), *role.env]
    leader = _engine_pod(role, image, [*role.argv, *multi], env, has_http=True)
    worker = _engine_pod(role, image, [*role.argv, *multi, "--headless"], env, has_http=False)
    return {
        "apiVersion": LWS_API, "kind": "LeaderWorkerSet",
        "metadata": _meta(role.name, topology, role.role),
        "spec": {
            "replicas": role.replicas,
            "leaderWorkerTemplate": {
                "size": role.nodes,
                # A TP group with a dead rank cannot serve; restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _template(topology, role.role, leader),
                "workerTemplate": _template(topology, role.role, worker),
            },
        },
    }


def engine_objects(topology: Topology, role: EngineRole, image: str) -> list[Obj]:
    """StatefulSet + headless Service, or a LeaderWorkerSet (which makes its own Service)."""
    if role.nodes > 1:
        return [leader_worker_set(topology, role, image)]
    return [headless_service(topology, role), stateful_set(topology, role, image)]


def config_map(topology: Topology, text: str) -> Obj:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(f"{topology.name}-topology", topology),
        "data": {"topology.yaml": text},
    }


def api_key_env(topology: Topology, *names: str) -> list[Obj]:
    """Env entries that read proxy.api_key from its Secret (none without an api_key)."""
    if not has_api_key(topology.proxy):
        return []
    ref = {"name": f"{topology.name}-proxy-api-key", "key": "api-key"}
    return [{"name": name, "valueFrom": {"secretKeyRef": ref}} for name in names]


def engine_key_env(topology: Topology) -> list[Obj]:
    """In the cluster the instances require proxy.api_key itself (no key per run there)."""
    return api_key_env(topology, KEY_ENV)


def api_key_secret(topology: Topology) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(f"{topology.name}-proxy-api-key", topology, "proxy"),
        "stringData": {"api-key": topology.proxy.api_key or ""},
    }


def proxy_objects(topology: Topology, argv: Sequence[str], image: str) -> list[Obj]:
    """The proxy's Deployment and its ClusterIP Service on proxy.port."""
    name = f"{topology.name}-proxy"
    env = api_key_env(topology, API_KEY_ENV, UPSTREAM_KEY_ENV)
    container: Obj = {
        "name": "proxy",
        "image": image,
        "command": [a.replace("$(", "$$(") for a in argv],
        "env": env,
        "ports": [{"name": "http", "containerPort": HTTP_PORT}],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "topology", "mountPath": CONFIG_DIR, "readOnly": True}],
        **_probes(),
    }
    container["startupProbe"]["failureThreshold"] = 30
    pod = {
        "containers": [container],
        "volumes": [{"name": "topology", "configMap": {"name": f"{topology.name}-topology"}}],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name, topology, "proxy"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels(topology, "proxy")},
            "template": _template(topology, "proxy", pod),
        },
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(name, topology, "proxy"),
        "spec": {
            "selector": labels(topology, "proxy"),
            "ports": [{"name": "http", "port": topology.proxy.port, "targetPort": "http"}],
        },
    }
    return [service, deployment]
