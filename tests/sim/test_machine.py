"""The simulated machine through the normal path: `epdctl up` on fake GPUs, the real proxy,
fake engines as E, P, PD and D, and requests through the proxy."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from epdctl.bench.images import png
from tests.harness import free_ports

pytestmark = pytest.mark.timeout(120)
IMAGE = "data:image/png;base64," + base64.b64encode(png(32, 32, 3)).decode()


def _env(state_root: Path, gpus: int) -> dict[str, str]:
    env = {**os.environ, "EPDCTL_STATE_DIR": str(state_root), "NO_COLOR": "1",
           "EPDCTL_FAKE_GPUS": str(gpus), "EPDCTL_FAKE_GPU_MEMORY": "24GiB"}
    env.pop("EPDCTL_PROXY_COMMAND", None)  # the real proxy
    return env


def _epdctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epdctl", *args], env=env, text=True,
                          capture_output=True, timeout=90)


def _topology(tmp_path: Path, name: str, roles: str) -> Path:
    cost = tmp_path / "cost.yaml"
    cost.write_text("time_scale: 0.01\ngpu: {memory: 24GiB}\n"
                    "model: {weights: 4GiB, encoder_weights: 1GiB, kv_per_token: 64KiB}\n")
    base = free_ports(8)
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nmodel: sim-model\ndevice: cuda\n"
        f"engine: {{command: [{sys.executable!r}, -m, epdctl.sim.engine, --cost-model, "
        f"{str(cost)!r}], args: [--max-model-len, '2048']}}\n"
        f"cache: {{dir: {str(tmp_path / 'shm')!r}}}\nkv: {{connector: ExampleConnector}}\n"
        f"ports: {{base: {base}, side_channel_base: {base + 5}}}\nproxy: {{port: {base + 4}}}\n"
        f"roles:\n{roles}")
    return path


def _round_trip(env: dict[str, str], topology: Path) -> list[str]:
    up = _epdctl(env, "up", str(topology), "-d", "--timeout", "60")
    assert up.returncode == 0, up.stderr
    try:
        status = json.loads(_epdctl(env, "status", "--json").stdout)
        body = {"model": "sim-model", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": IMAGE}},
            {"type": "text", "text": "what is it?"}]}]}
        reply = httpx.post(f"{status['proxy_url']}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
        with httpx.stream("POST", f"{status['proxy_url']}/v1/chat/completions",
                          json={**body, "stream": True}, timeout=30) as stream:
            text = "".join(stream.iter_text())
        assert text.count("tok ") == 5 and text.rstrip().endswith("data: [DONE]")
        logs = _epdctl(env, "logs", "-n", "50")
        return [line for line in logs.stdout.splitlines() if "epdctl-sim:" in line]
    finally:
        down = _epdctl(env, "down")
        assert down.returncode == 0, down.stderr


def test_epd_on_three_fake_gpus(tmp_path: Path) -> None:
    state_root = tmp_path / "state"
    topology = _topology(tmp_path, "sim-epd", "  encode: {}\n  prefill: {}\n  decode: {}\n")
    started = _round_trip(_env(state_root, 3), topology)
    roles = sorted(line.split("epdctl-sim: ")[1].split(" serving")[0] for line in started)
    assert roles == ["decode", "encode", "prefill"]
    assert any("gpus 2 " in line for line in started)


def test_shared_gpu_and_tp(tmp_path: Path) -> None:
    state_root = tmp_path / "state"
    roles = ("  encode: {gpus: [0], gpu_memory_utilization: 0.2}\n"
             "  prefill_decode: {gpus: [0, 1], tensor_parallel: 2, "
             "gpu_memory_utilization: 0.7}\n")
    started = _round_trip(_env(state_root, 2), _topology(tmp_path, "sim-share", roles))
    assert any("prefill_decode" in line and "gpus 0,1 tp 2" in line for line in started)


def test_out_of_memory_is_a_startup_failure(tmp_path: Path) -> None:
    state_root = tmp_path / "state"
    roles = "  prefill_decode: {gpu_memory_utilization: 0.1}\n"
    up = _epdctl(_env(state_root, 1), "up", str(_topology(tmp_path, "sim-oom", roles)),
                 "-d", "--timeout", "60")
    assert up.returncode != 0
    assert "out of memory" in up.stderr.lower()
