"""Per-request bookkeeping: stage timings, retries and fallbacks, and its one log line."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("epdctl.proxy")


class Recorded(Protocol):
    """What a completion request's line records for a trace: request.traffic.Recorded (a
    layer above this one), filled in by the stages that see each part."""

    items: list[Any] | None
    answer: bytes
    events: int
    waits: int | None
    tail: bytes

    def fields(self) -> list[str]: ...


@dataclass
class Trace:
    """What happened to one request, logged once when it ends."""

    rid: str
    route: str
    start: float = field(default_factory=time.perf_counter)
    arrival: float = field(default_factory=time.time)
    """When it came (epoch s): `at=` on the line, whose own stamp is when it ended."""
    stages_ms: dict[str, float] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    items: int = 0
    retries: int = 0
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(stage, url) of each attempt that failed before the client got a byte."""
    is_resumable: bool = False
    """A broken stream raises to replay.py, which resumes it, instead of ending it."""
    encoding: asyncio.Task[None] | None = None
    """The E stage still running beside PD (overlap): the line waits for its timings."""
    recorded: Recorded | None = None
    """A completion request's shape for a trace (its text, media, stream, output tokens)."""

    def timed(self, stage: str, since: float) -> float:
        """Record a stage's time since `since` (stages may repeat on retry: times add up)."""
        elapsed_s = time.perf_counter() - since
        self.stages_ms[stage] = self.stages_ms.get(stage, 0.0) + elapsed_s * 1000
        return elapsed_s

    def line(self, status: int | str, total_ms: float | None = None) -> str:
        """rid, route, status, then per-stage timings, then its arrival and (a completion
        request's) shape for a trace; `epdctl logs proxy | grep RID`."""
        if total_ms is None:
            total_ms = (time.perf_counter() - self.start) * 1000
        parts = [f"rid={self.rid}", f"route={self.route}", f"status={status}",
                 f"total_ms={total_ms:.1f}"]
        parts += [f"{k}_ms={v:.1f}" for k, v in self.stages_ms.items()]
        if self.items:
            parts.append(f"items={self.items}")
        parts += [f"{k}={v}" for k, v in self.instances.items()]
        if self.retries:
            parts.append(f"retries={self.retries}")
        if self.fallbacks:
            parts.append("fallbacks=" + ",".join(self.fallbacks))
        parts += self.notes
        parts.append(f"at={self.arrival:.3f}")
        if self.recorded is not None:
            try:
                parts += self.recorded.fields()
            except Exception:  # a body no test foresaw: the line itself is never lost
                log.exception("rid=%s its shape for a trace could not be read", self.rid)
                parts.append("shape=unread")
        return " ".join(parts)
