"""`bench compare`: two saved reports, arm by arm, the later over the earlier (pure)."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epdctl.bench.report import finish
from epdctl.errors import BenchError


def load(path: Path) -> dict[str, Any]:
    """A report.json `bench --out` (or `--json`) wrote; a directory means its report.json."""
    file = path / "report.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{file}: not a bench report ({exc})") from None
    if not isinstance(doc, dict) or not {"workload", "results", "arms"} <= set(doc):
        raise BenchError(f"{file}: not a bench report (no workload, arms and results)")
    bad = [r["arm"] for r in doc["results"]
           if not r.get("rounds") or any(x.get("samples") is None for x in r["rounds"])]
    if bad:
        raise BenchError(f"{file}: no per-request samples for `{bad[0]}` (a report from "
                         "before `bench --rounds`); run that bench again to compare it")
    return doc


def compare(a: Mapping[str, Any], b: Mapping[str, Any], *, arms: tuple[str, ...] = (),
            labels: tuple[str, str] = ("A", "B")) -> dict[str, Any]:
    """Each arm of both (or of `arms`) at each load point: B's over A's, with intervals."""
    points_a = [p["label"] for p in a["workload"]["points"]]
    points_b = [p["label"] for p in b["workload"]["points"]]
    if points_a != points_b:
        raise BenchError(f"the two runs have other load points ({', '.join(points_a)} vs "
                         f"{', '.join(points_b)}); compare runs of the same sweep")
    names_a = [x["name"] for x in a["arms"]]
    names_b = {x["name"] for x in b["arms"]}
    common = [n for n in names_a if n in names_b]
    wanted = list(arms) or common
    missing = [n for n in wanted if n not in common]
    if missing or not wanted:
        raise BenchError(f"no arm `{missing[0] if missing else '-'}` in both runs "
                         f"(both have: {', '.join(common) or 'none'})")
    la, lb = labels
    rows = []
    for index in range(len(points_a)):
        for name in wanted:
            for doc, label in ((a, la), (b, lb)):
                r = next(copy.deepcopy(x) for x in doc["results"]
                         if x["arm"] == name and x["point"] == index)
                r["arm"] = f"{label}:{name}"
                if doc is b:
                    r["vs"] = f"{la}:{name}"
                rows.append(r)
    notes = [f"{k}: {a['workload'][k]} vs {b['workload'][k]}" for k in a["workload"]
             if k != "points" and a["workload"].get(k) != b["workload"].get(k)]
    out = {"compare": {la: a.get("command"), lb: b.get("command")},
           "versions": {la: [a.get("epdctl_version"), a.get("vllm_version")],
                        lb: [b.get("epdctl_version"), b.get("vllm_version")]},
           "devices": list(a.get("devices") or []), "workload": a["workload"],
           "workload_differences": notes,
           "arms": [{"name": f"{lab}:{n}", "topology": x["topology"], "mode": x["mode"],
                     "hash": x["hash"]} for n in wanted for lab, d in ((la, a), (lb, b))
                    for x in d["arms"] if x["name"] == n],
           "reference": None, "rounds": max(a.get("rounds") or 1, b.get("rounds") or 1),
           "results": rows}
    return finish(out, int(a["workload"].get("seed") or 0))
