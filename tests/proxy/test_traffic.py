"""What a completion request's log line records for a trace (proxy/request/traffic.py), and
the line itself, through the proxy app before fake instances."""

from __future__ import annotations

import base64
import io
import random
import re
import string
import time

import httpx
import pytest

from epdctl.proxy.request.parse import CHAT, COMPLETIONS, RESPONSES
from epdctl.proxy.request.traffic import (
    Recorded,
    prompt_tokens,
    text_tokens,
    usage_tokens,
)
from epdctl.proxy.trace import Trace
from tests.proxy.fakes import STREAM, sse_response

Image = pytest.importorskip("PIL.Image")
WORDS = re.compile(r"\w+|[^\w\s]")


def encoded(fmt: str, width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(buf, fmt)
    return buf.getvalue()


def jpeg(width: int, height: int) -> bytes:
    return encoded("JPEG", width, height)


def image_url(data: bytes, mime: str = "image/jpeg") -> dict:
    url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return {"type": "image_url", "image_url": {"url": url}}


def test_text_estimate_counts_what_the_regex_counts() -> None:
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \t\n_"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        assert text_tokens(text) == len(WORDS.findall(text)), repr(text)
    assert text_tokens("Hello, world! It's 4.5 km.") == 12  # It ' s 4 . 5
    assert text_tokens("") == 0
    assert text_tokens("café naïve") == 2  # letters past ASCII are letters
    assert text_tokens("\ud800 lone surrogate") == 3  # not UTF-8, still counted


def test_prompt_tokens_of_each_route() -> None:
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [
                             {"type": "text", "text": "What is this?"},
                             image_url(b"x"), {"type": "text", "text": "Two words"}]}]}
    assert prompt_tokens(CHAT, chat) == 3 + 4 + 2
    assert prompt_tokens(COMPLETIONS, {"prompt": "one two three"}) == 3
    assert prompt_tokens(COMPLETIONS, {"prompt": ["a b", "c"]}) == 3
    assert prompt_tokens(COMPLETIONS, {"prompt": [1, 2, 3, 4]}) == 4  # token ids: counted
    assert prompt_tokens(COMPLETIONS, {"prompt": [[1, 2], [3]]}) == 3
    responses = {"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Describe it"},
                                     {"type": "input_image", "image_url": "http://x/a.png"}]}]}
    assert prompt_tokens(RESPONSES, responses) == 3 + 2
    assert prompt_tokens(RESPONSES, {"input": "just text"}) == 2


def test_usage_tokens_from_the_last_usage_never_from_content() -> None:
    body = (b'{"choices":[{"message":{"content":"say \\"completion_tokens\\": 99"}}],'
            b'"usage":{"prompt_tokens":5,"completion_tokens":12,"total_tokens":17}}')
    assert usage_tokens(body, CHAT) == 12
    assert usage_tokens(b'{"choices":[{"message":{"content":"\\"completion_tokens\\": 9"}}]}',
                        CHAT) is None
    assert usage_tokens(b'"usage": {"completion_tokens" : 7}', COMPLETIONS) == 7
    responses = b'{"usage":{"input_tokens":3,"output_tokens":21,"output_tokens_details":{}}}'
    assert usage_tokens(responses, RESPONSES) == 21


def test_output_tokens_usage_then_events_then_max_tokens() -> None:
    answer = Recorded(CHAT, {"max_tokens": 50}, is_stream=False,
                      answer=b'{"usage":{"completion_tokens":7}}')
    assert answer.output() == (7, "usage")
    streamed = Recorded(CHAT, {"max_tokens": 50}, is_stream=True, events=6, waits=1,
                        tail=b"data: [DONE]\n\n")
    assert streamed.output() == (4, "events")  # less the role event and [DONE]
    with_usage = Recorded(CHAT, {}, is_stream=True, events=9, waits=1,
                          tail=b'data: {"choices":[],"usage":{"completion_tokens":5}}\n\n'
                               b"data: [DONE]\n\n")
    assert with_usage.output() == (5, "usage")
    assert Recorded(CHAT, {"max_completion_tokens": 9, "max_tokens": 50},
                    is_stream=False).output() == (9, "max_tokens")
    assert Recorded(RESPONSES, {"max_output_tokens": 8}, is_stream=True).output() == (
        8, "max_tokens")
    assert Recorded(COMPLETIONS, {"max_tokens": True}, is_stream=False).output() == (None, "")


