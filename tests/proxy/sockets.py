"""The fake instances on real local sockets, so that the proxy's own clients (RawUpstream and
aiohttp, or httpx) carry every rig test's sub-requests as they do in production.

Each instance name a rig's proxy reaches (`e0`, `pd0`, `media`, ...) gets an HTTP/1.1 server
of its own on 127.0.0.1, on a port the OS picks, started on first use. It turns each request
into the httpx.Request that `Fakes.handle` takes (so every scripted handler works as it
did behind httpx.MockTransport) and writes the httpx.Response back: status, headers, and the
body, a streamed one chunk by chunk (`transfer-encoding: chunked`), each written as it comes:
the clients' parsers hand each chunk on by itself, so the proxy meets the chunk boundaries
the test scripted even where TCP joins them. The faults a handler scripts become what a
client meets on a socket:

- `httpx.ConnectError` (an instance in `Fakes.down`): the connection closes without an
  answer; the proxy sees the instance unavailable.
- an httpx.TransportError from a streamed body: the connection closes mid-body; the proxy
  sees the answer broken.
- a handler that never returns: the client's own deadline ends the wait.
- the client leaving (the proxy gave up, or its client left): the handler is cancelled and
  its body closed, as vLLM aborts a request whose connection is gone.

Anything else a handler raises is a bug in the test: it closes the connection and fails the
test at teardown.

Configs keep `http://pd0`: `Names` resolves those names to the servers, through the test's
event loop (`loop.getaddrinfo`, which RawUpstream's and aiohttp's connections use) and
`anyio.connect_tcp` (httpx's). A test may hold several rigs whose instances share names:
a name resolves to the servers of the rig whose client made the request (`Names.routed`),
or of the only rig there is.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any

import anyio
import h11
import httpx

from tests.waits import WAIT_S

LOCAL = "127.0.0.1"
Handle = Callable[[httpx.Request], "Awaitable[httpx.Response] | httpx.Response"]
"""What answers the requests to every name: `Fakes.handle`, or a test's own."""


class Instance:
    """One fake instance's server: requests to `name`, answered by `handle`."""

    def __init__(self, name: str, handle: Handle) -> None:
        self.name = name
        self.handle = handle
        self.port = 0
        self.connections: set[_Connection] = set()
        self.answers: set[asyncio.Task[None]] = set()
        self.errors: list[BaseException] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), LOCAL, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, drop every connection (cancelling what is still being
        answered) and wait until those answers have unwound."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        if self.answers:
            _, stuck = await asyncio.wait(self.answers, timeout=WAIT_S)
            if stuck:
                raise AssertionError(f"{self.name}: a handler went on after its client left")
        if self._server is not None:
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    """One client connection: its requests in turn, each answered in a task that the loss of
    the connection cancels."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.http = h11.Connection(h11.SERVER)
        self.transport: asyncio.Transport | None = None
        self.answering: asyncio.Task[None] | None = None
        self._head: h11.Request | None = None
        self._body = bytearray()
        self._room: asyncio.Future[None] | None = None  # set while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.instance.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.http.receive_data(data)
        self._next_request()

    def eof_received(self) -> bool:
        self.http.receive_data(b"")
        self._next_request()
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.instance.connections.discard(self)
        if self.answering is not None:
            self.answering.cancel()  # the client left: the instance stops answering
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._room is None:
            self._room = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """End the connection after what was written (a FIN: the client reads all of it,
        then finds the answer missing or cut short)."""
        if self.transport is not None:
            self.transport.close()

    def _next_request(self) -> None:
        """Take the buffered request's events; once one is whole, answer it (the next one is
        taken when that answer is done)."""
        while self.answering is None:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError:
                self.close()  # a torn request: the client went away while sending it
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._head, self._body = event, bytearray()
            elif isinstance(event, h11.Data):
                self._body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert self._head is not None
                request = _request(self.instance.name, self._head, bytes(self._body))
                self.answering = asyncio.get_running_loop().create_task(self._answer(request))
                self.instance.answers.add(self.answering)
                self.answering.add_done_callback(self._answered)
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return

    def _answered(self, task: asyncio.Task[None]) -> None:
        self.instance.answers.discard(task)
        self.answering = None
        if task.cancelled() or task.exception() is not None or self.transport is None \
                or self.transport.is_closing():
            return
        if self.http.our_state is h11.DONE and self.http.their_state is h11.DONE:
            self.http.start_next_cycle()
            self._next_request()
        else:
            self.close()  # `connection: close`, or an answer cut short

    async def _answer(self, request: httpx.Request) -> None:
        try:
            response = self.instance.handle(request)
            if inspect.isawaitable(response):
                response = await response
        except httpx.ConnectError:
            self.close()  # refused: no answer at all
            return
        except Exception as exc:  # a bug in the test's handler: fail the test with it
            self.instance.errors.append(exc)
            self.close()
            return
        try:
            self._send(h11.Response(status_code=response.status_code,
                                    headers=list(response.headers.raw),
                                    reason=response.reason_phrase.encode()))
            stream: Any = response.stream  # as the handler made it: not decoded, not read
            async for chunk in stream:
                self._send(h11.Data(data=chunk))  # its own chunk of the chunked encoding
                await self._drain()
            self._send(h11.EndOfMessage())
        except httpx.TransportError:
            self.close()  # the instance broke off mid-answer: the client's read breaks
        except Exception as exc:
            self.instance.errors.append(exc)
            self.close()
        finally:
            await response.aclose()  # a streamed body is closed, as the client's leaving does

    def _send(self, event: h11.Event) -> None:
        data = self.http.send(event)
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def _drain(self) -> None:
        """Until the transport has room for more (a long answer is not buffered whole)."""
        if self._room is not None:
            await self._room


def _request(name: str, head: h11.Request, body: bytes) -> httpx.Request:
    """The request as Fakes.handle takes it: its URL names the instance."""
    url = f"http://{name}{head.target.decode('latin-1')}"
    return httpx.Request(head.method.decode("ascii"), url,
                         headers=list(head.headers.raw_items()), content=body)


class Instances:
    """One rig's fake instances: a server per name, started on the first connection to it."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.served: dict[str, Instance] = {}
        self._starting = asyncio.Lock()

    async def port(self, name: str) -> int:
        async with self._starting:
            instance = self.served.get(name)
            if instance is None:
                instance = Instance(name, self.handle)
                await instance.start()
                self.served[name] = instance
        return instance.port

    async def close(self) -> None:
        """Every server closed; then AssertionError for the first thing that went wrong in
        one (a handler's own error, or a handler that would not stop), if any."""
        failures: list[BaseException] = []
        for instance in self.served.values():
            try:
                await instance.close()
            except AssertionError as exc:
                failures.append(exc)
            failures += instance.errors
        if failures:
            raise AssertionError(f"a fake instance failed: {failures[0]!r}") from failures[0]


