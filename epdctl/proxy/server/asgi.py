"""The ASGI side of a request: its body read under the cap, the client's departure watched,
an answer (whole or streamed) sent, the key a request presents."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import MutableMapping
from typing import Any

from epdctl.proxy.answer import Answer
from epdctl.proxy.deadlines import Entry, wheel
from epdctl.proxy.errors import JSON_TYPE, ProxyError
from epdctl.proxy.trace import Recorded

Scope = MutableMapping[str, Any]


WATCH_AFTER_S = 0.25
"""How long a request runs before its client's departure is watched for: most answers are
sent by then, and the watch is a task of its own (a departure is noticed this much late)."""


class Disconnect:
    """Cancels the request's task when the client goes away before the answer is done."""

    def __init__(self, receive: Any) -> None:
        self.is_gone = False
        self._task = asyncio.current_task()
        self._receive = receive
        self._watch: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._entry: Entry | None = wheel(loop).at(loop.time() + WATCH_AFTER_S, self._begin)

    def _begin(self) -> None:
        self._entry = None
        self._watch = asyncio.ensure_future(self._wait())

    async def _wait(self) -> None:
        receive = self._receive
        while (await receive())["type"] != "http.disconnect":
            pass
        self.is_gone = True
        if self._task is not None:
            self._task.cancel()

    def stop(self) -> None:
        if self._entry is not None:
            self._entry.cancel()
            self._entry = None
        if self._watch is not None:
            self._watch.cancel()


def error_answer(exc: ProxyError) -> Answer:
    return Answer(exc.status, JSON_TYPE, exc.body(), headers=exc.headers)


def too_large(limit: int) -> ProxyError:
    return ProxyError(413, f"request body is larger than {limit} bytes (--max-body-bytes)")


async def read_body(receive: Any, max_bytes: int) -> bytes | None:
    """The whole body, or None if the client left; 413 past the limit."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _headers(answer: Answer, rid: str) -> list[tuple[bytes, bytes]]:
    if answer.raw_headers is not None:
        return list(answer.raw_headers)
    headers = [(b"content-type", answer.content_type.encode()),
               (b"x-request-id", rid.encode())]
    headers += [(k.encode(), v.encode()) for k, v in answer.headers.items()]
    return headers


async def send_answer(send: Any, answer: Answer, rid: str) -> None:
    headers = _headers(answer, rid)
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


async def send_stream(send: Any, answer: Answer, rid: str, watcher: Disconnect,
                      recorded: Recorded | None = None) -> None:
    """Relay a committed stream; the watcher's cancel stops it if the client leaves.

    What a trace records of it is counted on the way, nothing parsed: its events (a blank
    line ends each; never inside one, where JSON escapes every newline) and its last two
    chunks (request/traffic.py reads their usage once the line is written)."""
    assert answer.stream is not None
    stream = answer.stream
    events = 0
    prev = last = b""
    try:
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": _headers(answer, rid)})
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            events += chunk.count(b"\n\n")
            if last.endswith(b"\n") and chunk.startswith(b"\n"):  # a blank line cut in two
                events += 1
            prev, last = last, chunk
        watcher.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    if recorded is not None:
        recorded.events, recorded.tail = events, prev + last


def presents(scope: Scope, keys: list[bytes]) -> bool:
    """Whether the request's authorization header is one of `keys` (constant time each)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return any([hmac.compare_digest(value, key) for key in keys])
    return False
