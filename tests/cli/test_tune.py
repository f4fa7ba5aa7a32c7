"""`epdctl tune`: bad input in one line, and a whole run on the simulated machine (fake
GPUs and engines, the real proxy, the simulated `vllm bench serve` sending real requests)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from epdctl.topology.model import load_topology
from epdctl.tune.decide import above_knee, knee_rate
from epdctl.tune.model import ATTAINMENT
from epdctl.tune.search import CONFIRM_POINTS, KNEE_STEPS
from tests.harness import free_ports


def _base(tmp_path: Path) -> Path:
    cost = tmp_path / "cost.yaml"
    cost.write_text("time_scale: 0.2\ngpu: {memory: 24GiB}\n"
                    "model: {heads: 8, weights: 4GiB, encoder_weights: 1GiB, "
                    "kv_per_token: 64KiB}\n")
    base = free_ports(8)
    path = tmp_path / "base.yaml"
    path.write_text(
        f"name: sim\nmodel: sim-model\ndevice: cuda\n"
        f"engine: {{command: [{sys.executable!r}, -m, epdctl.sim.engine, --cost-model, "
        f"{str(cost)!r}], args: [--max-model-len, '2048']}}\n"
        f"cache: {{dir: {str(tmp_path / 'shm')!r}}}\nkv: {{connector: ExampleConnector}}\n"
        f"ports: {{base: {base}, side_channel_base: {base + 5}}}\nproxy: {{port: {base + 4}}}\n"
        "roles:\n  prefill_decode: {gpus: [0]}\n")
    return path


@pytest.mark.parametrize(("args", "message"), [
    (["--slo", "ttft=fast"], "--slo: expected METRIC=TIME"),
    (["--slo", "e2el=2s"], "tune takes ttft and tpot"),
    (["--slo", "ttft=500", "--gpus", "0,x"], "--gpus: expected distinct GPU indices"),
    (["--slo", "ttft=500", "--budget", "soon"], "--budget: expected a duration"),
])
def test_bad_input_is_one_line(epdctl: Callable[..., Result], tmp_path: Path, args: list[str],
                               message: str) -> None:
    result = epdctl("tune", str(_base(tmp_path)), *args,
                    env={"EPDCTL_FAKE_GPUS": "1"})
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output


def test_point_seconds_reaches_the_model_and_the_confirmations(
        epdctl: Callable[..., Result], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--point-seconds is the workload's: the model simulates as many requests as a point
    sends (tune.model.sim_requests), and each confirmation's points send them."""
    seen = {}

    def run_tune(settings: Any, profiler: Any, confirmer: Any, progress: Any) -> None:
        seen["settings"], seen["confirmer"] = settings, confirmer
        raise KeyboardInterrupt

    monkeypatch.setattr("epdctl.tune.runner.tune", run_tune)
    result = epdctl("tune", str(_base(tmp_path)), "--slo", "ttft=500", "--num-prompts", "8",
                    "--point-seconds", "2.5", "--out", str(tmp_path / "out"),
                    # set, so that the runner puts it back: tune points it at the simulated
                    # load generator, which later tests' real vLLM benches must not inherit
                    env={"EPDCTL_FAKE_GPUS": "1", "EPDCTL_BENCH_COMMAND": ""})
    assert result.exit_code == 130, result.output
    assert seen["settings"].workload.point_seconds == 2.5
    workload = seen["confirmer"].workload
    assert (workload.num_prompts, workload.point_seconds) == (8, 2.5)


@pytest.mark.parametrize(("given", "seconds"), [([], 60.0), (["--point-seconds", "0"], 0.0)])
def test_a_trace_is_confirmed_for_a_minute_a_point_unless_told(
        epdctl: Callable[..., Result], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        given: list[str], seconds: float) -> None:
    """tune --trace without --point-seconds plays each confirmation speed for at least
    TRACE_POINT_SECONDS (a short trace at a high speed is a burst too short for a verdict);
    --point-seconds 0 plays the trace once, as bench --trace does."""
    from epdctl.cli._tune_trace import TRACE_POINT_SECONDS

    seen = {}

    def run_tune(settings: Any, profiler: Any, confirmer: Any, progress: Any) -> None:
        seen["settings"], seen["confirmer"] = settings, confirmer
        raise KeyboardInterrupt

    monkeypatch.setattr("epdctl.tune.runner.tune", run_tune)
    result = epdctl("tune", str(_base(tmp_path)), "--slo", "ttft=500", "--trace",
                    str(_trace_file(tmp_path)), "--image-size", "64x64", *given,
                    "--out", str(tmp_path / "out"),
                    env={"EPDCTL_FAKE_GPUS": "1", "EPDCTL_BENCH_COMMAND": ""})
    assert result.exit_code == 130, result.output
    assert TRACE_POINT_SECONDS == 60.0
    assert seen["settings"].trace.model.point_seconds == seconds
    assert seen["confirmer"].workload.point_seconds == seconds


