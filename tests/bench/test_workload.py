"""Load points, options, the `vllm bench serve` argv, its result JSON, the --repeat dataset."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from epdctl.bench.arms import derive_arms
from epdctl.bench.workload import (
    LoadPoint,
    Workload,
    argv,
    bench_command,
    check,
    load_points,
    parse_image_size,
    parse_list,
    parse_result,
    parse_slo,
    write_dataset,
)
from epdctl.errors import BenchError
from epdctl.topology.model import parse_topology

TOPOLOGY = parse_topology({
    "name": "t", "model": "org/vl", "served_model_name": "vl", "device": "cpu",
    "engine": {"args": ["--max-model-len", "512", "--limit-mm-per-prompt", '{"image": 2}']},
    "roles": {"encode": {}, "prefill_decode": {}}})
ARMS = derive_arms(TOPOLOGY, Path("t.yaml"))


def test_sweeps() -> None:
    assert load_points(parse_list("1,2.5,inf", "--request-rate", float), []) == (
        LoadPoint(1.0), LoadPoint(2.5), LoadPoint(math.inf))
    assert load_points([4.0], [1, 8]) == (LoadPoint(4.0, 1), LoadPoint(4.0, 8))
    assert load_points([1.0, 2.0], [8]) == (LoadPoint(1.0, 8), LoadPoint(2.0, 8))
    assert [p.label for p in load_points([], [])] == [
        "concurrency 1", "concurrency 4", "concurrency 16"]
    with pytest.raises(BenchError, match="sweep one of"):
        load_points([1.0, 2.0], [1, 2])


@pytest.mark.parametrize("text", ["0", "-1", "x", "1,,2", "inf"])
def test_bad_concurrency_lists(text: str) -> None:
    with pytest.raises(BenchError, match="--max-concurrency: expected a comma-separated"):
        parse_list(text, "--max-concurrency", int)


def test_slo_and_image_size() -> None:
    assert parse_slo("ttft=500,tpot=50ms,e2el=2s") == (
        ("ttft", 500.0), ("tpot", 50.0), ("e2el", 2000.0))
    for bad in ("ttft", "itl=5", "ttft=-1", "ttft=fast"):
        with pytest.raises(BenchError, match="--slo: expected METRIC=TIME"):
            parse_slo(bad)
    assert parse_image_size("640x480") == (640, 480) and parse_image_size("56") == (56, 56)
    with pytest.raises(BenchError, match="--image-size"):
        parse_image_size("0x5")


def test_argv_random_mm(tmp_path: Path) -> None:
    w = Workload(points=(LoadPoint(2.0, 8), LoadPoint(4.0, 8)), num_prompts=30, seed=7,
                 images=2, image_size=(640, 480), slo=(("ttft", 500.0),))
    args = argv(["vllm", "bench", "serve"], w, 1, url="http://127.0.0.1:9", model="org/vl",
                served_model_name="vl", result_dir=tmp_path, result_name="epd-1.json")
    text = " ".join(args)
    assert args[:3] == ["vllm", "bench", "serve"]
    assert "--backend openai-chat --base-url http://127.0.0.1:9" in text
    assert "--model org/vl --served-model-name vl" in text
    assert "--num-prompts 30 --seed 8 --request-rate 4 --max-concurrency 8" in text
    assert "--dataset-name random-mm" in text
    assert "--random-mm-base-items-per-request 2" in text
    assert args[args.index("--random-mm-bucket-config") + 1] == "{(480, 640, 1): 1.0}"
    assert (f"--save-result --save-detailed --result-dir {tmp_path} "
            "--result-filename epd-1.json") in text
    assert args[-2:] == ["--goodput", "ttft:500"]


def test_argv_generated_and_user_datasets(tmp_path: Path) -> None:
    w = Workload(points=(LoadPoint(),), repeat=0.5)
    args = argv(["b"], w, 0, url="u", model="m", served_model_name="m", result_dir=tmp_path,
                result_name="r.json", dataset=tmp_path / "d.jsonl")
    assert "--dataset-name custom_image --dataset-path " + str(tmp_path / "d.jsonl") in \
        " ".join(args)
    assert "--disable-shuffle" in args and "--max-concurrency" not in args
    mine = Workload(points=(LoadPoint(),), dataset=tmp_path / "mine.json", dataset_name="sharegpt")
    args = argv(["b"], mine, 0, url="u", model="m", served_model_name="m", result_dir=tmp_path,
                result_name="r.json")
    assert "--dataset-name sharegpt --dataset-path " + str(tmp_path / "mine.json") in \
        " ".join(args)
    assert "--disable-shuffle" not in args


def test_bench_command_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPDCTL_BENCH_COMMAND", raising=False)
    assert bench_command(ARMS[0])[1:] == ["-m", "epdctl.engines.vllm_cpu", "bench", "serve"]
    gpu = parse_topology({"name": "g", "model": "m", "roles": {"prefill_decode": {}}})
    assert bench_command(derive_arms(gpu, Path("g.yaml"))[0]) == ["vllm", "bench", "serve"]
    own = parse_topology({"name": "o", "model": "m", "engine": {
        "command": ["/opt/v/bin/vllm", "serve"]}, "roles": {"prefill_decode": {}}})
    assert bench_command(derive_arms(own, Path("o.yaml"))[0]) == [
        "/opt/v/bin/vllm", "bench", "serve"]


def test_parse_result(tmp_path: Path) -> None:
    # What vLLM 0.32's `vllm bench serve --save-result --metric-percentiles 50,90,99` writes.
    path = tmp_path / "r.json"
    path.write_text(json.dumps({
        "date": "20250101-000000", "backend": "openai-chat", "duration": 10.5,
        "completed": 98, "failed": 2, "total_input_tokens": 1000,
        "total_output_tokens": 6272, "request_throughput": 9.33, "request_goodput": 7.1,
        "output_throughput": 597.3, "total_token_throughput": 692.5,
        "max_output_tokens_per_s": 700.0, "max_concurrent_requests": 16,
        "mean_ttft_ms": 120.0, "median_ttft_ms": 100.0, "std_ttft_ms": 30.0,
        "p50_ttft_ms": 100.0, "p90_ttft_ms": 180.0, "p99_ttft_ms": 250.0,
        "mean_tpot_ms": 12.5, "median_tpot_ms": 12.0, "p90_tpot_ms": 15.0,
        "p99_tpot_ms": 20.0, "p50_itl_ms": 11.0, "p90_itl_ms": 14.0, "p99_itl_ms": 30.0,
        "p90_e2el_ms": 900.0}))
    assert parse_result(path) == {
        "completed": 98, "failed": 2, "duration_s": 10.5, "request_throughput": 9.33,
        "output_throughput": 597.3, "request_goodput": 7.1, "ttft_p50_ms": 100.0,
        "ttft_p90_ms": 180.0, "ttft_p99_ms": 250.0, "tpot_mean_ms": 12.5, "tpot_p90_ms": 15.0,
        "itl_p99_ms": 30.0, "e2el_p90_ms": 900.0}
    path.write_text(json.dumps({"completed": 1, "median_ttft_ms": 5.0, "request_goodput": None}))
    figures = parse_result(path)
    assert figures["ttft_p50_ms"] == 5.0 and figures["request_goodput"] is None
    path.write_text("[]")
    with pytest.raises(BenchError, match="not a `vllm bench serve` result"):
        parse_result(path)
    with pytest.raises(BenchError, match="no `vllm bench serve` result"):
        parse_result(tmp_path / "missing.json")


def test_repeat_dataset(tmp_path: Path) -> None:
    w = Workload(points=(LoadPoint(), LoadPoint()), num_prompts=20, images=2,
                 image_size=(64, 48), repeat=0.25, input_len=8)
    counts = write_dataset(w, 0, tmp_path / "a.jsonl")
    assert counts == {"requests": 20, "images": 40, "distinct_images": 30, "repeated_images": 10}
    lines = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert len(lines) == 20 and all(len(x["image_files"]) == 2 for x in lines)
    urls = [u for x in lines for u in x["image_files"]]
    assert len(set(urls)) == 30
    seen: set[str] = set()
    for line in lines:  # a repeat always follows its first use, never within one request
        assert len(set(line["image_files"])) == 2
        seen |= set(line["image_files"])
    assert write_dataset(w, 0, tmp_path / "b.jsonl") == counts
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    write_dataset(w, 1, tmp_path / "c.jsonl")  # another load point: other images
    other = {u for x in (tmp_path / "c.jsonl").read_text().splitlines()
             for u in json.loads(x)["image_files"]}
    assert not other & set(urls)


def test_repeat_dataset_images_decode_and_vllm_reads_it(tmp_path: Path) -> None:
    import base64
    import io

    Image = pytest.importorskip("PIL.Image")
    w = Workload(points=(LoadPoint(),), num_prompts=6, images=1, image_size=(64, 48),
                 repeat=0.5, input_len=4)
    write_dataset(w, 0, tmp_path / "d.jsonl")
    first = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
    data = base64.b64decode(first["image_files"][0].partition(",")[2])
    assert Image.open(io.BytesIO(data)).size == (64, 48)
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    ds = datasets.CustomImageDataset(dataset_path=str(tmp_path / "d.jsonl"), random_seed=0,
                                     disable_shuffle=True)
    requests = ds.sample(tokenizer=None, num_requests=6, output_len=4)
    assert len(requests) == 6
    assert [r.prompt for r in requests] == [
        json.loads(x)["prompt"] for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert requests[0].multi_modal_data["image_url"]["url"] == first["image_files"][0]


def test_refusals_before_anything_starts() -> None:
    with pytest.raises(BenchError, match=r"3 image\(s\) per request; `epd` accepts at most 2"):
        check(ARMS, Workload(points=(LoadPoint(),), images=3))
    with pytest.raises(BenchError, match="--max-model-len 512"):
        check(ARMS, Workload(points=(LoadPoint(),), input_len=500, output_len=64))
    check(ARMS, Workload(points=(LoadPoint(),), images=2, input_len=32, output_len=8))


def test_user_dataset_image_count_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "p", "image_files": ["a", "b", "c"]}) + "\n")
    with pytest.raises(BenchError, match=r"3 image\(s\) per request"):
        check(ARMS, Workload(points=(LoadPoint(),), dataset=path))


def test_argv_random_mm_with_videos_gives_exact_counts_in_vllms_sampler(tmp_path: Path) -> None:
    """A video bucket (frames > 1) beside the image one; vLLM's own sampler then draws
    exactly the images and videos asked for per request."""
    w = Workload(points=(LoadPoint(),), images=1, videos=2, video_frames=6, image_size=(64, 48))
    args = argv(["b"], w, 0, url="u", model="m", served_model_name="m", result_dir=tmp_path,
                result_name="r.json")
    config = args[args.index("--random-mm-bucket-config") + 1]
    assert config == "{(48, 64, 1): 0.3333333333333333, (48, 64, 6): 0.6666666666666666}"
    limit = json.loads(args[args.index("--random-mm-limit-mm-per-prompt") + 1])
    assert limit == {"image": 1, "video": 2}
    assert args[args.index("--random-mm-base-items-per-request") + 1] == "3"
    datasets = pytest.importorskip("vllm.benchmarks.datasets.datasets")
    import ast

    parsed = ast.literal_eval(config)  # as vLLM's --random-mm-bucket-config parser reads it
    sampler = datasets.RandomMultiModalDataset(random_seed=0)
    for _ in range(20):
        drawn = list(sampler.get_mm_item_iterator(3, 3, parsed, limit))
        assert sorted(frames for _, _, frames in drawn) == [1, 6, 6]
    only_videos = Workload(points=(LoadPoint(),), images=0, videos=1)
    args = argv(["b"], only_videos, 0, url="u", model="m", served_model_name="m",
                result_dir=tmp_path, result_name="r.json")
    assert args[args.index("--random-mm-bucket-config") + 1] == "{(512, 512, 4): 1.0}"
    assert "--dataset-name random-mm" in " ".join(args)


def test_more_videos_than_an_arm_takes_is_refused() -> None:
    topology = parse_topology({
        "name": "t", "model": "org/vl", "served_model_name": "vl", "device": "cpu",
        "engine": {"args": ["--limit-mm-per-prompt", '{"image": 2, "video": 1}']},
        "roles": {"encode": {}, "prefill_decode": {}}})
    arms = derive_arms(topology, Path("t.yaml"))
    with pytest.raises(BenchError, match=r"2 video\(s\) per request; `epd` accepts at most 1"):
        check(arms, Workload(points=(LoadPoint(),), videos=2))
    check(arms, Workload(points=(LoadPoint(),), images=2, videos=1))


def test_point_seconds_cycles_a_short_trace(tmp_path: Path) -> None:
    """A trace's point sends at least its mean rate there x point_seconds requests (the
    replayer plays the trace again past its end), at most --limit; without, the trace."""
    from epdctl.bench.senders import estimate_s, replay_argv
    from epdctl.bench.tracefile import TraceFile

    trace = TraceFile(tmp_path / "t.jsonl", "epdctl", 11, 5.0, (("text", 11),), limit=100)
    assert trace.rate == 2.0
    points = (LoadPoint(speed=1.0), LoadPoint(speed=4.0), LoadPoint(speed=50.0))
    w = Workload(points=points, num_prompts=11, point_seconds=3.0, trace=trace)
    assert [w.requests_at(i) for i in range(3)] == [11, 24, 100]

    def argv(i: int) -> list[str]:
        return replay_argv(w, i, url="http://x", model="m", served_model_name="m",
                           result_dir=tmp_path, result_name="r.json")

    assert "--num-prompts" not in argv(0)
    assert argv(1)[argv(1).index("--num-prompts") + 1] == "24"
    assert estimate_s(w, 1) == pytest.approx(5.0 * 24 / 11 / 4)
    assert replace(w, point_seconds=0.0).requests_at(2) == 11


def test_point_seconds_sends_a_rates_seconds_of_requests(tmp_path: Path) -> None:
    """--point-seconds: a rate point sends max(num_prompts, rate x S), in the argv, the
    generated dataset and the report's JSON; all-at-once and concurrency points keep
    num_prompts."""
    points = (LoadPoint(2.0), LoadPoint(50.0), LoadPoint(math.inf), LoadPoint(math.inf, 4))
    w = Workload(points=points, num_prompts=30, point_seconds=10, repeat=0.5,
                 image_size=(8, 8), input_len=4)
    assert [w.requests_at(i) for i in range(4)] == [30, 500, 30, 30]
    off = Workload(points=points, num_prompts=30)
    assert [off.requests_at(i) for i in range(4)] == [30, 30, 30, 30]
    args = argv(["vllm", "bench", "serve"], w, 1, url="http://127.0.0.1:9", model="org/vl",
                served_model_name="vl", result_dir=tmp_path, result_name="x.json",
                dataset=tmp_path / "d.jsonl")
    assert args[args.index("--num-prompts") + 1] == "500"
    counts = write_dataset(w, 1, tmp_path / "d.jsonl")
    assert counts["requests"] == 500
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == 500
    doc = w.as_json()
    assert doc["point_seconds"] == 10
    assert [p["requests"] for p in doc["points"]] == [30, 500, 30, 30]
