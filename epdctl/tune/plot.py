"""plot.png of a tune report: predicted against measured goodput per confirmed candidate,
and each confirmed one's share of requests within the SLO against load (needs matplotlib)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_plot(doc: Mapping[str, Any], path: Path) -> bool:
    """False (nothing written) without matplotlib or without a confirmed candidate."""
    from epdctl.bench.plot import has_matplotlib

    confirmed = [c for c in doc["candidates"] if c.get("measured_goodput") is not None]
    if not has_matplotlib() or not confirmed:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for c in confirmed:
        left.scatter(c["predicted_goodput"], c["measured_goodput"])
        left.annotate(c["shape"], (c["predicted_goodput"], c["measured_goodput"]),
                      fontsize=8)
        points = sorted(c.get("measured_points") or [])
        if points:
            right.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                       label=c["shape"])
    top = max(max(c["predicted_goodput"] or 0, c["measured_goodput"] or 0) for c in confirmed)
    left.plot([0, top * 1.1], [0, top * 1.1], linestyle=":", color="grey")
    left.set(xlabel="predicted goodput (req/s)", ylabel="measured goodput (req/s)",
             title="prediction vs measurement")
    right.axhline(0.9, linestyle=":", color="grey")
    right.set(xlabel="request rate (req/s)", ylabel="share within the SLO",
              title="confirmed candidates against load")
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
