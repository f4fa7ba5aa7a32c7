"""`logs --request ID`: one request's lines across the proxy and every instance.

The proxy names sub-requests `<rid>:enc<i>` and `<rid>:prefill` (their x-request-id) and
sends the final stage the client's own `<rid>`; vLLM makes that `chatcmpl-<rid>`, the
response `id` a client sees, and adds `-<8 hex>` inside the engine. Any of these forms
(and the older `<rid>:decode`) finds the request.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from epdctl.logs.lines import Line, TimeSource, merged
from epdctl.logs.stamps import Stamps
from epdctl.logs.times import own_time

API_PREFIXES = ("chatcmpl-", "cmpl-")
CHILD = re.compile(r":(?:enc\d+|prefill|decode)(?:-[0-9a-f]{8})?$")
ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
"""What vLLM's engine adds to the id it was given (`chatcmpl-<rid>-1a2b3c4d`)."""
LOOK_BACK_LINES = 500
"""How far back a line without a time of its own looks for one."""


@dataclass(frozen=True)
class Journey:
    rid: str
    summary: list[Line]
    """The proxy's line(s) for the request: status and stage timings."""
    lines: list[Line]
    """Every other line naming the request or a sub-request, in time order."""


def candidates(given: str) -> list[str]:
    """Request ids `given` may stand for, the most likely first."""
    rid = given.strip()
    forms = []
    for prefix in API_PREFIXES:
        if rid.startswith(prefix):
            bare = rid[len(prefix):]
            parent = CHILD.sub("", bare)
            if parent != bare:  # a sub-request's id
                forms.append(parent)
            else:  # the response id, or the engine's for it (a client's rid may end so too)
                forms += [ENGINE_SUFFIX.sub("", bare), bare]
            break
    forms += [CHILD.sub("", rid), rid]
    return list(dict.fromkeys(f for f in forms if f))


_BEFORE = rb"(?:^|(?<=[\s=\"'(\[])|(?<=chatcmpl-)|(?<=cmpl-))"
_END = rb"(?:$|[\s,;\"')\]]|[.:](?:$|\s))"
"""Where an id ends: a space, a separator, or a full stop / colon that ends a phrase."""
_AFTER = rb"(?=(?::(?:enc\d+|prefill|decode))?(?:-[0-9a-f]{8})?" + _END + rb")"
"""The id whole, or with a sub-request's `:enc0` and/or the engine's `-1a2b3c4d` after it."""


def naming(rid: str) -> re.Pattern[bytes]:
    """Lines that name rid as a whole id: `rid=X `, `chatcmpl-X-1a2b3c4d.`, `X:enc0: params`.

    Not `Xd`, `X-other`, `X.v2` or `X:7` (other requests' ids)."""
    return re.compile(_BEFORE + re.escape(rid.encode()) + _AFTER, re.M)


def find(files: Sequence[tuple[str, Path]], given: str, proxy: str = "proxy") -> Journey:
    """The lines of every file that name the request `given` stands for."""
    rid = candidates(given)[0]
    proxy_log = dict(files).get(proxy)
    if proxy_log is not None:
        for form in candidates(given):
            if any(_is_summary(line, form) for line in
                   _matches(proxy, proxy_log, naming(form))):
                rid = form  # the form the proxy knows
                break
    by_file = {name: _matches(name, path, naming(rid)) for name, path in files}
    summary = [line for line in by_file.get(proxy, []) if _is_summary(line, rid)]
    rest = [[line for line in lines if line not in summary] for lines in by_file.values()]
    return Journey(rid, summary, list(merged(rest)))


def _is_summary(line: Line, rid: str) -> bool:
    """The proxy's one line per request (proxy/trace.py): `rid=X route=... status=...`."""
    return f"rid={rid} route=" in line.text


def _matches(name: str, path: Path, pattern: re.Pattern[bytes]) -> list[Line]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return []
            reference = os.fstat(f.fileno()).st_mtime
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return []
    with data:
        stamps = Stamps.load(path)
        found: list[Line] = []
        order, seen = float("-inf"), -1
        for match in pattern.finditer(data):  # type: ignore[call-overload]
            start = data.rfind(b"\n", 0, match.start()) + 1
            if start <= seen:
                continue  # the same line named it twice
            end = data.find(b"\n", match.end())
            end = size if end < 0 else end
            seen = start
            text = data[start:end].rstrip(b"\r").decode("utf-8", "replace")
            at, source = _time_of(data, start, end, text, stamps, reference)
            order = max(order, at) if at is not None else order
            found.append(Line(name, text, at, source, order))
        return found


def _time_of(data: mmap.mmap, start: int, end: int, text: str, stamps: Stamps,
             reference: float) -> tuple[float | None, TimeSource]:
    own = own_time(text, reference)
    if own is not None:
        return own, "own"
    written = stamps.written_by(end + 1)
    if written is not None:
        return written, "written"
    for _ in range(LOOK_BACK_LINES):  # the last line before it that says when it was
        if start == 0:
            break
        previous = data.rfind(b"\n", 0, start - 1) + 1
        earlier = own_time(data[previous:start - 1].decode("utf-8", "replace"), reference)
        if earlier is not None:
            return earlier, "inherited"
        start = previous
    return None, "unknown"
