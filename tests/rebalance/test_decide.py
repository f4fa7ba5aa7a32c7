"""The rebalancing choice, by tune's model on real profiles (tests/data/rebalance: the
profiles `tune` measured on the simulated encode-heavy machine, examples/sim): an encoder-
bound mix moves GPUs to E, a text mix does not, and the margin and the switch's cost hold a
move back."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from epdctl.rebalance.decide import decide
from epdctl.traces.format import MediaItem, Trace, TraceRequest
from epdctl.tune.candidates import Pool, Shape
from epdctl.tune.facts import from_file
from epdctl.tune.model import Slo
from epdctl.tune.runner import saved_profile
from epdctl.tune.workload import ProfiledShape, TraceWorkload, from_trace

ROOT = Path(__file__).parents[2]
DATA = Path(__file__).parents[1] / "data" / "rebalance"
SLO = Slo(3000, 60)
CLASSES = {"text": (384, 128, 0), "image": (64, 32, 1), "image4": (32, 16, 4)}
ONE_E, THREE_E = Shape("e-pd", 1, pd=Pool(3, 1)), Shape("e-pd", 3, pd=Pool(1, 1))


def traffic(mix: dict[str, float], rate: float = 3.0, n: int = 120) -> TraceWorkload:
    """`n` streamed requests of `mix` (the benchmark trace's classes), Poisson at `rate`."""
    rng, at, out = random.Random(0), 0.0, []
    for _ in range(n):
        name = rng.choices(list(mix), weights=list(mix.values()))[0]
        text, answer, images = CLASSES[name]
        out.append(TraceRequest(round(at * 1000, 3), text, answer,
                                (MediaItem("image", 512, 512),) * images, stream=True))
        at += rng.expovariate(rate)
    facts = from_file(ROOT / "examples" / "sim" / "encode-heavy.yaml")
    return from_trace(Trace(tuple(out)), ProfiledShape((512, 512),
                                                       facts.image_tokens_per_mpixel))


@pytest.fixture(scope="module")
def profile():  # type: ignore[no-untyped-def]
    return saved_profile(DATA / "encode-heavy")[0]


def test_an_encoder_bound_mix_moves_gpus_to_the_encoders(profile) -> None:  # type: ignore
    albums = traffic({"image4": 0.8, "image": 0.2})
    decision = decide(ONE_E, profile, albums, SLO, switch_s=30, interval_s=600)
    assert decision.act and decision.best.shape == THREE_E
    assert decision.moves == [("prefill_decode", "encode")] * 2
    assert decision.best.share >= 0.9 > decision.current.share
    assert decision.move > decision.stay
    assert [o.shape for o in decision.options][0] == ONE_E  # the running split first
    there = decide(THREE_E, profile, albums, SLO, switch_s=30, interval_s=600)
    assert not there.act and there.best.shape == THREE_E and there.moves == []


def test_a_mix_the_running_split_holds_moves_nothing(profile) -> None:  # type: ignore
    chats = traffic({"text": 0.9, "image": 0.1})
    decision = decide(ONE_E, profile, chats, SLO, switch_s=30, interval_s=600)
    assert not decision.act and decision.best.shape == ONE_E
    assert "predicted best" in decision.why


def test_the_margin_and_the_switch_cost_hold_a_move_back(profile) -> None:  # type: ignore
    albums = traffic({"image4": 0.8, "image": 0.2})
    costly = decide(ONE_E, profile, albums, SLO, switch_s=400, interval_s=600)
    assert costly.best.shape == THREE_E and not costly.act  # the switches eat the interval
    strict = decide(ONE_E, profile, albums, SLO, switch_s=30, interval_s=600, margin=100.0)
    assert not strict.act and "stay" in strict.why


def test_profiles_without_the_running_split_are_refused(profile) -> None:  # type: ignore
    with pytest.raises(ValueError, match="no cost for the running split"):
        decide(Shape("e-pd", 1, pd=Pool(1, 8)), profile, traffic({"image": 1.0}), SLO,
               switch_s=30, interval_s=600)
