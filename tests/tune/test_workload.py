"""A trace's requests as the queue model's work: scaled from the profiled shape."""

from __future__ import annotations

import pytest

from epdctl.traces.format import MediaItem, Trace, TraceError, TraceRequest
from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.des import Job, StepCost, alone_s
from epdctl.tune.model import Profile, RequestShape, simulate, stage_key
from epdctl.tune.workload import ProfiledShape, from_trace, request_shape

PROFILED = ProfiledShape((512, 512), 1000.0)


def _request(*media: MediaItem, ts: float = 0.0) -> TraceRequest:
    return TraceRequest(ts, 100, 20, tuple(media), True)


def test_images_scale_by_pixels_and_add_their_tokens() -> None:
    profiled = request_shape(_request(MediaItem("image", 512, 512)), PROFILED)
    assert profiled == RequestShape(1, 100 + 263, 20)  # 0.262 Mpixel x 1000, rounded up
    big = request_shape(_request(MediaItem("image", 1024, 1024), MediaItem("image")), PROFILED)
    assert big.images == 2
    assert big.image_work == (4.0, 1.0)  # an image of unknown size: the profiled one
    assert big.prompt_tokens == 100 + 1311  # (1.049 + 0.262) Mpixel x 1000, rounded up
    assert request_shape(_request(), PROFILED) == RequestShape(0, 100, 20)


def test_a_workload_keeps_arrivals_classes_and_streaming() -> None:
    trace = Trace((_request(ts=1000.0), _request(MediaItem("image"), ts=1500.0),
                   TraceRequest(3000.0, 5, 1)))
    workload = from_trace(trace, PROFILED)
    assert [a.at_s for a in workload.arrivals] == [0.0, 0.5, 2.0]
    assert [a.shape_class for a in workload.arrivals] == ["text", "image", "text"]
    assert [a.is_stream for a in workload.arrivals] == [True, True, False]
    assert workload.rate == pytest.approx(1.0)  # 2 intervals over 2 s
    assert workload.speed(4.0) == pytest.approx(4.0)
    assert workload.counts() == {"text": 2, "image": 1}
    assert len(from_trace(trace, PROFILED, limit=2).arrivals) == 2


def test_what_the_model_cannot_scale_is_refused() -> None:
    at_once = Trace((_request(), _request()), source="t.jsonl")
    with pytest.raises(TraceError, match="t.jsonl: its requests arrive at once"):
        from_trace(at_once, PROFILED)
    video = Trace((_request(), _request(MediaItem("video"), MediaItem("audio"), ts=5.0)))
    with pytest.raises(TraceError, match=r"no cost for video or audio \(classes "
                                         r"video\+audio \(1\)\)"):
        from_trace(video, PROFILED)


def test_an_image_of_four_times_the_pixels_costs_four_on_e_and_on_aggregated_pd() -> None:
    encode = StepCost(fixed_ms=0, per_image_ms=10.0)
    profile = Profile({"encode": encode, stage_key("prefill_decode", 1): StepCost(),
                       stage_key("prefill_decode", 1, encodes=True): encode})
    big = request_shape(_request(MediaItem("image", 1024, 1024)), PROFILED)
    for shape in (Shape("e-pd", 1, pd=Pool(1, 1)), Shape("aggregated", pd=Pool(1, 1))):
        out = simulate(shape, profile, big, rate=1.0, requests=1)
        assert out.ttft[0] == pytest.approx(0.040)


def test_alone_is_what_an_idle_instance_takes() -> None:
    cost = StepCost(fixed_ms=2, per_token_ms=0.01, per_seq_ms=1, per_kctx_ms=1,
                    prefill_fixed_ms=5)
    # a PD job: a prefill step (the larger fixed cost, 5, + 10 ms), then 2 decode steps
    # (2 + 1 ms) at 1001 and 1002 tokens of context
    assert alone_s(cost, Job(0, 1000, 3)) == pytest.approx((15 + 3 + 1.001 + 3 + 1.002) / 1000)
    # a D job: 3 decode steps at 1000, 1001 and 1002 tokens
    assert alone_s(cost, Job(0, 1000, 3, needs_prefill=False)) == pytest.approx(
        (3 * 3 + 1.000 + 1.001 + 1.002) / 1000)
