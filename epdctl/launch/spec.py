"""LaunchSpec and Plan: what `plan()` decides, as fields. argv is derived, never parsed back."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdctl.cache import CONNECTOR_NAME
from epdctl.engines.guard import KEY_ENV, MIDDLEWARE
from epdctl.proxy.config import API_KEY_ENV, UPSTREAM_KEY_ENV

HOST = "127.0.0.1"
"""Where every engine instance listens, and the address a wildcard-bound proxy is reached at."""
PROXY_ROLE = "proxy"
WILDCARD_HOSTS = ("0.0.0.0", "::")
EC_FLAG = "--ec-transfer-config"
KV_FLAG = "--kv-transfer-config"
# What a shown command line prints instead of the secret (the value lives in state.json).
SECRET_ENV = {KEY_ENV: "<internal>", UPSTREAM_KEY_ENV: "<internal>",
              API_KEY_ENV: "<proxy.api_key>"}
PROBE_PATHS = ("/health", "/metrics")
"""What epdctl (readiness, the proxy's health loop, `top`) and Kubernetes poll on an engine."""
QUIET_FLAG = "--disable-access-log-for-endpoints"
LOG_REQUESTS_FLAG = "--enable-log-requests"


def transfer_args(ec_config: Mapping[str, Any] | None,
                  kv_config: Mapping[str, Any] | None) -> list[str]:
    """The transfer-config flags, their JSON compact (as vLLM's own examples write it)."""
    argv: list[str] = []
    for flag, config in ((EC_FLAG, ec_config), (KV_FLAG, kv_config)):
        if config is not None:
            argv += [flag, json.dumps(config, separators=(",", ":"))]
    return argv


def connect_url(host: str, port: int) -> str:
    """The URL a local client uses for a server bound to host:port."""
    host = HOST if host in WILDCARD_HOSTS else host
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class LaunchSpec:
    """One process epdctl starts, an engine instance or the proxy, as its parts."""

    name: str
    role: str
    """encode, prefill_decode, prefill, decode or proxy."""
    command: tuple[str, ...]
    """argv before epdctl's flags: the engine command and the model, or the proxy module."""
    port: int
    log_path: Path
    host: str = HOST
    """Address the process binds."""
    args: tuple[str, ...] = ()
    """Flags after epdctl's own: the topology's engine and role args (the proxy's knobs)."""
    served_model_name: str | None = None
    tensor_parallel: int = 1
    gpu_memory_utilization: float | None = None
    ec_config: Mapping[str, Any] | None = None
    """--ec-transfer-config (None: no encoder cache transfer)."""
    kv_config: Mapping[str, Any] | None = None
    """--kv-transfer-config (prefill and decode only)."""
    env: Mapping[str, str] = field(default_factory=dict)
    gpus: tuple[str, ...] = ()
    """Device ids as written into CUDA_VISIBLE_DEVICES."""
    side_channel_port: int | None = None
    start_after: tuple[str, ...] = ()
    """Instances that must be ready before this one starts (they share a GPU with it)."""
    ec_ports: tuple[int, ...] = ()
    """Ports the EC connector binds (ECMooncakeConnector consumers: one per TP rank from
    ec_port; ECCPUConnector producers: the side channel)."""
    is_key_required: bool = False
    """Answer only requests with the internal key ($VLLM_API_KEY), on every route but
    /health (epdctl.engines.guard): every run `up` starts (render: with proxy.api_key)."""
    quiet_paths: tuple[str, ...] = ()
    """Paths the engine leaves out of its access log (the probes)."""
    log_requests: bool = False
    """The engine logs each request's id (`engine.log_requests`)."""

    @property
    def is_proxy(self) -> bool:
        return self.role == PROXY_ROLE

    @property
    def engine_flags(self) -> list[str]:
        """What epdctl sets on an engine between the address and the topology's args."""
        flags: list[str] = []
        if self.served_model_name:
            flags += ["--served-model-name", self.served_model_name]
        if self.tensor_parallel > 1:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel)]
        if self.gpu_memory_utilization is not None:
            flags += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.is_key_required:
            flags += ["--middleware", MIDDLEWARE]
        if self.quiet_paths:
            flags += [QUIET_FLAG, ",".join(self.quiet_paths)]
        if self.log_requests:
            flags.append(LOG_REQUESTS_FLAG)
        return flags

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.command, "--host", self.host, "--port", str(self.port),
                *self.engine_flags, *self.args, *transfer_args(self.ec_config, self.kv_config))

    @property
    def url(self) -> str:
        """Base URL clients on this machine use."""
        return connect_url(self.host, self.port)

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"

    def shell(self) -> str:
        """The command as one shell line, env first; API keys show as placeholders."""
        env = " ".join(f"{k}={SECRET_ENV.get(k) or shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


@dataclass(frozen=True)
class Plan:
    """Everything `up` needs, decided before anything starts."""

    name: str
    mode: str
    state_dir: Path
    namespace: str
    store_dir: Path
    model_name: str
    instances: tuple[LaunchSpec, ...]
    """The engines, in start order."""
    proxy: LaunchSpec
    ec_connector: str = CONNECTOR_NAME
    """cache.connector: epdctl's store, a vLLM connector's name, or module.path:ClassName."""
    notes: tuple[str, ...] = field(default=())
    """What `up --dry-run` says beside the commands (how another connector differs)."""

    @property
    def specs(self) -> tuple[LaunchSpec, ...]:
        """Engines first, the proxy last: the order things start in."""
        return (*self.instances, self.proxy)

    def spec(self, name: str) -> LaunchSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)
