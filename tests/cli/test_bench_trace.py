"""`epdctl bench --trace` and `--mix`: what cannot go together, refused in one line before
anything starts; a trace on the simulated machine (fake GPUs and engines that record what
they are sent, the real proxy, epdctl's replayer sending the trace's requests); a mix on
fake servers."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from epdctl.traces.classes import shape_class
from epdctl.traces.format import read_trace
from tests.harness import free_ports

RECORDING_ENGINE = Path(__file__).parents[1] / "recording_sim_engine.py"
COUNTS = {"text": 24, "image2": 21, "video+audio": 20}
"""Three classes, each with the requests a class verdict needs (by_class.MIN_REQUESTS)."""


def trace_lines() -> str:
    """COUNTS's requests 20 ms apart, the classes interleaved, lengths and sizes varied,
    streamed or not; some text lines Mooncake's (hash_ids)."""
    media = {"text": [], "image2": [{"type": "image", "width": 64, "height": 48},
                                    {"type": "image", "width": 40, "height": 40}],
             "video+audio": [{"type": "video", "width": 32, "height": 24, "frames": 3},
                             {"type": "audio", "seconds": 0.25}]}
    names = [name for i in range(max(COUNTS.values())) for name in COUNTS
             if i < COUNTS[name]]
    lines = []
    for i, name in enumerate(names):
        line: dict[str, Any] = {"timestamp": 20 * i, "input_length": 4 + i % 9,
                                "output_length": 2 + i % 4}
        if media[name]:
            line["media"] = media[name]
        if i % 3:
            line["stream"] = True
        elif name == "text":
            line["hash_ids"] = [i, i + 1]
        lines.append(json.dumps(line))
    return "\n".join(lines) + "\n"


def topology(tmp_path: Path, record: Path) -> Path:
    cost = tmp_path / "cost.yaml"
    cost.write_text("time_scale: 0.01\ngpu: {memory: 24GiB}\n"
                    "model: {weights: 4GiB, encoder_weights: 1GiB, kv_per_token: 64KiB}\n")
    base = free_ports(8)
    path = tmp_path / "sim.yaml"
    limits = json.dumps({"image": 2, "video": 1, "audio": 1})
    path.write_text(
        f"name: sim\nmodel: sim-model\ndevice: cuda\n"
        f"engine: {{command: [{sys.executable!r}, {str(RECORDING_ENGINE)!r}, {str(record)!r},"
        f" --cost-model, {str(cost)!r}], args: [--max-model-len, '2048', "
        f"--limit-mm-per-prompt, '{limits}']}}\n"
        f"cache: {{dir: {str(tmp_path / 'shm')!r}}}\nkv: {{connector: ExampleConnector}}\n"
        f"ports: {{base: {base}, side_channel_base: {base + 5}}}\nproxy: {{port: {base + 4}}}\n"
        "roles:\n  encode: {gpus: [0]}\n  prefill_decode: {gpus: [1]}\n")
    return path


def sent(request: Any) -> tuple[str, int, int, bool]:
    """A trace line as the engines should see it: class, words, max_tokens, stream."""
    return shape_class(request), request.input_length, request.output_length, request.stream


def received(line: dict[str, Any]) -> tuple[str, int, int, bool]:
    kinds = Counter(m["type"] for m in line["media"])
    name = "+".join(k if n == 1 else f"{k}{n}" for k in ("image", "video", "audio")
                    if (n := kinds[k])) or "text"
    return name, line["words"], line["max_tokens"], line["stream"]


