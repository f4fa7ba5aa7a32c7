"""The upstream transport contract: what every stage relies on from the client that talks
to the instances, whichever implementation (`transport/*_impl.py`) is chosen.

- `post` sends a sub-request and returns its Reply once the answer's head is in; `request`
  does the same for any method (passed-through routes); `fetch` gets a media URL whole,
  `probe` a health URL's verdict.
- A Reply's `chunks` yields its body as it arrives: at each step everything that has
  arrived, in one piece (a stream's events relayed at the speed of bytes, never one write
  to the client per event the instance wrote when several came together).
- Failures raise UpstreamError: "unavailable" when no answer began (refused, reset before
  any byte: retryable), "broken" when one began and was cut short, "timeout" when the
  instance stayed silent past `read_timeout_s` (each wait for its next bytes), or past
  the bound a Reply's `idle(seconds)` set for every later wait (a committed stream).
- Header values are ASCII (routing.header_id); an instance URL is http://host:port
  (config refuses https); a body is written as the instance takes it; an implementation
  bounds its connections to one instance and closes idle ones after keep-alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol


class Reply(Protocol):
    """An upstream response whose body has not been read yet."""

    status: int
    content_type: str

    def header_list(self) -> list[tuple[bytes, bytes]]: ...
    async def read(self) -> bytes: ...
    def chunks(self) -> AsyncIterator[bytes]: ...
    def idle(self, seconds: float) -> None: ...
    async def close(self) -> None: ...


class Upstream(Protocol):
    """POST (or any method) to an instance, fetch media, probe health; failures raise
    UpstreamError: "unavailable" when no response arrived, "broken" when one began."""

    async def post(self, base: str, path: str, body: bytes, headers: Mapping[str, str],
                   read_timeout_s: float, stage: str) -> Reply: ...
    async def request(self, method: str, base: str, path: str, body: bytes,
                      headers: Mapping[str, str], read_timeout_s: float, stage: str
                      ) -> Reply: ...
    async def fetch(self, url: str, timeout_s: float, max_bytes: int) -> tuple[int, str, bytes]:
        ...
    async def probe(self, url: str, timeout_s: float) -> bool: ...


def with_key(headers: Mapping[str, str], auth: str | None) -> Mapping[str, str]:
    """A sub-request's headers plus the instances' `authorization`, when they require one."""
    return headers if auth is None else {**headers, "authorization": auth}


async def within(body: AsyncIterator[bytes], bound: Callable[[], float | None]
                 ) -> AsyncIterator[bytes]:
    """`body`'s chunks, each wait bounded by `bound()` seconds where it gives a bound (a
    Reply's `idle`, read anew for every wait): TimeoutError past it."""
    chunks = body.__aiter__()
    while True:
        seconds = bound()
        try:
            if seconds is None:
                chunk = await chunks.__anext__()
            else:
                async with asyncio.timeout(seconds):
                    chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return
        yield chunk
