"""What a Kubernetes rendering does differently from `epdctl up`, and why (one line each)."""

from __future__ import annotations

import posixpath
from collections import Counter
from typing import TYPE_CHECKING

from epdctl import cache
from epdctl.launch.plan import Plan
from epdctl.render import _volumes as v
from epdctl.topology.keys import env_name, has_api_key, literal_key
from epdctl.topology.model import Topology

if TYPE_CHECKING:
    from epdctl.render._manifests import EngineRole
    from epdctl.render.options import K8sOptions


def _ec_notes(topology: Topology, options: K8sOptions) -> list[str]:
    name = options.ec_connector
    lines = [
        f"EC transfer uses {name}, not {cache.CONNECTOR_NAME}: a shared-memory store does not "
        "cross nodes (the cache: section is not used, and the proxy sends every media item to "
        "an encoder after E answers: proxy.skip_cached_items and proxy.overlap need that "
        "store)."
    ]
    if name == "ECMooncakeConnector":
        lines += [
            "ECMooncakeConnector: mooncake_protocol tcp (set rdma where pods have RDMA NICs); "
            "each pod's control socket is $(POD_IP):14579; encode must keep tensor_parallel 1.",
            "The proxy runs --ec-protocol mooncake: it picks the PD pod first, then E pushes "
            "each media item to that pod's control socket (<pod DNS name>:14579) under a fresh "
            "transfer_id; PD cannot encode media itself, so an encoder failure is a 502. "
            "Checked against fake engines only: not yet run on a cluster.",
        ]
    elif name == "ECCPUConnector":
        lines.append(
            "ECCPUConnector: ec_cpu_bytes from cache.capacity, NIXL pull over "
            "VLLM_EC_SIDE_CHANNEL_HOST=$(POD_IP); it needs vLLM's V2 model runner."
        )
    else:
        lines.append(f"epdctl knows no settings for {name}: add its ec_connector_extra_config "
                     "to the rendered --ec-transfer-config by hand.")
    return lines


def _model_notes(topology: Topology, options: K8sOptions) -> list[str]:
    """Where the pods find the model, and what that assumes of the cluster."""
    model = topology.model
    lines: list[str] = []
    mount = v.model_mount(topology, options)
    if mount is not None:
        if options.model_pvc:
            source = f"PVC {options.model_pvc}"
            needs = ("pods on several nodes need an access mode they can share (ReadOnlyMany "
                     "or ReadWriteMany)")
        else:
            source = f"hostPath {options.model_host_path}"
            needs = "every GPU node needs that directory (a pod without it does not start)"
        inside = posixpath.relpath(posixpath.normpath(model), mount)
        where = "at the volume's top level" if inside == "." else f"in {inside}/ on the volume"
        lines.append(
            f"model: {model} is a path in the engine pods: {source} is mounted read-only at "
            f"{mount}, so the model's files must be {where}; {needs}."
        )
    elif v.is_pod_path(model):
        lines.append(
            f"model: {model} is a path in the engine pods, and no --model-pvc or "
            "--model-host-path was given: the image must contain it."
        )
    if v.has_hf_cache(topology, options):
        where = v.hf_cache_dir(topology.engine.env)
        if where == v.HF_HOME:
            where = f"HF_HOME={where}"
        if options.hf_cache_pvc:
            first = "" if v.is_pod_path(model) else \
                "; the first pods to start download the model into it"
            lines.append(
                f"Hugging Face cache: PVC {options.hf_cache_pvc} at {where}, shared by every "
                f"engine pod (ReadWriteMany across nodes){first}."
            )
        else:
            lines.append(
                f"model: {model} is downloaded from the Hugging Face Hub by every engine pod "
                f"at each start, into an emptyDir at {where} (lost with the pod); "
                "--hf-cache-pvc NAME keeps one cache."
            )
            offline = topology.engine.env.get("HF_HUB_OFFLINE", "").upper()
            if offline in ("1", "ON", "YES", "TRUE"):
                lines.append("engine.env sets HF_HUB_OFFLINE, so that emptyDir stays empty: "
                             "give --hf-cache-pvc a volume that already holds the model.")
    if options.hf_token_secret:
        lines.append(
            f"HF_TOKEN comes from Secret {options.hf_token_secret}, key "
            f"{options.hf_token_key}: create it first (kubectl create secret generic "
            f"{options.hf_token_secret} --from-literal={options.hf_token_key}=hf_...)."
        )
    elif not v.is_pod_path(model):
        lines.append("No HF_TOKEN (--hf-token-secret): a gated or private model cannot "
                     "be downloaded.")
    return lines


def notes(
    topology: Topology, roles: list[EngineRole], options: K8sOptions, local: Plan
) -> list[str]:
    """The differences from the local plan, most important first."""
    lines: list[str] = []
    if "encode" in topology.roles:
        lines += _ec_notes(topology, options)
    if any(r.role in ("prefill", "decode") for r in roles):
        lines.append(
            "KV transfer uses NIXL across pods: VLLM_NIXL_SIDE_CHANNEL_HOST is the pod IP "
            "(localhost locally) and every P/D pod uses side-channel port 5600."
        )
    lines.append(
        "Every instance listens on 0.0.0.0:8000 in its own pod and gets whole GPUs "
        "(nvidia.com/gpu) instead of ports.* and CUDA_VISIBLE_DEVICES."
    )
    used = Counter(g for s in local.instances for g in s.gpus)
    if any(n > 1 for n in used.values()):
        lines.append(
            "Roles that share a GPU locally get one GPU per pod here; their "
            "gpu_memory_utilization is kept as written (raise it to use the whole GPU)."
        )
    for role in roles:
        if role.nodes > 1:
            lines.append(
                f"roles -> {role.role}: tensor_parallel {role.nodes * role.gpus} spans "
                f"{role.nodes} nodes of {role.gpus} GPU(s): a LeaderWorkerSet ({role.name}), "
                "which needs the LWS controller installed and makes its own headless Service."
            )
    lines += _model_notes(topology, options)
    if topology.restart.policy != "no":
        lines.append("restart: Kubernetes restarts failed pods itself; restart.* is not used.")
    lines.append(
        f"The proxy runs `python3 -m epdctl.proxy` with one URL per pod (stable StatefulSet "
        f"DNS names): the image ({options.image}) must have epdctl installed."
    )
    secret = f"{topology.name}-proxy-api-key"
    if literal_key(topology.proxy):
        lines.append(f"proxy.api_key is in Secret {secret}, not in the ConfigMap.")
    elif topology.proxy.api_key_file is not None:
        lines.append(f"Create Secret {secret} from proxy.api_key_file (the key is not "
                     f"rendered): kubectl create secret generic {secret} "
                     f"--from-file=api-key={topology.proxy.api_key_file}")
    elif (name := env_name(topology.proxy)) is not None:
        lines.append(f"Create Secret {secret} from ${name} (the key is not rendered): "
                     f"kubectl create secret generic {secret} --from-literal=api-key=\"${name}\"")
    if has_api_key(topology.proxy):
        lines.append(
            "The instances require proxy.api_key too (VLLM_API_KEY from that Secret; the "
            "proxy sends it), but vLLM checks it on /v1 routes only: keep other pods from "
            "reaching the engine pods with a NetworkPolicy."
        )
    return lines
