"""`epdctl tune` output: the ranked table (text and Markdown), and the --out files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HEADERS = ("#", "candidate", "shape", "GPUs", "pred req/s", "meas req/s", "error",
           "TTFT p90", "TPOT p90", "bottleneck", "utilization")


CLASS_HEADERS = ("candidate", "class", "requests", "within SLO", "TTFT p90", "TPOT p90",
                 "binding stage")
CLASS_CANDIDATES = 3
"""Over a trace: the candidates shown per class (the best predicted, and the best
measured)."""


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def class_rows(doc: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """Over a trace: per class of the best candidates, its share within the SLO at the
    candidate's predicted knee, its percentiles and the stage that binds it."""
    traced = [c for c in doc["candidates"] if c.get("classes")]
    shown = traced[:CLASS_CANDIDATES] + [c for c in traced[CLASS_CANDIDATES:]
                                         if c["name"] == doc.get("best")]
    out: list[tuple[str, ...]] = [CLASS_HEADERS]
    for c in shown:
        for name, k in c["classes"].items():
            out.append((c["name"], name, str(k["requests"]), f"{k['attainment']:.0%}",
                        _num(k["ttft_ms"].get("p90")), _num(k["tpot_ms"].get("p90")),
                        k["binding_stage"] or "-"))
    return out if len(out) > 1 else []


def trace_line(doc: Mapping[str, Any]) -> str | None:
    """What trace was tuned for, and the request shape profiled (None: not a trace)."""
    t, w = doc.get("trace"), doc.get("workload") or {}
    if not t:
        return None
    classes = ", ".join(f"{name} {n}" for name, n in t["classes"].items())
    size = "x".join(str(n) for n in w.get("image_size", ()))
    return (f"trace {t['file']}: {t['requests']} requests ({classes}), "
            f"{_num(t['rate'])} req/s at speed 1 (goodput is that x a speed); profiled at "
            f"class `{t['profiled_class']}`'s typical request: {w.get('images')} image(s) of "
            f"{size}, {w.get('input_len')} text tokens, {w.get('output_len')} output tokens")


def _aligned(table: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True))
                     .rstrip() for r in table)


def _md_table(table: list[tuple[str, ...]]) -> list[str]:
    return (["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
            + ["| " + " | ".join(r) + " |" for r in table[1:]])


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
    """The ranked table; over a trace, the per-class table after it."""
    text = _aligned(rows(doc))
    per_class = class_rows(doc)
    if per_class:
        text += "\n\nper class, at each candidate's predicted knee:\n" + _aligned(per_class)
    return text


def markdown(doc: Mapping[str, Any]) -> str:
    table = rows(doc)
    lines = ["# epdctl tune", "",
             f"Best measured: `{doc.get('best') or '-'}` "
             f"({_num(doc.get('best_goodput'))} req/s)"
             + (f", since {doc['best_reason']}" if doc.get("best_reason") else "")
             + f". Stopped: {doc['stop_reason']}.", ""]
    if doc.get("workload") and not doc.get("trace"):  # an older epdctl's report has none
        from epdctl.bench.report import workload_line

        lines += [f"Workload: {workload_line(doc['workload'])}.", ""]
    if doc.get("handoffs"):  # a report of an older epdctl has none
        h = doc["handoffs"]
        lines += [f"Hand-offs profiled: EC (the proxy's hop from E's answer to PD) "
                  f"{_num(h['ec_ms'])} ms; KV (D's pull) {_num(h['kv_ms'])} ms. A busy "
                  f"neighbour on a shared GPU makes a step "
                  f"{_num(h['sharing_slowdown'] * 100)} % longer.", ""]
    if trace_line(doc):
        lines += [f"Tuned for the {trace_line(doc)}.", ""]
    lines += _md_table(table)
    per_class = class_rows(doc)
    if per_class:
        lines += ["", "Per class, at each candidate's predicted knee (the share of the "
                  "class's requests within the SLO; the stage that delays them most):", ""]
        lines += _md_table(per_class)
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
