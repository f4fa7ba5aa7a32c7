"""The proxy's own controls, for epdctl's `down --drain` and `restart` (a caller with the api
key or the run's internal key; anyone where neither is set, as /health's URLs):

- `POST /epdctl/drain {"seconds": S}`: admit nothing new (503 with Retry-After and a JSON
  error; /health says "draining"), then answer once every request in flight has ended or S
  seconds have passed: `{"finished": N, "in_flight": M}` (M are cut when the run stops).
- `POST /epdctl/instances/drain {"url": U, "seconds": S}`: send the instance at U nothing new
  (another of its role takes its requests, or they wait for it within replay_wait), then
  answer as above for its requests in flight.
- `POST /epdctl/instances/admit {"url": U}`: send it requests again.
- `POST /epdctl/instances/add {"url": U, "role": R}`: route requests of role R to the instance
  at U too, from now on (`epdctl scale`, `switch`, `apply`: it is ready first).
- `POST /epdctl/instances/remove {"url": U, "seconds": S}`: drain it as above, then route
  nothing more to it: `{"finished": N, "in_flight": M}` (409: the last of its role).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from epdctl.proxy import jsonio
from epdctl.proxy.errors import JSON_TYPE, UNAUTHORIZED_BODY, ProxyError, error_body
from epdctl.proxy.server.asgi import Scope, read_body
from epdctl.proxy.server.handler import ProxyHandler

PREFIX = "/epdctl/"
MAX_CONTROL_BYTES = 4096
POLL_S = 0.05


class Admin:
    """The control routes over one ProxyHandler."""

    def __init__(self, proxy: ProxyHandler) -> None:
        self._proxy = proxy
        self._routes: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "/epdctl/drain": self._drain,
            "/epdctl/instances/drain": self._drain_instance,
            "/epdctl/instances/admit": self._admit,
            "/epdctl/instances/add": self._add,
            "/epdctl/instances/remove": self._remove,
        }

    def serves(self, path: str) -> bool:
        return path in self._routes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        status, body = 200, b""
        try:
            if scope["method"] != "POST":
                raise ProxyError(405, "Method Not Allowed")
            if not self._proxy.is_trusted(scope):
                status, body = 401, UNAUTHORIZED_BODY
            else:
                body = jsonio.dumps(await self._routes[scope["path"]](
                    await _control(receive)))
        except ProxyError as exc:
            status, body = exc.status, error_body(exc.message, exc.status, exc.param)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", JSON_TYPE.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _drain(self, control: dict[str, Any]) -> dict[str, Any]:
        proxy, seconds = self._proxy, _seconds(control)
        proxy.is_draining = True
        return await _settle(lambda: proxy.inflight, seconds)

    async def _drain_instance(self, control: dict[str, Any]) -> dict[str, Any]:
        (pool, inst), seconds = self._instance(control), _seconds(control)
        self._proxy.upstreams.set_draining(pool, inst, True)
        return await _settle(lambda: inst.outstanding, seconds)

    async def _admit(self, control: dict[str, Any]) -> dict[str, Any]:
        pool, inst = self._instance(control)
        self._proxy.upstreams.set_draining(pool, inst, False)
        return {"url": inst.url, "role": inst.role}

    async def _add(self, control: dict[str, Any]) -> dict[str, Any]:
        url, role = control.get("url"), control.get("role")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ProxyError(400, "`url` must be an http(s) URL", param="url")
        upstreams = self._proxy.upstreams
        if not isinstance(role, str) or role not in upstreams.pools:
            raise ProxyError(409, f"this proxy routes no role {role!r} (its roles: "
                             f"{', '.join(upstreams.pools)})", param="role")
        pool, inst = upstreams.add(role, url)
        return {"url": inst.url, "role": inst.role, "instances": len(pool.instances)}

    async def _remove(self, control: dict[str, Any]) -> dict[str, Any]:
        (pool, inst), seconds = self._instance(control), _seconds(control)
        if pool.instances == [inst]:
            raise ProxyError(409, f"{inst.url} is the only {inst.role} instance: requests of "
                             "its role would have nowhere to go", param="url")
        self._proxy.upstreams.set_draining(pool, inst, True)
        settled = await _settle(lambda: inst.outstanding, seconds)
        if inst in pool.instances:  # another remove of it may have ended first
            try:
                self._proxy.upstreams.remove(pool, inst)
            except ValueError as exc:  # its peers were removed meanwhile: it stays, admitted
                self._proxy.upstreams.set_draining(pool, inst, False)
                raise ProxyError(409, f"{exc}: kept", param="url") from None
        return settled

    def _instance(self, control: dict[str, Any]) -> Any:
        url = control.get("url")
        found = self._proxy.upstreams.find(url) if isinstance(url, str) else None
        if found is None:
            raise ProxyError(404, f"no instance at {url!r} behind this proxy", param="url")
        return found


async def _control(receive: Any) -> dict[str, Any]:
    raw = await read_body(receive, MAX_CONTROL_BYTES)
    try:
        control = jsonio.loads(raw or b"{}")
    except ValueError:
        raise ProxyError(400, "the body must be a JSON object") from None
    if not isinstance(control, dict):
        raise ProxyError(400, "the body must be a JSON object")
    return control


def _seconds(control: dict[str, Any]) -> float:
    seconds = control.get("seconds", 30)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ProxyError(400, "`seconds` must be a number >= 0", param="seconds")
    return float(seconds)


async def _settle(count: Callable[[], int], seconds: float) -> dict[str, Any]:
    """Until `count()` is 0 or `seconds` have passed: how many ended, how many are left."""
    before = count()
    until = time.monotonic() + seconds
    while count() and time.monotonic() < until:
        await asyncio.sleep(POLL_S)
    left = count()
    return {"finished": max(before - left, 0), "in_flight": left}
