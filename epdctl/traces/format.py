"""The trace format: one JSON object per line, a request each, in arrival order.

    {"timestamp": 1250, "input_length": 64, "output_length": 32,
     "media": [{"type": "image", "width": 512, "height": 512}], "stream": true}

`timestamp` (milliseconds since the trace's start), `input_length` (prompt text tokens) and
`output_length` (tokens generated) are Mooncake's fields with Mooncake's units, so a Mooncake
trace is a trace of text-only requests as it is (its `hash_ids` are read and ignored). `media`
(images: width x height pixels; videos: frames of width x height; audio: seconds) and `stream`
are ours. An Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens) is
read as the same requests. Nothing of a request's content is ever in a trace.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO, TypeVar

from epdctl.errors import EpdctlError

MEDIA_TYPES = ("image", "video", "audio")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
T = TypeVar("T")


class TraceError(EpdctlError):
    """A trace that cannot be read (with the line it failed on), written, or sent."""


@dataclass(frozen=True)
class MediaItem:
    """One media item's kind and size."""

    type: str
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    """Videos: frames (None: not known; a replay sends its --video-frames)."""
    seconds: float | None = None
    """Audio: the clip's length (None: not known)."""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for key in ("width", "height", "frames", "seconds"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @property
    def label(self) -> str:
        """`image:512x512`, `video:8x320x240`, `audio:2.5s` (`image` where the size is not
        known)."""
        size = f"{self.width}x{self.height}" if self.width and self.height else ""
        if self.type == "video" and self.frames:
            size = f"{self.frames}x{size}" if size else f"{self.frames}f"
        if self.type == "audio" and self.seconds is not None:
            size = f"{self.seconds:g}s"
        return f"{self.type}:{size}" if size else self.type

    @classmethod
    def of_label(cls, label: str) -> MediaItem:
        """The item a `label` names (the proxy's log line writes them); ValueError for one
        that is not a label."""
        kind, colon, size = label.partition(":")
        if kind not in MEDIA_TYPES:
            raise ValueError(f"not a media label: {label!r}")
        if not colon:
            return cls(kind)
        if kind == "audio" and size.endswith("s"):
            try:
                seconds = float(size[:-1])
            except ValueError:
                seconds = math.nan
            if math.isfinite(seconds) and seconds > 0:
                return cls(kind, seconds=seconds)
        elif kind == "video" and size.endswith("f") and size[:-1].isdigit():
            return cls(kind, frames=int(size[:-1]) or None)
        elif all(n.isdigit() and int(n) > 0 for n in size.split("x")):
            numbers = [int(n) for n in size.split("x")]
            if len(numbers) == 2:
                return cls(kind, numbers[0], numbers[1])
            if len(numbers) == 3 and kind == "video":
                return cls(kind, numbers[1], numbers[2], numbers[0])
        raise ValueError(f"not a media label: {label!r}")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    media: tuple[MediaItem, ...] = ()
    stream: bool = False

    def as_json(self) -> dict[str, Any]:
        ts = self.timestamp_ms
        out: dict[str, Any] = {"timestamp": int(ts) if float(ts).is_integer() else round(ts, 3),
                               "input_length": self.input_length,
                               "output_length": self.output_length}
        if self.media:
            out["media"] = [m.as_json() for m in self.media]
        if self.stream:
            out["stream"] = True
        return out

    def count(self, kind: str) -> int:
        return sum(1 for m in self.media if m.type == kind)


@dataclass(frozen=True)
class Trace:
    """A trace's requests, in arrival order, and where they came from."""

    requests: tuple[TraceRequest, ...]
    source: str = ""
    kind: str = "epdctl"
    """epdctl (ours, Mooncake's lines included), or azure (CSV)."""
    notes: tuple[str, ...] = field(default=())

    @property
    def duration_s(self) -> float:
        if len(self.requests) < 2:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000

    @property
    def rate(self) -> float:
        """Mean arrivals per second over the trace (0: one request, or all at once)."""
        span = self.duration_s
        return (len(self.requests) - 1) / span if span > 0 else 0.0


def read_trace(path: Path, limit: int | None = None) -> Trace:
    """A trace file: JSON lines (ours, or Mooncake's), or Azure's CSV. Timestamps are made
    relative to the first request's. TraceError in one line for what cannot be read (the
    file, a line with its number), and for a trace longer than `limit` requests."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc})") from None
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if first.startswith("{"):
        requests, kind = list(_json_lines(path, text)), "epdctl"
    elif first.replace(" ", "").startswith(",".join(AZURE_COLUMNS)):
        requests, kind = list(_azure(path, text)), "azure"
    elif not first:
        raise TraceError(f"{path}: the trace is empty")
    else:
        raise TraceError(f"{path}: line 1: neither a JSON object (a trace line) nor Azure's "
                         f"CSV header ({','.join(AZURE_COLUMNS)})")
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    if limit is not None and len(requests) > limit:
        raise TraceError(f"{path}: the trace has {len(requests)} requests, more than --limit "
                         f"{limit} (raise it, or cut the trace)")
    start = min(r.timestamp_ms for r in requests)
    ordered = sorted(requests, key=lambda r: r.timestamp_ms)  # stable: ties keep file order
    return Trace(tuple(replace(r, timestamp_ms=r.timestamp_ms - start) for r in ordered),
                 source=str(path), kind=kind)


def write_trace(path: Path | TextIO, requests: Iterable[TraceRequest]) -> int:
    """Write requests as trace lines; the count written."""
    lines = [json.dumps(r.as_json(), separators=(", ", ": ")) + "\n" for r in requests]
    if isinstance(path, Path):
        path.write_text("".join(lines))
    else:
        path.write("".join(lines))
    return len(lines)


def parse_line(data: Any, where: str) -> TraceRequest:
    """One trace line's object (ours or Mooncake's) -> its request; TraceError naming
    `where` (the file and line) for what is missing or wrong."""
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    timestamp = _number(data, "timestamp", where)
    input_length = _count(data, "input_length", where)
    output_length = _count(data, "output_length", where, least=1)
    media = data.get("media") or []
    if not isinstance(media, list):
        raise TraceError(f"{where}: `media` must be a list of items")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise TraceError(f"{where}: `stream` must be true or false")
    return TraceRequest(timestamp, input_length, output_length,
                        tuple(_media(item, f"{where}: media[{i}]") for i, item in
                              enumerate(media)), stream)


def _json_lines(path: Path, text: str) -> Iterator[TraceRequest]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{where}: not JSON ({exc.args[0] if exc.args else exc})") \
                from None
        yield parse_line(data, where)


def _azure(path: Path, text: str) -> Iterator[TraceRequest]:
    """Azure's LLM inference traces: TIMESTAMP (a date and time, to the tenth of a
    microsecond), ContextTokens, GeneratedTokens."""
    rows = csv.reader(io.StringIO(text))
    header = [h.strip() for h in next(rows)]
    at = {name: header.index(name) for name in AZURE_COLUMNS}
    for number, row in enumerate(rows, 2):
        if not row or not any(cell.strip() for cell in row):
            continue
        where = f"{path}: line {number}"
        try:
            stamp = _azure_time(row[at["TIMESTAMP"]].strip())
            context, generated = (int(row[at[c]]) for c in AZURE_COLUMNS[1:])
        except (IndexError, ValueError):
            raise TraceError(f"{where}: expected {','.join(AZURE_COLUMNS)}, got "
                             f"{','.join(row)!r}") from None
        if context < 0 or generated < 1:
            raise TraceError(f"{where}: ContextTokens must be 0 or more and GeneratedTokens "
                             "1 or more")
        yield TraceRequest(stamp.timestamp() * 1000, context, generated)


def _azure_time(text: str) -> datetime:
    """`2023-11-16 18:15:46.6805900`: seven digits of fraction (Python takes six)."""
    head, dot, fraction = text.partition(".")
    return datetime.fromisoformat(f"{head}.{fraction[:6]}" if dot else head)


def _number(data: dict[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value) or value < 0:
        raise TraceError(f"{where}: `{key}` must be a number of 0 or more, got {value!r}")
    return float(value)


def _count(data: dict[str, Any], key: str, where: str, least: int = 0) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TraceError(f"{where}: `{key}` must be a whole number of {least} or more, "
                         f"got {value!r}")
    return value


def _media(item: Any, where: str) -> MediaItem:
    if not isinstance(item, dict):
        raise TraceError(f"{where}: expected an object with `type`")
    kind = item.get("type")
    if kind not in MEDIA_TYPES:
        raise TraceError(f"{where}: `type` must be one of {', '.join(MEDIA_TYPES)}, "
                         f"got {kind!r}")
    sizes: dict[str, Any] = {}
    for key in ("width", "height", "frames"):
        if item.get(key) is not None:
            sizes[key] = _count(item, key, where, least=1)
    if item.get("seconds") is not None:
        seconds = _number(item, "seconds", where)
        if seconds <= 0:
            raise TraceError(f"{where}: `seconds` must be above 0")
        sizes["seconds"] = seconds
    if ("width" in sizes) != ("height" in sizes):
        raise TraceError(f"{where}: give both `width` and `height`, or neither")
    return MediaItem(kind, **sizes)


def cycle_ms(requests: Sequence[TraceRequest]) -> float:
    """How long one pass of the requests lasts when they are played back to back: their
    span and one mean gap (span / (n - 1)) before the next pass's first (cycled)."""
    if len(requests) < 2:
        return 0.0
    span = requests[-1].timestamp_ms - requests[0].timestamp_ms
    return span + span / (len(requests) - 1)


def cycle(items: Sequence[T], count: int, period: float, shift: Callable[[T, float], T]
          ) -> tuple[T, ...]:
    """The first `count` of `items` played back to back: past the last, the items again
    from the first, each pass `period` after the one before (`shift(item, by)`: the item
    that much later). The one rule of a cycled trace, for its lines (cycled) and for the
    queue model's arrivals (tune.workload.TraceWorkload.arrivals_at)."""
    n = len(items)
    if count <= n:
        return tuple(items[:count])
    return tuple(shift(items[i % n], (i // n) * period) for i in range(count))


def cycled(requests: Sequence[TraceRequest], count: int) -> tuple[TraceRequest, ...]:
    """The first `count` requests of the trace played back to back, each pass cycle_ms
    after the one before (a short trace that a load point must send more of)."""
    return cycle(requests, count, cycle_ms(requests),
                 lambda r, by: replace(r, timestamp_ms=r.timestamp_ms + by))


def scaled(trace: Trace, speed: float) -> list[float]:
    """Each request's send time (s from the start) at `speed` times the trace's pace."""
    return [r.timestamp_ms / 1000 / speed for r in trace.requests]

