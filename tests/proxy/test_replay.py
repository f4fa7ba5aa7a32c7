"""replay.py on fake instances: a request whose instance died before the client got a byte
goes elsewhere (or waits for the restarted one); a broken stream goes on from the text the
client has, under the same id, with nothing twice and nothing missing; what cannot go on
exactly ends as today, and says why."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from epdctl.logs.journey import find
from epdctl.proxy.attempts import MAX_REPLAYS
from epdctl.proxy.errors import ENGINE_DEAD
from tests.proxy.fakes import MODEL, STREAM, Seen, chat_chunk, sse, sse_response
from tests.waits import until

pytestmark = pytest.mark.anyio
DEAD = {"error": {"message": ENGINE_DEAD.decode(), "type": "InternalServerError",
                  "param": None, "code": 500}}
HEL = 7  # the id of the token "Hel"
HEAD = [sse({**chat_chunk("", role="assistant", ids=[]), "prompt_token_ids": [1, 2, 3]}),
        sse(chat_chunk("Hel", ids=[HEL]))]
REST = [sse(chat_chunk("", role="assistant")), sse(chat_chunk("lo é€😀", ids=[8, 9, 10])),
        sse(chat_chunk(finish="stop", ids=[2])), sse("[DONE]")]
BARE_HEAD = [sse(chat_chunk("", role="assistant")), sse(chat_chunk("Hel"))]


def plain(*chunks: bytes) -> bytes:
    """The chunks as a client that did not ask for token ids reads them."""
    return re.sub(rb'"(prompt_)?token_ids": ?\[[0-9, ]*\]', rb'"\1token_ids":null',
                  b"".join(chunks))


class _Breaks(httpx.AsyncByteStream):
    """Some chunks, then the connection resets (the instance was SIGKILLed)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):  # type: ignore[override]
        for chunk in self.chunks:
            yield chunk
        raise httpx.ReadError("connection reset by peer")


def breaks(*chunks: bytes):
    return lambda seen: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                       stream=_Breaks(list(chunks)))


def dead_engine(seen: Seen) -> httpx.Response:
    return httpx.Response(500, json=DEAD)


def tokenize(*tokens: int):
    """/tokenize's answer: the text sent so far is `tokens`."""
    def answer(seen: Seen) -> httpx.Response:
        assert seen.path == "/tokenize" and seen.body is not None
        assert seen.body["add_special_tokens"] is False
        return httpx.Response(200, json={"count": len(tokens), "tokens": list(tokens)})
    return answer


def texts(content: bytes) -> tuple[str, list[Any]]:
    """The text a client reads from a chat stream, and its events."""
    events = [line.removeprefix(b"data: ") for line in content.split(b"\n\n") if line]
    decoded = [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
    text = "".join(c["delta"].get("content") or "" for e in decoded if isinstance(e, dict)
                   for c in e.get("choices", []))
    return text, decoded


def pd2(rig_factory, **kwargs: Any):
    return rig_factory(prefill_decode=("http://pd0", "http://pd1"), **kwargs)


def order(rig, role: str = "prefill_decode") -> tuple[str, str]:
    """The instance a pool of two gives the next request, and the other one."""
    taken = rig.proxy.upstreams.pools[role].pick().url.removeprefix("http://")
    names = [i.url.removeprefix("http://") for i in rig.proxy.upstreams.pools[role].instances]
    other = names[1 - names.index(taken)]
    return other, taken  # picks rotate: the next one is the other


async def metric(rig, name: str) -> str:
    text = (await rig.client.get("/metrics")).text
    return "\n".join(line for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_dead_engine_before_the_first_byte_is_replayed_elsewhere(rig_factory,
                                                                          stream, caplog):
    rig = pd2(rig_factory)
    first, _ = order(rig)
    rig.fakes.then(first, dead_engine)
    caplog.set_level("INFO", "epdctl.proxy")
    r = await rig.client.post("/v1/chat/completions", headers={"x-request-id": "replay-me"},
                              json={"model": MODEL, "messages": [{"role": "user",
                                                                  "content": "hi"}],
                                    "stream": stream})
    assert r.status_code == 200
    assert r.content == STREAM if stream else r.json()["choices"][0]["message"]["content"]
    died, answered = rig.fakes.posts("pd")
    assert died.instance != answered.instance and died.raw == answered.raw
    assert answered.headers["x-request-id"] == "replay-me"  # the client's id, unchanged
    assert 'outcome="ok",stage="prefill_decode"} 1.0' in await metric(
        rig, "epdctl_proxy_replays_total")
    [line] = [r.getMessage() for r in caplog.records if "rid=replay-me route=" in r.getMessage()]
    assert f"replayed=prefill_decode:http://{died.instance}>http://{answered.instance}" in line


async def test_a_stream_broken_before_content_is_replayed_whole(rig_factory):
    rig = pd2(rig_factory)
    rig.fakes.then(order(rig)[0], breaks(HEAD[0]))  # the role chunk only: nothing sent yet
    r = await rig.chat("hi", stream=True)
    assert (r.status_code, r.content) == (200, STREAM)


async def test_a_stream_broken_after_some_chunks_goes_on_from_the_text_sent(rig_factory):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(*HEAD))
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(*REST))
    r = await rig.chat("hi", stream=True, max_tokens=10, temperature=0.7, seed=7)
    text, events = texts(r.content)
    assert text == "Hello é€😀"
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    roles = [e for e in events[:-1] if e["choices"][0]["delta"].get("role")]
    assert len(roles) == 1  # the continuation's own opening chunk is not sent again
    assert {e["id"] for e in events[:-1]} == {"c1"}
    [resumed] = rig.fakes.to(pd1, "/v1/chat/completions")
    assert resumed.body is not None
    assert resumed.body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert resumed.body["continue_final_message"] is True
    assert resumed.body["add_generation_prompt"] is False
    assert (resumed.body["max_tokens"], resumed.body["temperature"], resumed.body["seed"]) \
        == (9, 0.7, 7)
    assert resumed.headers["x-request-id"] == rig.fakes.to(pd0)[0].headers["x-request-id"]


