"""`logs --export-trace`'s reading of the proxy's request lines (epdctl/logs/export.py), on
lines in the format the proxy writes them (proxy/server/logline.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from epdctl.logs.export import export, fields, read_requests
from epdctl.traces.format import MediaItem, TraceError, TraceRequest, read_trace

T0 = time.time() - 600  # ten minutes ago


def stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) + \
        f",{int(epoch % 1 * 1000):03d}"


def line(rid: str, arrival: float, took_s: float, rest: str, status: str = "200",
         route: str = "/v1/chat/completions") -> str:
    """A request line as the proxy writes it: its own time is its end."""
    return (f"{stamp(arrival + took_s)} INFO epdctl.proxy: rid={rid} route={route} "
            f"status={status} total_ms={took_s * 1000:.1f} at={arrival:.3f} {rest}")


def write_log(path: Path, rows: list[str]) -> Path:
    path.write_text("--- epdctl start 2024-01-01T00:00:00 python -m epdctl.proxy\n"
                    + "".join(f"{r}\n" for r in rows))
    return path


def test_fields_after_a_rid_with_spaces() -> None:
    text = line("my id with spaces", T0, 0.1, "text_tokens=3 media=image:2x3 stream=1")
    got = fields(text)
    assert got is not None
    assert got["route"] == "/v1/chat/completions" and got["media"] == "image:2x3"
    assert fields(f"{stamp(T0)} WARNING epdctl.proxy: rid=x replay 1: pd died") is None
    assert fields("INFO:     127.0.0.1:5 - \"GET /health HTTP/1.1\" 200 OK") is None


def test_media_labels_read_back() -> None:
    items = [MediaItem("image"), MediaItem("image", 640, 480), MediaItem("video"),
             MediaItem("video", 320, 240), MediaItem("video", 320, 240, 8),
             MediaItem("video", frames=8), MediaItem("audio"), MediaItem("audio", seconds=2.5)]
    assert [MediaItem.of_label(m.label) for m in items] == items
    for bad in ("picture", "image:", "image:3", "image:0x3", "image:3x4x5", "audio:s",
                "audio:-1s", "audio:nans", "video:1x2x3x4"):
        with pytest.raises(ValueError, match="not a media label"):
            MediaItem.of_label(bad)


def test_requests_in_arrival_order_failed_and_old_lines_left_out(tmp_path: Path) -> None:
    log = write_log(tmp_path / "proxy.log", [
        f"{stamp(T0)} INFO epdctl.proxy: proxy on http://127.0.0.1:8000 mode=E|PD",
        # Before this version: no shape fields.
        f"{stamp(T0)} INFO epdctl.proxy: rid=old route=/v1/chat/completions status=200 "
        "total_ms=3.0",
        # A long request that came first ends last: its line is written after the others'.
        line("b", T0 + 1.0, 0.2, "text_tokens=8 out_tokens=3 out_from=usage"),
        line("c", T0 + 1.5, 0.1, "text_tokens=2 media=image:640x480,image:32x16 out_tokens=5 "
             "out_from=events stream=1"),
        line("a", T0 + 0.5, 2.0, "text_tokens=4 media=video:8x320x240,audio:2.5s "
             "out_tokens=0 out_from=events stream=1"),
        line("fail", T0 + 1.6, 0.1, "text_tokens=4", status="502"),
        line("gone", T0 + 1.7, 0.1, "text_tokens=4", status="client_gone"),
        line("models", T0 + 1.8, 0.1, "", route="/v1/models"),  # not a completion
        line("unread", T0 + 1.9, 0.1, "passed_through=1"),
    ])
    got = read_requests(log)
    assert (got.failed, got.unread, got.unshaped) == (2, 1, 1)
    assert got.requests == [
        TraceRequest(0.0, 4, 1, (MediaItem("video", 320, 240, 8),
                                 MediaItem("audio", seconds=2.5)), True),
        TraceRequest(500.0, 8, 3),
        TraceRequest(1000.0, 2, 5, (MediaItem("image", 640, 480),
                                    MediaItem("image", 32, 16)), True),
    ]
    out = tmp_path / "trace.jsonl"
    exported = export(log, out)
    assert exported.summary(out) == (
        f"wrote 3 requests over 1.0 s to {out} (image2 1, text 1, video+audio 1); left out 2 "
        "failed, 1 passed through unread; skipped 1 lines logged before requests' shapes were")
    assert exported.as_json(out) == {
        "path": str(out), "requests": 3, "duration_s": 1.0,
        "classes": {"image2": 1, "text": 1, "video+audio": 1}, "failed": 2, "unread": 1,
        "without_shape": 1}
    assert read_trace(out).requests == tuple(got.requests)  # a trace bench --trace reads
    assert json.loads(out.read_text().splitlines()[1]) == {
        "timestamp": 500, "input_length": 8, "output_length": 3}


def test_since_keeps_the_requests_that_arrived_in_it(tmp_path: Path) -> None:
    now = time.time()
    log = write_log(tmp_path / "proxy.log", [
        line("old", now - 3600, 0.1, "text_tokens=1 out_tokens=1 out_from=usage"),
        line("long", now - 70, 15.0, "text_tokens=2 out_tokens=1 out_from=usage"),
        line("new", now - 30, 0.1, "text_tokens=3 out_tokens=1 out_from=usage"),
    ])
    got = read_requests(log, since=now - 60)
    assert [r.input_length for r in got.requests] == [3]


def test_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"^no proxy log at .*proxy\.log: did this topology "):
        export(tmp_path / "proxy.log", tmp_path / "t.jsonl")
    log = write_log(tmp_path / "proxy.log", [
        f"{stamp(T0)} INFO epdctl.proxy: rid=old route=/v1/chat/completions status=200 "
        "total_ms=3.0", line("fail", T0, 0.1, "text_tokens=4", status="500")])
    with pytest.raises(TraceError, match=r"proxy\.log: no request to export \(1 failed, 1 "
                                         r"logged before requests' shapes were\)$"):
        export(log, tmp_path / "t.jsonl")
    write_log(log, [line("a", T0, 0.1, "text_tokens=4 out_tokens=2 out_from=usage")])
    with pytest.raises(TraceError, match=r"^.*/nowhere/t\.jsonl: cannot write the trace \("):
        export(log, tmp_path / "nowhere" / "t.jsonl")
