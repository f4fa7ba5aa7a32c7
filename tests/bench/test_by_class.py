"""A trace workload's report per shape class: each class's requests summarized apart, its
ratios and verdicts judged with the rows' in one error budget, the tables and JSON (pure)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench import by_class, report
from epdctl.bench.arms import derive_arms
from epdctl.bench.compare import compare
from epdctl.bench.runner import ArmRun, PointRun
from epdctl.bench.samples import Request, Round, parse_round
from epdctl.bench.tracefile import TraceFile, load_trace
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.topology.model import parse_topology
from epdctl.traces.classes import describe
from epdctl.traces.format import read_trace
from tests.bench.synthetic import make_round

TOPOLOGY = parse_topology({"name": "t", "model": "m", "device": "cpu",
                           "roles": {"encode": {}, "prefill_decode": {}}})
ARMS = derive_arms(TOPOLOGY, Path("t.yaml"))
COUNTS = {"text": 120, "image": 100}


def workload(counts: dict[str, int] = COUNTS) -> Workload:
    trace = TraceFile(Path("/traces/t.jsonl"), "epdctl", sum(counts.values()), 12.5,
                      tuple(counts.items()))
    return Workload(points=(LoadPoint(speed=1.0), LoadPoint(speed=2.0)),
                    slo=(("ttft", 500.0),), trace=trace, num_prompts=trace.requests)


def mixed(rng: random.Random, counts: dict[str, int], scales: dict[str, float]) -> Round:
    """One round of a trace's requests: each class's drawn at its own latency scale."""
    requests: list[Request] = []
    classes: list[str] = []
    for name, n in counts.items():
        requests += make_round(rng, n, scales.get(name, 1.0)).requests
        classes += [name] * n
    # A replay's arrivals are the trace's: its duration, whatever the latencies.
    return Round(5.0, len(requests) / 5.0, tuple(requests), 0, tuple(classes))


def arm_run(index: int, counts: dict[str, int], scales: dict[str, float],
            rounds: int = 4) -> ArmRun:
    """Every round on a start of its own: the between-start spread is measured."""
    points = [PointRun(point, ["python", "-m", "epdctl.bench.replay"], {"completed": 1,
                       "failed": 0}, {}, None, 1.0, round=k,
                       samples=mixed(random.Random(1000 * index + 10 * k + point), counts,
                                     scales),
                       seq=2 * (k * 2 + point) + index, start=k)
              for k in range(rounds) for point in range(2)]
    return ArmRun(ARMS[index], [], [], points, starts=rounds)


def build(counts: dict[str, int] = COUNTS, epd: dict[str, float] | None = None,
          rounds: int = 4) -> dict[str, Any]:
    runs = [arm_run(0, counts, epd or {}, rounds), arm_run(1, counts, {}, rounds)]
    return report.build(runs, workload(counts), [])


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    """epd's image requests 3x slower than the baseline's; its text requests the same."""
    return build(epd={"image": 3.0})


def test_each_row_reports_each_class_with_its_requests(doc: dict[str, Any]) -> None:
    for row in doc["results"]:
        assert [(c["class"], c["n"]) for c in row["classes"]] == [("text", 480),
                                                                   ("image", 400)]
        figures = {c["class"]: c["figures"] for c in row["classes"]}
        for name in ("text", "image"):
            assert figures[name]["ttft_p50_ms_ci"] is not None
            assert figures[name]["request_goodput"] is not None
        # A class's req/s: its share of the point's.
        total = sum(f["request_throughput"] for f in figures.values())
        assert total == pytest.approx(row["figures"]["request_throughput"], rel=0.05)
    epd = next(r for r in doc["results"] if r["arm"] == "epd" and r["point"] == 0)
    ratio = {c["class"]: c["ratios"]["ttft_p50_ms"] for c in epd["classes"]}
    assert ratio["image"] == pytest.approx(3.0, rel=0.2)
    assert ratio["text"] == pytest.approx(1.0, rel=0.2)


def test_a_class_of_its_own_gets_its_own_verdict(doc: dict[str, Any]) -> None:
    """The point's verdict mixes both classes; the image class's says where epd loses."""
    by = {(v["point"], v.get("class")): v for v in doc["verdicts"]}
    assert set(by) == {(p, c) for p in (0, 1) for c in (None, "text", "image")}
    for point in (0, 1):
        image, text = by[(point, "image")], by[(point, "text")]
        assert image["kind"] == "worse", image["text"]
        assert image["figures"]["ttft_p50_ms"]["side"] == "worse"
        assert text["kind"] != "worse", text["text"]
        assert text["figures"]["ttft_p50_ms"]["side"] != "worse"


def test_every_class_ratio_counts_in_the_one_error_budget(doc: dict[str, Any]) -> None:
    """Bonferroni over all of them: the level each interval is taken at is 1 - 0.05 / m,
    with m counting the classes' ratios too."""
    judged = [v for v in doc["verdicts"] if v["kind"] != "none"]
    levels = {v["level"] for v in judged}
    assert len(levels) == 1
    tests = sum(len(v["figures"]) for v in judged)
    assert levels.pop() == pytest.approx(1 - 0.05 / tests, abs=1e-5)
    alone = json.loads(json.dumps(doc))  # the same rows without their classes
    for row in alone["results"]:
        for x in row["rounds"]:
            x["samples"].pop("classes")
    plain = report.finish(alone, 0)
    assert all("class" not in v for v in plain["verdicts"])
    # Fewer ratios, a looser level each: the classes' made every interval wider.
    assert plain["verdicts"][0]["level"] < doc["verdicts"][0]["level"]


