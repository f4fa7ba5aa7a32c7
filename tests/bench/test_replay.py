"""The trace replayer: each line's request (its sizes, lengths, stream), its arrival at the
scaled time (a fake clock: exact; a real one: order and never early), and the result file
bench reads, against the simulated engine; Mooncake's text lines as they are."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import wave
import zlib
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from epdctl.bench import replay
from epdctl.bench.bodies import Defaults, body, part, request_seed
from epdctl.bench.client import Outcome
from epdctl.bench.samples import parse_round
from epdctl.bench.workload import WORDS, parse_result, parse_slo
from epdctl.sim.costmodel import CostModel
from epdctl.sim.engine import Engine, kv_capacity, make_app
from epdctl.sim.options import parse_options
from epdctl.sim.scheduler import Scheduler
from epdctl.traces.format import MediaItem, TraceRequest

COST = CostModel.model_validate({"time_scale": 0.01})
MOONCAKE = """\
{"timestamp": 27482, "input_length": 30, "output_length": 5, "hash_ids": [46, 47, 48]}
{"timestamp": 30535, "input_length": 22, "output_length": 3, "hash_ids": [46, 47, 49]}
{"timestamp": 27600, "input_length": 10, "output_length": 4, "hash_ids": []}
"""
"""Mooncake's lines (its timestamps in ms, out of order as some are, its hash_ids)."""
MEDIA = """\
{"timestamp": 0, "input_length": 12, "output_length": 5, "stream": true}
{"timestamp": 100, "input_length": 8, "output_length": 4, "media": [{"type": "image", "width": 64, "height": 48}, {"type": "image", "width": 32, "height": 32}]}
{"timestamp": 150, "input_length": 6, "output_length": 3, "media": [{"type": "video", "width": 32, "height": 24, "frames": 3}, {"type": "audio", "seconds": 0.5}], "stream": true}
{"timestamp": 400, "input_length": 10, "output_length": 6}
"""  # noqa: E501


def png_size(url: str) -> tuple[int, int]:
    raw = base64.b64decode(url.partition(",")[2])
    return struct.unpack(">II", raw[16:24])


def pixels(url: str) -> bytes:
    raw = base64.b64decode(url.partition(",")[2])
    length, = struct.unpack(">I", raw[33:37])  # the IDAT chunk after IHDR
    return zlib.decompress(raw[41:41 + length])


