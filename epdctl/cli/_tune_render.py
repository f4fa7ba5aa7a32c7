"""`epdctl tune` output: the ranked table (text and Markdown), and the --out files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HEADERS = ("#", "candidate", "shape", "GPUs", "pred req/s", "meas req/s", "error",
           "TTFT p90", "TPOT p90", "bottleneck", "utilization")


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def rows(doc: Mapping[str, Any]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [HEADERS]
    for i, c in enumerate(doc["candidates"], 1):
        util = c.get("utilization") or {}
        error = c.get("prediction_error")
        out.append((str(i), c["name"], c["shape"], str(c["gpus"]),
                    _num(c.get("predicted_goodput")), _num(c.get("measured_goodput")),
                    "-" if error is None else f"{error:+.0%}",
                    _num((c.get("ttft_ms") or {}).get("p90")),
                    _num((c.get("tpot_ms") or {}).get("p90")), c.get("bottleneck") or "-",
                    " ".join(f"{r[:6]} {u:.0%}" for r, u in util.items()) or "-"))
    return out


def hints(doc: Mapping[str, Any]) -> list[str]:
    """"E idle 70 %: fewer encoders", for the best one."""
    best = next((c for c in doc["candidates"] if c["name"] == doc.get("best")), None)
    lines = []
    for role, used in ((best or {}).get("utilization") or {}).items():
        if used < 0.3:
            lines.append(f"{role} idle {1 - used:.0%} at the knee: fewer {role} instances")
    return lines


def left_out(doc: Mapping[str, Any]) -> list[str]:
    """What the run did not get to (the budget, the stop rule): said after the table."""
    lines = []
    if doc.get("not_profiled"):
        lines.append("not profiled (no prediction for the candidates needing them): "
                     + ", ".join(doc["not_profiled"]))
    if doc.get("not_confirmed"):
        lines.append("not confirmed: " + ", ".join(doc["not_confirmed"]))
    return lines


def text_table(doc: Mapping[str, Any]) -> str:
    table = rows(doc)
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADERS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True))
                     .rstrip() for r in table)


def markdown(doc: Mapping[str, Any]) -> str:
    table = rows(doc)
    lines = ["# epdctl tune", "",
             f"Best measured: `{doc.get('best') or '-'}` "
             f"({_num(doc.get('best_goodput'))} req/s)"
             + (f", since {doc['best_reason']}" if doc.get("best_reason") else "")
             + f". Stopped: {doc['stop_reason']}.", ""]
    if doc.get("workload"):  # a report of an older epdctl has none
        from epdctl.bench.report import workload_line

        lines += [f"Workload: {workload_line(doc['workload'])}.", ""]
    if doc.get("handoffs"):  # a report of an older epdctl has none
        h = doc["handoffs"]
        lines += [f"Hand-offs profiled: EC (the proxy's hop from E's answer to PD) "
                  f"{_num(h['ec_ms'])} ms; KV (D's pull) {_num(h['kv_ms'])} ms. A busy "
                  f"neighbour on a shared GPU makes a step "
                  f"{_num(h['sharing_slowdown'] * 100)} % longer.", ""]
    lines += ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(r) + " |" for r in table[1:]]
    if doc.get("not_confirmed"):
        lines += ["", "Not confirmed: " + ", ".join(f"`{n}`" for n in doc["not_confirmed"])]
    if doc.get("not_profiled"):
        lines += ["", "Not profiled (so not predicted): "
                  + ", ".join(f"`{n}`" for n in doc["not_profiled"])]
    if doc.get("left_out"):
        lines += ["", "Left out (memory):"] + [f"- {x['shape']}: {x['reason']}"
                                                for x in doc["left_out"]]
    return "\n".join(lines) + "\n"


def write_out(doc: Mapping[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown(doc))
    from epdctl.tune.plot import write_plot

    write_plot(doc, out_dir / "plot.png")
