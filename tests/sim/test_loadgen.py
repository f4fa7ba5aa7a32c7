"""The simulated machine's `vllm bench serve`: bench's own argv, real requests to a fake
engine, vLLM's result file (as bench's parsers read it), its figures computed vLLM's way."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from epdctl.bench import client
from epdctl.bench.samples import parse_round
from epdctl.bench.workload import LoadPoint, Workload, argv, parse_result, parse_slo
from epdctl.sim import loadgen
from epdctl.sim.costmodel import CostModel
from epdctl.sim.engine import Engine, kv_capacity, make_app
from epdctl.sim.options import parse_options
from epdctl.sim.requests import parse_work
from epdctl.sim.scheduler import Scheduler
from epdctl.tune.probes import Bodies

COST = CostModel.model_validate({"time_scale": 0.01, "prefill": {"fixed_ms": 3000}})
PREFILL_S = 0.03
"""A prefill step's fixed cost, scaled: no request's first token comes sooner."""


def bench_argv(tmp_path: Path, url: str, *, rate: float = math.inf, images: int = 1,
               slo: str = "ttft=5000,tpot=1000", prompts: int = 6) -> list[str]:
    workload = Workload(points=(LoadPoint(rate, None),), num_prompts=prompts, images=images,
                        image_size=(64, 48), input_len=12, output_len=5, slo=parse_slo(slo))
    return argv(["loadgen"], workload, 0, url=url, model="/models/sim", served_model_name="m",
                result_dir=tmp_path, result_name="r.json")[1:]


def run_against_engine(args: list[str]) -> None:
    async def main() -> None:
        opts = parse_options(["m"], {})
        engine = Engine(COST, opts, Scheduler(COST, tp=1, kv_tokens=kv_capacity(COST, opts)))
        task = asyncio.create_task(engine.scheduler.run())
        server = TestServer(make_app(engine), host="127.0.0.1")
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            parsed = loadgen.parse_args([a if a != "URL" else url for a in args])
            outcomes, duration = await loadgen.run(parsed, loadgen.bodies(parsed))
            out = Path(parsed.result_dir) / parsed.result_filename
            out.write_text(json.dumps(loadgen.result(parsed, outcomes, duration)))
        finally:
            await server.close()
            task.cancel()

    asyncio.run(main())


def test_a_load_point_from_benchs_argv_gives_the_result_bench_reads(tmp_path: Path) -> None:
    run_against_engine(bench_argv(tmp_path, "URL", rate=200.0))
    data = json.loads((tmp_path / "r.json").read_text())
    figures = parse_result(tmp_path / "r.json")
    assert (figures["completed"], figures["failed"]) == (6, 0)
    assert data["output_lens"] == [5] * 6  # from the answers' usage
    # vLLM's timing: the role chunk is the first (it comes with the first token), then a gap
    # before each token's chunk.
    assert all(len(itl) == 5 for itl in data["itls"])
    assert all(PREFILL_S <= t < lat for t, lat in zip(data["ttfts"], data["latencies"],
                                                     strict=True))
    assert figures["request_goodput"] == pytest.approx(6 / data["duration"])  # a loose SLO
    samples = parse_round(data, parse_slo("ttft=5000,tpot=1000"))
    assert [r.good for r in samples.requests] == [True] * 6
    assert figures["tpot_mean_ms"] == pytest.approx(
        sum(r.tpot_ms for r in samples.requests if r.tpot_ms) / 6)


def test_goodput_counts_only_requests_within_every_slo(tmp_path: Path) -> None:
    run_against_engine(bench_argv(tmp_path, "URL", slo="ttft=5000,tpot=0.001"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["completed"] == 6 and data["request_goodput"] == 0.0
    assert [r.good for r in parse_round(data, parse_slo("ttft=5000,tpot=0.001")).requests
            ] == [False] * 6


def test_a_refused_request_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    args = bench_argv(tmp_path, "URL", prompts=2)
    args[args.index("--random-input-len") + 1] = "5000"  # longer than --max-model-len
    run_against_engine(args)
    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["completed"], data["failed"]) == (0, 2)
    assert all(e.startswith("HTTP 400") for e in data["errors"])


def test_requests_are_shaped_as_tunes_probes(tmp_path: Path) -> None:
    """What tune profiles (Bodies) and what it then confirms (this) cost the same."""
    args = loadgen.parse_args(bench_argv(tmp_path, "http://x", images=2))
    (body, *_) = loadgen.bodies(args)
    workload = Workload(points=(LoadPoint(),), images=2, image_size=(64, 48), input_len=12,
                        output_len=5)
    probe = Bodies(workload, "m").chat(0, 5, stream=True)
    ours, theirs = (parse_work(b, True, COST.model) for b in (body, probe))
    assert ours.mpixels == theirs.mpixels == [64 * 48 / 1e6] * 2
    assert abs(ours.prompt_tokens - theirs.prompt_tokens) <= 3  # a number ahead of the words
    assert ours.output_tokens == 5 and body["stream"] is True


def test_every_request_has_images_of_its_own(tmp_path: Path) -> None:
    args = loadgen.parse_args(bench_argv(tmp_path, "http://x", images=2, prompts=3))
    urls = [part["image_url"]["url"] for body in loadgen.bodies(args)
            for part in body["messages"][0]["content"] if part["type"] == "image_url"]
    assert len(urls) == len(set(urls)) == 6


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 50, 0.0), ([3.0], 99, 3.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([1.0, 2.0, 3.0, 4.0], 90, 3.7), ([10.0, 0.0, 5.0], 0, 0.0), ([10.0, 0.0, 5.0], 100, 10.0),
])
def test_percentiles_are_numpys_linear_ones(values: list[float], q: float,
                                            expected: float) -> None:
    assert client.percentile(values, q) == pytest.approx(expected)


@pytest.mark.parametrize(("extra", "message"), [
    (["--dataset-name", "sharegpt"], "invalid choice"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--goodput", "latency:5"], "expected ttft|tpot|e2el:MS"),
])
def test_what_it_does_not_simulate_is_refused_in_one_line(
        extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        loadgen.parse_args(["--base-url", "http://x", "--model", "m", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_video_buckets_are_refused() -> None:
    with pytest.raises(SystemExit, match="images only, not video"):
        loadgen.parse_args(["--base-url", "http://x", "--model", "m", "--dataset-name",
                            "random-mm", "--random-mm-bucket-config", "{(64, 64, 8): 1.0}"])
