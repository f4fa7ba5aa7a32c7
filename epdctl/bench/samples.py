"""Per-request samples of one load point on one arm, from `vllm bench serve --save-detailed`
(pure; also read back from a saved report.json for `bench compare`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from epdctl.errors import BenchError


@dataclass(frozen=True)
class Request:
    """One completed request."""

    ttft_ms: float
    tpot_ms: float | None
    """Time per output token after the first; None where the output came in one chunk (no
    token after the first was timed apart from it)."""
    latency_ms: float
    good: bool
    """Met every --slo target (vLLM's goodput rule); True without an SLO."""


@dataclass(frozen=True)
class Round:
    """One `vllm bench serve` run: its duration, vLLM's req/s and its completed requests."""

    duration_s: float
    request_throughput: float
    requests: tuple[Request, ...]
    failed: int = 0
    classes: tuple[str, ...] = ()
    """Each request's shape class (a trace replay's; empty otherwise)."""

    @cached_property
    def mean_latency_ms(self) -> float:
        return sum(r.latency_ms for r in self.requests) / len(self.requests) \
            if self.requests else 0.0

    def of_class(self, name: str) -> Round:
        """Its requests of one shape class, as if they alone had run for its duration: their
        share of its req/s (so goodput is theirs within the SLO per second)."""
        picked = tuple(r for r, c in zip(self.requests, self.classes, strict=True)
                       if c == name)
        share = len(picked) / len(self.requests) if self.requests else 0.0
        return Round(self.duration_s, self.request_throughput * share, picked, 0,
                     (name,) * len(picked))

    def as_json(self) -> dict[str, Any]:
        out = {"duration_s": self.duration_s, "request_throughput": self.request_throughput,
               "failed": self.failed,
               "requests": [[r.ttft_ms, r.tpot_ms, r.latency_ms, r.good]
                            for r in self.requests]}
        return out | {"classes": list(self.classes)} if self.classes else out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Round:
        try:
            requests = tuple(Request(float(t), None if p is None else float(p), float(lat),
                                     bool(g)) for t, p, lat, g in data["requests"])
            classes = tuple(str(c) for c in data.get("classes") or ())
            if classes and len(classes) != len(requests):
                raise ValueError("a class per request")
            return cls(float(data["duration_s"]), float(data["request_throughput"]), requests,
                       int(data.get("failed") or 0), classes)
        except (KeyError, TypeError, ValueError) as exc:
            raise BenchError(f"a saved round's samples cannot be read ({exc!r})") from None


def _good(ttft_s: float, tpot_s: float, latency_s: float,
          slo: Sequence[tuple[str, float]]) -> bool:
    measured = {"ttft": ttft_s, "tpot": tpot_s, "e2el": latency_s}
    return all(measured[k] * 1000.0 <= ms for k, ms in slo)


def parse_round(data: Mapping[str, Any], slo: Sequence[tuple[str, float]] = ()) -> Round:
    """A `--save-detailed` result's requests. TPOT as vLLM computes it, but None (not 0)
    where the output arrived in one chunk; goodput's rule is vLLM's (a 0 TPOT there)."""
    lists: list[list[Any]] = []
    for key in ("ttfts", "itls", "latencies", "output_lens"):
        value = data.get(key)
        if not isinstance(value, list):
            raise BenchError("the `vllm bench serve` result has no per-request data "
                             "(run with --save-detailed)")
        lists.append(value)
    ttfts, itls, latencies, lens = lists
    errors: list[Any] = data.get("errors") or [""] * len(ttfts)
    # A trace replay's (epdctl.bench.replay): each request's shape class.
    named = data.get("classes")
    named = named if isinstance(named, list) and len(named) == len(ttfts) else None
    requests, classes = [], []
    for i, (ttft, itl, latency, length, error) in enumerate(zip(
            ttfts, itls, latencies, lens, errors, strict=False)):
        if error or not length:
            continue  # failed: vLLM counts it out of every figure too
        tpot = (latency - ttft) / (length - 1) if length > 1 else 0.0
        chunked = bool(itl) and length > 1
        requests.append(Request(ttft * 1000.0, tpot * 1000.0 if chunked else None,
                                latency * 1000.0, _good(ttft, tpot, latency, slo)))
        if named is not None:
            classes.append(str(named[i]))
    duration = float(data.get("duration") or 0.0)
    rps = data.get("request_throughput")
    rps = float(rps) if isinstance(rps, int | float) else (
        len(requests) / duration if duration else 0.0)
    return Round(duration, rps, tuple(requests), int(data.get("failed") or 0), tuple(classes))
