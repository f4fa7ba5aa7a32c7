"""`epdctl rebalance` on the simulated machine (4 fake GPUs, the encode-heavy cost model whose
profiles `tune` measured: tests/data/rebalance): 1E+3PD sent four-image albums faster than
one encoder takes them; rebalance reads that traffic from the proxy's log, says to move two
PD GPUs to encoders and why (--dry-run), moves them (two switches, under the change log),
and then, on the same traffic, says the split is right."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from epdctl.bench.images import png
from tests.harness import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).parents[2]
PROFILES = Path(__file__).parents[1] / "data" / "rebalance" / "encode-heavy"
REQUESTS, RATE = 24, 3.0


def topology(tmp_path: Path, extra: str = "") -> Path:
    cost = ROOT / "examples" / "sim" / "encode-heavy.yaml"
    base = free_ports(8)
    path = tmp_path / "sim.yaml"
    path.write_text(
        f"name: sim\nmodel: sim-model\ndevice: cuda\n"
        f"engine: {{command: [{sys.executable!r}, -m, epdctl.sim.engine, --cost-model, "
        f"{str(cost)!r}], args: [--max-model-len, '8192']}}\n"
        f"cache: {{dir: {str(tmp_path / 'shm')!r}}}\n"
        f"ports: {{base: {base}, side_channel_base: {base + 5}}}\nproxy: {{port: {base + 4}}}\n"
        f"{extra}roles:\n  encode: {{gpus: [0]}}\n"
        "  prefill_decode: {gpus: [1, 2, 3], replicas: 3}\n")
    return path


def album(seed: int) -> dict:
    parts = [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png(512, 512, seed * 4 + i)).decode()}}
        for i in range(4)]
    return {"model": "sim-model", "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text",
                                                               "text": "what is here?"}]}]}


def cli(tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    env = {**os.environ, "EPDCTL_STATE_DIR": str(tmp_path / "state"),
           "EPDCTL_FAKE_GPUS": "4", "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("EPDCTL_PROXY_COMMAND", None)

    def epdctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "epdctl", *args], env=env, text=True,
                              capture_output=True, timeout=240)

    return epdctl


def send_albums(tmp_path: Path) -> None:
    """REQUESTS albums through the proxy, arriving at RATE whatever the answers take."""
    state = json.loads((tmp_path / "state" / "sim" / "state.json").read_text())
    url = f"http://127.0.0.1:{state['specs'][-1]['port']}"
    codes: list[int] = []
    threads = [threading.Thread(target=lambda s=seed: codes.append(httpx.post(
        f"{url}/v1/chat/completions", json=album(s), timeout=180).status_code))
        for seed in range(REQUESTS)]
    for thread in threads:
        thread.start()
        time.sleep(1 / RATE)
    for thread in threads:
        thread.join(200)
    assert codes == [200] * REQUESTS


def split(tmp_path: Path) -> dict[str, list[str]]:
    state = json.loads((tmp_path / "state" / "sim" / "state.json").read_text())
    return {s["name"]: s["gpus"] for s in state["specs"] if s["role"] != "proxy"}


def test_rebalance_moves_pd_gpus_to_the_encoders_for_albums(tmp_path: Path) -> None:
    epdctl = cli(tmp_path)
    up = epdctl("up", str(topology(tmp_path)), "-d", "--timeout", "120")
    assert up.returncode == 0, up.stderr
    try:
        send_albums(tmp_path)
        args = ("rebalance", "--profiles", str(PROFILES), "--slo", "ttft=3000,tpot=60",
                "--window", "10m", "--switch-seconds", "5")
        dry = epdctl(*args, "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        plan = json.loads(dry.stdout)
        assert plan["current"]["split"] == "1E+3PD" and plan["best"]["split"] == "3E+1PD"
        assert plan["act"] and plan["best"]["share"] > plan["current"]["share"]
        assert plan["switches"] == ["epdctl switch pd-2 encode", "epdctl switch pd-1 encode"]
        text = epdctl(*args, "--dry-run")  # the table, the verdict and the commands
        assert text.returncode == 0 and "Moving: 3E+1PD serves" in text.stderr, text.stderr
        assert "1E+3PD" in text.stdout and "running" in text.stdout and "best" in text.stdout
        assert "epdctl switch pd-2 encode" in text.stdout

        moved = epdctl(*args, "--json")
        assert moved.returncode == 0, moved.stderr
        assert [(s["step"], s["name"]) for s in json.loads(moved.stdout)["steps"]] == [
            ("switch", "encode-1"), ("switch", "encode-2")]
        assert split(tmp_path) == MOVED
        state = json.loads((tmp_path / "state" / "sim" / "state.json").read_text())
        assert all(r["state"] == "ready" for r in state["records"].values())
        log = (tmp_path / "state" / "sim" / "changes.jsonl").read_text().splitlines()
        assert sum(json.loads(line).get("reason", "").startswith("rebalance: 3E+1PD")
                   for line in log) == 2

        again = epdctl(*args, "--dry-run", "--json")
        assert again.returncode == 0, again.stderr
        assert not json.loads(again.stdout)["act"]
        assert json.loads(again.stdout)["current"]["split"] == "3E+1PD"
    finally:
        assert epdctl("down").returncode == 0


MOVED = {"encode-0": ["0"], "pd-0": ["1"], "encode-1": ["3"], "encode-2": ["2"]}


def test_up_rebalance_moves_encoders_in_by_itself_and_leaves_with_the_run(
        tmp_path: Path) -> None:
    """`up -d --rebalance`: the rebalancer judges every 2 s; as the albums come it moves PD
    GPUs to encoders (each move in changes.jsonl, each judgement in rebalance.jsonl), never
    back; and `down` leaves nothing of it. A section whose profiles are missing is refused
    in one line, nothing started."""
    from tests.reliability.helpers import marked_pids

    epdctl = cli(tmp_path)
    section = (f"rebalance: {{profiles: {str(PROFILES)!r}, slo: 'ttft=3000,tpot=60', "
               "every: 2s, window: 60s, interval: 10m, min_gap: 1s, switch_seconds: 5}\n")
    refused = epdctl("up", str(topology(tmp_path, section.replace(str(PROFILES),
                                                                  "/nowhere"))),
                     "-d", "--rebalance")
    assert refused.returncode == 1 and "no profiles in /nowhere" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    up = epdctl("up", str(topology(tmp_path, section)), "-d", "--rebalance")
    assert up.returncode == 0, up.stderr
    run_dir = tmp_path / "state" / "sim"

    def moves() -> list[dict]:
        path = run_dir / "changes.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e.get("reason", "").startswith(
            "rebalance: ")]

    try:
        send_albums(tmp_path)
        deadline = time.monotonic() + 120
        while not moves() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(6)  # three more rounds
        made = moves()
        assert made and all(e["remove"][0].startswith("pd-") and e["add"][0].startswith(
            "encode-") for e in made), made
        roles = [name.split("-")[0] for name in split(tmp_path)]
        assert roles.count("encode") == 1 + len(made) and "pd" in roles
        judged = [json.loads(line) for line in (run_dir / "rebalance.jsonl").read_text()
                  .splitlines()]
        assert sum(len(j["moves"]) for j in judged if j.get("moved")) == len(made)
        assert not judged[-1].get("act", False)  # the split holds now (or too few requests)
        state = json.loads((run_dir / "state.json").read_text())
        assert all(r["state"] == "ready" for r in state["records"].values())
    finally:
        assert epdctl("down").returncode == 0
    assert marked_pids(run_dir) == set()
    assert not (run_dir / "sidecars").exists() or not list((run_dir / "sidecars").iterdir())
