"""`epdctl bench topologies/cpu-demo.yaml` for real: two arms, two load points, repeated images."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.topology_run import cli_env, release_new_semaphores, store_files, write_topology

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
NUM_PROMPTS = 12
REPEAT = 0.5
FIGURES = ("completed", "failed", "duration_s", "request_throughput", "output_throughput",
           "request_goodput", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_mean_ms",
           "tpot_p90_ms", "itl_p99_ms", "e2el_p90_ms")


def test_bench_cpu_demo(tiny_llava: Path, tmp_path: Path) -> None:
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    state_root, out = tmp_path / "state", tmp_path / "out"
    argv = [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "bench", str(path),
            "--max-concurrency", "1,4", "--num-prompts", str(NUM_PROMPTS),
            "--repeat", str(REPEAT), "--image-size", "56", "--input-len", "32",
            "--output-len", "8", "--slo", "ttft=10s,tpot=1s", "--timeout", "400",
            "--json", "--out", str(out)]
    try:
        with release_new_semaphores():
            result = subprocess.run(argv, env=cli_env(), text=True, capture_output=True,
                                    timeout=840)
        check_report(result, out, state_root, cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def check_report(result: subprocess.CompletedProcess[str], out: Path, state_root: Path,
                 cache_dir: Path) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    doc = json.loads(result.stdout)
    assert json.loads((out / "report.json").read_text()) == doc

    assert [(a["name"], a["mode"]) for a in doc["arms"]] == [("epd", "e-pd"),
                                                             ("aggregated", "pd")]
    rows = {(r["arm"], r["point"]): r for r in doc["results"]}
    assert sorted(rows) == [("aggregated", 0), ("aggregated", 1), ("epd", 0), ("epd", 1)]
    for row in rows.values():  # every request completed, every figure there
        figures = row["figures"]
        assert (figures["completed"], figures["failed"]) == (NUM_PROMPTS, 0), row
        assert [k for k in FIGURES if figures[k] is None] == [], row
        assert row["proxy"]["requests_ok"] == NUM_PROMPTS and row["proxy"]["fallbacks"] == 0
    for point in (0, 1):
        assert rows[("epd", point)]["ratios"]["request_goodput"] is not None
        assert rows[("epd", point)]["proxy"]["encode_mean_ms"] > 0
        assert rows[("aggregated", point)]["store"] is None  # no encoder, no store

    # The store reflects the repeats: E saved each distinct image once, while P/PD loaded
    # every distinct image from the store (and served the repeats from it or its own cache).
    for index in (0, 1):
        dataset = out / "datasets" / f"point-{index}.jsonl"
        images = [u for line in dataset.read_text().splitlines()
                  for u in json.loads(line)["image_files"]]
        distinct = len(set(images))
        assert len(images) == NUM_PROMPTS and distinct == NUM_PROMPTS - round(REPEAT * NUM_PROMPTS)
        store = rows[("epd", index)]["store"]
        assert store["saves"] == distinct, store
        assert store["keys_hit"] == distinct and store["misses"] == 0, store
        assert distinct <= store["hits"] <= len(images), store

    check = doc["correctness"]
    assert check["ok"] is True and len(check["prompts"]) == 6
    assert check["answers"]["epd"] == check["answers"]["aggregated"]
    assert all(check["answers"]["epd"])

    assert len(doc["verdicts"]) == 2
    assert doc["vllm_version"].startswith("0.") and doc["devices"]
    assert all("bench" in r["argv"] and "--seed" in r["argv"] for r in doc["results"])
    assert "| concurrency 4 | aggregated | 12 | 0 |" in (out / "report.md").read_text()
    png = (out / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24])[0] > 600

    # Every arm is down: no state.json, nothing of theirs left in the store root.
    for name in ("cpu-demo", "cpu-demo-agg"):
        assert not (state_root / name / "state.json").exists()
        assert (state_root / name / "last-run.json").exists()
    assert store_files(cache_dir) == []
    print("\n" + (out / "report.md").read_text())
