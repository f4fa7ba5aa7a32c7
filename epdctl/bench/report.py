"""The bench report: figures per arm and load point, ratios to the baseline, verdicts, the
greedy subset compared across arms; as a JSON document and as markdown."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from epdctl.bench.arms import Arm
from epdctl.bench.runner import ArmRun
from epdctl.bench.workload import Workload
from epdctl.verify import Prompt

# Figure -> (column header, format) for tables; the order they are shown in.
COLUMNS = {
    "completed": ("done", "{:.0f}"), "failed": ("failed", "{:.0f}"),
    "request_throughput": ("req/s", "{:.2f}"), "output_throughput": ("tok/s", "{:.1f}"),
    "request_goodput": ("goodput", "{:.2f}"),
    "ttft_p50_ms": ("TTFT p50", "{:.0f}"), "ttft_p90_ms": ("TTFT p90", "{:.0f}"),
    "ttft_p99_ms": ("TTFT p99", "{:.0f}"), "tpot_mean_ms": ("TPOT", "{:.1f}"),
    "itl_p99_ms": ("ITL p99", "{:.1f}"),
}
RATIOS = ("request_goodput", "request_throughput", "output_throughput", "ttft_p90_ms",
          "ttft_p99_ms", "tpot_mean_ms")
SAME = 0.05
"""Ratios within 5 % of 1 count as on par."""


def topology_hash(arm: Arm) -> str:
    """sha256 of the arm's validated topology (derived arms included), 16 hex digits."""
    text = json.dumps(arm.topology.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reference(runs: Sequence[ArmRun]) -> ArmRun | None:
    """What ratios are taken against: the baseline arm, else the first when there are more."""
    for run in runs:
        if run.arm.kind == "baseline":
            return run
    return runs[0] if len(runs) > 1 else None


def ratios(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in RATIOS:
        a, b = mine.get(key), theirs.get(key)
        out[key] = round(a / b, 4) if isinstance(a, int | float) and b else None
    return out


def verdict(arm: str, ref: str, mine: Mapping[str, Any], theirs: Mapping[str, Any],
            ratio: Mapping[str, float | None], has_slo: bool) -> str:
    """One line: which arm serves this load better, by goodput (or req/s) and TTFT p90."""
    failed = {n: f["failed"] for n, f in ((arm, mine), (ref, theirs)) if f.get("failed")}
    if failed:
        which = ", ".join(f"`{n}` {c} failed" for n, c in failed.items())
        return f"`{arm}` vs `{ref}`: not comparable ({which})"
    name = "goodput" if has_slo else "req/s"
    tput = ratio.get("request_goodput" if has_slo else "request_throughput")
    ttft = ratio.get("ttft_p90_ms")
    if tput is None or ttft is None:
        return f"`{arm}` vs `{ref}`: no figures to compare"
    figures = f"{tput:.2f}x {name}, TTFT p90 {(ttft - 1) * 100:+.0f} %"
    up, down = tput >= 1 + SAME, tput <= 1 - SAME
    faster, slower = ttft <= 1 - SAME, ttft >= 1 + SAME
    if (up and not slower) or (faster and not down):
        return f"`{arm}` is better than `{ref}` here: {figures}"
    if (down and not faster) or (slower and not up):
        return f"`{ref}` is better than `{arm}` here: {figures}"
    if up or down:
        return f"`{arm}` vs `{ref}`: mixed, {figures}"
    return f"`{arm}` and `{ref}` are on par (within {SAME:.0%}): {figures}"


def correctness(runs: Sequence[ArmRun], prompts: Sequence[Prompt]) -> dict[str, Any]:
    """The greedy subset's answers per arm, against the first arm's."""
    if not runs:
        return {"reference": None, "prompts": [], "ok": True, "mismatches": [], "answers": {}}
    first = runs[0]
    mismatches = []
    for run in runs:
        for prompt, mine, theirs in zip(prompts, run.greedy, first.greedy, strict=True):
            if mine.error is not None or theirs.error is not None or mine.text != theirs.text:
                mismatches.append({"arm": run.arm.name, "prompt": prompt.name,
                                   "expected": theirs.text, "got": mine.text,
                                   "error": mine.error or theirs.error})
    return {"reference": first.arm.name, "prompts": [p.name for p in prompts],
            "ok": not mismatches, "mismatches": mismatches,
            "answers": {r.arm.name: [a.text for a in r.greedy] for r in runs}}


def build(runs: Sequence[ArmRun], workload: Workload, prompts: Sequence[Prompt],
          **meta: Any) -> dict[str, Any]:
    """The `bench --json` document (and report.json)."""
    ref = reference(runs)
    rows: list[dict[str, Any]] = []
    verdicts: list[dict[str, Any]] = []
    for index, point in enumerate(workload.points):
        theirs = ref.points[index].figures if ref is not None else None
        for run in runs:
            p = run.points[index]
            ratio = ratios(p.figures, theirs) if theirs is not None and run is not ref else None
            rows.append({"arm": run.arm.name, "point": index, "load": point.label,
                         "figures": p.figures, "proxy": p.proxy, "store": p.store,
                         "ratios": ratio, "elapsed_s": round(p.elapsed_s, 2), "argv": p.argv})
            if ratio is not None and ref is not None and theirs is not None:
                verdicts.append({"point": index, "load": point.label, "arm": run.arm.name,
                                 "text": verdict(run.arm.name, ref.arm.name, p.figures, theirs,
                                                 ratio, bool(workload.slo))})
    check = correctness(runs, prompts)
    arms = [{"name": r.arm.name, "kind": r.arm.kind, "topology": r.arm.topology.name,
             "file": str(r.arm.path), "mode": r.arm.topology.mode, "hash": topology_hash(r.arm),
             "instances": r.instances, "notes": list(r.arm.notes)} for r in runs]
    failed = sum(int(p.figures.get("failed") or 0) for r in runs for p in r.points)
    return {**meta, "workload": workload.as_json(), "arms": arms,
            "reference": ref.arm.name if ref else None, "results": rows, "verdicts": verdicts,
            "correctness": check, "failed_requests": failed, "ok": check["ok"]}


def cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """Header and one row per arm and load point (shared by the terminal and markdown)."""
    has_store = any(r["store"] is not None for r in doc["results"])
    header = ["load", "arm", *(h for h, _ in COLUMNS.values()), "encode ms", "fallbacks"]
    header += ["store hits"] * has_store + ["x ref"]
    rows = [header]
    key = "request_goodput" if doc["workload"]["slo_ms"] else "request_throughput"
    for r in doc["results"]:
        f, proxy = r["figures"], r["proxy"]
        row = [r["load"], r["arm"], *(cell(f.get(k), fmt) for k, (_, fmt) in COLUMNS.items()),
               cell(proxy.get("encode_mean_ms"), "{:.1f}"), cell(proxy.get("fallbacks"), "{}")]
        if has_store:
            row.append(cell((r["store"] or {}).get("hits"), "{}"))
        ratio = (r["ratios"] or {}).get(key)
        row.append(cell(ratio, "{:.2f}x"))
        rows.append(row)
    return rows


def markdown(doc: Mapping[str, Any]) -> str:
    """report.md: the table, the verdicts, the correctness check and what makes it repeatable."""
    rows = table_rows(doc)
    lines = ["# epdctl bench", ""]
    lines += [f"- vLLM {doc.get('vllm_version')}, epdctl {doc.get('epdctl_version')}; devices: "
              f"{', '.join(doc.get('devices') or ['-'])}",
              "- arms: " + "; ".join(f"`{a['name']}` = {a['topology']} ({a['mode']}, "
                                       f"{a['hash']})" for a in doc["arms"]),
              f"- workload: {_workload_line(doc['workload'])}", "",
              "Latencies in ms; throughput per second; `x ref` is goodput (or req/s without an "
              f"SLO) over `{doc.get('reference') or '-'}`'s.", ""]
    lines.append("| " + " | ".join(rows[0]) + " |")
    lines.append("|" + "|".join("---" for _ in rows[0]) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    if doc["verdicts"]:
        lines += ["", "## Verdicts", ""]
        lines += [f"- {v['load']}: {v['text']}" for v in doc["verdicts"]]
    check = doc["correctness"]
    lines += ["", "## Greedy subset", ""]
    if check["ok"]:
        lines.append(f"{len(check['prompts'])} prompts: every arm answered as "
                     f"`{check['reference']}` did.")
    for m in check["mismatches"]:
        lines.append(f"- MISMATCH `{m['arm']}`, {m['prompt']}: {m['got']!r} vs {m['expected']!r}"
                     + (f" ({m['error']})" if m["error"] else ""))
    lines += ["", "## Commands", ""]
    lines += [f"- `{r['arm']}`, {r['load']}: `{' '.join(r['argv'])}`" for r in doc["results"]]
    return "\n".join(lines) + "\n"


def _workload_line(w: Mapping[str, Any]) -> str:
    what = w["dataset"] or (f"{w['kind']}, {w['images']} image(s) of "
                            f"{w['image_size'][0]}x{w['image_size'][1]}")
    slo = ", ".join(f"{k} {v:g} ms" for k, v in w["slo_ms"].items()) or "none"
    return (f"{what}, {w['num_prompts']} requests per point, input {w['input_len']} / output "
            f"{w['output_len']} tokens, repeat {w['repeat']:g}, seed {w['seed']}, SLO {slo}")
