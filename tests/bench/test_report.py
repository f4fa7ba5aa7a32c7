"""The report: ratios to the baseline, verdicts, the greedy check, markdown, plot.png."""

from __future__ import annotations

import random
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench import plot, report
from epdctl.bench.arms import derive_arms
from epdctl.bench.runner import ArmRun, PointRun
from epdctl.bench.samples import Round
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.errors import BenchError
from epdctl.topology.model import parse_topology
from epdctl.verifier.prompts import PROMPTS, ChatAnswer
from tests.bench.synthetic import make_round

TOPOLOGY = parse_topology({"name": "t", "model": "m", "device": "cpu",
                           "roles": {"encode": {}, "prefill_decode": {}}})
ARMS = derive_arms(TOPOLOGY, Path("t.yaml"))
WORKLOAD = Workload(points=(LoadPoint(1.0), LoadPoint(4.0)), slo=(("ttft", 500.0),))
PROMPTS2 = PROMPTS[:2]


def figures(goodput: float, ttft: float, failed: int = 0) -> dict[str, Any]:
    return {"completed": 10 - failed, "failed": failed, "duration_s": 5.0,
            "request_throughput": goodput + 0.5, "output_throughput": 100.0,
            "request_goodput": goodput, "ttft_p50_ms": ttft / 2, "ttft_p90_ms": ttft,
            "ttft_p99_ms": ttft * 1.5, "tpot_mean_ms": 10.0, "tpot_p90_ms": 12.0,
            "itl_p99_ms": 20.0, "e2el_p90_ms": 400.0}


def samples(seed: int, scale: float, n: int = 200, chunked: bool = True) -> Round:
    return make_round(random.Random(seed), n, scale, chunked)


def arm_run(index: int, points: list[dict[str, Any]], texts: list[str | None],
            scales: tuple[float, ...] = (1.0, 1.0), chunked: bool = True,
            rounds: int = 1) -> ArmRun:
    """`rounds` rounds of `points`, each round on a start of its own that landed where the
    others did."""
    store = {"saves": 5, "hits": 8, "misses": 0, "keys_hit": 5, "repeat_hits": 3,
             "load_failures": 0} if index == 0 else None
    runs = [PointRun(i, ["vllm", "bench", "serve", "--seed", str(i)], f,
                     {"encode_mean_ms": 12.5 if index == 0 else None, "fallbacks": 0,
                      "retries": 0, "requests_ok": 10, "requests_failed": 0}, store, 3.0,
                     round=r, samples=samples(100 * index + i + 1000 * r, scales[i],
                                              chunked=chunked),
                     seq=100 * r + 2 * i + index, start=r)
            for r in range(rounds) for i, f in enumerate(points)]
    greedy = [ChatAnswer(t, 0.1, None if t is not None else "HTTP 500: boom") for t in texts]
    return ArmRun(ARMS[index], [{"name": "pd-0", "role": "prefill_decode", "gpus": []}],
                  greedy, runs, starts=rounds)


def doc(epd: list[dict[str, Any]], agg: list[dict[str, Any]],
        texts: tuple[list[str | None], list[str | None]] = (["a", "b"], ["a", "b"]),
        scales: tuple[float, ...] = (1.0, 1.0), chunked: bool = True,
        rounds: int = 1) -> dict[str, Any]:
    runs = [arm_run(0, epd, texts[0], scales, chunked, rounds),
            arm_run(1, agg, texts[1], (1.0, 1.0), chunked, rounds)]
    return report.build(runs, WORKLOAD, PROMPTS2, vllm_version="0.32.0",
                        epdctl_version="0.1.0", devices=["cpu"])


