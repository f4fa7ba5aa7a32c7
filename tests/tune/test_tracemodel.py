"""The queue model over a trace: its arrivals, its routing by shape, per-class results, and
its goodput against the single-shape model's and closed forms."""

from __future__ import annotations

import random

import pytest

from epdctl.traces.format import MediaItem, Trace, TraceRequest
from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.des import StepCost
from epdctl.tune.model import Profile, RequestShape, Slo, predict, simulate, stage_key
from epdctl.tune.tracemodel import predict_trace, simulate_trace
from epdctl.tune.workload import ProfiledShape, from_trace

FREE = StepCost()
E_PD = Shape("e-pd", 1, pd=Pool(1, 1))
EPD = Shape("epd", 1, prefill=Pool(1, 1), decode=Pool(1, 1))
PROFILED = ProfiledShape((512, 512), 1275.0)
IMAGE = (MediaItem("image", 512, 512),)


def _trace(times_s: list[float], media: list[tuple[MediaItem, ...]] | None = None,
           input_length: int = 64, output_length: int = 8, stream: bool = True) -> Trace:
    media = media or [IMAGE] * len(times_s)
    return Trace(tuple(TraceRequest(t * 1000, input_length, output_length, m, stream)
                       for t, m in zip(times_s, media, strict=True)))


def _poisson(n: int, seed: int) -> list[float]:
    """Arrivals as model.simulate draws them at rate 1."""
    draws, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += draws.expovariate(1.0)
        out.append(t)
    return out


def _stages(encode: StepCost, pd: StepCost = FREE) -> Profile:
    return Profile({"encode": encode, stage_key("prefill_decode", 1): pd,
                    stage_key("prefill", 1): pd, stage_key("decode", 1): pd})


def test_a_trace_of_one_class_predicts_as_the_single_shape() -> None:
    """The same Poisson arrivals and one request shape: the knee in req/s is the trace's
    mean rate x the speed at which it holds, and that speed is the single-shape knee (the
    trace's times are the draws at rate 1), to the bisection's precision."""
    times = _poisson(300, seed=0)
    workload = from_trace(_trace(times), PROFILED)
    profile = _stages(StepCost(fixed_ms=5, per_image_ms=50),
                      StepCost(fixed_ms=5, per_token_ms=0.01, per_seq_ms=0.1))
    req = workload.arrivals[0].request
    assert req == RequestShape(1, 64 + 335, 8)  # 0.262 Mpixel x 1275, rounded up
    slo = Slo(ttft_ms=400, tpot_ms=50)
    single = predict(E_PD, profile, req, slo, requests=300)
    traced = predict_trace(E_PD, profile, workload, slo)
    assert single.goodput > 5
    assert traced.speed == pytest.approx(single.goodput, rel=1e-3)
    assert traced.goodput == pytest.approx(single.goodput * workload.rate, rel=1e-3)
    assert list(traced.classes) == ["image"]
    assert traced.classes["image"].attainment >= 0.9
    assert traced.classes["image"].binding_stage == "encode"
    assert traced.prediction.bottleneck == single.bottleneck == "encode"


@pytest.mark.parametrize("shape", [E_PD, EPD, Shape("e-pd", 2, True, pd=Pool(2, 1))])
def test_text_only_requests_never_touch_the_encoder(shape: Shape) -> None:
    """As the proxy sends a body without media straight to PD (or P)."""
    times = [i * 0.01 for i in range(200)]
    workload = from_trace(_trace(times, [()] * 200), PROFILED)
    profile = _stages(StepCost(fixed_ms=5, per_image_ms=50),
                      StepCost(fixed_ms=1, per_token_ms=0.01, per_seq_ms=0.1))
    out = simulate_trace(shape, profile, workload, rate=50.0)
    assert out.utilization["encode"] == 0.0
    assert all("encode" not in d for d in out.delays)
    assert set(out.classes) == {"text"}
    with_images = simulate_trace(shape, profile, from_trace(_trace(times), PROFILED), rate=50.0)
    assert with_images.utilization["encode"] > 0


def test_a_mix_names_each_class_binding_stage() -> None:
    """A slow encoder (100 ms an image, one at a time) and a PD whose long text prompts
    take 40 ms each: images wait on E, text on PD."""
    encode = StepCost(per_image_ms=100.0, max_images=1)
    pd = StepCost(fixed_ms=2, per_token_ms=0.02, per_seq_ms=0.1, max_tokens=2048)
    n = 400
    media = [IMAGE if i % 2 else () for i in range(n)]
    workload = from_trace(_trace(_poisson(n, seed=3), media, input_length=2000), PROFILED)
    assert workload.counts() == {"image": 200, "text": 200}
    got = predict_trace(E_PD, _stages(encode, pd), workload, Slo(ttft_ms=1000, tpot_ms=100))
    image, text = got.classes["image"], got.classes["text"]
    assert image.binding_stage == "encode"
    assert text.binding_stage == "pd-tp1"
    assert text.delay_ms["encode"] == 0.0
    assert image.delay_ms["encode"] > image.delay_ms["pd-tp1"]
    assert text.attainment > image.attainment
    assert got.prediction.bottleneck == "encode"
    # E serves 10 images a second, half the requests carry one: the knee is below 20 req/s
    assert 10 < got.goodput < 20


