"""`bench --trace FILE`: what bench reports and checks of the trace before it replays it
(the replayer reads the file again; epdctl.bench.replay)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdctl.traces.classes import counts
from epdctl.traces.format import read_trace

DEFAULT_LIMIT = 10_000


@dataclass(frozen=True)
class TraceFile:
    """The file and what it holds."""

    path: Path
    kind: str
    """epdctl (ours, Mooncake's lines included) or azure (CSV)."""
    requests: int
    duration_s: float
    classes: tuple[tuple[str, int], ...]
    """Requests per shape class, the most frequent first."""
    limit: int = DEFAULT_LIMIT
    lengths: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """Each line's input_length + output_length (the text tokens it needs)."""

    @property
    def rate(self) -> float:
        """Mean arrivals per second at speed 1, as Trace.rate (0: all at once)."""
        return (self.requests - 1) / self.duration_s if self.duration_s > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"file": str(self.path), "kind": self.kind, "requests": self.requests,
                "duration_s": round(self.duration_s, 3), "classes": dict(self.classes),
                "limit": self.limit}


def load_trace(path: Path, limit: int = DEFAULT_LIMIT) -> TraceFile:
    """Read the trace (TraceError in one line; one for more than `limit` requests)."""
    trace = read_trace(path, limit)
    return TraceFile(path.absolute(), trace.kind, len(trace.requests), trace.duration_s,
                     tuple(counts(trace.requests).items()), limit,
                     tuple(r.input_length + r.output_length for r in trace.requests))
