"""Prometheus text as numbers: sums over label sets, histograms, their differences and
quantiles (as PromQL's histogram_quantile interpolates them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (+Inf last), and the observations' sum."""

    buckets: tuple[tuple[float, float], ...]
    total: float
    sum: float

    def __sub__(self, earlier: Histogram) -> Histogram:
        """What was observed between two scrapes (a restart resets: then all of it)."""
        before = dict(earlier.buckets)
        if self.total < earlier.total or set(before) - {le for le, _ in self.buckets}:
            return self
        return Histogram(tuple((le, count - before.get(le, 0.0)) for le, count in self.buckets),
                         self.total - earlier.total, self.sum - earlier.sum)

    def quantile(self, q: float) -> float | None:
        """The q-quantile, linear within its bucket; None without observations."""
        if self.total <= 0 or not self.buckets:
            return None
        rank = q * self.total
        lower, below = 0.0, 0.0
        for le, count in self.buckets:
            if count >= rank:
                if math.isinf(le):
                    return lower  # PromQL's answer: the highest finite bound
                if count == below:
                    return le
                return lower + (le - lower) * (rank - below) / (count - below)
            lower, below = le, count
        return lower

    @property
    def mean(self) -> float | None:
        return self.sum / self.total if self.total > 0 else None


class Scrape:
    """One /metrics text, parsed once: samples by name, then label set."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.samples: dict[str, dict[Labels, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                self.samples.setdefault(sample.name, {})[labels] = sample.value

    def total(self, name: str, **match: str) -> float | None:
        """The sum over every label set that has `match` (None: no such series)."""
        series = self._matching(name, match)
        return sum(series.values()) if series else None

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """Sums per value of one label."""
        result: dict[str, float] = {}
        for labels, value in self._matching(name, match).items():
            key = dict(labels).get(label, "")
            result[key] = result.get(key, 0.0) + value
        return result

    def histogram(self, name: str, **match: str) -> Histogram | None:
        """The histogram `name` summed over label sets that have `match` (le aside)."""
        counts: dict[float, float] = {}
        for labels, value in self._matching(f"{name}_bucket", match).items():
            bound = dict(labels).get("le")
            if bound is not None:
                counts[float(bound)] = counts.get(float(bound), 0.0) + value
        if not counts:
            return None
        return Histogram(tuple(sorted(counts.items())), self.total(f"{name}_count", **match) or
                         0.0, self.total(f"{name}_sum", **match) or 0.0)

    def _matching(self, name: str, match: Mapping[str, str]) -> dict[Labels, float]:
        series = self.samples.get(name, {})
        if not match:
            return series
        return {labels: v for labels, v in series.items()
                if all(dict(labels).get(k) == want for k, want in match.items())}
