"""`logs --request`: one request's lines across three instance logs, by any id a client sees."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pytest

from epdctl.logs.journey import candidates, find, naming

HEADER = f"--- epdctl start {datetime(2025, 1, 2, 12, 0).astimezone().isoformat()} vllm serve m"


def vllm(hms: str, text: str, proc: str = "APIServer") -> str:
    return f"({proc} pid=1) INFO 01-02 {hms} [request_logger.py:66] {text}"


LOGS = {
    "encode-0": [
        HEADER,
        vllm("12:00:10", "Received request chatcmpl-req-7:enc0: params: SamplingParams(n=1)."),
        vllm("12:00:10", "Added request chatcmpl-req-7:enc0-1a2b3c4d."),
        vllm("12:00:10", "Added request chatcmpl-req-7:enc1-5e6f7a8b."),
        'INFO:     127.0.0.1:5 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        vllm("12:00:11", "Received request chatcmpl-req-70:enc0: params: other request."),
        vllm("12:00:11", "Received request chatcmpl-xreq-7:enc0: params: other request."),
    ],
    "pd-0": [
        HEADER,
        vllm("12:00:09", "Received request chatcmpl-req-6:decode: params: earlier request."),
        vllm("12:00:11", "Received request chatcmpl-req-7:decode: params: SamplingParams()."),
        vllm("12:00:11", "Added request chatcmpl-req-7:decode-99aa88bb.", "APIServer"),
        "ValueError: request chatcmpl-req-7:decode-99aa88bb could not be",
        vllm("12:00:12", "Finished chatcmpl-req-7:decode-99aa88bb, 16 tokens", "EngineCore"),
    ],
    "proxy": [
        HEADER,
        "2025-01-02 12:00:10,050 WARNING epdctl.proxy: rid=req-7:enc1 encoder failed, media "
        "to PD: timeout",
        "2025-01-02 12:00:12,345 INFO epdctl.proxy: rid=req-7 route=/v1/chat/completions "
        "status=200 total_ms=2300.1 encode_ms=800.2 decode_ms=1490.0 items=2",
        "2025-01-02 12:00:12,400 INFO epdctl.proxy: rid=req-70 route=/v1/chat/completions "
        "status=200 total_ms=1.0",
    ],
}


def _write_logs(tmp_path: Path, logs: dict[str, list[str]]) -> list[tuple[str, Path]]:
    paths = []
    for name, rows in logs.items():
        path = tmp_path / f"{name}.log"
        path.write_text("".join(f"{r}\n" for r in rows))
        # vLLM's times have no year: the file's last write gives it.
        os.utime(path, (datetime(2025, 1, 2, 12, 5).timestamp(),) * 2)
        paths.append((name, path))
    return paths


@pytest.fixture
def files(tmp_path: Path) -> list[tuple[str, Path]]:
    return _write_logs(tmp_path, LOGS)


@pytest.mark.parametrize("given", ["req-7", "chatcmpl-req-7:decode", "req-7:enc0",
                                   "chatcmpl-req-7:decode-99aa88bb", " req-7 "])
def test_the_request_s_lines_across_three_logs_in_time_order(
        files: list[tuple[str, Path]], given: str) -> None:
    journey = find(files, given)
    assert journey.rid == "req-7"
    assert [line.text for line in journey.summary] == [LOGS["proxy"][2]]
    # Time order across logs, file order within each; whole-second vLLM times sort before
    # the proxy's 12:00:10.050.
    assert [(line.instance, line.text) for line in journey.lines] == [
        ("encode-0", LOGS["encode-0"][1]),
        ("encode-0", LOGS["encode-0"][2]),
        ("encode-0", LOGS["encode-0"][3]),
        ("proxy", LOGS["proxy"][1]),
        ("pd-0", LOGS["pd-0"][2]),
        ("pd-0", LOGS["pd-0"][3]),
        ("pd-0", LOGS["pd-0"][4]),
        ("pd-0", LOGS["pd-0"][5]),
    ]
    times = [line.order for line in journey.lines]
    assert times == sorted(times)
    traceback = next(line for line in journey.lines if line.text.startswith("ValueError"))
    assert traceback.source == "inherited"
    assert traceback.time == datetime(2025, 1, 2, 12, 0, 11).timestamp()


def test_a_request_no_line_names(files: list[tuple[str, Path]]) -> None:
    journey = find(files, "req-8")
    assert journey.summary == [] and journey.lines == []


def test_an_id_the_proxy_knows_with_a_prefix_is_taken_as_given(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    log.write_text("2025-01-02 12:00:12,345 INFO epdctl.proxy: rid=cmpl-mine route=/v1/"
                   "completions status=200 total_ms=3.0\n")
    assert find([("proxy", log)], "cmpl-mine").rid == "cmpl-mine"
    assert candidates("chatcmpl-abc:decode-0011aabb") == ["abc", "chatcmpl-abc",
                                                           "chatcmpl-abc:decode-0011aabb"]


# Since the proxy is a drop-in for `vllm serve`, the final stage gets the client's rid as is:
# vLLM logs `chatcmpl-<rid>` (the response id a client sees) and, inside the engine,
# `chatcmpl-<rid>-<8 hex>`; E still gets `<rid>:enc<i>` (proxy/stages/encode.py).
CURRENT = {
    "encode-0": [
        HEADER,
        vllm("12:00:10", "Received request chatcmpl-abc:enc0: params: SamplingParams(n=1)."),
        vllm("12:00:10", "Added request chatcmpl-abc:enc0-1a2b3c4d."),
        vllm("12:00:10", "Received request chatcmpl-abcd:enc0: params: other request."),
        vllm("12:00:10", "Added request chatcmpl-abcd:enc0-5e6f7a8b."),
    ],
    "pd-0": [
        HEADER,
        vllm("12:00:11", "Received request chatcmpl-abc: params: SamplingParams(n=1)."),
        vllm("12:00:11", "Added request chatcmpl-abc-99aa88bb."),
        vllm("12:00:11", "Received request chatcmpl-abcd: params: other request."),
        vllm("12:00:11", "Added request chatcmpl-abcd-0badf00d."),
        vllm("12:00:11", "Received request chatcmpl-abc.v2: params: other request."),
        vllm("12:00:11", "Received request chatcmpl-abc:7: params: other request."),
        vllm("12:00:11", "Added request chatcmpl-abc-x1-0badf00d."),
        vllm("12:00:12", "Aborted request(s) chatcmpl-abc-99aa88bb,chatcmpl-abcd-0badf00d."),
    ],
    "proxy": [
        HEADER,
        "2025-01-02 12:00:12,345 INFO epdctl.proxy: rid=abc route=/v1/chat/completions "
        "status=200 total_ms=2300.1 encode_ms=800.2 decode_ms=1490.0 items=1",
        "2025-01-02 12:00:12,400 INFO epdctl.proxy: rid=abcd route=/v1/chat/completions "
        "status=200 total_ms=1.0",
    ],
}


@pytest.fixture
def current_files(tmp_path: Path) -> list[tuple[str, Path]]:
    return _write_logs(tmp_path, CURRENT)


@pytest.mark.parametrize("given", ["abc", "chatcmpl-abc", "chatcmpl-abc-99aa88bb",
                                   "chatcmpl-abc:enc0-1a2b3c4d", "abc:enc0"])
def test_the_journey_by_the_ids_vllm_gives_the_final_stage_now(
        current_files: list[tuple[str, Path]], given: str) -> None:
    journey = find(current_files, given)
    assert journey.rid == "abc"
    assert [line.text for line in journey.summary] == [CURRENT["proxy"][1]]
    assert [(line.instance, line.text) for line in journey.lines] == [
        ("encode-0", CURRENT["encode-0"][1]),
        ("encode-0", CURRENT["encode-0"][2]),
        ("pd-0", CURRENT["pd-0"][1]),
        ("pd-0", CURRENT["pd-0"][2]),
        ("pd-0", CURRENT["pd-0"][8]),  # names abc-99aa88bb (and abcd's too)
    ]


@pytest.mark.parametrize(("text", "names_abc"), [
    ("Received request chatcmpl-abc: params: x", True),
    ("Added request chatcmpl-abc-99aa88bb.", True),
    ("Added request cmpl-abc-99aa88bb.", True),
    ("Added request chatcmpl-abc:enc3-99aa88bb.", True),
    ("Finished chatcmpl-abc:prefill-99aa88bb, 16 tokens", True),
    ("rid=abc route=/v1/chat/completions status=200", True),
    ("rid=abc:enc1 encoder failed, PD will encode it: timeout", True),
    ("abort('chatcmpl-abc')", True),
    ("Received request chatcmpl-abcd: params: x", False),
    ("Added request chatcmpl-abcd-99aa88bb.", False),
    ("Added request chatcmpl-xabc-99aa88bb.", False),
    ("Received request chatcmpl-abc.v2: params: x", False),
    ("Received request chatcmpl-abc:7: params: x", False),
    ("Added request chatcmpl-abc-x1-99aa88bb.", False),
    ("Added request chatcmpl-abc-99aa88bb7.", False),
    ("Added request chatcmpl-abc-99aa88bb-2.", False),
])
def test_an_id_is_named_whole(text: str, names_abc: bool) -> None:
    assert bool(naming("abc").search(text.encode())) is names_abc


def test_the_engine_s_suffix_is_dropped_from_a_response_id_only() -> None:
    assert candidates("chatcmpl-abc-99aa88bb") == ["abc", "abc-99aa88bb",
                                                    "chatcmpl-abc-99aa88bb"]
    assert candidates("chatcmpl-abc") == ["abc", "chatcmpl-abc"]
    # Without vLLM's prefix it is a client's own id (which may end so).
    assert candidates("abc-99aa88bb") == ["abc-99aa88bb"]


def test_a_client_rid_that_ends_like_the_engine_s_suffix(tmp_path: Path) -> None:
    """The proxy's line decides: its rid is the client's, suffix and all."""
    log = tmp_path / "proxy.log"
    log.write_text("2025-01-02 12:00:12,345 INFO epdctl.proxy: rid=abc-0badf00d route=/v1/"
                   "chat/completions status=200 total_ms=3.0\n")
    assert find([("proxy", log)], "chatcmpl-abc-0badf00d").rid == "abc-0badf00d"
