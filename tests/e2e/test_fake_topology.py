"""`python -m epdctl` end to end, with tests/fake_server.py standing in for vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import FAKE_PROXY, is_running, run_pids
from tests.harness import wait_for

pytestmark = pytest.mark.timeout(90)


def cli_env(state_root: Path, *, fake_proxy: bool = True) -> dict[str, str]:
    env = {**os.environ, "EPDCTL_STATE_DIR": str(state_root), "NO_COLOR": "1"}
    env.pop("EPDCTL_PROXY_COMMAND", None)
    if fake_proxy:
        env["EPDCTL_PROXY_COMMAND"] = FAKE_PROXY
    return env


def epdctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epdctl", *args], env=env, text=True,
                          capture_output=True, timeout=60)


def foreground(env: dict[str, str], topo: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "epdctl", "up", str(topo), "--timeout", "20"],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    out = ""
    while not out.startswith("  curl "):
        line = proc.stdout.readline()
        assert line, f"up ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}"
        out = line
    return out


def test_detached_round_trip(fake_topology, state_root) -> None:
    env = cli_env(state_root)
    up = epdctl(env, "up", str(fake_topology()), "-d", "--timeout", "20")
    assert up.returncode == 0, up.stderr
    status = epdctl(env, "status", "--json")
    assert status.returncode == 0
    doc = json.loads(status.stdout)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{doc['proxy_url']}/v1/chat/completions", json=body)
    assert reply.status_code == 200
    # `|`: the line's time is when it was written, which the supervisor notes as the log
    # grows (at its next look); until then `~` (a lower bound).
    line = "proxy | fake: POST /v1/chat/completions"
    assert wait_for(lambda: line in epdctl(env, "logs", "-n", "5", "proxy").stdout, 30), \
        epdctl(env, "logs", "-n", "5", "proxy").stdout
    pids = run_pids(state_root)
    down = epdctl(env, "down")
    assert down.returncode == 0, down.stderr
    assert not any(is_running(p) for p in pids.values())


def test_foreground_ctrl_c_stops_everything(fake_topology, state_root) -> None:
    proc = foreground(cli_env(state_root), fake_topology())
    try:
        wait_ready(proc)
        pids = run_pids(state_root)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
    assert not any(is_running(p) for p in pids.values())
    assert not (state_root / "fake" / "state.json").exists()


def test_foreground_instance_death_exits_1(fake_topology, state_root) -> None:
    proc = foreground(cli_env(state_root), fake_topology(pd_args=("--exit-after", "3")))
    try:
        wait_ready(proc)
        assert proc.wait(timeout=30) == 1
        assert proc.stderr is not None
        assert "Error: `pd-0` exited with code 1 while serving;" in proc.stderr.read()
    finally:
        proc.kill()


def test_second_up_while_foreground_runs(fake_topology, state_root) -> None:
    env = cli_env(state_root)
    topo = fake_topology()
    proc = foreground(env, topo)
    try:
        wait_ready(proc)
        again = epdctl(env, "up", str(topo), "-d")
        assert again.returncode == 1 and "is already running" in again.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        proc.kill()


@pytest.mark.skipif(not (Path(__file__).parents[2] / "epdctl/proxy/__main__.py").exists(),
                    reason="TODO: epdctl.proxy not written yet")
def test_real_proxy_in_front_of_fakes(fake_topology, state_root) -> None:
    env = cli_env(state_root, fake_proxy=False)
    up = epdctl(env, "up", str(fake_topology()), "-d", "--timeout", "30")
    assert up.returncode == 0, up.stderr
    try:
        doc = json.loads(epdctl(env, "status", "--json").stdout)
        assert doc["instances"][-1]["state"] == "ready"
        reply = httpx.post(f"{doc['proxy_url']}/v1/completions", timeout=30,
                           json={"model": "fake-model", "prompt": "hi", "max_tokens": 4})
        assert reply.status_code == 200, reply.text
    finally:
        assert epdctl(env, "down").returncode == 0
