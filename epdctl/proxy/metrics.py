"""Prometheus metrics in a per-app registry, so two apps in one process never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from epdctl.proxy.upstreams import Upstreams

STAGES = ("encode", "prefill", "decode", "total")
KEYED_BY = ("client", "content")
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0)


class Metrics:
    """Everything /metrics shows; children are resolved once, off the hot path."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "epdctl_proxy_requests", "Requests by route and outcome.",
            ["route", "outcome"], registry=registry)
        stage = Histogram(
            "epdctl_proxy_stage_seconds",
            "Per-stage latency: encode (all items), prefill, decode (to first content "
            "chunk, or whole answer when not streaming), total.",
            ["stage"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.stage = {name: stage.labels(name) for name in STAGES}
        self.fanout = Histogram(
            "epdctl_proxy_encoder_fanout_items", "Encoder sub-requests per request that sends "
            "any.",
            buckets=(1, 2, 4, 8, 16, 32, 64), registry=registry)
        # Per distinct media item of a request (a repeat inside one request is one item, as
        # E sees it); never per attempt: an E retry or a resend to PD is not a second item.
        self.lookups = Counter(
            "epdctl_proxy_store_lookups", "Media items looked up in the EC store before the "
            "E stage.", registry=registry)
        self.skipped = Counter(
            "epdctl_proxy_items_skipped", "Media items found in the EC store: no E "
            "sub-request.", registry=registry)
        self.overlapped = Counter(
            "epdctl_proxy_overlapped_requests", "Requests sent to PD (or P) while E still "
            "encoded their media (overlap; PD waits for the entries).", registry=registry)
        self.sent = Counter(
            "epdctl_proxy_items_sent", "Media items sent to an encoder.", registry=registry)
        self.fallbacks = Counter(
            "epdctl_proxy_fallbacks",
            "Media sent on to PD raw: encoder failed (encoder) or PD lacked a rewritten "
            "item's entry (rewrite).", ["reason"], registry=registry)
        keyed_by = Counter(
            "epdctl_proxy_media_keys",
            "Media keys the proxy sent on, by source: a client uuid (in its own key space; "
            "any content part carrying one) or the item's content (media going through E).",
            ["keyed_by"], registry=registry)
        self.keyed_by = {name: keyed_by.labels(name) for name in KEYED_BY}
        self.retries = Counter(
            "epdctl_proxy_retries", "Retries on another instance, by stage.", ["stage"],
            registry=registry)
        self.replays = Counter(
            "epdctl_proxy_replays", "Requests replayed (or streams resumed) after the "
            "instance serving them died, by stage and outcome: ok, failed (that attempt "
            "failed too), no_instance (none ready within replay_wait), not_resumable (a "
            "stream that cannot go on exactly).", ["stage", "outcome"], registry=registry)
        self.inflight = Gauge(
            "epdctl_proxy_inflight_requests", "Requests being served.", registry=registry)
        self.instance_up = Gauge(
            "epdctl_proxy_instance_up", "1 while an instance is in rotation, 0 when ejected.",
            ["role", "url"], registry=registry)
        self._outcomes: dict[tuple[str, str], Counter] = {}

    def count(self, route: str, outcome: str) -> None:
        child = self._outcomes.get((route, outcome))
        if child is None:
            child = self._outcomes[(route, outcome)] = self.requests.labels(route, outcome)
        child.inc()

    def render(self, upstreams: Upstreams) -> bytes:
        for pool in upstreams.pools.values():
            for inst in pool.instances:
                self.instance_up.labels(pool.role, inst.url).set(0 if inst.is_ejected else 1)
        return generate_latest(self.registry)


def outcome_of(status: int) -> str:
    """A small, fixed label set: ok, client_error, overloaded, upstream_error, timeout."""
    if status < 400:
        return "ok"
    if status == 503:
        return "overloaded"
    if status == 504:
        return "timeout"
    if status < 500:
        return "client_error"
    return "upstream_error"
