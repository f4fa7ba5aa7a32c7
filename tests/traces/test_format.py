"""The trace format: ours, Mooncake's lines and Azure's CSV read as one; every bad input a
line of its own, with the line it failed on."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from epdctl.traces.classes import counts, parse_class, shape_class, typical
from epdctl.traces.format import (
    MediaItem,
    TraceError,
    TraceRequest,
    read_trace,
    scaled,
    write_trace,
)
from epdctl.traces.mix import Sizes, exact_counts, parse_mix, synthetic

MOONCAKE = """\
{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}
{"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": [46, 47, 49]}
{"timestamp": 30000, "input_length": 10, "output_length": 5, "hash_ids": []}
"""
"""Mooncake's conversation trace's first lines (timestamps in ms, unordered as some are)."""

AZURE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.4222070,879,45
"""


def test_a_mooncake_trace_reads_unchanged_as_text_requests(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    path.write_text(MOONCAKE)
    trace = read_trace(path)
    assert [r.timestamp_ms for r in trace.requests] == [0, 2518, 3053]  # sorted, from 0
    assert [(r.input_length, r.output_length) for r in trace.requests] == [
        (6955, 52), (10, 5), (6472, 26)]
    assert all(shape_class(r) == "text" and not r.stream for r in trace.requests)
    assert trace.duration_s == pytest.approx(3.053)
    assert scaled(trace, 2.0) == pytest.approx([0, 1.259, 1.5265])


def test_an_azure_csv_trace_reads_as_the_same_requests(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    trace = read_trace(path)
    assert trace.kind == "azure"
    assert [r.timestamp_ms for r in trace.requests] == pytest.approx([0, 4314.579, 4741.617])
    assert [(r.input_length, r.output_length) for r in trace.requests] == [
        (374, 44), (396, 109), (879, 45)]


def test_our_lines_round_trip_with_media_and_stream(tmp_path: Path) -> None:
    requests = [TraceRequest(0, 64, 32, (MediaItem("image", 512, 384),), stream=True),
                TraceRequest(125.5, 16, 8),
                TraceRequest(250, 20, 4, (MediaItem("image", 64, 64), MediaItem("image", 64, 64),
                                          MediaItem("video", 320, 240, 8),
                                          MediaItem("audio", seconds=2.5)))]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, requests) == 3
    assert read_trace(path).requests == tuple(requests)
    assert [shape_class(r) for r in requests] == ["image", "text", "image2+video+audio"]
    buffer = io.StringIO()
    write_trace(buffer, requests[:1])
    assert buffer.getvalue() == ('{"timestamp": 0, "input_length": 64, "output_length": 32, '
                                 '"media": [{"type": "image", "width": 512, "height": 384}], '
                                 '"stream": true}\n')
    assert [m.label for m in requests[2].media] == ["image:64x64", "image:64x64",
                                                    "video:8x320x240", "audio:2.5s"]


@pytest.mark.parametrize(("text", "message"), [
    ('{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 1,',
     "line 2: not JSON"),
    ('{"timestamp": -1, "input_length": 4, "output_length": 2}', "line 1: `timestamp`"),
    ('{"timestamp": 0, "input_length": 4}', "line 1: `output_length` must be a whole number"),
    ('{"timestamp": 0, "input_length": 4.5, "output_length": 2}', "`input_length`"),
    ('\n\n{"timestamp": 0, "input_length": 4, "output_length": 2, "media": [{"type": "smell"}]}',
     "line 3: media[0]: `type` must be one of image, video, audio, got 'smell'"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 2, "media": [{"type": "image", '
     '"width": 4}]}', "give both `width` and `height`"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 2, "stream": "yes"}', "`stream`"),
    ("[1, 2]", "line 1: neither a JSON object"),
    ("", "the trace is empty"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12\n",
     "line 2: expected TIMESTAMP,ContextTokens,GeneratedTokens"),
])
def test_a_bad_trace_is_one_line_naming_the_line(tmp_path: Path, text: str, message: str
                                                 ) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith(str(path))


def test_a_trace_longer_than_the_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceRequest(i, 4, 2) for i in range(5)])
    assert len(read_trace(path, limit=5).requests) == 5
    with pytest.raises(TraceError, match="5 requests, more than --limit 4"):
        read_trace(path, limit=4)
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing.jsonl")


def test_a_trace_cycled_past_its_end_starts_again_a_mean_gap_later() -> None:
    from epdctl.traces.format import cycle_ms, cycled

    requests = tuple(TraceRequest(at, n, 1) for n, at in enumerate((0.0, 100.0, 400.0)))
    assert cycle_ms(requests) == 600.0  # span 400 and a mean gap of 200
    assert cycled(requests, 2) == requests[:2]
    again = cycled(requests, 7)
    assert [r.timestamp_ms for r in again] == [0, 100, 400, 600, 700, 1000, 1200]
    assert [r.input_length for r in again] == [0, 1, 2, 0, 1, 2, 0]
    assert cycle_ms(requests[:1]) == 0.0 and len(cycled(requests[:1], 3)) == 3


def test_class_names_parse_back_and_bad_ones_are_refused() -> None:
    assert parse_class("image2+audio") == {"image": 2, "audio": 1}
    assert parse_class("text") == {}
    for bad in ("picture", "image0", "image+image", "img2", ""):
        with pytest.raises(TraceError, match="unknown shape class"):
            parse_class(bad)


def test_a_mix_makes_a_trace_of_its_proportions_and_the_workload_sizes() -> None:
    mix = parse_mix("text:4,image:4,image4:1.5,video:0.5")
    assert mix == pytest.approx({"text": 0.4, "image": 0.4, "image4": 0.15, "video": 0.05})
    assert exact_counts(mix, 20) == {"text": 8, "image": 8, "image4": 3, "video": 1}
    trace = synthetic(mix, 20, 4.0, Sizes(input_len=16, output_len=8, image_size=(64, 48),
                                          video_frames=6), seed=3)
    assert counts(trace.requests) == {"image": 8, "text": 8, "image4": 3, "video": 1}
    assert all(r.input_length == 16 and r.output_length == 8 for r in trace.requests)
    video = next(r for r in trace.requests if shape_class(r) == "video")
    assert video.media == (MediaItem("video", 64, 48, 6),)
    stamps = [r.timestamp_ms for r in trace.requests]
    assert stamps == sorted(stamps) and stamps[0] == 0 and stamps[-1] > 0
    assert synthetic(mix, 20, 4.0, Sizes(), seed=3) == synthetic(mix, 20, 4.0, Sizes(), seed=3)
    assert synthetic(mix, 20, 4.0, Sizes(), seed=3) != synthetic(mix, 20, 4.0, Sizes(), seed=4)
    assert {r.timestamp_ms for r in synthetic(mix, 5, float("inf"), Sizes()).requests} == {0}


@pytest.mark.parametrize("text", ["text", "text:0", "text:-1,image:1", "text:1,text:1",
                                  "text:1,pictures:1", "text:abc"])
def test_a_bad_mix_is_one_line(text: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_mix(text)
    assert str(info.value).startswith(("--mix", "unknown shape class"))


def test_typical_sizes_are_each_class_median() -> None:
    requests = [TraceRequest(0, 10, 4, (MediaItem("image", 100, 100),)),
                TraceRequest(1, 30, 8, (MediaItem("image", 300, 200),)),
                TraceRequest(2, 20, 6, (MediaItem("image", 200, 100),)),
                TraceRequest(3, 50, 2)]
    image, text = typical(requests)
    assert (image.name, image.requests, image.share) == ("image", 3, 0.75)
    assert (image.input_length, image.output_length) == (20, 6)
    assert image.media == (MediaItem("image", 200, 100),)
    assert (text.name, text.input_length, text.media) == ("text", 50, ())
