"""The queue model against closed forms (M/M/1, M/D/1) and its goodput search."""

from __future__ import annotations

import pytest

from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.des import Instance, Job, Sim, StepCost
from epdctl.tune.model import (
    MAX_SIM_REQUESTS,
    Profile,
    RequestShape,
    Slo,
    predict,
    sim_requests,
    simulate,
    stage_key,
)

FREE = StepCost()  # a stage that takes no time
E_PD = Shape("e-pd", 1, pd=Pool(1, 1))


def _mean_wait(profile: Profile, rate: float, service_s: float) -> float:
    """Mean time in E's queue: TTFT less the service, PD being free."""
    out = simulate(E_PD, profile, RequestShape(1, 10, 1), rate=rate, requests=20_000, seed=7)
    return sum(out.ttft) / len(out.ttft) - service_s


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_mean_wait(rho: float) -> None:
    encode = StepCost(per_image_ms=1000.0, max_images=1)  # deterministic, one at a time
    profile = Profile({"encode": encode, stage_key("prefill_decode", 1): FREE})
    expected = rho * 1.0 / (2 * (1 - rho))  # M/D/1: rho * s / (2 (1 - rho))
    assert _mean_wait(profile, rho, 1.0) == pytest.approx(expected, rel=0.06)


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mm1_mean_wait(rho: float) -> None:
    encode = StepCost(per_image_ms=1000.0, max_images=1, is_exponential=True)
    profile = Profile({"encode": encode, stage_key("prefill_decode", 1): FREE})
    expected = rho / (1.0 - rho)  # M/M/1: rho / (mu - lambda), mu = 1
    out = simulate(E_PD, profile, RequestShape(1, 10, 1), rate=rho, requests=20_000, seed=7)
    # TTFT = wait + an exponential service of mean 1 s. 20k requests leave a sampling error
    # of about 5 % (10 % at worst over seeds tried); M/D/1's answer is half this one.
    assert sum(out.ttft) / len(out.ttft) - 1.0 == pytest.approx(expected, rel=0.15)


def test_utilization_is_the_offered_load() -> None:
    encode = StepCost(per_image_ms=100.0, max_images=1)
    profile = Profile({"encode": encode, stage_key("prefill_decode", 1): FREE})
    out = simulate(E_PD, profile, RequestShape(1, 10, 1), rate=5.0, requests=20_000)
    assert out.utilization["encode"] == pytest.approx(0.5, rel=0.03)


def test_batching_shares_decode_steps() -> None:
    sim = Sim()
    d = Instance(sim, StepCost(fixed_ms=10, per_seq_ms=1))
    times: list[float] = []
    for _ in range(4):
        d.submit(Job(0, 10, 5, needs_prefill=False, on_token=times.append))
    sim.run()
    # The first submit finds the instance idle and steps alone (11 ms); the other three join
    # the next step: four steps of 14 ms finish the first, one of 13 ms the rest.
    assert times[0] == pytest.approx(0.011)
    assert times[-1] == pytest.approx(0.011 + 4 * 0.014 + 0.013)
    assert len(times) == 20


def test_closed_loop_concurrency() -> None:
    pd = StepCost(fixed_ms=10, per_seq_ms=1)
    profile = Profile({stage_key("prefill_decode", 1, encodes=True): pd})
    out = simulate(Shape("aggregated", pd=Pool(1, 1)), profile, RequestShape(0, 10, 20),
                   concurrency=4, requests=40)
    assert len(out.ttft) == 40
    assert all(0.010 <= t <= 0.0141 for t in out.tpot)  # 3 or 4 in a step, never more


def test_goodput_grows_with_encoders_and_names_the_bottleneck() -> None:
    encode = StepCost(fixed_ms=5, per_image_ms=50)
    pd = StepCost(fixed_ms=5, per_token_ms=0.01, per_seq_ms=0.1)
    profile = Profile({"encode": encode, stage_key("prefill_decode", 1): pd})
    req, slo = RequestShape(1, 500, 8), Slo(ttft_ms=400, tpot_ms=50)
    one = predict(E_PD, profile, req, slo, requests=200)
    three = predict(Shape("e-pd", 3, pd=Pool(1, 1)), profile, req, slo, requests=200)
    assert one.goodput > 0 and three.goodput > 2 * one.goodput
    assert one.bottleneck == "encode"
    assert one.ttft_ms["p50"] <= one.ttft_ms["p90"] <= one.ttft_ms["p99"]


def test_epd_hand_off_and_sharing() -> None:
    stages = {"encode": StepCost(per_image_ms=10, max_images=1),
              stage_key("prefill", 1): StepCost(per_token_ms=0.01),
              stage_key("decode", 1): StepCost(fixed_ms=5)}
    shape = Shape("epd", 1, prefill=Pool(1, 1), decode=Pool(1, 1))
    req = RequestShape(1, 1000, 3)
    plain = simulate(shape, Profile(stages), req, rate=1.0, requests=1)
    # 10 ms encode, 10 ms prefill, then D's first step of 5 ms
    assert plain.ttft[0] == pytest.approx(0.025)
    handed = simulate(shape, Profile(stages, ec_handoff_ms=3, kv_fixed_ms=2,
                                     kv_per_ktoken_ms=4), req, rate=1.0, requests=1)
    assert handed.ttft[0] == pytest.approx(0.025 + 0.003 + 0.006)
    shared = Shape("epd", 1, True, prefill=Pool(1, 1), decode=Pool(1, 1))
    assert Profile(stages).missing(shared) == []
    assert Profile({}).missing(E_PD) == ["encode", "pd-tp1"]


def test_a_run_of_few_requests_overstates_the_knee_and_seconds_of_arrivals_do_not() -> None:
    """E takes 100 ms an image, one at a time: it sustains 10 req/s. 20 requests at 20 req/s
    are a burst gone within the 1 s TTFT; a minute of arrivals at the rate finds the knee
    below 10 req/s, as a queue at steady state must."""
    encode = StepCost(per_image_ms=100.0, max_images=1)
    profile = Profile({"encode": encode, stage_key("prefill_decode", 1): FREE})
    req, slo = RequestShape(1, 10, 1), Slo(ttft_ms=1000)
    burst = predict(E_PD, profile, req, slo, requests=20)
    steady = predict(E_PD, profile, req, slo, requests=20, seconds=60)
    assert burst.goodput > 15
    assert 7 < steady.goodput < 10
    assert sim_requests(9.5, 20, 60) == 570 and sim_requests(9.5, 20, 0) == 20
    assert sim_requests(1e6, 20, 60) == MAX_SIM_REQUESTS and sim_requests(0.1, 20, 60) == 20
