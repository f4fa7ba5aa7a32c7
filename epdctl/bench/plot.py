"""plot.png: TTFT p90 (p50 on small samples) and goodput against load, one line per
arm with its 95 % intervals; for a trace, a second row of the same per shape class, one line
per arm and class (needs matplotlib)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epdctl.errors import BenchError

LINE_STYLES = ("-", "--", ":", "-.")
MISSING = ("plot.png not written: matplotlib is not installed "
           "(pip install 'epdctl[bench]')")


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def series(doc: Mapping[str, Any], figure: str) -> dict[str, list[float | None]]:
    """arm -> the figure at each load point, in point order."""
    out: dict[str, list[float | None]] = {a["name"]: [] for a in doc["arms"]}
    for row in sorted(doc["results"], key=lambda r: r["point"]):
        out[row["arm"]].append(row["figures"].get(figure))
    return out


def class_series(doc: Mapping[str, Any], figure: str
                 ) -> dict[tuple[str, str], list[tuple[float | None, list[float] | None]]]:
    """(arm, class) -> (the figure, its interval) at each load point ({}: no classes)."""
    points = sorted({r["point"] for r in doc["results"]})
    out: dict[tuple[str, str], list[tuple[float | None, list[float] | None]]] = {}
    for row in doc["results"]:
        for c in row.get("classes") or []:
            line = out.setdefault((row["arm"], c["class"]), [(None, None)] * len(points))
            line[points.index(row["point"])] = (c["figures"].get(figure),
                                                c["figures"].get(f"{figure}_ci"))
    return out


def ttft_figure(doc: Mapping[str, Any]) -> tuple[str, str]:
    """TTFT p90, or p50 where the sample cannot support a p90."""
    if any(r["figures"].get("ttft_p90_ms") is not None for r in doc["results"]):
        return "ttft_p90_ms", "TTFT p90 (ms)"
    return "ttft_p50_ms", "TTFT p50 (ms; too few requests for a p90)"


def _errors(doc: Mapping[str, Any], arm: str, figure: str, at: list[int]) -> list[list[float]]:
    """Distances below and above each point to its 95 % interval's ends (0: none)."""
    rows = sorted((r for r in doc["results"] if r["arm"] == arm), key=lambda r: r["point"])
    low, high = [], []
    for i in at:
        value, ci = rows[i]["figures"].get(figure), rows[i]["figures"].get(f"{figure}_ci")
        low.append(value - ci[0] if ci and value is not None else 0.0)
        high.append(ci[1] - value if ci and value is not None else 0.0)
    return [low, high]


def _class_lines(ax: Any, doc: Mapping[str, Any], figure: str, x: list[int]) -> None:
    """A colour per class, a line style per arm."""
    lines = class_series(doc, figure)
    arms = list(dict.fromkeys(arm for arm, _ in lines))
    classes = list(dict.fromkeys(name for _, name in lines))
    for (arm, name), line in lines.items():
        drawn = [(i, v, ci) for i, (v, ci) in zip(x, line, strict=True) if v is not None]
        if drawn:
            low = [v - ci[0] if ci else 0.0 for _, v, ci in drawn]
            high = [ci[1] - v if ci else 0.0 for _, v, ci in drawn]
            ax.errorbar([i for i, _, _ in drawn], [v for _, v, _ in drawn], yerr=[low, high],
                        marker="o", capsize=3, label=f"{arm}: {name}",
                        color=f"C{classes.index(name) % 10}",
                        linestyle=LINE_STYLES[arms.index(arm) % len(LINE_STYLES)])


def _axes(ax: Any, title: str, x: list[int], labels: list[str]) -> None:
    ax.set_title(title)
    ax.set_xticks(x, labels, rotation=15)
    ax.set_xlabel("load")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def write_plot(doc: Mapping[str, Any], path: Path) -> None:
    """Two panels over the load points; BenchError (MISSING) without matplotlib."""
    if not has_matplotlib():
        raise BenchError(MISSING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [p["label"] for p in doc["workload"]["points"]]
    has_slo = bool(doc["workload"]["slo_ms"])
    right = ("request_goodput", "goodput (req/s within the SLO)") if has_slo else \
        ("request_throughput", "request throughput (req/s; no --slo given)")
    panels = (ttft_figure(doc), right)
    has_classes = any(r.get("classes") for r in doc["results"])
    fig, grid = plt.subplots(2 if has_classes else 1, 2, squeeze=False,
                             figsize=(11, 8.4 if has_classes else 4.2))
    x = list(range(len(labels)))
    for ax, (figure, title) in zip(grid[0], panels, strict=True):
        for arm, values in series(doc, figure).items():
            points = [(i, v) for i, v in zip(x, values, strict=True) if v is not None]
            if points:
                at = [p[0] for p in points]
                ax.errorbar(at, [p[1] for p in points], yerr=_errors(doc, arm, figure, at),
                            marker="o", capsize=3, label=arm)
        _axes(ax, title, x, labels)
    if has_classes:
        # p50: a class's requests are fewer than its point's.
        shaped = (("ttft_p50_ms", "TTFT p50 (ms) per shape class"),
                  (right[0], right[1] + " per shape class"))
        for ax, (figure, title) in zip(grid[1], shaped, strict=True):
            _class_lines(ax, doc, figure, x)
            _axes(ax, title, x, labels)
    fig.suptitle(f"epdctl bench: {', '.join(a['name'] for a in doc['arms'])}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