_ROUTE: ContextVar[Instances | None] = ContextVar("fake_instances", default=None)


def is_fake(host: object) -> bool:
    """Whether `host` names a fake instance: any name but localhost (no test reaches a real
    host; an IP address is a real local server's, as test_large_media's)."""
    if not isinstance(host, str) or host == "localhost":
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


class Names:
    """Resolves fake instance names to their servers on 127.0.0.1 while installed: on the
    running loop (its `getaddrinfo`: asyncio's create_connection, aiohttp's resolver) and in
    anyio (`connect_tcp`: httpcore, which takes the port from the URL, not the lookup)."""

    def __init__(self) -> None:
        self.rigs: list[Instances] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connect_tcp: Callable[..., Any] | None = None

    def add(self, handle: Handle) -> Instances:
        """Servers for another rig (or a test's own clients), each request answered by
        `handle`."""
        self.rigs.append(Instances(handle))
        return self.rigs[-1]

    @staticmethod
    @contextlib.contextmanager
    def routed(instances: Instances) -> Iterator[None]:
        """Names resolve to these instances' servers within (and in tasks started within)."""
        token = _ROUTE.set(instances)
        try:
            yield
        finally:
            _ROUTE.reset(token)

    def route(self) -> Instances:
        routed = _ROUTE.get()
        if routed is not None:
            return routed
        if len(self.rigs) == 1:
            return self.rigs[0]
        raise LookupError(f"{len(self.rigs)} rigs in this test: which one's instances? Reach "
                          "them through rig.client, or within Names.routed(rig.instances)")

    async def port(self, name: str) -> int:
        return await self.route().port(name)

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        resolve = self._loop.getaddrinfo
        connect_tcp = self._connect_tcp = anyio.connect_tcp

        async def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if not is_fake(host):
                return await resolve(host, port, *args, **kwargs)
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "",
                     (LOCAL, await self.port(host)))]

        async def anyio_connect_tcp(remote_host: Any, remote_port: int, **kwargs: Any) -> Any:
            if is_fake(remote_host):
                remote_host, remote_port = LOCAL, await self.port(remote_host)
            return await connect_tcp(remote_host, remote_port, **kwargs)

        self._loop.getaddrinfo = getaddrinfo  # type: ignore[method-assign]
        anyio.connect_tcp = anyio_connect_tcp  # type: ignore[assignment]

    async def close(self) -> None:
        """Uninstalled; every rig's servers closed (the first handler error raised)."""
        if self._loop is not None:
            del self._loop.getaddrinfo  # the loop's own again
            anyio.connect_tcp = self._connect_tcp  # type: ignore[assignment]
            self._loop = None
        rigs, self.rigs = self.rigs, []
        errors: list[BaseException] = []
        for instances in rigs:
            try:
                await instances.close()
            except AssertionError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
