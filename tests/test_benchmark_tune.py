"""benchmarks/tune.py's figures: rank correlation and the aggregated call."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_tune", Path(__file__).parents[1] / "benchmarks" / "tune.py")
assert SPEC and SPEC.loader
bench_tune = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench_tune)


def test_spearman() -> None:
    assert bench_tune.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert bench_tune.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert bench_tune.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(bench_tune.spearman([1], [1]))


def test_agg_call() -> None:
    sweep = {"a": ("aggregated", 5.0), "b": ("e-pd", 7.0)}
    assert bench_tune.agg_call_right(sweep, "e-pd")
    assert bench_tune.agg_call_right(sweep, "epd")
    assert not bench_tune.agg_call_right(sweep, "aggregated")
