"""token_ids.py: asking for the ids of a stream's tokens, and taking them out again."""

from __future__ import annotations

import json

import pytest

from epdctl.proxy.request.parse import CHAT, COMPLETIONS
from epdctl.proxy.stages.token_ids import TokenIds, asked


@pytest.mark.parametrize(("body", "ours"), [
    (b'{"model":"m","stream":true}', True),
    (b'  {}', True),
    (b'{"return_token_ids": false, "stream": true}', True),
    (b'{"return_token_ids": true}', False),
    (b'{"messages": [{"content": "say return_token_ids"}]}', True),
    ({"stream": True}, True),
    ({"return_token_ids": True}, False),
])
def test_asked_sets_the_flag_and_says_whose_it_is(body, ours):
    new, is_ours = asked(body, body if isinstance(body, dict) else json.loads(body))
    as_dict = new if isinstance(new, dict) else json.loads(new)
    assert as_dict["return_token_ids"] is True and is_ours is ours
    original = body if isinstance(body, dict) else json.loads(body)
    assert {k: v for k, v in as_dict.items() if k != "return_token_ids"} \
        == {k: v for k, v in original.items() if k != "return_token_ids"}


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(content: str | None, ids: list[int] | None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "token_ids": ids}]}


def test_ids_are_read_in_order_and_taken_out_when_ours():
    ids = TokenIds(CHAT, is_ours=True)
    first = {**chunk("", [], None), "prompt_token_ids": [1, 2, 3]}
    stream = event(first) + event(chunk("He", [5])) + event(chunk(None, [6])) \
        + event(chunk("llo", [7, 8])) + event(chunk(None, [], "stop")) + b"data: [DONE]\n\n"
    out = ids(stream)
    assert ids.ids == [5, 6, 7, 8] and ids.is_seen
    bare = {**chunk("", None), "prompt_token_ids": None}
    assert out == event(bare) + event(chunk("He", None)) + event(chunk("llo", None)) \
        + event(chunk(None, None, "stop")) + b"data: [DONE]\n\n"  # the ids-only chunk: gone


def test_ids_the_client_asked_for_stay():
    ids = TokenIds(CHAT, is_ours=False)
    stream = event(chunk("He", [5])) + event(chunk(None, [6]))
    assert ids(stream) == stream and ids.ids == [5, 6]


def test_a_completion_stream_keeps_every_chunk():
    ids = TokenIds(COMPLETIONS, is_ours=True)
    raw = event({"choices": [{"index": 0, "text": "", "prompt_token_ids": [1],
                              "token_ids": [9]}]})
    assert ids(raw) == event({"choices": [{"index": 0, "text": "", "prompt_token_ids": None,
                                           "token_ids": None}]})
    assert ids.ids == [9]


def test_no_ids_no_change():
    ids = TokenIds(CHAT, is_ours=True)
    raw = event(chunk("He", None))
    assert ids(raw) == raw and not ids.is_seen
    ids.ids = [1]
    ids.restart()
    assert ids.ids == []