@pytest.mark.parametrize("alone", [False, True], ids=["after-events", "alone"])
async def test_a_stream_broken_mid_event_sends_no_half_event(rig_factory, alone):
    """Not a byte of the half event, whether it came in one read with whole events or in
    a read of its own (chunk by chunk on the socket: the proxy reads them apart)."""
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    half = sse(chat_chunk("lo"))[:12]
    rig.fakes.then(pd0, breaks(*HEAD, half) if alone else breaks(HEAD[0] + HEAD[1] + half))
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(*REST))
    r = await rig.chat("hi", stream=True)
    assert r.content == plain(*HEAD, *REST[1:])


async def test_a_stream_broken_after_its_last_chunk_gets_its_done(rig_factory):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(*HEAD, sse(chat_chunk(finish="stop"))))
    r = await rig.chat("hi", stream=True, max_tokens=10)
    assert r.content == plain(*HEAD, sse(chat_chunk(finish="stop")), sse("[DONE]"))
    assert rig.fakes.posts(pd1) == []


async def test_usage_counts_as_if_nothing_broke(rig_factory):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(*HEAD))
    usage = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
             "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(
        *REST[:3], sse(usage), sse("[DONE]")))
    r = await rig.chat("hi", stream=True, stream_options={"include_usage": True})
    _, events = texts(r.content)
    assert events[-2]["usage"] == {"prompt_tokens": 11, "completion_tokens": 4,
                                   "total_tokens": 15}


async def test_continuous_usage_goes_on_counting_and_sends_one_opening(rig_factory):
    """With `continuous_usage_stats` every chunk has a usage, the continuation's opening
    one too: it is not sent again, and the counts go on from the tokens sent."""
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)

    def counted(chunk: dict[str, Any], prompt: int, done: int) -> bytes:
        return sse({**chunk, "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                       "total_tokens": prompt + done}})

    rig.fakes.then(pd0, breaks(counted(chat_chunk("", role="assistant"), 12, 0),
                               counted(chat_chunk("Hel", ids=[HEL]), 12, 1)))
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(
        counted(chat_chunk("", role="assistant"), 13, 0),
        counted(chat_chunk("lo", ids=[8]), 13, 1), sse("[DONE]")))
    r = await rig.chat("hi", stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})
    _, events = texts(r.content)
    assert [e["choices"][0]["delta"].get("role") for e in events[:-1]] \
        == ["assistant", None, None]
    assert [e["usage"]["completion_tokens"] for e in events[:-1]] == [0, 1, 2]
    assert {e["usage"]["prompt_tokens"] for e in events[:-1]} == {12}


