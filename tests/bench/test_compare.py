"""`bench compare`: two saved reports, arm by arm, B over A."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench.compare import compare, load
from epdctl.errors import BenchError
from tests.bench.test_report import doc, figures


def saved(tmp_path: Path, name: str, scales: tuple[float, float],
          rounds: int = 3) -> dict[str, Any]:
    """A run of `rounds` rounds, every arm brought up once a round."""
    d = doc([figures(2.0, 100.0)] * 2, [figures(2.0, 100.0)] * 2, scales=scales, rounds=rounds)
    (tmp_path / name).mkdir()
    (tmp_path / name / "report.json").write_text(json.dumps(d))
    return load(tmp_path / name)  # a directory means its report.json


def test_a_regression_shows_as_the_earlier_run_being_better(tmp_path: Path) -> None:
    a = saved(tmp_path, "a", (1.0, 1.0))
    b = saved(tmp_path, "b", (1.6, 1.0))  # epd got slower at the first load point
    out = compare(a, b)
    assert [r["arm"] for r in out["results"]] == ["A:epd", "B:epd", "A:aggregated",
                                                  "B:aggregated"] * 2
    assert [(v["arm"], v["reference"], v["point"]) for v in out["verdicts"]] == [
        ("B:epd", "A:epd", 0), ("B:aggregated", "A:aggregated", 0),
        ("B:epd", "A:epd", 1), ("B:aggregated", "A:aggregated", 1)]
    first = out["verdicts"][0]
    assert first["kind"] == "worse"
    assert first["text"].startswith("`A:epd` is better than `B:epd` here: goodput 0.")
    # Same samples on both sides: nothing to call.
    for v in out["verdicts"][1:]:
        assert v["kind"] in ("undecided", "on_par") and "no significant difference" in v["text"]
        assert {f["ratio"] for f in v["figures"].values()} == {1.0}
    b_row = out["results"][1]
    assert b_row["vs"] == "A:epd" and b_row["ratios"]["ttft_p90_ms"] > 1.3
    assert b_row["figures"]["ttft_p50_ms_ci"] is not None


def test_two_runs_of_one_start_per_arm_give_figures_and_no_verdict(tmp_path: Path) -> None:
    """Each run brought each arm up once: nothing measured how far one start lands from the
    next, so even a 1.6x slowdown is figures only."""
    out = compare(saved(tmp_path, "a", (1.0, 1.0), rounds=1),
                  saved(tmp_path, "b", (1.6, 1.0), rounds=1))
    for v in out["verdicts"]:
        assert (v["kind"], v["reason"]) == ("undecided", "one start per arm"), v
        assert "better" not in v["text"] and "worse" not in v["text"]
    assert out["verdicts"][0]["text"].startswith(
        "`B:epd` vs `A:epd`: undecided (one start per arm); figures only, not a verdict: "
        "goodput 0.")
    assert out["results"][1]["ratios"]["ttft_p90_ms"] > 1.3  # the figures are all there


def test_only_the_arms_asked_for(tmp_path: Path) -> None:
    a, b = saved(tmp_path, "a", (1.0, 1.0)), saved(tmp_path, "b", (1.0, 1.0))
    out = compare(a, b, arms=("aggregated",))
    assert {r["arm"] for r in out["results"]} == {"A:aggregated", "B:aggregated"}
    with pytest.raises(BenchError, match=r"no arm `tp` in both runs \(both have: epd, "
                                         r"aggregated\)"):
        compare(a, b, arms=("tp",))


def test_other_load_points_are_refused(tmp_path: Path) -> None:
    a, b = saved(tmp_path, "a", (1.0, 1.0)), saved(tmp_path, "b", (1.0, 1.0))
    b["workload"]["points"][1]["label"] = "8 req/s"
    with pytest.raises(BenchError, match="the two runs have other load points"):
        compare(a, b)


def test_a_report_without_samples_or_no_report(tmp_path: Path) -> None:
    a = saved(tmp_path, "a", (1.0, 1.0))
    for row in a["results"]:
        for x in row["rounds"]:
            x["samples"] = None
    (tmp_path / "old.json").write_text(json.dumps(a))
    with pytest.raises(BenchError, match="no per-request samples for `epd`"):
        load(tmp_path / "old.json")
    (tmp_path / "junk.json").write_text("[]")
    with pytest.raises(BenchError, match="not a bench report"):
        load(tmp_path / "junk.json")
    with pytest.raises(BenchError, match="not a bench report"):
        load(tmp_path / "missing.json")
