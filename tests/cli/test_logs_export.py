"""`epdctl logs --export-trace`: what the real proxy (`python -m epdctl.proxy`, before fake
engines) served, recorded in its log and written back as a trace."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import pytest

from epdctl.traces.format import MediaItem, read_trace
from tests.harness import wait_for

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.timeout(90)
REAL_PROXY = {"EPDCTL_PROXY_COMMAND": ""}  # the fixture's default is a fake proxy


def image(fmt: str, width: int, height: int) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (9, 99, 199)).save(buf, fmt)
    url = f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def chat(content: object, **extra: object) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}


def test_export_what_the_real_proxy_served(epdctl, fake_topology, state_root,
                                           tmp_path: Path) -> None:
    up = epdctl("up", str(fake_topology()), "-d", "--timeout", "30", env=REAL_PROXY)
    assert up.exit_code == 0, up.stderr
    try:
        url = json.loads(epdctl("status", "--json").stdout)["proxy_url"]
        requests = [
            chat("Hello, world! How are you?", max_tokens=5),
            chat([{"type": "text", "text": "What is this?"}, image("PNG", 64, 48)],
                 stream=True),
            chat([{"type": "text", "text": "Compare"}, image("JPEG", 100, 50),
                  image("PNG", 30, 20)], max_tokens=7),
            # Passed through unread (the proxy does not take it; the fake engine does).
            chat("not a model the proxy serves", model="no-such-model"),
        ]
        statuses = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code
                    for body in requests]
        # Failed: not JSON, passed through, and the fake engine fails on it (no answer).
        statuses.append(httpx.post(f"{url}/v1/chat/completions", content=b"{not json",
                                   timeout=30).status_code)
        assert statuses == [200, 200, 200, 200, 502]
        running = tmp_path / "running.jsonl"
        # While it runs: the proxy writes its lines in batches (every 0.1 s).
        wait_for(lambda: epdctl("logs", "--export-trace", str(running)).exit_code == 0
                 and len(read_trace(running).requests) == 3, timeout_s=10)
    finally:
        assert epdctl("down").exit_code == 0

    out = tmp_path / "trace.jsonl"
    result = epdctl("logs", "--export-trace", str(out))
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("wrote 3 requests over ")
    assert result.stdout.endswith(f" s to {out} (image 1, image2 1, text 1); left out 1 "
                                  "failed, 1 passed through unread\n")
    lines = out.read_text().splitlines()
    assert len(lines) == 3
    trace = read_trace(out)
    first, one, two = trace.requests
    assert first.timestamp_ms == 0 < one.timestamp_ms < two.timestamp_ms
    assert [r.media for r in trace.requests] == [
        (), (MediaItem("image", 64, 48),),
        (MediaItem("image", 100, 50), MediaItem("image", 30, 20))]
    assert [r.stream for r in trace.requests] == [False, True, False]
    # The fake engine answers "hello from fake": usage says 3 tokens, its stream 3 events.
    assert [r.output_length for r in trace.requests] == [3, 3, 3]
    assert [r.input_length for r in trace.requests] == [8, 4, 1]
    assert read_trace(running).requests == trace.requests

    as_json = epdctl("logs", "--export-trace", str(out), "--json", "--since", "1h")
    assert as_json.exit_code == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert {k: doc[k] for k in ("requests", "classes", "failed", "unread", "without_shape")} \
        == {"requests": 3, "classes": {"image": 1, "image2": 1, "text": 1}, "failed": 1,
            "unread": 1, "without_shape": 0}


def test_export_errors_are_one_line(epdctl, state_root, tmp_path: Path) -> None:
    logs = state_root / "demo" / "logs"
    logs.mkdir(parents=True)
    (logs / "pd-0.log").write_text("nothing\n")
    out = tmp_path / "t.jsonl"
    missing = epdctl("logs", "--name", "demo", "--export-trace", str(out))
    assert missing.exit_code == 1
    assert missing.stderr == (f"Error: no proxy log at {logs / 'proxy.log'}: did this "
                              "topology run with epdctl's proxy?\n")
    (logs / "proxy.log").write_text("2024-01-01 00:00:00,000 INFO epdctl.proxy: proxy on x\n")
    empty = epdctl("logs", "--name", "demo", "--export-trace", str(out))
    assert empty.exit_code == 1
    assert empty.stderr == f"Error: {logs / 'proxy.log'}: no request to export\n"
    for args in (["-f"], ["pd-0"], ["-n", "3"], ["--grep", "x"], ["--request", "r"]):
        both = epdctl("logs", "--name", "demo", "--export-trace", str(out), *args)
        assert both.exit_code == 2, args
        assert "--export-trace does not take" in both.stderr, both.stderr
    assert "--export-trace FILE" in epdctl("logs", "--help").stdout
