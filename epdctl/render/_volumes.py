"""Where the engine pods find the model: its volume, the Hugging Face cache, HF_TOKEN.

`model:` is read as the pods see it. An absolute path is a path inside the pods (it need not
exist on this machine): a PVC or node directory can be mounted read-only over its directory.
A Hugging Face id is downloaded into a cache volume at HF_HOME. A relative or `~` path names
this machine's files, which no pod can see, so rendering refuses it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epdctl.errors import RenderError

if TYPE_CHECKING:
    from epdctl.render.options import K8sOptions
    from epdctl.topology.model import Topology

# vllm/vllm-openai runs as root: this is where huggingface_hub caches unless told otherwise.
HF_HOME = "/root/.cache/huggingface"
"""The Secret key read for HF_TOKEN when --hf-token-secret names none."""
MODEL_VOLUME = "model"
HF_CACHE_VOLUME = "hf-cache"
# Where an engine's environment can move huggingface_hub's cache, most specific first.
_CACHE_ENV = ("HF_HUB_CACHE", "HF_HOME")

Obj = dict[str, Any]


@dataclass(frozen=True)
class PodStorage:
    """What one role's engine container gets for its model: volumes, mounts and env."""

    volumes: tuple[Obj, ...] = ()
    mounts: tuple[Obj, ...] = ()
    env: tuple[Obj, ...] = ()


def is_pod_path(model: str) -> bool:
    """An absolute `model:` is a path inside the pods; anything else path-like is refused."""
    return model.startswith("/")


def _is_local_path(model: str) -> bool:
    """Path-like but not absolute: a path on this machine, meaningless in a pod."""
    from epdctl.topology.model import is_local_model

    return is_local_model(model) and not is_pod_path(model)


def model_mount(topology: Topology, options: K8sOptions) -> str | None:
    """Where the model volume is mounted, or None when no volume is asked for."""
    if not (options.model_pvc or options.model_host_path):
        return None
    if options.model_mount:
        return posixpath.normpath(options.model_mount)
    return posixpath.dirname(posixpath.normpath(topology.model))


def hf_cache_dir(env: Mapping[str, str]) -> str:
    """The directory the HF cache volume is mounted at: the engine env's choice, or HF_HOME."""
    return next((env[name] for name in _CACHE_ENV if name in env), HF_HOME)


def has_hf_cache(topology: Topology, options: K8sOptions) -> bool:
    """A hub model always gets a cache volume; a path model only when one is named."""
    return not is_pod_path(topology.model) or options.hf_cache_pvc is not None


def check(topology: Topology, options: K8sOptions) -> None:
    """Refuse model and volume choices the pods could not use, one line each."""
    model = topology.model
    if _is_local_path(model):
        raise RenderError(
            f"model: `{model}` is a path on this machine, which pods cannot see: write the "
            "model's absolute path inside the pods (such as /models/<name>) and mount it "
            "with --model-pvc or --model-host-path"
        )
    if options.model_pvc and options.model_host_path:
        raise RenderError("--model-pvc and --model-host-path: pick one volume for the model")
    has_volume = bool(options.model_pvc or options.model_host_path)
    if options.model_mount and not has_volume:
        raise RenderError("--model-mount needs --model-pvc or --model-host-path to mount")
    if has_volume and not is_pod_path(model):
        flag = "--model-pvc" if options.model_pvc else "--model-host-path"
        raise RenderError(
            f"{flag}: model `{model}` is a Hugging Face id, not a path in the pods; write "
            "its absolute path in the pods as model:, or cache the download with --hf-cache-pvc"
        )
    mount = model_mount(topology, options)
    if mount is not None:
        path = posixpath.normpath(model)
        if mount == "/":
            raise RenderError(f"model: `{model}`: the model volume cannot be mounted at /; "
                              "use --model-mount DIR")
        if path != mount and not path.startswith(mount + "/"):
            raise RenderError(f"--model-mount {mount}: model `{model}` is not inside it")
    for name, role in topology.roles.items():
        env = {**topology.engine.env, **role.env}
        if has_hf_cache(topology, options):
            for key in _CACHE_ENV:
                if key in env and not posixpath.isabs(env[key]):
                    raise RenderError(f"{_where(name, role.env, key)}: {key} must be an "
                                      "absolute path to mount the Hugging Face cache there, "
                                      f"not `{env[key]}`")
        if options.hf_token_secret and "HF_TOKEN" in env:
            raise RenderError(f"{_where(name, role.env, 'HF_TOKEN')}: HF_TOKEN is set here and "
                              "by --hf-token-secret; keep one (a Secret keeps it out of the "
                              "ConfigMap)")


def _where(role: str, role_env: Mapping[str, str], key: str) -> str:
    """Where an engine env key was set: the role's env, or engine.env under it."""
    return f"roles -> {role} -> env" if key in role_env else "engine -> env"


def pod_storage(topology: Topology, env: Mapping[str, str], options: K8sOptions) -> PodStorage:
    """The model volume, HF cache and HF_TOKEN for an engine container whose env is `env`."""
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    extra_env: list[Obj] = []
    mount = model_mount(topology, options)
    if mount is not None:
        if options.model_pvc:
            source: Obj = {"persistentVolumeClaim": {"claimName": options.model_pvc,
                                                     "readOnly": True}}
        else:
            # Directory: a node without it fails the pod at once instead of serving nothing.
            source = {"hostPath": {"path": options.model_host_path, "type": "Directory"}}
        volumes.append({"name": MODEL_VOLUME, **source})
        mounts.append({"name": MODEL_VOLUME, "mountPath": mount, "readOnly": True})
    if has_hf_cache(topology, options):
        cache: Obj = ({"persistentVolumeClaim": {"claimName": options.hf_cache_pvc}}
                      if options.hf_cache_pvc else {"emptyDir": {}})
        volumes.append({"name": HF_CACHE_VOLUME, **cache})
        mounts.append({"name": HF_CACHE_VOLUME, "mountPath": hf_cache_dir(env)})
        if not any(name in env for name in _CACHE_ENV):
            # Set, not assumed: the cache lands on the volume whatever the image's user.
            extra_env.append({"name": "HF_HOME", "value": HF_HOME})
    if options.hf_token_secret:
        ref = {"name": options.hf_token_secret, "key": options.hf_token_key}
        extra_env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})
    return PodStorage(tuple(volumes), tuple(mounts), tuple(extra_env))
