"""The bench report: figures per arm and load point, ratios to the baseline, verdicts, the
greedy subset compared across arms; as a JSON document and as markdown."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from epdctl.bench import by_class
from epdctl.bench.arms import Arm
from epdctl.bench.estimates import FIGURES, Summary, summarize
from epdctl.bench.runner import ArmRun, PointRun
from epdctl.bench.samples import Round
from epdctl.bench.verdicts import TOO_FEW, Comparison, judge
from epdctl.bench.workload import Workload
from epdctl.verifier.prompts import Prompt

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
COUNTS = ("completed", "failed")


def topology_hash(arm: Arm) -> str:
    """sha256 of the arm's validated topology (derived arms included), 16 hex digits."""
    text = json.dumps(arm.topology.model_dump(mode="json"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reference(runs: Sequence[ArmRun], name: str | None = None) -> ArmRun | None:
    """What ratios are taken against: the arm `name` (`--reference`), else the baseline arm,
    else the first when there are more."""
    for run in runs:
        if run.arm.name == name if name else run.arm.kind == "baseline":
            return run
    return runs[0] if len(runs) > 1 and not name else None


def ratios(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in RATIOS:
        a, b = mine.get(key), theirs.get(key)
        out[key] = round(a / b, 4) if isinstance(a, int | float) and b else None
    return out


def _sum(values: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Counters added over rounds; a mean (`*_mean_ms`) averaged."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    out: dict[str, Any] = {}
    for key in present[0]:
        got = [v[key] for v in present if v.get(key) is not None]
        if not got:
            out[key] = None
        elif key.endswith("_mean_ms"):
            out[key] = round(sum(got) / len(got), 3)
        else:
            out[key] = sum(got)
    return out


def _pooled(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """vLLM's figures over rounds: counts added, the rest averaged."""
    out: dict[str, Any] = {}
    for key in rounds[0]["figures"]:
        got = [r["figures"][key] for r in rounds if r["figures"].get(key) is not None]
        out[key] = None if not got else sum(got) if key in COUNTS else sum(got) / len(got)
    return out


def point_row(arm: str, index: int, label: str, points: Sequence[PointRun]) -> dict[str, Any]:
    """One arm at one load point, every round of it kept (figures are filled in later)."""
    rounds: list[dict[str, Any]] = [
        {"round": p.round, "seq": p.seq, "start": p.start, "figures": p.figures,
         "proxy": p.proxy,
         "store": p.store, "elapsed_s": round(p.elapsed_s, 2), "argv": p.argv,
         "samples": p.samples.as_json() if p.samples is not None else None}
        for p in sorted(points, key=lambda p: p.round)]
    return {"arm": arm, "point": index, "load": label, "rounds": rounds,
            "proxy": _sum([r["proxy"] for r in rounds]),
            "store": _sum([r["store"] for r in rounds]),
            "elapsed_s": round(sum(p.elapsed_s for p in points), 2), "argv": rounds[0]["argv"]}


def summary_of(r: Mapping[str, Any], has_slo: bool, seed: int) -> Summary | None:
    """The row's estimates and intervals from its rounds' samples (None: none saved)."""
    if any(x.get("samples") is None for x in r["rounds"]):
        return None
    # A report from before starts were recorded: its rounds count as one start (the
    # cautious reading: nothing then measured how far one start lands from the next).
    return summarize([Round.from_json(x["samples"]) for x in r["rounds"]], has_slo, seed,
                     starts=[int(x.get("start") or 0) for x in r["rounds"]])


def finish(doc: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Figures with their intervals, ratios and verdicts, from the rows' rounds (shared by
    `bench` and `bench compare`)."""
    has_slo = bool(doc["workload"]["slo_ms"])
    summaries: dict[tuple[str, int], Summary | None] = {}
    classes: dict[tuple[str, int], dict[str, Summary]] = {}
    for number, r in enumerate(doc["results"]):
        summary = summaries[(r["arm"], r["point"])] = summary_of(r, has_slo, seed + number)
        per_class = classes[(r["arm"], r["point"])] = by_class.summaries(
            r, has_slo, seed + by_class.SEEDS * (number + 1))
        if per_class:
            r["classes"] = by_class.rows(per_class)
        figures = _pooled(r["rounds"])
        r["unsupported"] = {}
        if summary is not None:
            for name in FIGURES:
                figures[name] = summary.estimate[name]
                ci = summary.ci[name]
                figures[f"{name}_ci"] = [round(ci[0], 4), round(ci[1], 4)] if ci else None
            r["unsupported"] = dict(summary.unsupported)
            if "tpot_mean_ms" in summary.unsupported:  # one chunk: no inter-token latency
                figures["itl_p99_ms"] = figures["tpot_p90_ms"] = None
        r["figures"], r["n"] = figures, summary.n if summary else figures.get("completed")
    by_key = {(r["arm"], r["point"]): r for r in doc["results"]}
    comparisons: list[Comparison] = []
    shaped: list[Comparison] = []  # per class
    unjudged: list[dict[str, Any]] = []  # classes of too few requests
    for r in doc["results"]:
        ref = r.get("vs", doc.get("reference"))
        theirs = by_key.get((ref, r["point"])) if ref and r["arm"] != ref else None
        r["ratios"] = ratios(r["figures"], theirs["figures"]) if theirs else None
        if theirs is not None:
            by_class.add_ratios(r, theirs)
        mine_s, theirs_s = summaries[(r["arm"], r["point"])], \
            summaries.get((ref, r["point"])) if theirs else None
        if theirs is not None and mine_s is not None and theirs_s is not None:
            failed = {n: f["figures"]["failed"] for n, f in ((r["arm"], r), (ref, theirs))
                      if f["figures"].get("failed")}
            comparisons.append(Comparison(r["point"], r["load"], r["arm"], str(ref), mine_s,
                                          theirs_s, failed))
            judged, skipped = by_class.comparisons(
                comparisons[-1], classes[(r["arm"], r["point"])], classes[(str(ref), r["point"])])
            shaped += judged
            unjudged += skipped
    # The classes' ratios share the rows' error budget: one judge over all of them.
    doc["verdicts"] = judge(comparisons + shaped, has_slo)
    by_class.label(doc["verdicts"], comparisons + shaped)
    doc["verdicts"] += unjudged
    doc["failed_requests"] = sum(int(r["figures"].get("failed") or 0) for r in doc["results"])
    return doc


def is_undecided(doc: Mapping[str, Any]) -> bool:
    """Whether a load point's verdict is still undecided (--until-significant); a shape
    class's is not waited for: a rare class may never have the requests to decide, nor is
    one of too few requests a round (more rounds of one request give no interval)."""
    return any(not v["decided"] for v in doc["verdicts"]
               if not v.get("class") and v.get("reason") != TOO_FEW)


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


def notes(runs: Sequence[ArmRun]) -> list[str]:
    """What differs between arms besides their layout and may show in the figures."""
    logging = [r.arm.name for r in runs if r.arm.topology.engine.log_requests]
    if not logging or len(logging) == len(runs):
        return []
    quiet = [r.arm.name for r in runs if r.arm.name not in logging]
    return [f"{', '.join(f'`{n}`' for n in logging)} "
            f"{'logs' if len(logging) == 1 else 'log'} every request "
            f"(engine.log_requests) and {', '.join(f'`{n}`' for n in quiet)} "
            f"{'does' if len(quiet) == 1 else 'do'} not: its cost is in the figures of "
            f"{'that arm' if len(logging) == 1 else 'those arms'}"]


def build(runs: Sequence[ArmRun], workload: Workload, prompts: Sequence[Prompt],
          reference_name: str | None = None, **meta: Any) -> dict[str, Any]:
    """The `bench --json` document (and report.json); ratios and verdicts against the arm
    `reference_name` where given."""
    ref = reference(runs, reference_name)
    rows = [point_row(run.arm.name, index, point.label,
                      [p for p in run.points if p.index == index])
            for index, point in enumerate(workload.points) for run in runs]
    order = sorted((p.seq, p.round, run.arm.name, p.index) for run in runs for p in run.points)
    check = correctness(runs, prompts)
    arms = [{"name": r.arm.name, "kind": r.arm.kind, "topology": r.arm.topology.name,
             "file": str(r.arm.path), "mode": r.arm.topology.mode, "hash": topology_hash(r.arm),
             "instances": r.instances, "notes": list(r.arm.notes), "starts": r.starts}
            for r in runs]
    doc = {**meta, "workload": workload.as_json(), "arms": arms, "notes": notes(runs),
           "reference": ref.arm.name if ref else None,
           "rounds": max((p.round + 1 for r in runs for p in r.points), default=0),
           "order": [{"round": rnd, "arm": arm, "point": i} for _, rnd, arm, i in order],
           "results": rows, "correctness": check, "ok": check["ok"]}
    return finish(doc, workload.seed)


def cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def figure_cell(r: Mapping[str, Any], key: str, fmt: str) -> str:
    """The figure, `±` half its 95 % interval; `n<100` / `n/a` where it cannot be shown."""
    why = (r.get("unsupported") or {}).get(key)
    if why:
        return str(why)
    value, ci = r["figures"].get(key), r["figures"].get(f"{key}_ci")
    if value is None or not ci:
        return cell(value, fmt)
    return f"{fmt.format(value)}±{fmt.format((ci[1] - ci[0]) / 2)}"


def table_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """Header and one row per arm and load point (shared by the terminal and markdown)."""
    has_store = any(r["store"] is not None for r in doc["results"])
    header = ["load", "arm", *(h for h, _ in COLUMNS.values()), "encode ms", "fallbacks"]
    header += ["store hits"] * has_store + ["x ref"]
    rows = [header]
    key = "request_goodput" if doc["workload"]["slo_ms"] else "request_throughput"
    for r in doc["results"]:
        proxy = r["proxy"] or {}
        row = [r["load"], r["arm"], *(figure_cell(r, k, fmt) for k, (_, fmt) in COLUMNS.items()),
               cell(proxy.get("encode_mean_ms"), "{:.1f}"), cell(proxy.get("fallbacks"), "{}")]
        if has_store:
            row.append(cell((r["store"] or {}).get("hits"), "{}"))
        ratio = (r["ratios"] or {}).get(key)
        row.append(cell(ratio, "{:.2f}x"))
        rows.append(row)
    return rows


# A shape class's columns: the figures its requests alone support.
CLASS_COLUMNS = {"request_throughput": ("req/s", "{:.2f}"),
                 "request_goodput": ("goodput", "{:.2f}"),
                 "ttft_p50_ms": ("TTFT p50", "{:.0f}"), "ttft_p90_ms": ("TTFT p90", "{:.0f}"),
                 "tpot_mean_ms": ("TPOT", "{:.1f}")}


def class_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """A trace's per shape class table: header, then per load point, class and arm (only
    the header: no classes)."""
    rows = [["load", "class", "arm", "requests", *(h for h, _ in CLASS_COLUMNS.values()),
             "x ref"]]
    key = "request_goodput" if doc["workload"]["slo_ms"] else "request_throughput"
    for point in sorted({r["point"] for r in doc["results"]}):
        results = [r for r in doc["results"] if r["point"] == point and r.get("classes")]
        names = list(dict.fromkeys(c["class"] for r in results for c in r["classes"]))
        for name in names:
            for r in results:
                c = next((c for c in r["classes"] if c["class"] == name), None)
                if c is not None:
                    rows.append([r["load"], name, r["arm"], str(c["n"]),
                                 *(figure_cell(c, k, fmt) for k, (_, fmt) in
                                   CLASS_COLUMNS.items()),
                                 cell((c["ratios"] or {}).get(key), "{:.2f}x")])
    return rows


def verdict_line(v: Mapping[str, Any]) -> str:
    """`load: text`, or `load, class NAME: text` for a shape class's."""
    where = f"{v['load']}, class {v['class']}" if v.get("class") else v["load"]
    return f"{where}: {v['text']}"


def markdown(doc: Mapping[str, Any]) -> str:
    """report.md: the table, the verdicts, the correctness check and what makes it repeatable."""
    rows = table_rows(doc)
    lines = ["# epdctl bench", ""]
    lines += [f"- vLLM {doc.get('vllm_version')}, epdctl {doc.get('epdctl_version')}; devices: "
              f"{', '.join(doc.get('devices') or ['-'])}",
              "- arms: " + "; ".join(f"`{a['name']}` = {a['topology']} ({a['mode']}, "
                                       f"{a['hash']})" for a in doc["arms"]),
              f"- workload: {workload_line(doc['workload'])}",
              f"- {order_line(doc)}", *(f"- note: {n}" for n in doc.get("notes") or []), "",
              method_line(doc), ""]
    lines.append("| " + " | ".join(rows[0]) + " |")
    lines.append("|" + "|".join("---" for _ in rows[0]) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    shaped = class_rows(doc)
    if len(shaped) > 1:
        lines += ["", "## Per shape class", "", "Each class's requests alone; req/s and "
                  "goodput are theirs per second of the run.", ""]
        lines.append("| " + " | ".join(shaped[0]) + " |")
        lines.append("|" + "|".join("---" for _ in shaped[0]) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in shaped[1:]]
    if doc["verdicts"]:
        lines += ["", "## Verdicts", ""]
        lines += [f"- {verdict_line(v)}" for v in doc["verdicts"]]
    check = doc.get("correctness") or {"ok": False, "prompts": [], "mismatches": []}
    lines += ["", "## Greedy subset", ""] if check["prompts"] else []
    if check["ok"]:
        lines.append(f"{len(check['prompts'])} prompts: every arm answered as "
                     f"`{check['reference']}` did.")
    for m in check["mismatches"]:
        lines.append(f"- MISMATCH `{m['arm']}`, {m['prompt']}: {m['got']!r} vs {m['expected']!r}"
                     + (f" ({m['error']})" if m["error"] else ""))
    lines += ["", "## Commands", ""]
    lines += [f"- `{r['arm']}`, {r['load']}, round {x['round'] + 1}: `{' '.join(x['argv'])}`"
              for r in doc["results"] for x in r["rounds"]]
    return "\n".join(lines) + "\n"


def order_line(doc: Mapping[str, Any]) -> str:
    """How the arms took turns: `2 rounds: epd aggregated | aggregated epd`."""
    turns: dict[int, list[str]] = {}
    for step in doc.get("order") or []:
        names = turns.setdefault(step["round"], [])
        if not names or names[-1] != step["arm"]:
            names.append(step["arm"])
    warmup = (doc.get("plan") or {}).get("warmup")
    shown = " | ".join(" ".join(t) for t in turns.values())
    extra = f"; {warmup} warm-up requests after each start, not counted" if warmup else ""
    return f"{len(turns)} round(s), arms in turn: {shown}{extra}"


def method_line(doc: Mapping[str, Any]) -> str:
    ref = doc.get("reference") or "-"
    over = "rounds and requests" if (doc.get("rounds") or 0) >= 3 else "requests"
    return ("Latencies in ms; throughput per second; `±` is half the 95 % bootstrap interval "
            f"(over {over}); `n<N`: a percentile that needs N requests; `n/a`: outputs of one "
            f"chunk have no TPOT. `x ref` is goodput (or req/s without an SLO) over `{ref}`'s. "
            "A verdict needs a ratio's interval (at 95 % over all the ratios judged, and "
            "over how far one start of an arm lands from the next) wholly outside 5 % of 1; "
            "with one start per arm that spread is not measured: figures only, no verdict.")


def workload_line(w: Mapping[str, Any]) -> str:
    """A workload's JSON (Workload.as_json) in one line (bench's and tune's reports)."""
    slo = ", ".join(f"{k} {v:g} ms" for k, v in w["slo_ms"].items()) or "none"
    if w.get("trace") or w.get("mix"):
        return f"{_trace_line(w)}, seed {w['seed']}, SLO {slo}"
    what = w["dataset"] or (f"{w['kind']}, {w['images']} image(s) of "
                            f"{w['image_size'][0]}x{w['image_size'][1]}")
    if not w["dataset"] and w.get("audios"):
        what = f"{w['kind']}, {w['audios']} clip(s) of generated audio"
    count = f"{w['num_prompts']} requests per point"
    if w.get("point_seconds"):  # a report of an older epdctl has none
        count = (f"{w['num_prompts']} requests per point or a rate's {w['point_seconds']:g} s "
                 "of them if more")
    return (f"{what}, {count}, input {w['input_len']} / output {w['output_len']} tokens, "
            f"repeat {w['repeat']:g}, seed {w['seed']}, SLO {slo}")


def _trace_line(w: Mapping[str, Any]) -> str:
    """`trace FILE (epdctl, 300 requests over 60 s: text 120, image 180), each at speed 1x,
    speed 2x`, or `mix text:0.4, image:0.6 (...)`."""
    speeds = ", ".join(p["label"] for p in w["points"])
    if w.get("trace"):
        t = w["trace"]
        classes = ", ".join(f"{name} {n}" for name, n in t["classes"].items())
        return (f"trace {t['file']} ({t['kind']}, {t['requests']} requests over "
                f"{t['duration_s']:g} s: {classes}), each at {speeds}")
    shares = ", ".join(f"{name}:{share:.3g}" for name, share in w["mix"].items())
    width, height = w["image_size"]
    return (f"mix {shares} (input {w['input_len']} / output {w['output_len']} tokens, images "
            f"{width}x{height}, videos of {w['video_frames']} frames; streamed), "
            f"{w['num_prompts']} requests per point, Poisson at {speeds}")
