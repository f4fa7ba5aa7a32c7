"""sse.py's peek: a stream is committed at its first content, [DONE] or finish, failed at
an error event before that; each event judged once, however the bytes arrive."""

from __future__ import annotations

import json

from epdctl.proxy.sse import verdict


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                           "finish_reason": None}]})
TOKEN = event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
ERROR = event({"error": {"message": "boom", "type": "InternalServerError", "code": 500}})


def test_the_first_content_commits_and_what_follows_is_not_read():
    # What follows the content is not JSON at all: it is never parsed.
    kind, obj, at = verdict(ROLE + TOKEN + b"data: {not json\n\n" * 50)
    assert (kind, obj, at) == ("commit", None, len(ROLE))


def test_an_error_before_any_content_fails_the_stream():
    kind, obj, _ = verdict(ROLE + ERROR + TOKEN)
    assert kind == "error" and obj is not None and obj["error"]["message"] == "boom"


def test_a_stream_arriving_in_pieces_is_judged_from_where_it_stopped():
    buf = ROLE + TOKEN[:10]
    kind, _, at = verdict(buf)
    assert (kind, at) == ("wait", len(ROLE))  # the role event judged; half an event waits
    assert verdict(buf + TOKEN[10:], at)[0] == "commit"
    # The events before `start` are not judged again (an error there would fail it).
    assert verdict(ERROR + TOKEN, len(ERROR))[0] == "commit"