def test_ratios_and_verdicts_against_the_baseline() -> None:
    """epd at half the latency at the first point, the same at the second."""
    d = doc([figures(4.0, 100.0), figures(2.0, 300.0)], [figures(2.0, 200.0), figures(2.0, 300.0)],
            scales=(0.5, 1.0), rounds=3)
    assert d["reference"] == "aggregated"
    epd0 = d["results"][0]
    assert epd0["arm"] == "epd" and 1.8 < epd0["ratios"]["request_throughput"] < 2.3
    assert epd0["ratios"]["request_goodput"] > 2  # and more of them within the TTFT SLO
    assert 0.4 < epd0["ratios"]["ttft_p90_ms"] < 0.6
    assert d["results"][1]["ratios"] is None  # the baseline itself
    first, second = d["verdicts"]
    assert first["kind"] == "better" and first["decided"]
    assert first["text"].startswith("`epd` is better than `aggregated` here: goodput 2.")
    assert re.search(r"; TTFT p50 0\.\d\dx \[0\.\d\d, 0\.\d\d\]; TTFT p90 .*; TPOT 0\.",
                     first["text"])
    assert all(f["side"] == "better" and f["ci"][1] < 0.95 for name, f in first["figures"].items()
               if name != "request_goodput")
    assert second["kind"] in ("undecided", "on_par")
    assert second["text"].startswith("`epd` vs `aggregated`: no significant difference at "
                                     "n=600")
    assert first["starts"] == {"epd": 3, "aggregated": 3} and first["starts_measured"]
    assert first["level"] == second["level"] == 1 - 0.05 / 8  # 4 figures x 2 points judged
    assert d["ok"] is True and d["failed_requests"] == 0
    assert d["correctness"] == {"reference": "epd", "prompts": [p.name for p in PROMPTS2],
                                "ok": True, "mismatches": [],
                                "answers": {"epd": ["a", "b"], "aggregated": ["a", "b"]}}
    assert [a["name"] for a in d["arms"]] == ["epd", "aggregated"]
    assert len({a["hash"] for a in d["arms"]}) == 2


def test_verdict_when_the_baseline_wins_or_requests_fail() -> None:
    d = doc([figures(1.0, 400.0), figures(2.0, 100.0, failed=3)],
            [figures(2.0, 200.0), figures(2.0, 100.0)], scales=(2.0, 1.0), rounds=3)
    assert d["verdicts"][0]["kind"] == "worse"
    assert d["verdicts"][0]["text"].startswith(
        "`aggregated` is better than `epd` here: goodput 0.")
    # 3 failed in each of 3 rounds
    assert d["verdicts"][1]["text"] == "`epd` vs `aggregated`: not comparable (`epd` 9 failed)"
    assert d["verdicts"][1]["decided"] is True
    assert d["failed_requests"] == 9


def test_one_start_per_arm_gives_figures_and_no_verdict() -> None:
    """One round: each arm brought up once. Twice the throughput, half the latency, tight
    intervals over the requests: still no verdict, in the JSON, the text and report.md."""
    d = doc([figures(4.0, 100.0), figures(2.0, 300.0, failed=3)],
            [figures(2.0, 200.0), figures(2.0, 300.0)], scales=(0.5, 1.0))
    first, second = d["verdicts"]
    assert (first["kind"], first["decided"], first["reason"]) == (
        "undecided", False, "one start per arm")
    assert first["starts"] == {"epd": 1, "aggregated": 1} and not first["starts_measured"]
    assert {f["side"] for f in first["figures"].values()} == {"undecided"}
    assert 1.8 < first["figures"]["request_goodput"]["ratio"]  # the figures are still there
    assert re.fullmatch(r"`epd` vs `aggregated`: undecided \(one start per arm\); figures "
                        r"only, not a verdict: goodput \d\.\d\dx \[\d\.\d\d, \d\.\d\d\]; "
                        r"TTFT p50 0\.\d\dx .*; TPOT 0\.\d\dx \[.*\] \(intervals over requests "
                        r"within one start; how far one start of an arm lands from the next is "
                        r"not measured: --rounds 2 or more for a verdict\)", first["text"])
    assert second["kind"] == "not_comparable" and second["reason"] is None
    text = report.markdown(d)
    assert f"- 1 req/s: {first['text']}" in text
    assert "with one start per arm that spread is not measured: figures only, no verdict" in \
        text
    assert not re.search(r"\b(better|worse|on par)\b", text.split("## Verdicts")[1])


def test_one_chunk_outputs_have_no_tpot() -> None:
    d = doc([figures(4.0, 100.0)] * 2, [figures(2.0, 200.0)] * 2, chunked=False)
    row = d["results"][0]
    assert row["unsupported"]["tpot_mean_ms"] == "n/a"
    assert row["figures"]["tpot_mean_ms"] is None and row["figures"]["tpot_mean_ms_ci"] is None
    assert row["figures"]["itl_p99_ms"] is None  # vLLM's 0.0 is not a measurement
    assert "TPOT" not in d["verdicts"][0]["text"]
    table = report.markdown(d)
    assert table.count("| n/a |") == 4