def test_a_class_of_too_few_requests_is_shown_but_not_judged() -> None:
    small = build({"text": 120, "video": 5}, rounds=1)
    row = small["results"][0]
    assert [(c["class"], c["n"]) for c in row["classes"]] == [("text", 120), ("video", 5)]
    video = [v for v in small["verdicts"] if v.get("class") == "video"]
    assert [(v["kind"], v["decided"]) for v in video] == [("none", False)] * 2
    assert video[0]["text"] == ("`epd` vs `aggregated`: not judged, 5 request(s) of this "
                                f"class, {by_class.MIN_REQUESTS} needed")
    judged = [v for v in small["verdicts"] if v["kind"] != "none"]
    tests = sum(len(v["figures"]) for v in judged)
    assert judged[0]["level"] == pytest.approx(1 - 0.05 / tests, abs=1e-5)


def test_one_class_adds_no_verdict_of_its_own() -> None:
    """A Mooncake trace is all text: its class is the point, judged once."""
    only = build({"text": 120}, rounds=1)
    assert [c["class"] for c in only["results"][0]["classes"]] == ["text"]
    assert all("class" not in v for v in only["verdicts"]) and len(only["verdicts"]) == 2


def test_markdown_and_tables_give_the_classes(doc: dict[str, Any]) -> None:
    rows = report.class_rows(doc)
    assert rows[0] == ["load", "class", "arm", "requests", "req/s", "goodput", "TTFT p50",
                       "TTFT p90", "TPOT", "x ref"]
    assert [r[:4] for r in rows[1:5]] == [["speed 1x", "text", "epd", "480"],
                                          ["speed 1x", "text", "aggregated", "480"],
                                          ["speed 1x", "image", "epd", "400"],
                                          ["speed 1x", "image", "aggregated", "400"]]
    text = report.markdown(doc)
    assert "## Per shape class" in text
    assert "| speed 2x | image | epd | 400 |" in text
    assert "- speed 1x, class image: `aggregated` is better than `epd` here:" in text
    assert ("- workload: trace /traces/t.jsonl (epdctl, 220 requests over 12.5 s: text 120, "
            "image 100), each at speed 1x, speed 2x, seed 0, SLO ttft 500 ms") in text


def test_without_classes_no_class_table(doc: dict[str, Any]) -> None:
    """Samples without classes (`vllm bench serve`'s): the report is as it always was."""
    plain = json.loads(json.dumps(doc))
    for row in plain["results"]:
        del row["classes"]
    assert report.class_rows(plain) == [report.class_rows(doc)[0]]
    assert "Per shape class" not in report.markdown(plain)


def test_compare_of_two_saved_trace_reports_keeps_the_classes(doc: dict[str, Any]) -> None:
    saved = json.loads(json.dumps(doc))
    both = compare(saved, json.loads(json.dumps(doc)), arms=("epd",))
    assert [[c["n"] for c in r["classes"]] for r in both["results"]] == [[480, 400]] * 4
    later = [v for v in both["verdicts"] if v.get("class")]
    assert {v["kind"] for v in later} <= {"on_par", "undecided"}  # a run against itself


def test_a_trace_workload_in_json() -> None:
    data = workload().as_json()
    assert data["kind"] == "trace"
    assert data["trace"] == {"file": "/traces/t.jsonl", "kind": "epdctl", "requests": 220,
                             "duration_s": 12.5, "classes": COUNTS, "limit": 10_000}
    assert [(p["label"], p["speed"], p["requests"], p["classes"]) for p in data["points"]] == [
        ("speed 1x", 1.0, 220, COUNTS), ("speed 2x", 2.0, 220, COUNTS)]
    mix = Workload(points=(LoadPoint(2.0), LoadPoint(4.0)), num_prompts=10,
                   mix=(("text", 0.4), ("image2", 0.6))).as_json()
    assert (mix["kind"], mix["mix"]) == ("mix", {"text": 0.4, "image2": 0.6})
    assert [p["classes"] for p in mix["points"]] == [{"text": 4, "image2": 6}] * 2
    assert "trace" not in Workload(points=(LoadPoint(),)).as_json()


def test_samples_keep_each_requests_class_through_failures_and_saving() -> None:
    data = {"ttfts": [0.1, 0.2, 0.3], "itls": [[0.01], [], [0.02]],
            "latencies": [0.2, 0.2, 0.5], "output_lens": [2, 0, 2],
            "errors": ["", "HTTP 500", ""], "duration": 1.0, "failed": 1,
            "classes": ["text", "image", "video"]}
    round_ = parse_round(data)
    assert round_.classes == ("text", "video")  # the failed image request is out
    assert Round.from_json(json.loads(json.dumps(round_.as_json()))) == round_
    video = round_.of_class("video")
    assert (video.requests, video.classes) == (round_.requests[1:], ("video",))
    assert video.request_throughput == pytest.approx(round_.request_throughput / 2)
    assert "classes" not in parse_round({**data, "classes": None}).as_json()


def test_the_trace_file_summary(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2}\n'
                    '{"timestamp": 2000, "input_length": 3, "output_length": 4, '
                    '"media": [{"type": "image"}]}\n'
                    '{"timestamp": 500, "input_length": 1, "output_length": 1}\n')
    trace = load_trace(path)
    assert (trace.kind, trace.requests, trace.duration_s, trace.classes, trace.lengths) == (
        "epdctl", 3, 2.0, (("text", 2), ("image", 1)), (7, 2, 7))
    assert describe(read_trace(path).requests) == "3 requests over 2.0 s: text 2, image 1"


def test_until_significant_waits_for_the_points_verdicts_not_the_classes() -> None:
    point = {"decided": True}
    assert not report.is_undecided({"verdicts": [point, {"decided": False, "class": "video"}]})
    assert report.is_undecided({"verdicts": [{"decided": False}, point]})