async def test_the_token_limit_reached_at_the_break_finishes_with_length(rig_factory):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(*HEAD))
    rig.fakes.then(pd1, tokenize(HEL))
    r = await rig.chat("hi", stream=True, max_tokens=1)
    _, events = texts(r.content)
    assert events[-2]["choices"] == [{"index": 0, "finish_reason": "length", "delta": {}}]
    assert events[-1] == "[DONE]" and rig.fakes.to(pd1, "/v1/chat/completions") == []


async def test_a_completion_stream_goes_on_after_its_prompt(rig_factory):
    rig = pd2(rig_factory)

    def chunk(text: str, ids: list[int], finish: str | None = None) -> bytes:
        return sse({"id": "cmpl-1", "object": "text_completion", "model": MODEL,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                 "prompt_token_ids": [1, 2] if text == "Once" else None,
                                 "token_ids": ids}]})

    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(chunk("Once", [5]), chunk(" upon", [6])))
    rig.fakes.then(pd1, tokenize(5, 6), lambda seen: sse_response(
        chunk(" a time", [3, 4]), chunk("", [], "length"), sse("[DONE]")))
    r = await rig.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Tell me:", "max_tokens": 5, "stream": True})
    assert r.content == plain(chunk("Once", [5]), chunk(" upon", [6]), chunk(" a time", [3, 4]),
                              chunk("", [], "length"), sse("[DONE]"))
    [resumed] = rig.fakes.to(pd1, "/v1/completions")
    assert resumed.body is not None
    assert (resumed.body["prompt"], resumed.body["max_tokens"]) == ("Tell me:Once upon", 3)


HE, L = 5, 6  # "He" and "l": generated as two tokens


@pytest.mark.parametrize("tokenized", [(HEL,), (4, 3), ()], ids=[
    "into-one-token", "into-as-many-other-tokens", "the-instance-sent-no-ids"])
async def test_a_text_that_tokenizes_otherwise_is_generated_again_less_what_was_sent(
        rig_factory, tokenized):
    """Two tokens sent ("He", "l") that /tokenize makes other tokens (one, or as many as were
    sent: "H"+"el"), or whose ids the instance did not send: only the whole request again
    gives the same tokens after them; the client gets the rest, once."""
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    ids: tuple[list[int] | None, ...] = ([HE], [L]) if tokenized else (None, None)
    rig.fakes.then(pd0, breaks(HEAD[0], sse(chat_chunk("He", ids=ids[0])),
                               sse(chat_chunk("l", ids=ids[1]))))
    again = [HEAD[0], sse(chat_chunk("He", ids=ids[0])), sse(chat_chunk("llo é€😀")), *REST[2:]]
    rig.fakes.then(pd1, tokenize(*(tokenized or (HE, L))), lambda seen: sse_response(*again))
    r = await rig.chat("hi", stream=True, max_tokens=10)
    text, events = texts(r.content)
    assert text == "Hello é€😀" and events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"].get("content") for e in events[1:-1]] \
        == ["He", "l", "lo é€😀", None]
    [resumed] = rig.fakes.to(pd1, "/v1/chat/completions")
    assert resumed.raw == rig.fakes.to(pd0)[0].raw  # the same request, whole


async def test_merged_deltas_go_on_after_their_tokens(rig_factory):
    """vLLM merged two tokens into one delta (a reader that lags): their ids say so, and
    the stream goes on after both (max_tokens less two)."""
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(HEAD[0], sse(chat_chunk("Hel", ids=[HE, L]))))
    rig.fakes.then(pd1, tokenize(HE, L), lambda seen: sse_response(*REST))
    r = await rig.chat("hi", stream=True, max_tokens=10)
    assert texts(r.content)[0] == "Hello é€😀"
    [resumed] = rig.fakes.to(pd1, "/v1/chat/completions")
    assert resumed.body is not None and resumed.body["max_tokens"] == 8
    assert resumed.body["messages"][-1] == {"role": "assistant", "content": "Hel"}


