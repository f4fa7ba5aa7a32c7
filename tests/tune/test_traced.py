"""`tune --trace` in the tune loop: the shape profiled (the trace's typical image request),
the trace predicted with predict_trace and reported per class, confirmations asked in req/s
and replayed at speeds of the trace; traces the model cannot take refused in one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench.tracefile import TraceFile
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.traces.classes import counts
from epdctl.traces.format import MediaItem, Trace, TraceError, TraceRequest
from epdctl.tune import runner
from epdctl.tune.candidates import Candidate
from epdctl.tune.decide import Measured
from epdctl.tune.facts import ModelFacts
from epdctl.tune.model import KNEE_CEILING
from epdctl.tune.search import grid_seed
from epdctl.tune.traced import for_trace
from epdctl.tune.workload import MAX_TRACE_REQUESTS
from tests.tune.test_runner import Clock, Log, confirm, profiler_calls, settings

FACTS = ModelFacts(heads=1, weights=1, encoder_weights=1, kv_per_token=1)
SIZES = Workload(points=(LoadPoint(),), image_size=(256, 256), input_len=64, output_len=16)
IMAGE = MediaItem("image", 320, 240)


def _trace(n: int = 60, gap_ms: float = 100.0, extra: tuple[MediaItem, ...] = ()) -> Trace:
    """Every third request text only (input 300), the others one image (inputs 40, 60, 80:
    median 60; outputs 24), one of them with `extra` media too."""
    requests = []
    for i in range(n):
        if i % 3 == 0:
            requests.append(TraceRequest(i * gap_ms, 300, 8))
        else:
            media = (IMAGE, *extra) if i == 1 else (IMAGE,)
            requests.append(TraceRequest(i * gap_ms, 40 + 20 * (i % 3 == 2) + 20 * (i % 2),
                                         24, media, stream=True))
    return Trace(tuple(requests), source="t.jsonl")


def _file(trace: Trace) -> TraceFile:
    return TraceFile(Path("/t.jsonl"), "epdctl", len(trace.requests), trace.duration_s,
                     tuple(counts(trace.requests).items()))


def test_the_typical_request_of_the_most_frequent_image_class_is_profiled() -> None:
    trace = _trace()
    profiled, tuned = for_trace(trace, _file(trace), SIZES, FACTS)
    assert tuned.profiled_class == "image"  # text is 20 requests, image 40
    assert (profiled.images, profiled.image_size, profiled.output_len) == (1, (320, 240), 24)
    assert profiled.input_len == 60
    assert tuned.model.rate == pytest.approx(10.0)
    assert tuned.model.counts() == {"image": 40, "text": 20}


@pytest.mark.parametrize(("trace", "message"), [
    (_trace(extra=(MediaItem("video", 64, 64, 4),)), "no cost for video or audio"),
    (_trace(gap_ms=0.0), "arrive at once"),
    (Trace(tuple(TraceRequest(i * 100.0, 10, 4) for i in range(5)), source="t.jsonl"),
     "no request has an image"),
])
def test_a_trace_the_model_cannot_take_is_refused_in_one_line(trace: Trace, message: str
                                                              ) -> None:
    with pytest.raises(TraceError) as caught:
        for_trace(trace, _file(trace), SIZES, FACTS)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def _trace_settings(tmp_path: Path, point_seconds: float = 2.0) -> runner.Settings:
    """90 requests of _trace; a rate sends at least rate x `point_seconds` (the trace
    cycled): 90 alone meet the SLO however fast they come."""
    base = settings(tmp_path)
    trace = _trace(n=90)
    profiled, tuned = for_trace(trace, _file(trace), replace(
        base.workload, slo=(), point_seconds=point_seconds), base.facts)
    return replace(base, workload=profiled, trace=tuned)


def test_a_trace_too_short_to_load_a_topology_is_cycled_or_refused(tmp_path: Path) -> None:
    """Without --point-seconds, 90 requests are served within the SLO at any speed: the knee
    search would reach its ceiling (1e6 req/s) and say nothing; tune says so in one line.
    With it, a rate sends rate x S requests, the trace played again a pass later."""
    with pytest.raises(TraceError) as caught:
        runner.tune(_trace_settings(tmp_path, 0.0), profiler_calls([]), confirm, Log(),
                    Clock())
    assert "--point-seconds" in str(caught.value) and "\n" not in str(caught.value)
    model = _trace_settings(tmp_path / "30s", 30.0).trace.model  # type: ignore[union-attr]
    assert model.arrivals_at(1.0) == model.arrivals  # 30 requests wanted: the 90 suffice
    cycled = model.arrivals_at(10.0)  # 300 wanted: 3 passes and 30 more
    assert len(cycled) == 300 and cycled[:90] == model.arrivals
    assert cycled[90].at_s == pytest.approx(model.arrivals[-1].at_s + 0.1)  # one mean gap
    assert [a.shape_class for a in cycled[90:180]] == [a.shape_class for a in model.arrivals]
    assert len(model.arrivals_at(1e9)) == MAX_TRACE_REQUESTS
    doc = runner.tune(_trace_settings(tmp_path / "2s"), profiler_calls([]), confirm, Log(),
                      Clock())
    goodputs = [c["predicted_goodput"] for c in doc["candidates"]
                if c["predicted_goodput"] is not None]
    assert goodputs and max(goodputs) < KNEE_CEILING / 2


def test_a_trace_is_predicted_with_predict_trace_and_reported_per_class(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _trace_settings(tmp_path)
    modelled: list[Any] = []
    asked: list[float] = []

    original = runner.predict_trace

    def spy(shape: Any, profile: Any, workload: Any, slo: Any) -> Any:
        modelled.append(workload)
        return original(shape, profile, workload, slo)

    monkeypatch.setattr(runner, "predict_trace", spy)

    def confirmer(candidate: Candidate, knee: float) -> Measured:
        asked.append(knee)
        return confirm(candidate, knee)

    doc = runner.tune(s, profiler_calls([]), confirmer, Log(), Clock())
    assert modelled and all(w is s.trace.model for w in modelled)  # type: ignore[union-attr]
    predicted = [c for c in doc["candidates"] if c["predicted_goodput"] is not None]
    assert predicted and all(set(c["classes"]) == {"image", "text"} for c in predicted)
    for c in predicted:
        assert c["predicted_goodput"] == pytest.approx(c["speed"] * s.trace.model.rate,
                                                       rel=1e-3)
        image = c["classes"]["image"]
        assert image["requests"] == 60 and 0 <= image["attainment"] <= 1
        assert {"ttft_ms", "tpot_ms", "delay_ms", "binding_stage"} <= set(image)
        assert c["classes"]["text"]["delay_ms"].get("encode", 0.0) == 0.0  # text skips E
    # confirmations are asked in req/s: the predicted knee, as for one shape
    assert asked and set(asked) <= {c["predicted_goodput"] for c in predicted}
    assert doc["trace"]["profiled_class"] == "image" and doc["workload"]["images"] == 1
    from epdctl.cli._tune_render import markdown, text_table

    assert "binding stage" in text_table(doc) and "Per class" in markdown(doc)
    assert "profiled at class `image`'s typical request: 1 image(s) of 320x240" \
        in markdown(doc)


def test_a_trace_change_keeps_the_profiles_not_the_confirmations(tmp_path: Path) -> None:
    s = _trace_settings(tmp_path)
    runner.tune(s, profiler_calls([]), confirm, Log(), Clock())
    other = _trace(n=90, gap_ms=50.0)
    _, tuned = for_trace(other, _file(other), replace(s.workload, slo=()), s.facts)
    again: list[str] = []
    confirmed: list[str] = []

    def confirmer(candidate: Candidate, knee: float) -> Measured:
        confirmed.append(candidate.name)
        return confirm(candidate, knee)

    runner.tune(replace(s, trace=tuned), profiler_calls(again), confirmer, Log(), Clock())
    assert again == [] and confirmed  # the same shape profiled; another trace confirmed


def test_a_confirmation_replays_the_trace_at_the_speed_of_each_grid_rate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from epdctl.bench import runner as bench_runner
    from epdctl.tune.live import LiveConfirmer

    s = _trace_settings(tmp_path)
    seen: list[Workload] = []

    def run_arms(arms: Any, workload: Workload, *args: Any, **kwargs: Any) -> list[Any]:
        seen.append(workload)
        return [type("Run", (), {"points": []})()]

    monkeypatch.setattr(bench_runner, "run_arms", run_arms)
    replayed = replace(s.workload, points=(LoadPoint(speed=1.0),), images=0,
                       trace=s.trace.replay)  # type: ignore[union-attr]
    confirmer = LiveConfirmer(replayed, tmp_path, tmp_path / "out", timeout_s=1,
                              progress=Log(), trace_rate=10.0)
    cand = runner.candidates(s.base, s.gpus, s.facts, runner.limits_for(
        s.base, s.facts, s.gpu_memory, 1000))[0][0]
    confirmer(cand, 4.0)
    (workload,) = seen
    assert workload.trace is s.trace.replay  # type: ignore[union-attr]
    first = workload.points[0]
    assert first.speed == pytest.approx(0.4) and first.seed == grid_seed(4.0)
    assert all(p.speed is not None and p.request_rate == float("inf")
               for p in workload.points)
