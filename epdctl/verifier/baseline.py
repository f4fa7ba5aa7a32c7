"""The aggregated baseline `verify` compares with: a twin of the PD/prefill instance."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from epdctl.engines.guard import KEY_ENV
from epdctl.errors import EpdctlError, StartupError
from epdctl.host import ipc
from epdctl.launch.processes import Proc, describe_failure, exit_text, spawn, stop_all
from epdctl.launch.readiness import is_ready
from epdctl.launch.spec import LaunchSpec

NAME = "verify-baseline"
# The internal key too: verify talks to its own baseline directly, without one.
NOT_FOR_BASELINE_ENV = ("VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_EC_SIDE_CHANNEL_HOST",
                        "VLLM_EC_SIDE_CHANNEL_PORT", KEY_ENV)


def free_port(avoid: Sequence[int] = ()) -> int:
    """A TCP port that is free now (the OS picks it) and not one of `avoid`."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port


def first_model(base_url: str, headers: Mapping[str, str] | None = None) -> str:
    """The first model a server lists (a baseline may serve the model under its path)."""
    import httpx

    try:
        reply = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=dict(headers or {}),
                          timeout=10.0)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EpdctlError(f"cannot list the models of {base_url}: {exc}") from None


def baseline_spec(
    spec: LaunchSpec, port: int, log_path: Path, gpus: Sequence[str] | None = None
) -> LaunchSpec:
    """An aggregated twin of a PD/prefill instance: same argv and env, no EC/KV transfer
    (transfer configs are what make an instance a disaggregated one) and no key."""
    env = {k: v for k, v in spec.env.items() if k not in NOT_FOR_BASELINE_ENV}
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return replace(spec, name=NAME, role="baseline", ec_config=None, kv_config=None, env=env,
                   port=port, log_path=log_path, gpus=tuple(gpus or ()),
                   side_channel_port=None, start_after=(), ec_ports=(), is_key_required=False)


def parse_gpus(device: str, gpus: str | None) -> list[str] | None:
    """--baseline-gpus as device ids; required on cuda, where the topology holds its GPUs."""
    if device != "cuda":
        return None
    if gpus is None:
        raise EpdctlError("on `device: cuda` verify needs --baseline-url URL (a server of the "
                          "same model without EC/KV transfer) or --baseline-gpus LIST (free "
                          "GPUs to start one on)")
    return [g.strip() for g in gpus.split(",") if g.strip()]


def start(specs: Sequence[LaunchSpec], run_dir: Path,
          gpus: Sequence[str] | None = None) -> tuple[LaunchSpec, Proc]:
    """Spawn the twin of the first PD/prefill spec on a free port; log under run_dir/logs."""
    pd = next(s for s in specs if s.role in ("prefill_decode", "prefill"))
    if gpus is not None and len(gpus) != len(pd.gpus):
        raise EpdctlError(f"--baseline-gpus: `{pd.name}` runs on {len(pd.gpus)} GPU(s); "
                          f"give as many, not {len(gpus)}")
    port = free_port([s.port for s in specs])
    spec = baseline_spec(pd, port, run_dir / "logs" / f"{NAME}.log", gpus)
    if ipc.ours(pd.env, run_dir, pd.name):  # IPC sockets of its own, not pd's
        spec = replace(spec, env={**spec.env, **ipc.engine_env(run_dir, NAME)})
    return spec, spawn(spec, run_dir)


def stop(spec: LaunchSpec, proc: Proc, run_dir: Path) -> None:
    """Stop the twin's group and remove its IPC directory."""
    stop_all([proc])
    ipc.remove(ipc.ours(spec.env, run_dir, spec.name))


def wait_ready(spec: LaunchSpec, proc: Proc, deadline: float, timeout_s: float) -> None:
    """Until /health answers 200; StartupError (with the log tail) on exit or deadline."""
    while not is_ready(spec.health_url):
        code = proc.popen.poll() if proc.popen is not None else None
        if code is not None:
            raise StartupError(describe_failure(spec.name, exit_text(code), spec.log_path, code))
        if time.monotonic() > deadline:
            what = f"was not ready within {timeout_s:g}s"
            raise StartupError(describe_failure(spec.name, what, spec.log_path))
        time.sleep(0.5)
