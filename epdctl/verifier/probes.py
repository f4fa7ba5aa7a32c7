"""`epdctl verify` core: the fixed prompts against a topology and a baseline, compared and
timed, and what the EC store (or ECExampleConnector's files) shows of their media."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from epdctl.verifier.prompts import (
    PROMPTS,
    ChatAnswer,
    Prompt,
    Send,
    chat_body,
    media_keys,
    send_chat,
)

# The consumer's stats writer flushes at most once a second, so a hit can show up that late.
STATS_WAIT_S = 3.0


@dataclass(frozen=True)
class CacheUse:
    """EC store counter deltas while one prompt ran (summed over the consumers)."""

    keys: int
    """Distinct media items the prompt sent."""
    hits: int
    """Of those, how many a consumer loaded from the store."""
    misses: int = 0
    """Lookups that found nothing usable: P/PD encoded the item itself."""

    @property
    def verdict(self) -> str:
        """hit, partial, miss, or unused (P/PD needed no encoder output: its KV was reused)."""
        if self.misses:
            return "miss"
        if not self.hits:
            return "unused"
        return "hit" if self.hits == self.keys else "partial"

    @property
    def is_ok(self) -> bool:
        # Items nobody looked up were not needed; only a miss means work done twice.
        return self.misses == 0

    @property
    def is_evidence(self) -> bool:
        """Whether this shows P/PD used E's output."""
        return self.hits > 0

    @property
    def shown(self) -> str:
        return f"{self.verdict} {self.hits}/{self.keys}"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "keys": self.keys, "hits": self.hits,
                "misses": self.misses}


@dataclass(frozen=True)
class FileUse:
    """ECExampleConnector: how many of a prompt's items E's files hold. P/PD's loads leave
    no trace there, so a load cannot be seen; a missing file means P/PD encoded it."""

    keys: int
    saved: int

    @property
    def verdict(self) -> str:
        return "saved" if self.saved == self.keys else "missing"

    @property
    def is_ok(self) -> bool:
        return self.saved == self.keys

    @property
    def is_evidence(self) -> bool:
        return self.saved > 0

    @property
    def shown(self) -> str:
        return f"{self.verdict} {self.saved}/{self.keys}"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "keys": self.keys, "saved": self.saved}


@dataclass(frozen=True)
class Result:
    prompt: Prompt
    topology: ChatAnswer
    baseline: ChatAnswer
    cache: CacheUse | FileUse | None = None
    """None when the prompt has no media, the topology has no encoder, or its connector
    keeps nothing verify can read."""

    @property
    def is_equal(self) -> bool:
        a, b = self.topology, self.baseline
        return a.error is None and b.error is None and a.text == b.text

    @property
    def is_ok(self) -> bool:
        return self.is_equal and (self.cache is None or self.cache.is_ok)


def is_passed(results: Sequence[Result]) -> bool:
    """Every prompt ok and, where the cache is checked, at least one item E's output served."""
    uses = [r.cache for r in results if r.cache is not None]
    has_hit = not uses or any(u.is_evidence for u in uses)
    return bool(results) and has_hit and all(r.is_ok for r in results)


@dataclass
class StoreCounters:
    """Summed counters and per-key hits of one EC namespace at one moment."""

    counts: Counter[str] = field(default_factory=Counter)
    key_hits: Counter[str] = field(default_factory=Counter)

    @classmethod
    def read(cls, ns_dir: Path) -> StoreCounters:
        from epdctl.cache.stats import read_stats

        counts, key_hits = read_stats(ns_dir)
        return cls(counts, key_hits)


def cache_use(
    ns_dir: Path, before: StoreCounters, keys: set[str], *, timeout_s: float = STATS_WAIT_S,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> CacheUse:
    """Wait (briefly) until every key got a hit from the store or a miss was counted; the deltas."""
    deadline = clock() + timeout_s
    while True:
        now = StoreCounters.read(ns_dir)
        hits = sum(1 for k in keys if now.key_hits[k] > before.key_hits[k])
        misses = now.counts["misses"] - before.counts["misses"]
        if hits == len(keys) or misses > 0 or clock() >= deadline:
            return CacheUse(keys=len(keys), hits=hits, misses=int(misses))
        sleep(0.1)


class Probe(Protocol):
    """How verify reads the EC connector's side of one prompt: a snapshot before, a use after."""

    def snapshot(self) -> Any: ...

    def use(self, before: Any, keys: set[str]) -> CacheUse | FileUse: ...


@dataclass(frozen=True)
class StoreProbe:
    """epdctl's store: its per-key hit and miss counters."""

    ns_dir: Path

    def snapshot(self) -> StoreCounters:
        return StoreCounters.read(self.ns_dir)

    def use(self, before: Any, keys: set[str]) -> CacheUse:
        return cache_use(self.ns_dir, before, keys)


@dataclass(frozen=True)
class FileProbe:
    """ECExampleConnector: whether E's file of each item is there."""

    root: Path

    def snapshot(self) -> None:
        return None

    def use(self, before: Any, keys: set[str]) -> FileUse:
        from epdctl.cache.example_files import item_file

        return FileUse(len(keys), sum(item_file(self.root, k).is_file() for k in keys))


def probe_for(connector: str, ns_dir: Path) -> Probe | None:
    """What verify can read of a connector's work (None: nothing, e.g. Mooncake pushes)."""
    from epdctl.topology.ec_names import EXAMPLE, OURS

    if connector == OURS:
        return StoreProbe(ns_dir)
    return FileProbe(ns_dir) if connector == EXAMPLE else None


@dataclass(frozen=True)
class Target:
    """Where to send a prompt: base URL, model name, headers."""

    url: str
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)


def run_prompts(
    topology: Target, baseline: Target, probe: Probe | None,
    prompts: Sequence[Prompt] = PROMPTS, *, send: Send | None = None,
    on_result: Callable[[Result], None] = lambda r: None,
) -> list[Result]:
    """Each prompt to the topology, then to the baseline; with what the probe saw, if any."""
    send = send or send_chat
    results = []
    for prompt in prompts:
        keys = media_keys(prompt) if probe is not None and prompt.modalities else set()
        before = probe.snapshot() if keys and probe is not None else None
        mine = send(topology.url, chat_body(prompt, topology.model), topology.headers)
        theirs = send(baseline.url, chat_body(prompt, baseline.model), baseline.headers)
        use = probe.use(before, keys) if keys and probe is not None else None
        result = Result(prompt, mine, theirs, use)
        on_result(result)
        results.append(result)
    return results


def report(results: Sequence[Result], **meta: Any) -> dict[str, Any]:
    """The `verify --json` document (stable keys)."""

    def answer(a: ChatAnswer) -> dict[str, Any]:
        return {"text": a.text, "latency_s": round(a.latency_s, 4), "error": a.error}

    rows = [{
        "name": r.prompt.name, "images": len(r.prompt.images),
        "videos": len(r.prompt.videos), "audios": len(r.prompt.audios),
        "stream": r.prompt.is_streamed,
        "equal": r.is_equal, "ok": r.is_ok,
        "cache": None if r.cache is None else r.cache.to_json(),
        "topology": answer(r.topology), "baseline": answer(r.baseline),
    } for r in results]
    return {**meta, "ok": is_passed(results), "prompts": rows}
