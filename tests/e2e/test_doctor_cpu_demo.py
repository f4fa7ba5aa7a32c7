"""`epdctl doctor` of topologies/cpu-demo.yaml for real: the venv's vLLM and plugin, no engine.

It runs `vllm --version` through the CPU engine command (~7 s of importing vLLM in a
subprocess), hence e2e; nothing is started and nothing is created.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.harness import copy_topology

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
# The CLI as a user runs it, then a word on whether vLLM got into the CLI's own process.
SCRIPT = """
import sys
from epdctl.cli import cli
try:
    cli(sys.argv[1:], prog_name="epdctl")
finally:
    print("vllm imported" if "vllm" in sys.modules else "vllm not imported", file=sys.stderr)
"""


def _doctor(topology: Path, tmp_path: Path, *args: str,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EPDCTL_STATE_DIR": str(tmp_path / "state"), "NO_COLOR": "1",
           "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-c", SCRIPT, "doctor", str(topology), *args],
                          env=env, capture_output=True, text=True, timeout=540)


def _vllm_version() -> str:
    from importlib.metadata import version

    from epdctl.engines.vllm_cpu import cpu_version_alias

    return cpu_version_alias() or version("vllm")


def test_cpu_demo_is_ready_to_go_up(tiny_llava: Path, tmp_path: Path) -> None:
    store = Path(f"/dev/shm/epdctl-test-{uuid.uuid4().hex[:8]}")
    topology = copy_topology("cpu-demo", tmp_path, model=tiny_llava, cache_dir=store)
    result = _doctor(topology, tmp_path, "--json")
    assert result.returncode == 0, result.stdout
    assert result.stderr == "vllm not imported\n"
    doc = json.loads(result.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert doc["ok"] is True
    assert {n: c["status"] for n, c in checks.items()} == {
        "vllm": "ok", "plugin": "ok", "kv-connector": "skip", "ec-connector": "skip",
        "gpus": "skip",
        "placement": "ok", "gpu-memory": "skip", "ec-store": "ok", "ports": "ok",
        "model": "ok", "combination": "ok", "safety": "ok"}
    assert checks["vllm"]["detail"] == (
        f"vLLM {_vllm_version()} (`{sys.executable} -m epdctl.engines.vllm_cpu --version`)")
    assert checks["plugin"]["detail"].startswith("`epdctl_ec` loads in ")
    assert checks["ec-store"]["detail"].startswith(f"{store}: tmpfs, ")
    assert checks["model"]["detail"] == f"local model {tiny_llava.resolve()}"
    assert not store.exists()  # doctor creates nothing


def test_cpu_demo_without_its_model_names_the_build(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    store = Path(f"/dev/shm/epdctl-test-{uuid.uuid4().hex[:8]}")
    topology = copy_topology("cpu-demo", tmp_path, model=tiny / "llava", cache_dir=store)
    result = _doctor(topology, tmp_path, env={"EPDCTL_TINY_MODEL_DIR": str(tiny)})
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    model = lines.index(f"fail  model         local path {tiny}/llava does not exist")
    assert lines[model + 1].strip().startswith("fix: build it: `")
    assert lines[model + 1].endswith(" -m epdctl.dev.tiny_models llava`")
    assert lines[0].startswith(f"ok    vllm          vLLM {_vllm_version()} ")
    assert result.stderr.endswith(", 1 fail, 4 skip\nvllm not imported\n")
