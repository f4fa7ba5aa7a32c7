"""Shape classes: requests grouped by what they carry (the media and how many of each), the
buckets `bench --trace` reports by and `tune --trace` profiles. A class name is `text`, or
each media type with its count where more than one, joined by `+`: `image`, `image2`,
`video`, `image+audio`. Sizes and lengths are not in it (a trace's classes stay few); each
class's typical sizes are (`typical`)."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from epdctl.traces.format import MEDIA_TYPES, MediaItem, TraceError, TraceRequest

TEXT = "text"
_PART = re.compile(r"(image|video|audio)(\d*)")


def shape_class(request: TraceRequest) -> str:
    """The class of one request."""
    parts = []
    for kind in MEDIA_TYPES:
        n = request.count(kind)
        if n:
            parts.append(kind if n == 1 else f"{kind}{n}")
    return "+".join(parts) or TEXT


def parse_class(name: str) -> dict[str, int]:
    """`image2+audio` -> {"image": 2, "audio": 1}; `text` -> {}; TraceError otherwise."""
    name = name.strip()
    if name == TEXT:
        return {}
    counts: dict[str, int] = {}
    for part in name.split("+"):
        match = _PART.fullmatch(part.strip())
        if not match or match[1] in counts or (match[2] and int(match[2]) < 1):
            raise TraceError(f"unknown shape class {name!r}: expected `text`, or media types "
                             f"({', '.join(MEDIA_TYPES)}) each with a count over 1 where more "
                             "than one, joined by `+` (image, image4, image+audio)")
        counts[match[1]] = int(match[2] or 1)
    return counts


def counts(requests: Sequence[TraceRequest]) -> dict[str, int]:
    """Requests per class, the most frequent first (ties by name)."""
    tally = Counter(shape_class(r) for r in requests)
    return dict(sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])))


def describe(requests: Sequence[TraceRequest]) -> str:
    """`12 requests over 3.4 s: text 4, image 6, image2 2` (here, not in format: format
    knows nothing of classes)."""
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 if requests else 0.0
    by_class = ", ".join(f"{name} {n}" for name, n in counts(requests).items())
    return f"{len(requests)} requests over {span:.1f} s: {by_class}"


@dataclass(frozen=True)
class Typical:
    """A class's typical request: the median of each size and length over its requests."""

    name: str
    share: float
    requests: int
    input_length: int
    output_length: int
    media: tuple[MediaItem, ...]


def typical(requests: Sequence[TraceRequest]) -> list[Typical]:
    """Each class of `requests` (the most frequent first) with its median lengths and
    media sizes."""
    by: dict[str, list[TraceRequest]] = {}
    for r in requests:
        by.setdefault(shape_class(r), []).append(r)
    out = []
    for name in counts(requests):
        members = by[name]
        media = []
        for slot, item in enumerate(members[0].media):
            same = [m.media[slot] for m in members if len(m.media) > slot
                    and m.media[slot].type == item.type]
            media.append(MediaItem(item.type, _median(m.width for m in same),
                                   _median(m.height for m in same),
                                   _median(m.frames for m in same),
                                   _median_float(m.seconds for m in same)))
        out.append(Typical(name, len(members) / len(requests), len(members),
                           round(statistics.median(r.input_length for r in members)),
                           round(statistics.median(r.output_length for r in members)),
                           tuple(media)))
    return out


def _median(values: object) -> int | None:
    known = [v for v in values if v is not None]  # type: ignore[attr-defined]
    return round(statistics.median(known)) if known else None


def _median_float(values: object) -> float | None:
    known = [v for v in values if v is not None]  # type: ignore[attr-defined]
    return float(statistics.median(known)) if known else None
