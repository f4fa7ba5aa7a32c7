"""`logs --export-trace`: what a topology served, read back from the proxy's request lines
(proxy/trace.py, proxy/request/traffic.py) as a trace (epdctl/traces, docs/traces.md)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdctl.logs.times import own_time
from epdctl.proxy.request.parse import ORCHESTRATED
from epdctl.traces.classes import counts
from epdctl.traces.format import MediaItem, Trace, TraceError, TraceRequest, write_trace

MARK = " INFO epdctl.proxy: rid="
"""Starts a request's line (after its time), as proxy/server/logline.py writes it."""


@dataclass
class Exported:
    """The requests exported, and the lines left out."""

    requests: list[TraceRequest] = field(default_factory=list)
    failed: int = 0
    """Requests that got no answer, or an error (their status not 2xx)."""
    unshaped: int = 0
    """Completion lines without the trace's fields: logged before the proxy wrote them."""
    unread: int = 0
    """Requests the proxy passed through unread (a body it does not take; vLLM answered)."""

    def as_json(self, path: Path) -> dict[str, Any]:
        trace = Trace(tuple(self.requests))
        return {"path": str(path), "requests": len(self.requests),
                "duration_s": round(trace.duration_s, 3), "classes": counts(self.requests),
                "failed": self.failed, "unread": self.unread, "without_shape": self.unshaped}

    def summary(self, path: Path) -> str:
        """`wrote 12 requests over 3.4 s to FILE (text 4, image 6, image2 2)`, and what was
        left out."""
        doc = self.as_json(path)
        classes = ", ".join(f"{name} {n}" for name, n in doc["classes"].items())
        text = f"wrote {doc['requests']} requests over {doc['duration_s']:.1f} s to {path} " \
               f"({classes})"
        left = self.left_out()
        if left:
            text += f"; left out {left}"
        if self.unshaped:
            text += f"; skipped {self.unshaped} lines logged before requests' shapes were"
        return text

    def left_out(self) -> str:
        """`2 failed, 1 passed through unread` (or nothing)."""
        left = [f"{self.failed} failed"] if self.failed else []
        if self.unread:
            left.append(f"{self.unread} passed through unread")
        return ", ".join(left)


def fields(text: str) -> dict[str, str] | None:
    """A request line's key=value fields after its rid (which may hold spaces); None for
    another line."""
    at = text.find(MARK)
    route_at = text.find(" route=", at + len(MARK)) if at >= 0 else -1
    if route_at < 0:
        return None
    out = {}
    for part in text[route_at + 1:].split():
        key, eq, value = part.partition("=")
        if eq:
            out[key] = value
    return out


def request_of(line: dict[str, str]) -> TraceRequest:
    """One request line's fields -> its request, timestamped at its arrival (epoch ms);
    ValueError where a field is malformed."""
    media = tuple(MediaItem.of_label(label) for label in line["media"].split(",")) \
        if line.get("media") else ()
    arrival_s = float(line["at"])
    if not math.isfinite(arrival_s):
        raise ValueError("at")
    # A trace's output_length is 1 or more: an answer of nothing (or of tokens not known)
    # is replayed as one token.
    output = max(int(line.get("out_tokens", "1")), 1)
    return TraceRequest(arrival_s * 1000, int(line["text_tokens"]), output, media,
                        line.get("stream") == "1")


def is_failed(status: str) -> bool:
    """Not a 2xx answer: an error status, or none (`client_gone`)."""
    return not (status.isdigit() and 200 <= int(status) < 300)


def read_requests(proxy_log: Path, since: float | None = None) -> Exported:
    """The requests of the proxy's log (those that arrived from `since`, epoch s), in
    arrival order, timestamped from the first one's arrival. The file is read once, a line
    at a time (a long run's log is large)."""
    out = Exported()
    arrived: list[TraceRequest] = []
    with open(proxy_log, encoding="utf-8", errors="replace") as lines:
        for text in lines:
            got = fields(text)
            if got is None or got.get("route") not in ORCHESTRATED:
                continue
            if since is not None and _arrival(got, text) < since:
                continue
            request = _sorted(got, out)
            if request is not None:
                arrived.append(request)
    arrived.sort(key=lambda r: r.timestamp_ms)
    start = arrived[0].timestamp_ms if arrived else 0.0
    out.requests = [TraceRequest(round(r.timestamp_ms - start, 3), r.input_length,
                                 r.output_length, r.media, r.stream) for r in arrived]
    return out


def _sorted(got: dict[str, str], out: Exported) -> TraceRequest | None:
    """A completion line's request, or None with the reason it is left out counted."""
    if is_failed(got.get("status", "")):
        out.failed += 1
    elif "at" not in got:
        out.unshaped += 1
    elif "text_tokens" not in got:
        out.unread += 1
    else:
        try:
            return request_of(got)
        except (KeyError, ValueError):
            out.unshaped += 1  # a line cut short, or not the proxy's
    return None


def _arrival(got: dict[str, str], text: str) -> float:
    """When a line's request came (epoch s): its `at=`, else the line's own time (its
    end)."""
    try:
        return float(got["at"])
    except (KeyError, ValueError):
        return own_time(text, time.time()) or 0.0


def export(proxy_log: Path, path: Path, since: float | None = None) -> Exported:
    """Write the proxy log's requests to `path` as a trace; TraceError in one line where
    there is no log, no request in it, or `path` cannot be written."""
    if not proxy_log.is_file():
        raise TraceError(f"no proxy log at {proxy_log}: did this topology run with epdctl's "
                         "proxy?")
    exported = read_requests(proxy_log, since)
    if not exported.requests:
        window = "" if since is None else " in that window (--since)"
        left = [exported.left_out()] if exported.left_out() else []
        if exported.unshaped:
            left.append(f"{exported.unshaped} logged before requests' shapes were")
        why = f" ({', '.join(left)})" if left else ""
        raise TraceError(f"{proxy_log}: no request to export{window}{why}")
    try:
        write_trace(path, exported.requests)
    except OSError as exc:
        raise TraceError(f"{path}: cannot write the trace ({exc.strerror or exc})") from None
    return exported
