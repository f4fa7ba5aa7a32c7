"""Peek at the start of an SSE stream: commit to 200 only once real content arrives."""

from __future__ import annotations

import re
from typing import Any

from epdctl.proxy import jsonio

# vLLM separates events with a blank line; tolerate CRLF from other servers.
EVENT_END = re.compile(rb"\r?\n\r?\n")
_CONTENT_KEYS = ("content", "reasoning_content", "reasoning", "tool_calls", "function_call")
PEEK_LIMIT_BYTES = 256 * 1024
# /v1/responses streams open with these before any output (vLLM sends both at once).
_RESPONSES_PREAMBLE = frozenset({"response.created", "response.in_progress", "response.queued"})
_RESPONSES_ERRORS = frozenset({"error", "response.failed"})


def event_data(event: bytes) -> bytes | None:
    """The joined `data:` lines of one event, None for a comment or keep-alive."""
    lines = [line[5:].removeprefix(b" ") for line in event.splitlines()
             if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def classify(event: bytes) -> tuple[str, dict[str, Any] | None]:
    """"error" (with the error object), "commit" (content, finish, [DONE]) or "wait"."""
    data = event_data(event)
    if data is None:
        return "wait", None
    if data.strip() == b"[DONE]":
        return "commit", None
    try:
        obj = jsonio.loads(data)
    except ValueError:
        return "commit", None  # not ours to judge: pass it through
    if not isinstance(obj, dict):
        return "commit", None
    if isinstance(obj.get("error"), dict) and "choices" not in obj:
        return "error", obj
    if obj.get("object") == "error":  # older vLLM: the error fields at top level
        return "error", {"error": {k: obj.get(k) for k in ("message", "type", "param", "code")}}
    kind = obj.get("type")
    if isinstance(kind, str) and "choices" not in obj:  # the Responses API's events
        if kind in _RESPONSES_ERRORS:
            return "error", {"error": {k: obj.get(k) for k in ("message", "type", "param",
                                                               "code")}}
        return ("wait", None) if kind in _RESPONSES_PREAMBLE else ("commit", None)
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return "wait", None
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
            return "commit", None
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(k) for k in _CONTENT_KEYS):
            return "commit", None
        if choice.get("text"):
            return "commit", None
    return "wait", None


def verdict(buf: bytes, start: int = 0) -> tuple[str, dict[str, Any] | None, int]:
    """Judge the complete events in what has arrived so far, from `start` (where the events
    already judged "wait" end), stopping at the first that decides; with where the next
    look begins."""
    for end in EVENT_END.finditer(buf, start):
        kind, obj = classify(buf[start:end.start()])
        if kind != "wait":
            return kind, obj, start
        start = end.end()
    return ("commit", None, start) if len(buf) > PEEK_LIMIT_BYTES else ("wait", None, start)


def error_status(obj: dict[str, Any]) -> int:
    """The status an in-stream error maps to: its own code if it is an HTTP error code."""
    code = obj.get("error", {}).get("code")
    return code if isinstance(code, int) and 400 <= code <= 599 else 500


def error_event(message: str) -> bytes:
    """An SSE error event in vLLM's shape, for failures after the stream was committed."""
    error = {"message": message, "type": "Bad Gateway", "param": None, "code": 502}
    return b"data: " + jsonio.dumps_event({"error": error}) + b"\n\n"
