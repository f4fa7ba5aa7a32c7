from __future__ import annotations

import pytest

from epdctl.top.prom import Histogram, Scrape

TEXT = """\
# HELP x_seconds latency
# TYPE x_seconds histogram
x_seconds_bucket{le="0.1",stage="a"} 2.0
x_seconds_bucket{le="0.5",stage="a"} 6.0
x_seconds_bucket{le="1.0",stage="a"} 10.0
x_seconds_bucket{le="+Inf",stage="a"} 10.0
x_seconds_count{stage="a"} 10.0
x_seconds_sum{stage="a"} 4.0
x_seconds_bucket{le="0.1",stage="b"} 0.0
x_seconds_bucket{le="0.5",stage="b"} 0.0
x_seconds_bucket{le="1.0",stage="b"} 0.0
x_seconds_bucket{le="+Inf",stage="b"} 1.0
x_seconds_count{stage="b"} 1.0
x_seconds_sum{stage="b"} 7.0
# HELP r requests
# TYPE r counter
r_total{outcome="ok",route="/a"} 3.0
r_total{outcome="ok",route="/b"} 4.0
r_total{outcome="timeout",route="/a"} 1.0
r_created{outcome="ok",route="/a"} 1.7e9
"""


def test_totals_by_label_and_match() -> None:
    scrape = Scrape(TEXT)
    assert scrape.total("r_total") == 8.0
    assert scrape.total("r_total", route="/a") == 4.0
    assert scrape.by("r_total", "outcome") == {"ok": 7.0, "timeout": 1.0}
    assert scrape.total("missing_total") is None


def test_quantiles_interpolate_within_a_bucket_as_promql_does() -> None:
    a = Scrape(TEXT).histogram("x_seconds", stage="a")
    assert a is not None and (a.total, a.sum, a.mean) == (10.0, 4.0, 0.4)
    assert a.quantile(0.5) == pytest.approx(0.1 + 0.4 * (5 - 2) / (6 - 2))  # 0.4
    assert a.quantile(0.9) == pytest.approx(0.5 + 0.5 * (9 - 6) / (10 - 6))  # 0.875
    b = Scrape(TEXT).histogram("x_seconds", stage="b")
    assert b is not None and b.quantile(0.5) == 1.0  # in +Inf: the highest finite bound
    both = Scrape(TEXT).histogram("x_seconds")
    assert both is not None and both.total == 11.0 and dict(both.buckets)[float("inf")] == 11.0
    assert Histogram((), 0.0, 0.0).quantile(0.5) is None


def test_a_difference_is_what_was_observed_in_between_and_survives_a_reset() -> None:
    then = Histogram(((0.1, 2.0), (1.0, 5.0), (float("inf"), 5.0)), 5.0, 2.0)
    now = Histogram(((0.1, 2.0), (1.0, 9.0), (float("inf"), 9.0)), 9.0, 6.0)
    window = now - then
    assert window == Histogram(((0.1, 0.0), (1.0, 4.0), (float("inf"), 4.0)), 4.0, 4.0)
    assert window.quantile(0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    restarted = Histogram(((0.1, 1.0), (1.0, 1.0), (float("inf"), 1.0)), 1.0, 0.05)
    assert restarted - then == restarted


def test_not_prometheus_text() -> None:
    with pytest.raises(ValueError):
        Scrape("<html>not metrics</html>")
