"""`epdctl bench topologies/cpu-qwen2vl.yaml --videos 1` for real: a video workload (vLLM's
random-mm with a video bucket) completes every request in both arms, and E encoded each
video once while PD loaded it from the store. No warm-up: test_bench_cpu_demo has one, and
here it would be a `vllm bench serve` a start; one round (figures, no verdict: the
workload is what is tested here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import cli_env, release_new_semaphores, store_files, write_topology

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
NUM_PROMPTS = 6


def test_bench_video_workload_on_cpu_qwen2vl(tiny_qwen2vl: Path, tmp_path: Path) -> None:
    path, cache_dir = write_topology("cpu-qwen2vl", tmp_path, tiny_qwen2vl)
    state_root, out = tmp_path / "state", tmp_path / "out"
    argv = [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "bench", str(path),
            "--max-concurrency", "2", "--num-prompts", str(NUM_PROMPTS), "--images", "0",
            "--videos", "1", "--video-frames", "4", "--image-size", "56", "--input-len", "32",
            "--output-len", "8", "--warmup", "0", "--rounds", "1", "--timeout", "400",
            "--json", "--out", str(out)]
    try:
        with release_new_semaphores():
            result = subprocess.run(argv, env=cli_env(), text=True, capture_output=True,
                                    timeout=840)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        doc = json.loads(result.stdout)
        assert doc["workload"]["videos"] == 1 and doc["workload"]["images"] == 0
        rows = {r["arm"]: r for r in doc["results"]}
        assert sorted(rows) == ["aggregated", "epd"]
        for row in rows.values():
            assert (row["figures"]["completed"], row["figures"]["failed"]) == (NUM_PROMPTS, 0)
            assert "--random-mm-bucket-config" in row["argv"]
        epd = rows["epd"]
        assert epd["proxy"]["requests_ok"] == NUM_PROMPTS and epd["proxy"]["fallbacks"] == 0
        # Each request's video is new: E saved each one, PD loaded each from the store.
        assert epd["store"]["saves"] == NUM_PROMPTS, epd["store"]
        assert epd["store"]["keys_hit"] == NUM_PROMPTS and epd["store"]["misses"] == 0
        assert doc["correctness"]["ok"] is True
        for name in ("cpu-qwen2vl", "cpu-qwen2vl-agg"):
            assert not (state_root / name / "state.json").exists()
        assert store_files(cache_dir) == []
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
