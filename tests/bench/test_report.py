"""The report: ratios to the baseline, verdicts, the greedy check, markdown, plot.png."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench import plot, report
from epdctl.bench.arms import derive_arms
from epdctl.bench.runner import ArmRun, PointRun
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.errors import BenchError
from epdctl.topology import parse_topology
from epdctl.verify import PROMPTS, ChatAnswer

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


def arm_run(index: int, points: list[dict[str, Any]], texts: list[str | None]) -> ArmRun:
    store = {"saves": 5, "hits": 8, "misses": 0, "keys_hit": 5, "repeat_hits": 3,
             "load_failures": 0} if index == 0 else None
    runs = [PointRun(i, ["vllm", "bench", "serve", "--seed", str(i)], f,
                     {"encode_mean_ms": 12.5 if index == 0 else None, "fallbacks": 0,
                      "retries": 0, "requests_ok": 10, "requests_failed": 0}, store, 3.0)
            for i, f in enumerate(points)]
    greedy = [ChatAnswer(t, 0.1, None if t is not None else "HTTP 500: boom") for t in texts]
    return ArmRun(ARMS[index], [{"name": "pd-0", "role": "prefill_decode", "gpus": []}],
                  greedy, runs)


def doc(epd: list[dict[str, Any]], agg: list[dict[str, Any]],
        texts: tuple[list[str | None], list[str | None]] = (["a", "b"], ["a", "b"])
        ) -> dict[str, Any]:
    runs = [arm_run(0, epd, texts[0]), arm_run(1, agg, texts[1])]
    return report.build(runs, WORKLOAD, PROMPTS2, vllm_version="0.32.0",
                        epdctl_version="0.1.0", devices=["cpu"])


def test_ratios_and_verdicts_against_the_baseline() -> None:
    d = doc([figures(4.0, 100.0), figures(2.0, 300.0)], [figures(2.0, 200.0), figures(2.0, 300.0)])
    assert d["reference"] == "aggregated"
    epd0 = d["results"][0]
    assert epd0["arm"] == "epd" and epd0["ratios"]["request_goodput"] == 2.0
    assert epd0["ratios"]["ttft_p90_ms"] == 0.5
    assert d["results"][1]["ratios"] is None  # the baseline itself
    assert [v["text"] for v in d["verdicts"]] == [
        "`epd` is better than `aggregated` here: 2.00x goodput, TTFT p90 -50 %",
        "`epd` and `aggregated` are on par (within 5%): 1.00x goodput, TTFT p90 +0 %"]
    assert d["ok"] is True and d["failed_requests"] == 0
    assert d["correctness"] == {"reference": "epd", "prompts": [p.name for p in PROMPTS2],
                                "ok": True, "mismatches": [],
                                "answers": {"epd": ["a", "b"], "aggregated": ["a", "b"]}}
    assert [a["name"] for a in d["arms"]] == ["epd", "aggregated"]
    assert len({a["hash"] for a in d["arms"]}) == 2


def test_verdict_when_the_baseline_wins_or_requests_fail() -> None:
    d = doc([figures(1.0, 400.0), figures(2.0, 100.0, failed=3)],
            [figures(2.0, 200.0), figures(2.0, 100.0)])
    assert d["verdicts"][0]["text"] == (
        "`aggregated` is better than `epd` here: 0.50x goodput, TTFT p90 +100 %")
    assert d["verdicts"][1]["text"] == "`epd` vs `aggregated`: not comparable (`epd` 3 failed)"
    assert d["failed_requests"] == 3


def test_a_greedy_mismatch_is_flagged() -> None:
    d = doc([figures(1.0, 1.0)] * 2, [figures(1.0, 1.0)] * 2, (["a", "b"], ["a", None]))
    assert d["ok"] is False
    assert d["correctness"]["mismatches"] == [{
        "arm": "aggregated", "prompt": PROMPTS2[1].name, "expected": "b", "got": None,
        "error": "HTTP 500: boom"}]
    assert "- MISMATCH `aggregated`, one image: None vs 'b' (HTTP 500: boom)" in \
        report.markdown(d)


def test_markdown_has_every_figure_and_the_commands() -> None:
    d = doc([figures(4.0, 100.0)] * 2, [figures(2.0, 200.0)] * 2)
    text = report.markdown(d)
    header = ("| load | arm | done | failed | req/s | tok/s | goodput | TTFT p50 | TTFT p90 | "
              "TTFT p99 | TPOT | ITL p99 | encode ms | fallbacks | store hits | x ref |")
    assert header in text
    assert ("| 1 req/s | epd | 10 | 0 | 4.50 | 100.0 | 4.00 | 50 | 100 | 150 | 10.0 | 20.0 | "
            "12.5 | 0 | 8 | 2.00x |") in text
    assert "| 1 req/s | aggregated | 10 | 0 | 2.50 | 100.0 | 2.00 | 100 | 200 | 300 |" in text
    assert "- `epd`, 4 req/s: `vllm bench serve --seed 1`" in text
    assert "2 prompts: every arm answered as `epd` did." in text
    assert "vLLM 0.32.0, epdctl 0.1.0; devices: cpu" in text


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
    assert plot.series(d, "ttft_p90_ms") == {"epd": [100.0, 150.0], "aggregated": [200.0, 200.0]}
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