def test_a_greedy_mismatch_is_flagged() -> None:
    d = doc([figures(1.0, 1.0)] * 2, [figures(1.0, 1.0)] * 2, (["a", "b"], ["a", None]))
    assert d["ok"] is False
    assert d["correctness"]["mismatches"] == [{
        "arm": "aggregated", "prompt": PROMPTS2[1].name, "expected": "b", "got": None,
        "error": "HTTP 500: boom"}]
    assert "- MISMATCH `aggregated`, one image: None vs 'b' (HTTP 500: boom)" in \
        report.markdown(d)


def test_markdown_has_every_figure_its_interval_and_the_commands() -> None:
    d = doc([figures(4.0, 100.0)] * 2, [figures(2.0, 200.0)] * 2)
    text = report.markdown(d)
    header = ("| load | arm | done | failed | req/s | tok/s | goodput | TTFT p50 | TTFT p90 | "
              "TTFT p99 | TPOT | ITL p99 | encode ms | fallbacks | store hits | x ref |")
    assert header in text
    row = next(line for line in text.splitlines() if line.startswith("| 1 req/s | epd |"))
    cells = row.strip("| ").split(" | ")
    r = d["results"][0]
    lo, hi = r["figures"]["request_throughput_ci"]
    assert cells[4] == f"{r['figures']['request_throughput']:.2f}±{(hi - lo) / 2:.2f}"
    assert re.fullmatch(r"\d+±\d+", cells[7]) and re.fullmatch(r"\d+±\d+", cells[8])
    assert cells[9] == "n<1000"  # a p99 of 200 requests
    assert re.fullmatch(r"\d+\.\d±\d+\.\d", cells[10])
    assert cells[-3:] == ["0", "8", f"{r['ratios']['request_goodput']:.2f}x"]
    assert "- `epd`, 4 req/s, round 1: `vllm bench serve --seed 1`" in text
    assert "2 prompts: every arm answered as `epd` did." in text
    assert "vLLM 0.32.0, epdctl 0.1.0; devices: cpu" in text
    assert "1 round(s), arms in turn: epd aggregated" in text


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR, after checking the signature and chunk CRC."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:29]
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(kind + body)
    width, height = struct.unpack(">II", body[:8])
    return width, height


def test_plot_is_a_png_that_decodes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    d = doc([figures(4.0, 100.0), figures(3.0, 150.0)], [figures(2.0, 200.0)] * 2)
    series = plot.series(d, "ttft_p90_ms")
    assert [len(v) for v in series.values()] == [2, 2] and None not in series["epd"]
    path = tmp_path / "out" / "plot.png"
    plot.write_plot(d, path)
    width, height = png_size(path)
    assert width > 600 and height > 300
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        image.load()
        assert image.size == (width, height)
        assert len(image.getcolors(1 << 20) or []) > 10  # lines and text, not a blank canvas


def test_without_matplotlib_the_plot_says_how_to_get_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plot, "has_matplotlib", lambda: False)
    with pytest.raises(BenchError, match=r"pip install 'epdctl\[bench\]'"):
        plot.write_plot(doc([figures(1.0, 1.0)] * 2, [figures(1.0, 1.0)] * 2),
                        tmp_path / "plot.png")
    assert not (tmp_path / "plot.png").exists()


def test_an_arm_that_logs_requests_is_noted() -> None:
    quiet = parse_topology({"name": "q", "model": "m", "device": "cpu",
                            "roles": {"encode": {}, "prefill_decode": {}}})
    loud = parse_topology({"name": "l", "model": "m", "device": "cpu",
                           "engine": {"log_requests": True},
                           "roles": {"encode": {}, "prefill_decode": {}}})
    arms = derive_arms(quiet, Path("q.yaml"), "none", [(Path("l.yaml"), loud)])
    runs = [ArmRun(arm) for arm in arms]
    assert report.notes(runs) == ["`l` logs every request (engine.log_requests) and `epd` "
                                  "does not: its cost is in the figures of that arm"]
    assert report.notes(runs[:1]) == []


def test_the_workload_line_says_how_many_requests_a_point_sends() -> None:
    d = doc([figures(4.0, 100.0)] * 2, [figures(2.0, 200.0)] * 2)
    assert "100 requests per point, input" in report.markdown(d)
    d["workload"] = {**d["workload"], "point_seconds": 20.0}
    assert "100 requests per point or a rate's 20 s of them if more, input" in (
        report.markdown(d))
    del d["workload"]["point_seconds"]  # a report.json of an epdctl before the option
    assert "100 requests per point, input" in report.markdown(d)