def parts(made: dict[str, Any]) -> list[dict[str, Any]]:
    content = made["messages"][0]["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def test_a_line_becomes_its_request() -> None:
    line = TraceRequest(0.0, 7, 9, (MediaItem("image", 64, 48), MediaItem("video", 32, 24, 3),
                                    MediaItem("audio", seconds=0.5)), stream=True)
    made = body(line, request_seed(3, 1), "served")
    assert (made["model"], made["max_tokens"], made["ignore_eos"], made["temperature"]) == (
        "served", 9, True, 0.0)
    assert made["stream"] is True and made["stream_options"] == {"include_usage": True}
    image, video, audio, text = parts(made)
    words = text["text"].split()
    assert len(words) == 7 and set(words) <= set(WORDS)
    assert png_size(image["image_url"]["url"]) == (64, 48)
    header, _, frames = video["video_url"]["url"].partition(",")
    assert header == "data:video/jpeg;base64"
    assert [struct.unpack(">II", base64.b64decode(f)[16:24]) for f in frames.split(",")] == [
        (32, 24)] * 3
    assert audio["input_audio"]["format"] == "wav"
    with wave.open(BytesIO(base64.b64decode(audio["input_audio"]["data"]))) as clip:
        assert clip.getnframes() / clip.getframerate() == pytest.approx(0.5)
    assert body(line, request_seed(3, 1), "served") == made  # deterministic


def test_what_a_line_leaves_out_comes_from_the_defaults_and_text_is_a_string() -> None:
    line = TraceRequest(0.0, 4, 2, (MediaItem("image"), MediaItem("video"),
                                    MediaItem("audio")))
    image, video, audio, _ = parts(body(line, 5, "m", Defaults((40, 30), 2, 0.25)))
    assert png_size(image["image_url"]["url"]) == (40, 30)
    assert video["video_url"]["url"].count(",") == 2  # the header's comma and one between
    with wave.open(BytesIO(base64.b64decode(audio["input_audio"]["data"]))) as clip:
        assert clip.getnframes() / clip.getframerate() == pytest.approx(0.25)
    text_only = body(TraceRequest(0.0, 3, 2), 5, "m")
    assert isinstance(text_only["messages"][0]["content"], str)
    assert "stream" not in text_only  # answered whole, as the line says


def test_seeds_whose_colourings_meet_still_give_other_pixels() -> None:
    """Seeds 4171 and 7402 draw png's same three colour offsets: the seed written into the
    first pixels keeps their images apart."""
    a, b = (part(MediaItem("image", 16, 8), seed)["image_url"]["url"] for seed in (4171, 7402))
    assert pixels(a)[1 + 16:] == pixels(b)[1 + 16:]  # the same beyond the seed's pixels
    assert pixels(a) != pixels(b)


def test_no_two_requests_share_an_image_nor_a_frame() -> None:
    """Distinct pixels (vLLM hashes pixels): every seed's own, across requests and seeds."""
    line = TraceRequest(0.0, 1, 1, (MediaItem("image", 16, 8), MediaItem("image", 16, 8),
                                    MediaItem("video", 16, 8, 3)))
    seen = []
    for seed in (0, 1):
        for index in range(40):
            image_a, image_b, video, _ = parts(body(line, request_seed(seed, index), "m"))
            frames = video["video_url"]["url"].partition(",")[2].split(",")
            seen += [pixels(image_a["image_url"]["url"]), pixels(image_b["image_url"]["url"])]
            seen += [pixels("data:," + f) for f in frames]
    assert len(set(seen)) == len(seen) == 2 * 40 * 5


class FakeClock:
    """Time that passes only when the replayer sleeps (or a body takes `build_s`)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # the requests sent so far start now, as on a real loop
        self.slept.append(seconds)
        self.now += seconds


def fake_replay(times: list[float], ahead: int = 2
                ) -> tuple[replay.Replayed, list[tuple[int, float]], dict[int, int]]:
    """The replayer on a fake clock: what it sent when, and how many requests had been
    sent when each body was built."""
    clock = FakeClock()
    sent: list[tuple[int, float]] = []
    built: dict[int, int] = {}

    def build(i: int) -> int:
        built[i] = len(sent)
        return i

    async def outcome() -> Outcome:
        return Outcome(ttft=0.01, latency=0.02, output_tokens=1)

    def send(i: int) -> Any:
        sent.append((i, clock.now))  # when the replayer sends it
        return outcome()

    done = asyncio.run(replay.replay(times, build, send, clock=clock, sleep=clock.sleep,
                                     ahead=ahead))
    return done, sent, built


def test_each_request_is_sent_at_its_scaled_time_on_a_fake_clock() -> None:
    times = [0.0, 0.5, 0.5, 1.25, 4.0]
    done, sent, _ = fake_replay(times)
    assert done.offsets == times  # exactly: nothing but the schedule moves this clock
    assert sent == [(i, 100.0 + at) for i, at in enumerate(times)]
    assert done.duration == 4.0 and len(done.outcomes) == 5


def test_bodies_are_built_in_order_ahead_of_their_turn() -> None:
    """The first `ahead` before the clock starts; each later one after the request
    `ahead` before it went, and before its own turn."""
    _, _, built = fake_replay([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], ahead=2)
    assert list(built) == [0, 1, 2, 3, 4, 5]
    assert built[0] == built[1] == 0
    assert all(i - 2 <= built[i] <= i for i in range(2, 6)), built


def run_against_engine(args: list[str], trace_text: str, tmp_path: Path) -> dict[str, Any]:
    """`replay.main` in-process against the simulated engine; its result file."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(trace_text)

    async def serve() -> str:
        opts = parse_options(["m", "--max-model-len", "4096"], {})
        engine = Engine(COST, opts, Scheduler(COST, tp=1, kv_tokens=kv_capacity(COST, opts)))
        task = asyncio.create_task(engine.scheduler.run())
        server = TestServer(make_app(engine), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        full = ["--trace", str(trace), "--base-url", url, "--model", "/models/m",
                "--served-model-name", "m", "--result-dir", str(tmp_path),
                "--result-filename", "r.json", *args]
        try:
            result, _ = await replay.replay_trace(replay.parse_args(full))
            (tmp_path / "r.json").write_text(json.dumps(result))
        finally:
            await server.close()
            task.cancel()
        return url

    asyncio.run(serve())
    return json.loads((tmp_path / "r.json").read_text())


def test_the_result_is_what_bench_reads_with_classes_and_send_offsets(tmp_path: Path) -> None:
    data = run_against_engine(["--speed", "2", "--goodput", "ttft:5000"], MEDIA, tmp_path)
    figures = parse_result(tmp_path / "r.json")
    assert (figures["completed"], figures["failed"]) == (4, 0)
    assert data["classes"] == ["text", "image2", "video+audio", "text"]
    assert data["trace"]["speed"] == 2.0 and data["trace"]["classes"] == {
        "text": 2, "image2": 1, "video+audio": 1}
    assert data["output_lens"] == [5, 4, 3, 6] and data["input_lens"] == [12, 8, 6, 10]
    assert data["scheduled_offsets"] == [0.0, 0.05, 0.075, 0.2]  # ms / 1000 / speed
    assert data["request_rate"] == pytest.approx(3 / 0.2)
    sent = data["send_offsets"]
    assert sent == sorted(sent)  # in the trace's order
    # Never early (the clock's resolution aside); how late depends on the machine.
    assert all(s >= t - 1e-3 for s, t in zip(sent, data["scheduled_offsets"], strict=True))
    # Answered whole: TTFT is its latency, no inter-token times, so no TPOT.
    assert data["itls"][1] == data["itls"][3] == [] and data["ttfts"][1] == data["latencies"][1]
    assert all(data["itls"][i] for i in (0, 2))
    samples = parse_round(data, parse_slo("ttft=5000"))
    assert [r.tpot_ms is None for r in samples.requests] == [False, True, False, True]
    assert samples.classes == ("text", "image2", "video+audio", "text")


def test_a_mooncake_trace_replays_unchanged(tmp_path: Path) -> None:
    data = run_against_engine(["--num-prompts", "2"], MOONCAKE, tmp_path)
    assert data["completed"] == 2 and data["classes"] == ["text", "text"]
    # Sorted by time and made relative to the first: its first two arrivals, 118 ms apart.
    assert data["scheduled_offsets"] == pytest.approx([0.0, 0.118])
    assert data["input_lens"] == [30, 10] and data["output_lens"] == [5, 4]
    assert data["trace"]["kind"] == "epdctl"


def test_more_prompts_than_the_trace_holds_play_it_again(tmp_path: Path) -> None:
    """--num-prompts past the trace's end: the trace again from its start, one mean gap
    (span / (n - 1)) after its last request, each request its own body."""
    data = run_against_engine(["--num-prompts", "10", "--speed", "2"], MEDIA, tmp_path)
    assert data["completed"] == 10 and data["num_prompts"] == 10
    assert data["classes"] == ["text", "image2", "video+audio", "text"] * 2 + [
        "text", "image2"]
    # one pass: 0.2 s at speed 2 and a mean gap of 0.2 / 3
    first = [0.0, 0.05, 0.075, 0.2]
    period = 0.2 + 0.2 / 3
    assert data["scheduled_offsets"] == pytest.approx(
        first + [t + period for t in first] + [t + 2 * period for t in first[:2]])
    assert data["trace"]["requests"] == 10


@pytest.mark.parametrize(("args", "message"), [
    (["--speed", "0"], "--speed 0: expected a number above 0"),
    (["--goodput", "ttft:soon"], "--goodput ttft:soon: expected"),
    (["--image-size", "big"], "--image-size big: expected WxH"),
])
def test_bad_arguments_are_refused_in_one_line(args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        replay.parse_args(["--trace", "t", "--base-url", "http://x", "--model", "m", *args])
    assert message in capsys.readouterr().err


def test_a_trace_over_the_limit_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(MOONCAKE)
    with pytest.raises(SystemExit) as exc:
        replay.main(["--trace", str(tmp_path / "t.jsonl"), "--limit", "2", "--base-url",
                     "http://127.0.0.1:9", "--model", "m"])
    assert str(exc.value) == (f"replay: {tmp_path / 't.jsonl'}: the trace has 3 requests, "
                              "more than --limit 2 (raise it, or cut the trace)")
