"""Fake upstream instances, and the proxy in front of them.

`Fakes.handle` answers an httpx.Request as every instance would: the rig serves it on local
sockets (sockets.py); a test may also put it behind an httpx.MockTransport.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from epdctl.proxy import ProxyConfig, create_app
from epdctl.proxy.__main__ import upstream_client
from tests.proxy.sockets import Instances, Names

MODEL = "tiny"
TRANSPORTS = ("aiohttp", "httpx")
"""The proxy's clients to its instances (ProxyConfig.client): aiohttp, the default, means
RawUpstream for the POSTs to instances and aiohttp for the rest."""
PNG = b"\x89PNG\r\n\x1a\nfake image bytes"


def sse(*events: object) -> bytes:
    """Events as vLLM writes them: `data: <json>` and a blank line each."""
    out = b""
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
        out += f"data: {data}\n\n".encode()
    return out


def chat_chunk(content: str | None = None, role: str | None = None,
               finish: str | None = None, ids: list[int] | None = None) -> dict[str, Any]:
    """vLLM's chat chunk; `ids`: the token ids it carries when they were asked for."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}


STREAM = sse(chat_chunk("", role="assistant"), chat_chunk("Hel"), chat_chunk("lo é€😀"),
             chat_chunk(finish="stop"), "[DONE]")


def completion(text: str = "Hello") -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}]}


@dataclass
class Seen:
    """One request a fake instance received."""

    instance: str
    path: str
    headers: httpx.Headers
    body: dict[str, Any] | None
    raw: bytes = b""
    method: str = "POST"


Handler = Callable[[Seen], Any]
"""Returns a response, None (the default answer), or an awaitable of either."""


@dataclass
class Fakes:
    """Every fake instance: records what arrived; `script` overrides answers per instance."""

    encoder_metadata: dict[str, Any] = field(default_factory=dict)
    metadata_by_type: dict[str, dict[str, Any]] | None = None
    """E's metadata by the item's part type (`video_url`, ...), instead of encoder_metadata;
    a type not named reports none (as LLaVA's images, or an audio model's clips)."""
    seen: list[Seen] = field(default_factory=list)
    script: dict[str, list[Handler]] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    stream_body: bytes = STREAM
    stream_chunks: list[bytes] | None = None
    kv_params: dict[str, Any] = field(
        default_factory=lambda: {"do_remote_prefill": True, "remote_block_ids": [1, 2],
                                 "remote_engine_id": "p-engine"})
    store: Any = None
    """An epdctl.cache.store.Store the encoders save each item into before they answer,
    as a real E does (None: they save nothing)."""

    def to(self, instance: str, path: str | None = None) -> list[Seen]:
        return [s for s in self.seen if s.instance == instance
                and (path is None or s.path == path)]

    def posts(self, prefix: str) -> list[Seen]:
        """Completion requests seen by instances whose name starts with prefix."""
        return [s for s in self.seen if s.instance.startswith(prefix) and s.path != "/health"]

    def then(self, instance: str, *handlers: Handler) -> None:
        """Answer the next requests to `instance` with these handlers (None = default)."""
        self.script.setdefault(instance, []).extend(handlers)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        instance = request.url.host
        try:
            body = json.loads(request.content) if request.content else None
        except ValueError:
            body = None  # not JSON: the proxy passed a body through for vLLM to refuse
        seen = Seen(instance, request.url.path, request.headers, body, request.content,
                    request.method)
        self.seen.append(seen)
        if request.url.path == "/health" and request.method == "GET":
            return httpx.Response(503 if instance in self.down else 200)
        if instance in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        queue = self.script.get(instance)
        if queue:
            answer = queue.pop(0)(seen)
            if inspect.isawaitable(answer):
                answer = await answer
            if answer is not None:
                return answer
        return self.default(seen)

    def default(self, seen: Seen) -> httpx.Response:
        body = seen.body if isinstance(seen.body, dict) else {}
        if seen.instance.startswith("e"):
            part = body["messages"][0]["content"][0]
            key = part.get("uuid") or "no-uuid"
            if self.store is not None:
                self.store.publish(key, bytes(16 * 4 * 4), dtype="float32", shape=(16, 4))
            metadata = self.encoder_metadata if self.metadata_by_type is None else \
                self.metadata_by_type.get(part.get("type"), {})
            entry = {"item_indices": [0], "metadata": dict(metadata)}
            return httpx.Response(200, json={"id": "e", "choices": [],
                                             "ec_transfer_params": {key: entry}})
        if seen.instance.startswith("p") and not seen.instance.startswith("pd"):
            return httpx.Response(200, json={**completion("x"),
                                             "kv_transfer_params": self.kv_params})
        if body.get("stream"):
            chunks = self.stream_chunks or [self.stream_body]
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=_Chunks(chunks))
        return httpx.Response(200, json=completion())