def test_fields_and_the_line() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Compare them."}, image_url(jpeg(64, 48)),
        image_url(b"\x89PNG not really", "image/png")]}], "stream": True, "max_tokens": 3}
    trace = Trace("r1", CHAT)
    trace.arrival = 1700000000.1234
    trace.recorded = Recorded(CHAT, body, is_stream=True)
    line = trace.line(200, 12.5)
    assert line.startswith("rid=r1 route=/v1/chat/completions status=200 total_ms=12.5 ")
    assert line.endswith(" at=1700000000.123 text_tokens=3 media=image:64x48,image "
                         "out_tokens=3 out_from=max_tokens stream=1")
    bare = Trace("r2", "/v1/models")
    assert bare.line(200, 1.0).split(" ")[-1].startswith("at=")  # no shape: not a completion


@pytest.mark.anyio
async def test_the_proxys_lines_for_three_shapes(rig_factory, caplog) -> None:
    """Through the app (each production client): a text answer, a stream of one image, and
    two images, one of them fetched from a URL (its size read from the fetched bytes)."""
    rig = rig_factory(encode=("http://e0",))
    rig.fakes.then("pd0", lambda seen: httpx.Response(200, json={
        "id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 11}}))
    cut = STREAM.index(b"\n\n") + 1  # the first blank line cut in two: still one event
    rig.fakes.then("pd0", lambda seen: sse_response(STREAM[:cut], STREAM[cut:]))
    rig.fakes.then("media", lambda seen: httpx.Response(
        200, content=jpeg(300, 200), headers={"content-type": "image/jpeg"}))
    before = time.time()
    with caplog.at_level("INFO", logger="epdctl.proxy"):
        assert (await rig.chat("Hello there, proxy!", max_tokens=20)).status_code == 200
        assert (await rig.chat([image_url(jpeg(640, 480)), {"type": "text", "text": "Hi"}],
                               stream=True)).status_code == 200
        remote = {"type": "image_url", "image_url": {"url": "http://media/cat.jpg"}}
        assert (await rig.chat([image_url(jpeg(32, 16)), remote],
                               max_tokens=6)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if " route=" in r.getMessage()]
    assert len(lines) == 3
    fields = [dict(p.split("=", 1) for p in line.split(" ") if "=" in p) for line in lines]
    assert [f["text_tokens"] for f in fields] == ["5", "1", "0"]
    assert [f.get("media") for f in fields] == [None, "image:640x480",
                                               "image:32x16,image:300x200"]
    # The fake's last answer has no usage: the request's max_tokens stands for it.
    assert [(f["out_tokens"], f["out_from"]) for f in fields] == [
        ("11", "usage"), ("3", "events"), ("6", "max_tokens")]
    assert [f.get("stream") for f in fields] == [None, "1", None]
    arrivals = [float(f["at"]) for f in fields]
    assert before - 0.001 <= arrivals[0] <= arrivals[1] <= arrivals[2] <= time.time()


@pytest.mark.anyio
async def test_without_an_encoder_and_on_responses(rig_factory, caplog) -> None:
    """An aggregated topology (no E stage) still records its requests' media, found when the
    line is written; /v1/responses records its images and its max_output_tokens."""
    rig = rig_factory()
    png = image_url(encoded("PNG", 20, 10), "image/png")
    responses = {"model": "tiny", "max_output_tokens": 9, "instructions": "Be brief.",
                 "input": [{"role": "user", "content": [
                     {"type": "input_text", "text": "What is it?"},
                     {"type": "input_image", "image_url": png["image_url"]["url"]}]}]}
    with caplog.at_level("INFO", logger="epdctl.proxy"):
        assert (await rig.chat([png, png])).status_code == 200
        assert (await rig.client.post("/v1/responses", json=responses)).status_code == 200
    lines = [r.getMessage() for r in caplog.records if " route=" in r.getMessage()]
    assert [line.split(" at=")[1].split(" ", 1)[1] for line in lines] == [
        "text_tokens=0 media=image:20x10,image:20x10",
        "text_tokens=7 media=image:20x10 out_tokens=9 out_from=max_tokens"]
