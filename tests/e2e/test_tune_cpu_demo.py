"""`epdctl tune topologies/cpu-demo.yaml` for real, at a small budget: it profiles both
probe topologies, predicts both candidates (1E+1PD, 2PD), confirms both with `vllm bench
serve`, and writes the best as a topology that `up` starts and `verify` passes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epdctl.topology.model import load_topology
from epdctl.tune.model import ATTAINMENT
from tests.harness import (
    cli_env,
    leftovers,
    release_new_semaphores,
    stop_marked,
    topology_up,
    write_topology,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(os.environ.get("EPDCTL_LONG_TESTS") != "1", reason=(
                  "nine minutes of real vLLM on 2 cores (five starts), beyond the suite's "
                  "time budget: EPDCTL_LONG_TESTS=1 runs it"))]
NUM_PROMPTS = 6
"""Requests per load point: the test is about the method's steps, not the figures."""


def stop_everything_under(state_root: Path) -> None:
    """Whatever a killed `tune` left running: every process group marked for a run dir."""
    for run_dir in state_root.iterdir() if state_root.is_dir() else ():
        stop_marked(run_dir)


def test_tune_cpu_demo_confirms_two_and_writes_a_topology_up_runs(tiny_llava: Path,
                                                                  tmp_path: Path) -> None:
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    state_root, out, best_path = tmp_path / "state", tmp_path / "out", tmp_path / "best.yaml"
    argv = [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "tune", str(path),
            "--slo", "ttft=5000,tpot=1000", "--images", "1", "--image-size", "56",
            "--input-len", "16", "--output-len", "8", "--num-prompts", str(NUM_PROMPTS),
            "--budget", "10m", "--max-confirm", "2", "--confirm-points", "2",
            "--knee-steps", "1",
            "--timeout", "300", "--out", str(out), "--write", str(best_path), "--json"]
    try:
        with release_new_semaphores():
            result = subprocess.run(argv, env=cli_env(), text=True, capture_output=True,
                                    timeout=780)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        doc = json.loads(result.stdout)
        assert json.loads((out / "report.json").read_text()) == doc
        # Profiled: one probe per kind of instance the candidates need, kept in --out.
        profiles = json.loads((out / "profiles.json").read_text())["entries"]
        assert sorted(profiles) == ["1E+1PD", "1PD"], sorted(profiles)
        stages = {k for e in profiles.values() for k in e["stages"]}
        assert stages == {"encode", "pd-tp1", "pd+enc-tp1"}
        for key, cost in doc["profile"].items():
            assert cost["fixed_ms"] + cost["per_token_ms"] + cost["per_seq_ms"] \
                + cost["per_image_ms"] > 0, (key, cost)
        # Predicted: both candidates.
        rows = {r["shape"]: r for r in doc["candidates"]}
        assert sorted(rows) == ["1E+1PD", "2PD"]
        assert all(r["predicted_goodput"] > 0 for r in rows.values()), rows
        # Confirmed with real vLLM: both, each at two load points around its knee, and a
        # third only where the knee is not between them: up if both held the SLO, down if
        # the lower one missed it.
        for row in rows.values():
            assert row["measured_goodput"] is not None, (row, result.stderr[-3000:])
            points = row["measured_points"]
            low, high = (share >= ATTAINMENT for _, share in points[:2])
            assert len(points) == (3 if (low and high) or not low else 2), row
            runs = out / "bench" / row["name"] / "runs"
            assert len(list(runs.glob(f"{row['name']}-*.json"))) == len(points)
        assert doc["best"] in {r["name"] for r in rows.values()}
        assert doc["stop_reason"] and doc["not_confirmed"] == []
        assert (out / "report.md").read_text().startswith("# epdctl tune")
        # The recommendation is a topology that `up` starts and `verify` passes.
        best = load_topology(best_path)
        assert best.name == doc["best"]
    finally:
        stop_everything_under(state_root)
        shutil.rmtree(cache_dir, ignore_errors=True)

    with topology_up(best_path, cache_dir, state_root) as run:
        checked = run.cli("verify", str(best_path), "--json", "--timeout", "300",
                          timeout_s=420)
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
        report = json.loads(checked.stdout)
        assert report["ok"] is True and report["started_topology"] is False
        assert report["prompts"] and all(p["equal"] for p in report["prompts"])
        down = run.cli("down", timeout_s=90)
        assert down.returncode == 0, down.stderr
        assert leftovers(run) == []