async def test_token_ids_are_asked_for_and_taken_out_again(rig_factory):
    """The proxy asks for them; a client that did not gets vLLM's chunks as vLLM sends
    them without (ids null, no chunk that carries ids only); one that did gets them."""
    rig = pd2(rig_factory)
    ids_only = sse(chat_chunk(ids=[4]))  # a token held back: ids, no text yet
    chunks = [*HEAD, ids_only, *REST[1:]]
    for _ in range(2):
        rig.fakes.then(order(rig)[0], lambda seen: sse_response(*chunks))
    r = await rig.chat("hi", stream=True)
    assert r.content == plain(*HEAD, *REST[1:])
    [sent] = rig.fakes.posts("pd")
    assert sent.body is not None and sent.body["return_token_ids"] is True
    r = await rig.chat("hi", stream=True, return_token_ids=True)
    assert r.content == b"".join(chunks)
    r = await rig.chat("hi", stream=False)
    assert "return_token_ids" not in (rig.fakes.posts("pd")[-1].body or {})


async def test_an_answer_that_differs_when_generated_again_ends_with_the_error_event(
        rig_factory, caplog):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(HEAD[0], sse(chat_chunk("He", ids=[HE])),
                               sse(chat_chunk("l", ids=[L]))))
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(
        HEAD[0], sse(chat_chunk("Hi")), *REST[2:]))
    r = await rig.chat("hi", stream=True)
    _, events = texts(r.content)
    assert events[-1]["error"]["message"] == ("the answer generated again differs: 'Hi' where "
                                              "'He' was sent, at character 0 of 3 (after '')")
    assert "[DONE]" not in events


