"""rich renderables for `epdctl verify` (pure functions of its results)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from epdctl.verifier.probes import Result


def verify_table(results: Sequence[Result]) -> Table:
    """One row per prompt: output equal or not, EC cache verdict, both latencies."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("PROMPT", "OUTPUT", "EC CACHE", "TOPOLOGY", "BASELINE"):
        table.add_column(column, no_wrap=True)
    for r in results:
        output = Text("equal", "green") if r.is_equal else Text(
            "error" if r.topology.error or r.baseline.error else "DIFFERENT", "red")
        cache = Text("-") if r.cache is None else Text(
            r.cache.shown,
            "green" if r.cache.is_evidence and r.cache.is_ok else "" if r.cache.is_ok else "red")
        table.add_row(Text(r.prompt.name), output, cache,
                      *(Text(f"{a.latency_s * 1000:.0f} ms") for a in (r.topology, r.baseline)))
    return table


def mismatches(results: Sequence[Result]) -> Text:
    """Both answers of every prompt whose answers differ (user text: never markup)."""
    text = Text()
    for r in results:
        if not r.is_equal:
            for who, a in (("topology", r.topology), ("baseline", r.baseline)):
                said = f"error: {a.error}" if a.error else repr(a.text)
                text.append(f"{r.prompt.name}: {who} {said}\n")
    return text