@pytest.mark.slow  # two arms on the simulated machine, up and down
@pytest.mark.timeout(180)
def test_a_trace_of_three_classes_through_the_cli_on_the_simulated_machine(
        epdctl: Callable[..., Result], tmp_path: Path) -> None:
    trace_path, record = tmp_path / "trace.jsonl", tmp_path / "requests.jsonl"
    trace_path.write_text(trace_lines())
    out = tmp_path / "out"
    result = epdctl("bench", str(topology(tmp_path, record)), "--trace", str(trace_path),
                    "--speed", "2", "--rounds", "1", "--warmup", "0", "--slo", "ttft=5000",
                    "--json", "--out", str(out),
                    # The replayer sends a trace, whatever stands in for `vllm bench serve`.
                    env={"EPDCTL_FAKE_GPUS": "2", "EPDCTL_FAKE_GPU_MEMORY": "24GiB",
                         "EPDCTL_PROXY_COMMAND": "", "EPDCTL_BENCH_COMMAND": "false"})
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    trace = read_trace(trace_path)
    wanted = COUNTS
    assert doc["workload"]["kind"] == "trace"
    assert (doc["workload"]["trace"]["file"], doc["workload"]["trace"]["classes"]) == (
        str(trace_path), wanted)
    assert [p["label"] for p in doc["workload"]["points"]] == ["speed 2x"]
    assert [r["arm"] for r in doc["results"]] == ["epd", "aggregated"]
    for row in doc["results"]:
        assert {c["class"]: c["n"] for c in row["classes"]} == wanted
        assert row["figures"]["completed"] == len(trace.requests)
        args = row["argv"]
        assert args[:3] == [sys.executable, "-m", "epdctl.bench.replay"]
        assert args[args.index("--speed") + 1] == "2"
        raw = json.loads((out / "runs" / f"{row['arm']}-0.json").read_text())
        assert raw["classes"] == [shape_class(r) for r in trace.requests]
        assert raw["scheduled_offsets"] == pytest.approx([r.timestamp_ms / 2000
                                                          for r in trace.requests])
    # One class verdict per class (beside the point's own), in the same error budget.
    assert sorted(v.get("class", "") for v in doc["verdicts"]) == [
        "", "image2", "text", "video+audio"]
    assert len({v["level"] for v in doc["verdicts"]}) == 1
    report = (out / "report.md").read_text()
    assert "## Per shape class" in report and "| speed 2x | video+audio | epd | 20 |" in report
    # What the engines got: every line's shape, once per arm (PD), its media on E too.
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    served = Counter(received(x) for x in lines if x["role"] == "prefill_decode"
                     and not x["salted"])  # the greedy subset's prompts carry a salt
    assert served == Counter({k: 2 * n for k, n in Counter(map(sent, trace.requests)).items()})
    encoded = Counter(m["type"] for x in lines if x["role"] == "encode" for m in x["media"]
                      if m.get("width") != 56)  # the greedy subset's images are 56 px
    assert encoded == {"image": 42, "video": 20, "audio": 20}
    sizes = sorted((m["type"], m.get("width"), m.get("height"), m.get("frames"))
                   for x in lines if x["role"] == "prefill_decode" and not x["salted"]
                   for m in x["media"])
    assert sizes == sorted(2 * [(m.type, m.width, m.height, m.frames)
                                for r in trace.requests for m in r.media])


SHORT = """\
{"timestamp": 0, "input_length": 3, "output_length": 2}
{"timestamp": 10, "input_length": 3, "output_length": 2, "media": [{"type": "image"}, {"type": "image"}]}
{"timestamp": 20, "input_length": 3, "output_length": 2, "media": [{"type": "video"}]}
{"timestamp": 30, "input_length": 3, "output_length": 2, "media": [{"type": "image"}, {"type": "image"}]}
"""  # noqa: E501


