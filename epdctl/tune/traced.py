"""`tune --trace` (and `--mix`): what a trace is tuned as. The probes send one request shape,
the typical one of the trace's most frequent image-bearing class; the model sends the
trace's own requests, scaled from that shape (workload.from_trace); confirmations replay the
trace at speeds (live.LiveConfirmer)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from epdctl.bench.tracefile import TraceFile
from epdctl.bench.workload import Workload
from epdctl.traces.classes import Typical, typical
from epdctl.traces.format import MediaItem, Trace, TraceError, TraceRequest
from epdctl.tune.facts import ModelFacts
from epdctl.tune.workload import ProfiledShape, TraceWorkload, from_trace


@dataclass(frozen=True)
class TraceTune:
    """What a trace is tuned as."""

    model: TraceWorkload
    """The queue model's requests (the trace's first MAX_TRACE_REQUESTS)."""
    replay: TraceFile
    """What confirmations replay (bench's replayer reads the file)."""
    profiled_class: str
    """The class whose typical request the probes send (Settings.workload's shape)."""
    unsized_image: tuple[int, int] = (512, 512)
    """What an image of no size in the trace is taken as (the replay's --image-size)."""

    def as_json(self) -> dict[str, Any]:
        return {**self.replay.as_json(), "rate": round(self.model.rate, 6),
                "modelled_requests": len(self.model.arrivals),
                "profiled_class": self.profiled_class}


def sized(trace: Trace, image_size: tuple[int, int]) -> Trace:
    """The trace with its images of no size at `image_size` (bench's replay sends those at
    its --image-size): what is profiled, modelled and replayed is then the same."""
    def fill(m: MediaItem) -> MediaItem:
        if m.type != "image" or (m.width and m.height):
            return m
        return replace(m, width=image_size[0], height=image_size[1])

    def request(r: TraceRequest) -> TraceRequest:
        return replace(r, media=tuple(fill(m) for m in r.media)) if r.media else r

    return replace(trace, requests=tuple(request(r) for r in trace.requests))


def profiled_class(trace: Trace) -> Typical:
    """The most frequent class with images, as its typical request (TraceError: none)."""
    found = next((t for t in typical(trace.requests)
                  if any(m.type == "image" for m in t.media)), None)
    if found is None:
        raise TraceError(f"{trace.source or 'the trace'}: no request has an image: tune "
                         "profiles the trace's most frequent image-bearing class")
    return found


def for_trace(trace: Trace, replay: TraceFile, sizes: Workload, facts: ModelFacts
              ) -> tuple[Workload, TraceTune]:
    """The workload the probes send (`sizes` at the profiled class's typical shape) and the
    trace as tuned. TraceError in one line for video or audio, for a trace with no rate
    (one request, or all at once) and for one without images."""
    trace = sized(trace, sizes.image_size)
    from_trace(trace, ProfiledShape(sizes.image_size, facts.image_tokens_per_mpixel))
    shape = profiled_class(trace)
    images = [m for m in shape.media if m.type == "image"]
    size = (images[0].width or sizes.image_size[0], images[0].height or sizes.image_size[1])
    # The probes' requests need text (a Workload's input_len is 1 or more).
    profiled = replace(sizes, images=len(images), image_size=size,
                       input_len=max(shape.input_length, 1),
                       output_len=max(shape.output_length, 1))
    model = from_trace(trace, ProfiledShape(size, facts.image_tokens_per_mpixel),
                       point_seconds=sizes.point_seconds)
    return profiled, TraceTune(model, replay, shape.name, sizes.image_size)