@pytest.mark.slow  # ~35 s on a loaded 2-core machine: four topologies up and down
@pytest.mark.timeout(300)
def test_tune_on_one_fake_gpu(epdctl: Callable[..., Result], tmp_path: Path) -> None:
    out, best = tmp_path / "out", tmp_path / "best.yaml"
    result = epdctl("tune", str(_base(tmp_path)), "--slo", "ttft=2000,tpot=200",
                    "--images", "1", "--image-size", "64x64", "--input-len", "16",
                    "--output-len", "8", "--num-prompts", "4", "--model-facts",
                    str(tmp_path / "cost.yaml"), "--out", str(out), "--write", str(best),
                    "--json", env={"EPDCTL_FAKE_GPUS": "1", "EPDCTL_FAKE_GPU_MEMORY": "24GiB",
                                   "EPDCTL_PROXY_COMMAND": "", "EPDCTL_BENCH_COMMAND": ""})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    shapes = sorted(c["shape"] for c in doc["candidates"])
    assert shapes == ["1E~1PD", "1PD"]
    assert all(c["measured_goodput"] is not None for c in doc["candidates"])
    for c in doc["candidates"]:  # each knee bracketed: a rate held, the next one up missed
        shares = [share for _, share in sorted(c["measured_points"])]
        held = [share >= ATTAINMENT for share in shares]
        assert (True in held and False in held) or len(shares) == CONFIRM_POINTS \
            + KNEE_STEPS, c["measured_points"]
    assert {c["bottleneck"] for c in doc["candidates"]} <= {"encode", "prefill_decode"}
    assert (out / "report.json").is_file() and "| # |" in (out / "report.md").read_text()
    assert set(json.loads((out / "profiles.json").read_text())["entries"]) == {"1E~1PD", "1PD"}
    kept = json.loads((out / "confirmed.json").read_text())["entries"]
    for entry in kept.values():  # the knee point's samples, and the rate above it's
        points = [tuple(p) for p in entry["points"]]
        assert len(entry["samples"]) == (knee_rate(points) is not None), entry["points"]
        assert len(entry["above"]) == (above_knee(points) is not None), entry["points"]
    assert load_topology(best).name == doc["best"]



def _trace_file(tmp_path: Path, gap_ms: float = 250.0, media: str = "image") -> Path:
    """24 requests, 4 a second: text only, one image, two images (64x64), in turn."""
    item = {"type": media, "width": 64, "height": 64}
    lines = []
    for i in range(24):
        line: dict[str, Any] = {"timestamp": i * gap_ms, "input_length": 16,
                                "output_length": 8, "stream": True}
        if i % 3:
            line["media"] = [item] * (i % 3)
        lines.append(json.dumps(line))
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda p: _trace_file(p, media="video"), [], "no cost for video or audio"),
    (lambda p: _trace_file(p, gap_ms=0.0), [], "its requests arrive at once"),
    (_trace_file, ["--images", "2"], "--trace cannot go with --images"),
    (_trace_file, ["--num-prompts", "5"], "--trace cannot go with --num-prompts"),
    (None, ["--limit", "5"], "--limit applies to a trace"),
    (None, ["--mix", "text:0.5,video:0.5"], "no cost for video or audio"),
    (None, ["--mix", "text:1"], "no request has an image"),
    (None, ["--mix", "image:1", "--images", "2"], "--mix cannot go with --images"),
])
def test_a_trace_tune_cannot_take_is_refused_in_one_line(
        epdctl: Callable[..., Result], tmp_path: Path, make: Any, args: list[str],
        message: str) -> None:
    trace = ["--trace", str(make(tmp_path))] if make else []
    result = epdctl("tune", str(_base(tmp_path)), "--slo", "ttft=500", *trace, *args,
                    "--out", str(tmp_path / "out"), env={"EPDCTL_FAKE_GPUS": "1"})
    assert result.exit_code == 1, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow  # ~40 s on a loaded 2-core machine: four topologies up and down
@pytest.mark.timeout(300)
def test_tune_for_a_trace_on_one_fake_gpu(epdctl: Callable[..., Result], tmp_path: Path
                                          ) -> None:
    """Profiled at the `image` class's typical request, predicted per class, confirmed by
    replaying the trace at speeds (each candidate's points.json: the replayer's argv). 24
    requests meet the SLO however fast they come: --point-seconds plays the trace again
    (without it, tune says so in one line: test_traced)."""
    out = tmp_path / "out"
    result = epdctl("tune", str(_base(tmp_path)), "--slo", "ttft=2000,tpot=200",
                    "--trace", str(_trace_file(tmp_path)), "--image-size", "64x64",
                    "--point-seconds", "0.1",
                    "--model-facts", str(tmp_path / "cost.yaml"), "--out", str(out),
                    env={"EPDCTL_FAKE_GPUS": "1", "EPDCTL_FAKE_GPU_MEMORY": "24GiB",
                         "EPDCTL_PROXY_COMMAND": "", "EPDCTL_BENCH_COMMAND": ""})
    assert result.exit_code == 0, result.output
    assert "profiled at class `image`'s typical request: 1 image(s) of 64x64" in result.stdout
    assert "binding stage" in result.stdout
    doc = json.loads((out / "report.json").read_text())
    assert doc["trace"]["classes"] == {"image": 8, "image2": 8, "text": 8}
    assert doc["trace"]["rate"] == pytest.approx(4.0)
    assert (doc["workload"]["images"], doc["workload"]["input_len"]) == (1, 16)
    for c in doc["candidates"]:
        assert set(c["classes"]) == {"image", "image2", "text"}, c
        assert all(0 <= k["attainment"] <= 1 for k in c["classes"].values())
        assert c["predicted_goodput"] == pytest.approx(4.0 * c["speed"], rel=1e-3)
    confirmed = [c for c in doc["candidates"] if c["measured_goodput"] is not None]
    assert confirmed
    for c in confirmed:
        points = json.loads((out / "bench" / c["name"] / "points.json").read_text())
        assert points and len(points) == len(c["measured_points"])
        for p in points:
            argv = p["argv"]
            assert "epdctl.bench.replay" in argv and "--trace" in argv
            assert float(argv[argv.index("--speed") + 1]) == pytest.approx(
                p["rate"] / 4.0, rel=1e-3)
            sent = int(argv[argv.index("--num-prompts") + 1]) if "--num-prompts" in argv \
                else 24
            assert abs(sent - max(24, p["rate"] * 0.1)) <= 1  # the trace cycled
    assert "Per class" in (out / "report.md").read_text()