@pytest.mark.parametrize(("args", "message"), [
    (["--images", "2"], "--trace cannot go with --images: a trace's lines give each "
     "request's shape, length and arrival (--speed scales the arrivals)"),
    (["--request-rate", "2", "--num-prompts", "5"],
     "--trace cannot go with --request-rate, --num-prompts: a trace's lines"),
    (["--mix", "text:1"], "--trace cannot go with --mix"),
    (["--speed", "0"], "--speed: expected a comma-separated list of numbers above 0"),
    (["--speed", "inf"], "--speed: expected finite numbers above 0"),
    (["--limit", "3"], "TRACE: the trace has 4 requests, more than --limit 3 (raise it, or "
     "cut the trace)"),
    (["--max-concurrency", "2"], "--trace cannot go with --max-concurrency"),
])
def test_what_cannot_go_with_a_trace_is_refused_before_anything_starts(
        epdctl: Callable[..., Result], fake_topology: Callable[..., Path], state_root: Path,
        tmp_path: Path, args: list[str], message: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(SHORT)
    result = epdctl("bench", str(fake_topology()), "--trace", str(trace), *args)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {message.replace('TRACE', str(trace))}")
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(state_root.iterdir()) == []


def test_point_seconds_plays_a_short_trace_again_at_each_speed(
        epdctl: Callable[..., Result], fake_topology: Callable[..., Path], state_root: Path,
        tmp_path: Path) -> None:
    """SHORT: 4 requests over 30 ms (100 req/s); 0.05 s of them at speed 1 is 5 requests,
    at speed 4 is 20: the replayer is asked for them (it plays the trace again)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(SHORT)
    result = epdctl("bench", str(fake_topology()), "--trace", str(trace), "--speed", "0.5,1,4",
                    "--point-seconds", "0.05", "--dry-run")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if "--speed" in line]
    counts = [line.split("--num-prompts ")[1].split()[0] if "--num-prompts" in line else "-"
              for line in lines]
    assert counts == ["-", "5", "20"] * 2  # 2.5 at speed 0.5: the trace's 4
    assert list(state_root.iterdir()) == []


@pytest.mark.parametrize(("args", "message"), [
    (["--mix", "text:1", "--images", "2"], "--mix cannot go with --images: its classes give "
     "each request's media (e.g. text:0.4,image2:0.6), Poisson arrivals at each "
     "--request-rate"),
    (["--mix", "text:1", "--speed", "2", "--limit", "5"], "--mix cannot go with --speed, "
     "--limit"),
    (["--mix", "text:0"], "--mix: expected CLASS:SHARE entries with shares above 0"),
    (["--mix", "pictures:1"], "unknown shape class 'pictures'"),
    (["--speed", "2"], "--speed applies to a replayed trace: give --trace FILE"),
    (["--trace", "/nonexistent.jsonl"], "/nonexistent.jsonl: cannot read the trace"),
    (["--mix", "image2:1", "--num-prompts", "4"], "--mix: 4 of 4 requests per point are "
     "`image2` requests, 2 image(s) each; `epd` accepts at most 1 (--limit-mm-per-prompt)"),
    (["--mix", "text:1", "--input-len", "4000", "--output-len", "200"], "--mix: requests ask "
     "for more text tokens (input + output, up to 4200) than `epd`'s --max-model-len 4096"),
])
def test_mix_and_other_misuses_are_refused_before_anything_starts(
        epdctl: Callable[..., Result], fake_topology: Callable[..., Path], state_root: Path,
        args: list[str], message: str) -> None:
    path = fake_topology(pd_args=("--limit-mm-per-prompt", '{"image": 1}',
                                  "--max-model-len", "4096"))
    result = epdctl("bench", str(path), *args)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"Error: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(state_root.iterdir()) == []


@pytest.mark.parametrize(("limits", "message"), [
    ('{"image": 1, "video": 1}', "TRACE: 2 of its 4 lines are `image2` requests, 2 image(s) "
     "each; `epd` accepts at most 1 (--limit-mm-per-prompt)"),
    ('{"image": 2, "video": 0}', "TRACE: 1 of its 4 lines are `video` requests, 1 video(s) "
     "each; `epd` accepts at most 0 (--limit-mm-per-prompt)"),
])
def test_media_an_arm_does_not_take_is_refused_naming_the_class_and_its_lines(
        epdctl: Callable[..., Result], fake_topology: Callable[..., Path], state_root: Path,
        tmp_path: Path, limits: str, message: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(SHORT)
    path = fake_topology(encode_args=("--limit-mm-per-prompt", limits))
    result = epdctl("bench", str(path), "--trace", str(trace))
    assert result.exit_code == 1, result.output
    assert result.stderr == f"Error: {message.replace('TRACE', str(trace))}\n"
    assert list(state_root.iterdir()) == []


def test_a_mix_is_a_trace_per_rate_through_the_replayer(
        epdctl: Callable[..., Result], fake_topology: Callable[..., Path],
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = epdctl("bench", str(fake_topology()), "--mix", "text:0.5,image2:0.5",
                    "--num-prompts", "6", "--request-rate", "50,100", "--input-len", "8",
                    "--output-len", "3", "--image-size", "32x24", "--warmup", "1",
                    "--rounds", "1", "--json",
                    "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["workload"]["kind"], doc["workload"]["mix"]) == (
        "mix", {"text": 0.5, "image2": 0.5})
    assert [p["label"] for p in doc["workload"]["points"]] == ["50 req/s", "100 req/s"]
    for row in doc["results"]:
        assert {c["class"]: c["n"] for c in row["classes"]} == {"text": 3, "image2": 3}
        args = row["argv"]
        assert args[1:3] == ["-m", "epdctl.bench.replay"]
        written = read_trace(Path(args[args.index("--trace") + 1]))
        assert sorted(shape_class(r) for r in written.requests) == ["image2"] * 3 + ["text"] * 3
        assert all(r.stream and r.input_length == 8 and r.output_length == 3
                   for r in written.requests)
        assert {(m.width, m.height) for r in written.requests for m in r.media} == {(32, 24)}
    # Every arm meets the same arrivals at a rate; each rate its own.
    traces = {row["argv"][row["argv"].index("--trace") + 1] for row in doc["results"]}
    assert sorted(Path(t).name for t in traces) == ["point-0.jsonl", "point-1.jsonl"]
    assert sorted(p.name for p in (out / "datasets").glob("*warmup*")) == [
        "aggregated-warmup-1.jsonl", "epd-warmup-1.jsonl"]
    assert "- workload: mix text:0.5, image2:0.5" in (out / "report.md").read_text()