@pytest.mark.parametrize(("extra", "first", "why"), [
    ({"n": 2}, BARE_HEAD, "several choices (n>1)"),  # ids not asked for: none sent
    ({"logprobs": True}, BARE_HEAD, "logprobs would differ"),
    ({}, [HEAD[0], sse({"id": "c1", "object": "chat.completion.chunk", "model": MODEL,
                        "choices": [{"index": 0, "finish_reason": None, "delta": {
                            "tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]})],
     "a tool call was half sent"),
])
async def test_a_stream_that_cannot_go_on_exactly_ends_with_the_error_event(
        rig_factory, caplog, extra, first, why):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(*first))
    r = await rig.chat("hi", stream=True, **extra)
    _, events = texts(r.content)
    assert r.content.startswith(plain(*first)) and "[DONE]" not in events
    assert f"prefill_decode instance http://{pd0}: broken: " in events[-1]["error"]["message"]
    assert rig.fakes.posts(pd1) == []
    assert any(f"stream not resumed ({why})" in rec.getMessage() for rec in caplog.records)
    assert 'outcome="not_resumable"' in await metric(rig, "epdctl_proxy_replays_total")


async def test_replays_are_bounded(rig_factory):
    """An instance that dies at every request and comes back each time: MAX_REPLAYS."""
    rig = rig_factory(replay_wait_s=30)
    upstreams = rig.proxy.upstreams
    [inst] = upstreams.pools["prefill_decode"].instances
    rig.fakes.then("pd0", *[dead_engine] * (MAX_REPLAYS + 2))
    request = asyncio.ensure_future(rig.chat("hi"))
    for _ in range(MAX_REPLAYS):
        await _until_waiting(rig)
        upstreams.record_probe(inst, False)
        upstreams.record_probe(inst, True)  # a new life
    r = await request
    assert (r.status_code, r.json()) == (500, DEAD)
    assert len(rig.fakes.posts("pd0")) == 1 + MAX_REPLAYS


async def test_never_twice_onto_the_same_dead_instance(rig_factory):
    rig = rig_factory(prefill_decode=("http://pd0", "http://pd1", "http://pd2"))
    for name in ("pd0", "pd1", "pd2"):
        rig.fakes.then(name, dead_engine, dead_engine)
    r = await rig.chat("hi", stream=True)
    assert (r.status_code, r.json()) == (500, DEAD)
    assert sorted(s.instance for s in rig.fakes.posts("pd")) == ["pd0", "pd1", "pd2"]
    assert 'outcome="no_instance"' in await metric(rig, "epdctl_proxy_replays_total")


async def _until_waiting(rig) -> None:
    """Until a request waits for an instance to come back (the replayer's own future)."""
    await until(lambda: any(not waiter.done() for waiter in rig.proxy.upstreams.revived),
                "a request waiting for an instance", poll_s=0)


@pytest.mark.parametrize("when", ["before", "mid-stream"])
async def test_the_only_instance_restarted_within_replay_wait(rig_factory, when):
    rig = rig_factory(replay_wait_s=60)
    upstreams = rig.proxy.upstreams
    [inst] = upstreams.pools["prefill_decode"].instances
    if when == "before":
        rig.fakes.down.add("pd0")
        expected = STREAM
    else:
        rig.fakes.then("pd0", breaks(*HEAD), tokenize(HEL), lambda seen: sse_response(*REST))
        expected = plain(*HEAD, *REST[1:])
    request = asyncio.ensure_future(rig.chat("hi", stream=True))
    await _until_waiting(rig)
    assert not request.done()
    upstreams.record_probe(inst, False)  # the probes: down while it restarts, then up
    await asyncio.sleep(0)
    assert not request.done()  # a failed probe is no news
    rig.fakes.down.discard("pd0")
    upstreams.record_probe(inst, True)
    r = await request
    assert (r.status_code, r.content) == (200, expected)
    assert not upstreams.revived


async def test_prefill_dying_before_its_answer_is_replayed_on_another_prefill(rig_factory):
    rig = rig_factory(prefill=("http://p0", "http://p1"), decode=("http://d0",))
    first, second = order(rig, "prefill")
    rig.fakes.then(first, breaks())
    r = await rig.chat("hi", stream=True)
    assert (r.status_code, r.content) == (200, STREAM)
    assert [s.instance for s in rig.fakes.posts("p") if not s.instance.startswith("pd")] \
        == [first, second]
    assert 'outcome="ok",stage="prefill"} 1.0' in await metric(rig, "epdctl_proxy_replays_total")


async def test_decode_dying_mid_stream_goes_on_through_prefill_again(rig_factory):
    rig = rig_factory(prefill=("http://p0",), decode=("http://d0", "http://d1"))
    first, other = order(rig, "decode")
    rig.fakes.then(first, breaks(*HEAD))
    rig.fakes.then(other, tokenize(HEL), lambda seen: sse_response(*REST))
    r = await rig.chat("hi", stream=True)
    assert texts(r.content)[0] == "Hello é€😀"
    p_bodies = [s.body for s in rig.fakes.posts("p0")]
    assert len(p_bodies) == 2 and p_bodies[1]["messages"][-1]["content"] == "Hel"
    [resumed] = rig.fakes.to(other, "/v1/chat/completions")
    assert resumed.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"


async def test_the_journey_shows_both_attempts(rig_factory, caplog, tmp_path):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(*HEAD))
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(*REST))
    caplog.set_level("INFO", "epdctl.proxy")
    await rig.client.post("/v1/chat/completions", headers={"x-request-id": "two-tries"},
                          json={"model": MODEL, "stream": True,
                                "messages": [{"role": "user", "content": "hi"}]})
    log = tmp_path / "proxy.log"
    log.write_text("".join(f"2026-01-01 00:00:00,000 {r.levelname} epdctl.proxy: "
                           f"{r.getMessage()}\n" for r in caplog.records))
    journey = find([("proxy", log)], "chatcmpl-two-tries")
    [summary] = journey.summary
    assert f"replayed=prefill_decode:http://{pd0}>http://{pd1}" in summary.text
    assert any("resume 1" in line.text and f"now on http://{pd1}" in line.text
               for line in journey.lines)


async def test_vllms_dead_engine_event_mid_stream_is_resumed_not_sent(rig_factory):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, lambda seen: sse_response(*HEAD, sse(DEAD)))  # then it goes down
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(*REST))
    r = await rig.chat("hi", stream=True)
    assert r.content == plain(*HEAD, *REST[1:])


async def test_a_chat_prefix_ending_in_a_space_is_generated_again(rig_factory):
    rig = pd2(rig_factory)
    pd0, pd1 = order(rig)
    rig.fakes.then(pd0, breaks(HEAD[0], sse(chat_chunk("Hel ", ids=[HEL]))))
    rig.fakes.then(pd1, tokenize(HEL), lambda seen: sse_response(
        HEAD[0], sse(chat_chunk("Hel ")), sse(chat_chunk("lo")), *REST[2:]))
    r = await rig.chat("hi", stream=True)
    assert texts(r.content)[0] == "Hel lo"
    [again] = rig.fakes.to(pd1, "/v1/chat/completions")
    assert again.raw == rig.fakes.to(pd0)[0].raw
