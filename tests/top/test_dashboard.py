"""docs/grafana-epdctl.json asks Prometheus only for series the proxy and vLLM export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from epdctl.proxy.metrics import Metrics
from epdctl.top.prom import Scrape
from tests.top.test_summary import TEXTS, _upstreams

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-epdctl.json"
SERIES = re.compile(r"\b((?:epdctl_proxy|vllm:)[a-z0-9_:]+)")


def test_every_series_of_the_dashboard_exists() -> None:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    wanted = {name for expr in exprs for name in SERIES.findall(expr)}
    assert {"epdctl_proxy_requests_total", "epdctl_proxy_stage_seconds_bucket",
            "vllm:num_requests_running", "vllm:e2e_request_latency_seconds_bucket"} <= wanted
    metrics = Metrics()
    metrics.fallbacks.labels("encoder").inc()
    metrics.retries.labels("decode").inc()
    metrics.count("/v1/chat/completions", "ok")
    known = set(Scrape(metrics.render(_upstreams()).decode()).samples)
    for name in ("encode-0", "pd-0"):
        known |= set(Scrape(TEXTS[name]).samples)
    assert sorted(wanted - known) == []
    assert all(p.get("datasource", {}).get("uid", "${datasource}") == "${datasource}"
               for p in doc["panels"])
