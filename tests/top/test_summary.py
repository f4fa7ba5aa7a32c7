"""`top` figures from canned /metrics texts (captured from tests/e2e's cpu-demo run)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from epdctl.cache.listing import NamespaceStats
from epdctl.launch.plan import plan
from epdctl.launch.state import RunState, Settings
from epdctl.top.prom import Scrape
from epdctl.top.sample import Sample
from epdctl.top.summary import summarize
from epdctl.top.view import render
from epdctl.topology.model import parse_topology

DATA = Path(__file__).parent.parent / "data" / "metrics"
TEXTS = {name: (DATA / f"{name}.txt").read_text() for name in ("proxy", "encode-0", "pd-0")}


def demo_state(tmp_path: Path) -> RunState:
    """The topology the texts came from: its instance URLs are the proxy's labels."""
    topology = parse_topology({
        "name": "cpu-demo", "model": "m", "device": "cpu", "ports": {"base": 51725},
        "proxy": {"port": 43051}, "cache": {"dir": str(tmp_path / "shm")},
        "roles": {"encode": {}, "prefill_decode": {}}})
    return RunState.of(plan(topology, tmp_path / "state"), "t.yaml", Settings())


def bump(text: str, series: str, delta: float, *, from_le: float | None = None) -> str:
    """Add delta to the samples whose name{labels} starts with `series` (a regular
    expression); of buckets, those from from_le up."""

    def add(match: re.Match[str]) -> str:
        le = re.search(r'le="([^"]+)"', match[1])
        if from_le is not None and le and float(le[1]) < from_le:
            return match[0]
        return f"{match[1]} {float(match[2]) + delta}"

    pattern = re.compile(rf"^({series}[^ ]*) (\S+)$", re.M)
    bumped, count = pattern.subn(add, text)
    assert count, f"no series {series}"
    return bumped


CACHE = {"encode-0": Counter(saves=5, save_bytes=40960),
         "pd-0": Counter(hits=9, loads=5, load_bytes=40960)}
STORE = NamespaceStats(namespace="NS", entries=5, size_bytes=61440, pinned_entries=0, pins=0,
                       oldest=None, newest=None, hits=9, misses=0, invalid=0, saves=5, loads=5,
                       save_failures=0, load_failures=0)


def sample(at: float, texts: dict[str, str], cache: dict[str, Counter[str]] = CACHE) -> Sample:
    return Sample(at, {name: Scrape(text) for name, text in texts.items()}, cache, STORE)


def test_once_figures_are_what_metrics_and_cache_inspect_show(tmp_path: Path) -> None:
    state = demo_state(tmp_path)
    doc = summarize(state, [sample(100.0, TEXTS), sample(101.0, TEXTS)], latency_window_s=None)
    proxy = doc["proxy"]
    assert (proxy["requests"], proxy["ok"], proxy["errors"], proxy["inflight"]) == (13, 13, 0, 0)
    assert proxy["requests_per_s"] == 0.0 and doc["rate_window_s"] == 1.0
    assert doc["latency_window_s"] is None  # --once: since start
    # encode buckets 0.01:2 0.025:4 0.05:6 0.1:6 0.25:9 -> p50 in (0.025, 0.05], p90 in (0.1, 0.25]
    assert proxy["stages"]["encode"] == {"count": 9, "p50_s": 0.03125, "p90_s": 0.205,
                                         "mean_s": round(0.6728517699993972 / 9, 6)}
    assert proxy["stages"]["prefill"] == {"count": 0, "p50_s": None, "p90_s": None,
                                          "mean_s": None}
    assert proxy["encoder_fanout"] == {"requests": 9, "items": 9, "mean_items": 1.0,
                                       "items_per_s": 0.0}
    assert (proxy["fallbacks"], proxy["retries"]) == ({}, {})
    encode, pd = doc["instances"]
    assert (encode["name"], encode["requests"], encode["in_rotation"]) == ("encode-0", 9, True)
    assert (pd["name"], pd["requests"], pd["running"], pd["waiting"]) == ("pd-0", 13, 0, 0)
    assert encode["ttft_p50_s"] is None and pd["ttft_p50_s"] is not None
    assert encode["cache"]["saves"] == 5 and pd["cache"]["hits"] == 9
    assert pd["cache"]["hit_ratio"] == 1.0 and encode["cache"]["hit_ratio"] is None
    assert doc["roles"]["encode"]["requests"] == 9
    assert {k: doc["cache"][k] for k in ("entries", "size_bytes", "hits", "misses", "saves",
                                         "loads", "load_bytes", "save_bytes")} == {
        "entries": 5, "size_bytes": 61440, "hits": 9, "misses": 0, "saves": 5, "loads": 5,
        "load_bytes": 40960, "save_bytes": 40960}
    assert doc["cache"]["capacity_bytes"] == state.settings.cache_capacity_bytes
    assert doc["gpus"] == [] and pd["gpu_memory_bytes"] is None