def test_bursts_give_less_goodput_than_the_same_requests_spread_out() -> None:
    """The same 400 requests at the same mean rate: in bursts of 5 at once (the bursts at
    Poisson times), one at a time at Poisson times, or evenly spaced. E takes 50 ms an
    image, one at a time (20 req/s), and a burst 250 ms: bursts that follow closely put
    the last ones past the 500 ms TTFT at half the rate evenly spaced arrivals hold."""
    encode = StepCost(per_image_ms=50.0, max_images=1)
    profile, slo = _stages(encode), Slo(ttft_ms=500)
    starts = _poisson(80, seed=1)
    times = {"bursts": [starts[i // 5] for i in range(400)],
             "poisson": _poisson(400, seed=1),
             "even": [i * 19 / 399 for i in range(400)]}
    goodput = {name: predict_trace(E_PD, profile, from_trace(_trace(t), PROFILED), slo).goodput
               for name, t in times.items()}
    # E's capacity, a little more: 19 s of arrivals queue for 0.5 s at most at 20.5 req/s
    assert goodput["even"] == pytest.approx(20, rel=0.05)
    assert 15 < goodput["poisson"] < goodput["even"]
    assert 0 < goodput["bursts"] < 0.6 * goodput["poisson"]


def test_a_deterministic_trace_waits_as_a_single_server_must() -> None:
    """E takes exactly 1 s an image, one at a time; arrivals at 0, 0.5, 1 and 5 s (speed 1:
    3 requests over 5 s, 0.6 req/s) wait 0, 0.5, 1 and 0 s."""
    profile = _stages(StepCost(per_image_ms=1000.0, max_images=1))
    workload = from_trace(_trace([0, 0.5, 1, 5]), PROFILED)
    assert workload.rate == pytest.approx(0.6)
    out = simulate_trace(E_PD, profile, workload, rate=0.6)
    assert out.ttft == pytest.approx([1.0, 1.5, 2.0, 1.0])
    assert [d["encode"] for d in out.delays] == pytest.approx([0.0, 0.5, 1.0, 0.0])
    # twice the speed: arrivals at 0, 0.25, 0.5 and 2.5 s; the last finds E busy to 3 s
    assert simulate_trace(E_PD, profile, workload, rate=1.2).ttft == pytest.approx(
        [1.0, 1.75, 2.5, 1.5])


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait_over_a_poisson_trace(rho: float) -> None:
    """M/D/1: a Poisson trace of 20k requests on one deterministic server (1 s), scaled to
    rho req/s: the mean wait is rho s / (2 (1 - rho))."""
    profile = _stages(StepCost(per_image_ms=1000.0, max_images=1))
    workload = from_trace(_trace(_poisson(20_000, seed=7), output_length=1), PROFILED,
                          limit=20_000)
    out = simulate_trace(E_PD, profile, workload, rate=rho)
    waits = [d["encode"] for d in out.delays]
    expected = rho / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.06)
    assert sum(out.ttft) / len(out.ttft) - 1.0 == pytest.approx(expected, rel=0.06)


def test_a_request_answered_whole_counts_its_latency_as_ttft() -> None:
    profile = _stages(StepCost(per_image_ms=10.0), StepCost(fixed_ms=10, per_seq_ms=0))
    streamed = simulate_trace(E_PD, profile, from_trace(_trace([0, 10]), PROFILED), rate=0.1)
    whole = simulate_trace(E_PD, profile,
                           from_trace(_trace([0, 10], stream=False), PROFILED), rate=0.1)
    # 10 ms E, 10 ms prefill step (first token), then 7 decode steps of 10 ms
    assert streamed.ttft[0] == pytest.approx(0.020)
    assert streamed.tpot[0] == pytest.approx(0.010)
    assert whole.ttft[0] == pytest.approx(0.090) and whole.tpot[0] == 0.0


def test_the_single_shape_run_is_unchanged_by_the_trace_path() -> None:
    """simulate keeps no classes or delays (and its figures: tests/tune/test_model.py)."""
    out = simulate(E_PD, _stages(StepCost(per_image_ms=10.0)), RequestShape(1, 10, 2),
                   rate=1.0, requests=5)
    assert out.classes == [] and out.delays == []
    assert out.attainment(Slo(ttft_ms=1000)) == 1.0