def sse_response(*chunks: bytes, status: int = 200) -> httpx.Response:
    """A streamed answer, chunk by chunk, as a real transport delivers it."""
    return httpx.Response(status, headers={"content-type": "text/event-stream"},
                          stream=_Chunks(list(chunks)))


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


@dataclass
class Rig:
    """The proxy app, a client into it, and the fakes behind it."""

    app: Any
    client: httpx.AsyncClient
    fakes: Fakes
    config: ProxyConfig
    upstream: Any
    """The proxy's client to its instances, as __main__ makes it (config.client picks)."""
    instances: Instances
    """The fakes' servers."""

    @property
    def proxy(self) -> Any:
        return self.app.state.proxy

    async def chat(self, content: Any, **extra: Any) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
        return await self.client.post("/v1/chat/completions", json=body)


def make_rig(names: Names, transport: str, fakes: Fakes | None = None, **kwargs: Any) -> Rig:
    """The proxy over `fakes` served on local sockets, on the client `transport` names
    (aiohttp or httpx), built as __main__ builds it; `kwargs`: ProxyConfig's."""
    fakes = fakes or Fakes()
    kwargs.setdefault("models", (MODEL,))
    # No health probes run here, so nothing dead comes back: don't wait for it.
    kwargs.setdefault("replay_wait_s", 0.01)
    if not kwargs.get("prefill"):
        kwargs.setdefault("prefill_decode", ("http://pd0",))
    assert "client" not in kwargs, "the transport picks the client"
    config = ProxyConfig(client=transport, **kwargs)
    upstream = upstream_client(config)
    app = create_app(config, upstream)
    instances = names.add(fakes.handle)
    client = httpx.AsyncClient(transport=Routed(httpx.ASGITransport(app=app), instances),
                               base_url="http://proxy")
    return Rig(app, client, fakes, config, upstream, instances)


async def close_rig(rig: Rig) -> None:
    """Everything the rig opened closed, as __main__ closes it on exit, and RawUpstream's own
    pools with it (which an exiting process needs not close); its servers are its Names'."""
    await rig.client.aclose()
    await rig.proxy.stop_background()
    rig.proxy.close()
    close_pools = getattr(rig.proxy.client, "close", None)
    if close_pools is not None:
        close_pools()
    await rig.upstream.__aexit__(None, None, None)  # __main__'s `async with` ends


@contextlib.contextmanager
def rig_on_a_loop(transport: str, fakes: Fakes | None = None, **kwargs: Any
                  ) -> Iterator[tuple[asyncio.AbstractEventLoop, Rig]]:
    """A rig on a loop of its own, for a fixture that outlives a test (hypothesis's many
    examples on one rig): the loop runs only while the caller runs something on it."""
    loop = asyncio.new_event_loop()
    names = Names()

    async def start() -> Rig:
        names.install()
        return make_rig(names, transport, fakes, **kwargs)

    rig = loop.run_until_complete(start())
    try:
        yield loop, rig
    finally:
        try:
            loop.run_until_complete(close_rig(rig))
            loop.run_until_complete(names.close())
        finally:
            loop.close()


class Routed(httpx.AsyncBaseTransport):
    """Into one rig's app: what it sends to an instance meanwhile (or later, from tasks
    started meanwhile) reaches that rig's fakes, whatever other rigs the test holds."""

    def __init__(self, app: httpx.ASGITransport, instances: Instances) -> None:
        self.app = app
        self.instances = instances

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with Names.routed(self.instances):
            return await self.app.handle_async_request(request)


def image_part(data: bytes = PNG, **extra: Any) -> dict[str, Any]:
    import base64

    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}, **extra}