def test_rates_over_the_last_seconds_and_latency_over_the_last_minute(tmp_path: Path) -> None:
    state = demo_state(tmp_path)
    later = dict(TEXTS)
    proxy = bump(TEXTS["proxy"], r'epdctl_proxy_requests_total\{outcome="ok"', 10)
    # 10 encodes between 0.05 and 0.1 s, 2 of them two items.
    proxy = bump(proxy, r'epdctl_proxy_stage_seconds_bucket\{le="[^"]+",stage="encode"', 10,
                 from_le=0.1)
    proxy = bump(proxy, r'epdctl_proxy_stage_seconds_count\{stage="encode"\}', 10)
    proxy = bump(proxy, r'epdctl_proxy_stage_seconds_sum\{stage="encode"\}', 0.8)
    proxy = bump(proxy, "epdctl_proxy_encoder_fanout_items_count", 10)
    proxy = bump(proxy, "epdctl_proxy_encoder_fanout_items_sum", 12)
    proxy = proxy.replace("# TYPE epdctl_proxy_fallbacks_total counter\n",
                          "# TYPE epdctl_proxy_fallbacks_total counter\n"
                          'epdctl_proxy_fallbacks_total{reason="encoder"} 1.0\n')
    later["proxy"] = proxy
    later["pd-0"] = bump(bump(TEXTS["pd-0"], "vllm:num_requests_running", 2),
                         r'vllm:request_success_total\{engine="0",finished_reason="length"', 10)
    cache = {**CACHE, "pd-0": Counter(hits=17, misses=2, loads=12, load_bytes=98304)}
    history = [sample(0.0, TEXTS), sample(55.0, TEXTS), sample(60.0, later, cache)]
    doc = summarize(state, history)
    assert doc["rate_window_s"] == 5.0 and doc["latency_window_s"] == 60.0
    p = doc["proxy"]
    assert p["requests"] == 23 and p["requests_per_s"] == pytest.approx(2.0)
    # Only the window's 10 encodes count: all in (0.05, 0.1].
    assert p["stages"]["encode"]["count"] == 10
    assert p["stages"]["encode"]["p50_s"] == pytest.approx(0.075)
    assert p["stages"]["encode"]["p90_s"] == pytest.approx(0.095)
    assert p["stages"]["encode"]["mean_s"] == pytest.approx(0.08)
    assert p["encoder_fanout"]["mean_items"] == pytest.approx(21 / 19)
    assert p["encoder_fanout"]["items_per_s"] == pytest.approx(12 / 5)
    assert p["fallbacks"] == {"encoder": 1}
    pd = doc["instances"][1]
    assert (pd["running"], pd["requests"], pd["requests_per_s"]) == (2, 23, pytest.approx(2.0))
    assert pd["cache"]["hit_ratio"] == pytest.approx(8 / 10)  # 8 hits, 2 misses in the minute
    assert doc["cache"]["load_bytes_per_s"] == pytest.approx((98304 - 40960) / 5)
    assert doc["roles"]["prefill_decode"]["running"] == 2


def test_an_instance_that_does_not_answer(tmp_path: Path) -> None:
    state = demo_state(tmp_path)
    down = Sample(1.0, {"proxy": Scrape(TEXTS["proxy"]), "encode-0": None,
                        "pd-0": Scrape(TEXTS["pd-0"])})
    doc = summarize(state, [down])
    encode = doc["instances"][0]
    assert (encode["up"], encode["requests"], encode["requests_per_s"]) == (False, None, None)
    assert doc["rate_window_s"] is None and doc["proxy"]["requests_per_s"] is None
    assert doc["roles"]["encode"]["up"] == 0


def test_the_screen_shows_the_figures(tmp_path: Path) -> None:
    from rich.console import Console

    state = demo_state(tmp_path)
    doc = summarize(state, [sample(100.0, TEXTS), sample(101.0, TEXTS)], latency_window_s=None)
    console = Console(width=140, record=True, no_color=True)
    console.print(render(doc))
    screen = console.export_text()
    assert "cpu-demo  E|PD" in screen and "latency since start" in screen
    assert "requests 13 (ok 13, errors 0)" in screen
    assert "E fan-out 1.00 items per media request (9 requests, 9 items" in screen
    assert re.search(r"encode\s+9\s+31ms\s+205ms\s+75ms", screen)
    assert re.search(r"pd-0\s+PD\s+yes\s+0\s+0\s+0\.0\s+13 ", screen)
    assert "hits 9, misses 0 (hit ratio 100%)" in screen


def test_the_series_names_are_the_proxy_s() -> None:
    """summary.py names the proxy's series; a rename in proxy/metrics.py must show here."""
    from epdctl.proxy.metrics import Metrics
    from epdctl.top import summary

    metrics = Metrics()
    metrics.count("/v1/chat/completions", "ok")
    metrics.fanout.observe(2)
    metrics.fallbacks.labels("encoder").inc()
    metrics.retries.labels("decode").inc()
    text = metrics.render(_upstreams()).decode()
    scrape = Scrape(text)
    for name in (summary.REQUESTS, summary.FALLBACKS, summary.RETRIES, summary.INFLIGHT):
        assert scrape.total(name) is not None, name
    assert scrape.histogram(summary.STAGE, stage="encode") is not None
    assert scrape.histogram(summary.FANOUT) is not None
    assert scrape.by(summary.INSTANCE_UP, "url") == {"http://e": 1.0, "http://p": 1.0}


def _upstreams():
    from epdctl.proxy.config import ProxyConfig
    from epdctl.proxy.upstreams import Upstreams

    return Upstreams(ProxyConfig(models=("m",), encode=("http://e",), prefill_decode=("http://p",)))
