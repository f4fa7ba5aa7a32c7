"""A trace's requests as the queue model sees them: per request its arrival, its shape class
and its work (images, prompt and output tokens), scaled from the one request shape the
profile was taken at (`ProfiledShape`): per image by its pixels, per prompt token."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from epdctl.traces.classes import shape_class
from epdctl.traces.format import MediaItem, Trace, TraceError, TraceRequest, cycle, cycle_ms
from epdctl.tune.model import MAX_SIM_REQUESTS, RequestShape

MAX_TRACE_REQUESTS = MAX_SIM_REQUESTS
"""The most of a trace's requests one simulated run sends (its first ones)."""


@dataclass(frozen=True)
class ProfiledShape:
    """What the profile's per-image and per-token costs were measured at."""

    image_size: tuple[int, int]
    """Each probe image's width and height (a trace's image of unknown size: this one, as
    bench's replay sends --image-size)."""
    image_tokens_per_mpixel: float
    """Prompt tokens an image adds per megapixel (ModelFacts)."""


@dataclass(frozen=True)
class Arrival:
    """One request of the trace."""

    at_s: float
    """From the trace's first request, at its own pace."""
    request: RequestShape
    shape_class: str
    is_stream: bool = True
    """A request answered whole: its TTFT is its latency and it has no TPOT (as bench's
    replay and vLLM's goodput count it)."""


@dataclass(frozen=True)
class TraceWorkload:
    """A trace's requests in arrival order and their mean rate at the trace's own pace."""

    arrivals: tuple[Arrival, ...]
    rate: float
    """Requests per second at speed 1: (n - 1) / span, as Trace.rate."""
    cycle_s: float = 0.0
    """One pass of the trace played back to back (traces.format.cycle_ms)."""
    point_seconds: float = 0.0
    """A rate sends at least rate x this many requests, the trace played again from its start
    (arrivals_at; bench's Workload.requests_at for the confirmations' replays)."""

    def arrivals_at(self, rate: float) -> tuple[Arrival, ...]:
        """What a run at `rate` sends: the arrivals, cycled to rate x point_seconds where
        that is more (traces.format.cycle_ms's pass length), at most MAX_TRACE_REQUESTS."""
        wanted = math.ceil(rate * self.point_seconds)
        return cycle(self.arrivals, max(len(self.arrivals), min(wanted, MAX_TRACE_REQUESTS)),
                     self.cycle_s, lambda a, by: replace(a, at_s=a.at_s + by))

    def counts(self) -> dict[str, int]:
        """Requests per class, the most frequent first (ties by name)."""
        tally = Counter(a.shape_class for a in self.arrivals)
        return dict(sorted(tally.items(), key=lambda kv: (-kv[1], kv[0])))

    def speed(self, rate: float) -> float:
        """The speed at which the trace arrives at `rate` req/s on average."""
        return rate / self.rate


def from_trace(trace: Trace, profiled: ProfiledShape, limit: int = MAX_TRACE_REQUESTS,
               point_seconds: float = 0.0) -> TraceWorkload:
    """The trace's first `limit` requests as the model's workload. TraceError for a trace
    with no rate (one request, or all at once: no speed makes a mean rate of it) and for
    video or audio (no profile has a cost for them)."""
    requests = trace.requests[:limit]
    kept = Trace(requests)
    if kept.rate <= 0:
        raise TraceError(f"{trace.source or 'the trace'}: its requests arrive at once (or "
                         "there is one): the model scales a trace's arrivals to a mean rate")
    other = Counter(shape_class(r) for r in requests
                    if any(m.type != "image" for m in r.media))
    if other:
        listed = ", ".join(f"{name} ({n})" for name, n in sorted(other.items()))
        raise TraceError(f"{trace.source or 'the trace'}: the queue model has no cost for "
                         f"video or audio (classes {listed}): only text and images are "
                         "profiled")
    start = requests[0].timestamp_ms
    return TraceWorkload(tuple(Arrival((r.timestamp_ms - start) / 1000, request_shape(
        r, profiled), shape_class(r), r.stream) for r in requests), kept.rate,
        cycle_ms(requests) / 1000, point_seconds)


def request_shape(request: TraceRequest, profiled: ProfiledShape) -> RequestShape:
    """One trace request's work: each image's encoding work is its pixels over the profiled
    image's; its prompt is its text and its images' tokens (their megapixels at the model's
    rate, rounded up once, as candidates.request_tokens counts the profiled request's)."""
    w, h = profiled.image_size
    sizes = [_size(m, profiled.image_size) for m in request.media]
    mpixels = sum(x * y for x, y in sizes) / 1e6
    image_tokens = math.ceil(mpixels * profiled.image_tokens_per_mpixel)
    work = tuple(x * y / (w * h) for x, y in sizes)
    return RequestShape(len(sizes), request.input_length + image_tokens,
                        request.output_length,
                        () if all(x == 1.0 for x in work) else work)


def _size(item: MediaItem, default: tuple[int, int]) -> tuple[int, int]:
    return (item.width, item.height) if item.width and item.height else default
