"""A fake instance that answers the way `vllm serve` 0.32 does, for the parity tests.

Routes, ids (from x-request-id or the body's request_id), error bodies, the model card,
streams of chat chunks and of Responses events; shapes copied from vLLM's serving code.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

from tests.proxy.fakes import MODEL, Fakes, Seen, _Chunks, sse

CARD = {"object": "list", "data": [{
    "id": MODEL, "object": "model", "created": 1700000000, "owned_by": "vllm", "root": "/m",
    "parent": None, "max_model_len": 512, "permission": [{
        "id": "modelperm-0", "object": "model_permission", "created": 1700000000,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False}]}]}
ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/responses": "POST",
          "/tokenize": "POST", "/detokenize": "POST", "/v1/models": "GET", "/version": "GET",
          "/load": "GET", "/ping": "GET", "/v1/messages": "POST", "/invocations": "POST",
          "/health": "GET", "/pooling": "POST"}
TRUE, FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}
TEXT = "Hello"


def error(status: int, message: str, type_: str, param: str | None = None) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": type_,
                                                  "param": param, "code": status}})


def _bool(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in TRUE | FALSE:
        return value.lower() in TRUE
    raise ValueError(value)


def _parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("messages") or body.get("input") or []
    return [p for m in items if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict)]


def _media_error(body: dict[str, Any]) -> httpx.Response | None:
    """What vLLM answers for media it cannot load (file: URLs, a URL that 404s)."""
    for part in _parts(body):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str) and url.startswith("file:"):
            return error(500, "Cannot load local files without `--allowed-local-media-path`.",
                         "InternalServerError")
        if isinstance(url, str) and "missing" in url:
            return error(422, f"Failed to fetch media from {url}: 404 Not Found",
                         "UnprocessableEntityError")
    return None


class VllmLike(Fakes):
    """Fakes whose PD and D instances answer like vLLM (E and P keep the usual fakes)."""

    def default(self, seen: Seen) -> httpx.Response:
        name = seen.instance
        if name.startswith("e") or (name.startswith("p") and not name.startswith("pd")):
            return super().default(seen)
        if name == "media":
            return httpx.Response(404, text="not here")
        return answer(seen)


def answer(seen: Seen) -> httpx.Response:
    """One vLLM instance's answer to `seen`."""
    method = seen.method
    allowed = ROUTES.get(seen.path)
    if allowed is None:
        return httpx.Response(404, json={"detail": "Not Found"})
    if method != allowed:
        return httpx.Response(405, json={"detail": "Method Not Allowed"},
                              headers={"allow": allowed})
    if method == "GET":
        return {"/v1/models": lambda: httpx.Response(200, json=CARD),
                "/version": lambda: httpx.Response(200, json={"version": "0.32.0"}),
                "/load": lambda: httpx.Response(200, json={"server_load": 0}),
                }.get(seen.path, lambda: httpx.Response(200))()
    try:
        body = json.loads(seen.raw)
    except ValueError:
        return httpx.Response(400, json={"error": {
            "message": "[{'type': 'json_invalid', 'loc': ('body', 1), 'msg': 'JSON decode "
                       "error'}]", "type": "BadRequestError", "param": None, "code": 400}})
    if not isinstance(body, dict):
        return error(400, "Input should be a valid dictionary", "BadRequestError")
    if body.get("model") not in (None, MODEL):
        return error(404, f"The model `{body['model']}` does not exist. Valid aliases: "
                          f"{MODEL}.", "NotFoundError", "model")
    try:
        stream = _bool(body.get("stream"))
    except ValueError:
        return error(400, "Input should be a valid boolean", "BadRequestError", "stream")
    refused = _media_error(body)
    if refused is not None:
        return refused
    rid = seen.headers.get("x-request-id") or body.get("request_id") or os.urandom(8).hex()
    return _generate(seen.path, body, rid, bool(stream))


def _generate(path: str, body: dict[str, Any], rid: str, stream: bool) -> httpx.Response:
    if path == "/tokenize":
        return httpx.Response(200, json={"count": 2, "max_model_len": 512, "tokens": [1, 2],
                                         "token_strs": None})
    if path == "/detokenize":
        return httpx.Response(200, json={"prompt": "hi"})
    if path == "/pooling":
        return error(400, "The model does not support Pooling API", "BadRequestError")
    if path == "/v1/responses":
        return _responses(body, stream)
    if path == "/v1/messages":
        return httpx.Response(200, json={"id": f"msg_{rid}", "type": "message",
                                         "role": "assistant", "model": MODEL,
                                         "content": [{"type": "text", "text": TEXT}]})
    kind = "text_completion" if path == "/v1/completions" else "chat.completion"
    ident = ("cmpl-" if path == "/v1/completions" else "chatcmpl-") + rid
    if not stream:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        choice.update({"text": TEXT} if path == "/v1/completions" else
                      {"message": {"role": "assistant", "content": TEXT}})
        return httpx.Response(200, json={"id": ident, "object": kind, "model": MODEL,
                                         "choices": [choice]})
    chunks = [{"id": ident, "object": f"{kind}.chunk", "model": MODEL,
               "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": end}]}
              for piece, end in (("Hel", None), ("lo", None), ("", "stop"))]
    return _stream(sse(*chunks, "[DONE]"))


def _responses(body: dict[str, Any], stream: bool) -> httpx.Response:
    ident = body.get("request_id") or "resp_" + os.urandom(8).hex()
    done = {"id": ident, "object": "response", "model": MODEL, "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": TEXT, "annotations": []}]}],
            "usage": {"input_tokens": 3, "output_tokens": 2}}
    if not stream:
        return httpx.Response(200, json=done)
    started = {**done, "status": "in_progress", "output": [], "usage": None}
    events = [("response.created", {"response": started}),
              ("response.in_progress", {"response": started}),
              ("response.output_text.delta", {"delta": "Hel"}),
              ("response.output_text.delta", {"delta": "lo"}),
              ("response.completed", {"response": done})]
    text = "".join(f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': n, **e})}"
                   "\n\n" for n, (kind, e) in enumerate(events))
    return _stream(text.encode())


def _stream(data: bytes) -> httpx.Response:
    """A stream as vLLM sends it, in two pieces (the cut inside the first event)."""
    return httpx.Response(200, headers={"content-type": "text/event-stream; charset=utf-8"},
                          stream=_Chunks([data[:20], data[20:]]))
