"""Real traffic on real vLLM (CPU): record what topologies/cpu-demo.yaml served, then replay it.

Twelve requests of three shapes (text only, one image, two images; one of them streamed) go
through the demo's proxy; `epdctl logs --export-trace` writes them as a trace (12 lines, the
shapes and sizes sent, increasing times); `epdctl bench --trace` replays that file against
the demo and its aggregated baseline, and reports per shape class. What the engines got is
counted from their own access logs (PD: a request each; E: an image each), and the demo's
proxy log of the replay, exported again, holds the same shapes as the first recording.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from epdctl.traces.classes import shape_class
from epdctl.traces.format import read_trace
from tests.harness import (
    chat,
    cli_env,
    encoder_posts,
    image_data_url,
    make_image,
    release_new_semaphores,
    store_files,
    topology_up,
    write_topology,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "tiny-llava"
OUTPUT = 8
SIZES = {"text": [], "image": [(56, 56)], "image2": [(56, 56), (64, 48)]}
"""Each class's images (width, height): four requests of each class."""
CLASSES = {"text": 4, "image": 4, "image2": 4}


def _send(url: str) -> list[tuple[str, bool]]:
    """The twelve requests, one after another (classes interleaved; the second one-image
    request streamed): (class, streamed) in the order sent."""
    sent = []
    for n in range(4):
        for name, sizes in SIZES.items():
            urls = [image_data_url(make_image(100 + 10 * n + i, size)) for i, size in
                    enumerate(sizes)]
            stream = name == "image" and n == 1
            answer = chat(url, MODEL, image_urls=urls, text=f"request {n} of {name}: describe",
                          stream=stream, max_tokens=OUTPUT, extra_body={"ignore_eos": True})
            assert answer
            sent.append((name, stream))
    return sent


def test_record_what_the_demo_served_then_replay_it_against_aggregated(
        tiny_llava: Path, tmp_path: Path) -> None:
    path, cache_dir = write_topology("cpu-demo", tmp_path, tiny_llava)
    trace = tmp_path / "served.jsonl"
    with topology_up(path, cache_dir, tmp_path / "state") as run:
        sent = _send(run.proxy_url)
        result = run.cli("logs", "--export-trace", str(trace), "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
    assert summary["requests"] == 12 and summary["failed"] == 0, summary
    assert summary["classes"] == CLASSES, summary
    recorded = read_trace(trace)
    assert [(shape_class(r), r.stream) for r in recorded.requests] == sent
    stamps = [r.timestamp_ms for r in recorded.requests]
    assert stamps[0] == 0 and all(b > a for a, b in zip(stamps, stamps[1:], strict=False))
    for request in recorded.requests:
        sizes = [(m.width, m.height) for m in request.media]
        assert sizes == SIZES[shape_class(request)], request
        assert request.output_length == OUTPUT and request.input_length >= 5, request

    state_root, out = tmp_path / "bench-state", tmp_path / "out"
    argv = [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "bench", str(path),
            "--trace", str(trace), "--rounds", "1", "--warmup", "0",
            "--slo", "ttft=10s,tpot=1s", "--timeout", "400", "--json", "--out", str(out)]
    try:
        with release_new_semaphores():
            bench = subprocess.run(argv, env=cli_env(), text=True, capture_output=True,
                                   timeout=840)
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-5000:]
        doc = json.loads(bench.stdout)
        assert doc["workload"]["kind"] == "trace"
        assert doc["workload"]["trace"]["classes"] == CLASSES
        assert [r["arm"] for r in doc["results"]] == ["epd", "aggregated"]
        for row in doc["results"]:  # every request answered, reported per class
            assert row["figures"]["completed"] == 12 and row["figures"]["failed"] == 0, row
            assert {c["class"]: c["n"] for c in row["classes"]} == CLASSES, row
        assert "## Per shape class" in (out / "report.md").read_text()
        for v in doc["verdicts"]:  # one start per arm: figures, never a verdict
            assert v["kind"] in ("undecided", "none"), v

        # What the engines got: the demo's PD a request per line (and the greedy subset's),
        # its E an image per item that was not in the store yet (the replay's are new).
        from epdctl.verifier.prompts import PROMPTS

        greedy = [p for p in PROMPTS if p.name in doc["correctness"]["prompts"]]
        demo_logs = state_root / "cpu-demo" / "logs"
        pd_posts = encoder_posts((demo_logs / "pd-0.log").read_text(errors="replace"))
        assert pd_posts == 12 + len(greedy)
        e_posts = encoder_posts((demo_logs / "encode-0.log").read_text(errors="replace"))
        assert 12 <= e_posts <= 12 + sum(len(p.images) for p in greedy)
        agg_posts = sum(encoder_posts(log.read_text(errors="replace"))
                        for log in (state_root / "cpu-demo-agg" / "logs").glob("pd-*.log"))
        assert agg_posts == 12 + len(greedy)

        # The demo's proxy, recording the replay: the same shapes and sizes again.
        again = tmp_path / "replayed.jsonl"
        exported = subprocess.run(
            [sys.executable, "-m", "epdctl", "--state-dir", str(state_root), "logs",
             "--name", "cpu-demo", "--export-trace", str(again)],
            env=cli_env(), text=True, capture_output=True, timeout=120)
        assert exported.returncode == 0, exported.stderr
        replayed = Counter((shape_class(r), tuple((m.width, m.height) for m in r.media),
                            r.stream) for r in read_trace(again).requests)
        wanted = Counter((shape_class(r), tuple((m.width, m.height) for m in r.media),
                          r.stream) for r in recorded.requests)
        assert replayed & wanted == wanted, (replayed, wanted)  # and the greedy subset's
        for name in ("cpu-demo", "cpu-demo-agg"):  # every arm is down, the store empty
            assert not (state_root / name / "state.json").exists()
        assert store_files(cache_dir) == []
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
