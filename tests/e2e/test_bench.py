"""`epdctl bench topologies/cpu-demo.yaml` for real: two arms in two rounds (both orders),
repeated images, a warm-up after each start; and A/A runs (the topology against a copy of
itself, in two rounds and with bench's defaults). One load point each: every point is a
`vllm bench serve` process (~12 s of a core to import), and several points are the CLI's
own arithmetic, tested on the simulated load generator (tests/cli/test_bench.py)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from epdctl.bench.estimates import FIGURES as WITH_INTERVALS
from tests.harness import (
    cli_env,
    copy_topology,
    release_new_semaphores,
    store_files,
    write_topology,
)

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
            "--max-concurrency", "4", "--num-prompts", str(NUM_PROMPTS),
            "--repeat", str(REPEAT), "--image-size", "56", "--input-len", "32",
            "--output-len", "8", "--slo", "ttft=10s,tpot=1s", "--timeout", "400",
            "--rounds", "2", "--warmup", "2", "--json", "--out", str(out)]
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
    # Both orders: epd then aggregated, then aggregated (still up) then epd (started again).
    turns = [(o["round"], o["arm"]) for o in doc["order"]]
    assert turns == [(0, "epd"), (0, "aggregated"), (1, "aggregated"), (1, "epd")]
    assert [(a["name"], a["starts"]) for a in doc["arms"]] == [("epd", 2), ("aggregated", 1)]
    rows = {(r["arm"], r["point"]): r for r in doc["results"]}
    assert sorted(rows) == [("aggregated", 0), ("epd", 0)]
    for row in rows.values():  # every request completed, every figure there, per round
        assert [x["round"] for x in row["rounds"]] == [0, 1]
        for x in row["rounds"]:
            figures = x["figures"]
            assert (figures["completed"], figures["failed"]) == (NUM_PROMPTS, 0), row
            assert [k for k in FIGURES if figures[k] is None] == [], row
            assert x["proxy"]["requests_ok"] == NUM_PROMPTS and x["proxy"]["fallbacks"] == 0
            assert len(x["samples"]["requests"]) == NUM_PROMPTS
        assert row["n"] == 2 * NUM_PROMPTS
        # An interval for every figure, or why there is none (a p90 of 24: `n<100`).
        for name in WITH_INTERVALS:
            ci, why = row["figures"][f"{name}_ci"], row["unsupported"].get(name)
            assert (ci is not None) != (why is not None), (name, row["figures"], why)
            if ci is not None:
                assert ci[0] <= row["figures"][name] <= ci[1], (name, row["figures"])
            else:
                assert row["figures"][name] is None and why in ("n<100", "n<1000", "n/a")
        assert row["unsupported"].get("ttft_p99_ms") == "n<1000"
    for point in (0,):
        assert rows[("epd", point)]["ratios"]["request_goodput"] is not None
        assert rows[("epd", point)]["proxy"]["encode_mean_ms"] > 0
        assert rows[("aggregated", point)]["store"] is None  # no encoder, no store

    # The store reflects the repeats, in each round (each its own images): E saved each
    # distinct image once, P/PD loaded every distinct image from the store (and served the
    # repeats from it or its own cache).
    for index in (0,):
        for round_, suffix in ((0, ""), (1, "-r2")):
            dataset = out / "datasets" / f"point-{index}{suffix}.jsonl"
            images = [u for line in dataset.read_text().splitlines()
                      for u in json.loads(line)["image_files"]]
            distinct = len(set(images))
            assert len(images) == NUM_PROMPTS
            assert distinct == NUM_PROMPTS - round(REPEAT * NUM_PROMPTS)
            store = rows[("epd", index)]["rounds"][round_]["store"]
            assert store["saves"] == distinct, store
            assert store["keys_hit"] == distinct and store["misses"] == 0, store
            assert distinct <= store["hits"] <= len(images), store

    check = doc["correctness"]
    assert check["ok"] is True and len(check["prompts"]) == 6
    assert check["answers"]["epd"] == check["answers"]["aggregated"]
    assert all(check["answers"]["epd"])

    assert len(doc["verdicts"]) == 1
    for v in doc["verdicts"]:  # a verdict naming its figure and interval, or none
        assert v["n"] == 2 * NUM_PROMPTS and v["figures"], v
        if v["kind"] in ("better", "worse", "mixed"):
            assert " better " in v["text"] and "x [" in v["text"], v
        else:
            assert v["kind"] in ("undecided", "on_par"), v
            assert f"no significant difference at n={2 * NUM_PROMPTS}" in v["text"], v
    assert doc["vllm_version"].startswith("0.") and doc["devices"]
    assert all("bench" in r["argv"] and "--seed" in r["argv"] for r in doc["results"])
    assert "| concurrency 4 | aggregated | 24 | 0 |" in (out / "report.md").read_text()
    assert "2 round(s), arms in turn: epd aggregated | aggregated epd" in \
        (out / "report.md").read_text()
    png = (out / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24])[0] > 600

    # Every arm is down: no state.json, nothing of theirs left in the store root.
    for name in ("cpu-demo", "cpu-demo-agg"):
        assert not (state_root / name / "state.json").exists()
        assert (state_root / name / "last-run.json").exists()
    assert store_files(cache_dir) == []
    print("\n" + (out / "report.md").read_text())


def test_bench_a_topology_against_a_copy_of_itself(tiny_llava: Path, tmp_path: Path) -> None:
    """A/A: the same topology under another name and ports, in two rounds (A B B A); a
    verdict here is a bug (the copy's two rounds share one start, the original's come from
    two: the verdict weighs the spread between starts). cpu-demo less its encoder (one
    instance a start: the verdict's arithmetic is the same, the three starts cheaper), and no
    warm-up (test_bench_cpu_demo has one; here it would be a `vllm bench serve` a start)."""
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    data = yaml.safe_load(path.read_text())
    del data["roles"]["encode"]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    copy_cache = Path(f"{cache_dir}-copy")
    (tmp_path / "copy").mkdir()
    copy = copy_topology(path, tmp_path / "copy", model=tiny_llava, cache_dir=copy_cache,
                         name="cpu-demo-copy")
    state_root = tmp_path / "state"
    argv = [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "bench", str(path),
            "--baseline", "none", "--arm", str(copy), "--max-concurrency", "2",
            "--num-prompts", str(NUM_PROMPTS), "--image-size", "56", "--input-len", "32",
            "--output-len", "8", "--warmup", "0", "--rounds", "2", "--timeout", "400", "--json"]
    try:
        with release_new_semaphores():
            result = subprocess.run(argv, env=cli_env(), text=True, capture_output=True,
                                    timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        doc = json.loads(result.stdout)
        assert [a["name"] for a in doc["arms"]] == ["epd", "cpu-demo-copy"]
        (verdict,) = doc["verdicts"]
        assert verdict["kind"] in ("undecided", "on_par"), verdict["text"]
        assert "no significant difference at n=" in verdict["text"]
        assert verdict["starts"] == {"epd": 2, "cpu-demo-copy": 1}, verdict
        assert verdict["starts_measured"] is True
        print("\n" + verdict["text"])
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(copy_cache, ignore_errors=True)


def test_bench_with_its_defaults_gives_no_verdict_between_a_topology_and_its_copy(
        tiny_llava: Path, tmp_path: Path) -> None:
    """A/A with bench's defaults (2 rounds, 3 warm-up requests): topologies/cpu-demo.yaml
    against an identical copy (another name, ports and store), one load point of few
    requests. Between starts, identical topologies on this machine came out 2.30x apart on
    req/s; from one start per arm (the old cpu default) that read as a verdict. Neither the
    printed verdicts nor report.json may say better or worse, at any load point."""
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    copy_cache = Path(f"{cache_dir}-copy")
    (tmp_path / "copy").mkdir()
    copy = copy_topology(path, tmp_path / "copy", model=tiny_llava, cache_dir=copy_cache,
                         name="cpu-demo-copy")
    state_root, out = tmp_path / "state", tmp_path / "out"
    argv = [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "bench", str(path),
            "--baseline", "none", "--arm", str(copy), "--max-concurrency", "2",
            "--num-prompts", str(NUM_PROMPTS), "--image-size", "56", "--input-len", "32",
            "--output-len", "8", "--timeout", "400", "--out", str(out)]
    try:
        with release_new_semaphores():
            result = subprocess.run(argv, env=cli_env(), text=True, capture_output=True,
                                    timeout=840)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        verdicts = [line for line in result.stdout.splitlines() if " vs `epd`" in line]
        assert len(verdicts) == 1, result.stdout
        assert not re.search(r"\b(better|worse|mixed)\b", result.stdout), result.stdout
        assert "plan: 2 rounds, arms in turn: epd cpu-demo-copy | cpu-demo-copy epd; 3 " \
            "starts (`epd` 2, `cpu-demo-copy` 1)" in result.stderr
        doc = json.loads((out / "report.json").read_text())
        assert [(a["name"], a["starts"]) for a in doc["arms"]] == [("epd", 2),
                                                                   ("cpu-demo-copy", 1)]
        for v in doc["verdicts"]:
            assert v["kind"] in ("undecided", "on_par") and v["starts_measured"], v
        for name in ("cpu-demo", "cpu-demo-copy"):  # every arm is down
            assert not (state_root / name / "state.json").exists()
            assert (state_root / name / "last-run.json").exists()
        print("\n" + "\n".join(verdicts))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(copy_cache, ignore_errors=True)
