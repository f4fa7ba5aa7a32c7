"""`epdctl bench` with fake engines, a fake proxy and a fake `vllm bench serve`."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import Result

from tests.conftest import is_running

pytestmark = pytest.mark.timeout(120)
FAKE_BENCH = shlex.join([sys.executable, str(Path(__file__).parents[1] / "fake_bench.py")])
SMALL = ("--max-concurrency", "1,2", "--num-prompts", "5", "--input-len", "8", "--output-len", "4",
         "--rounds", "1")
"""A small workload in one round (the default, 2, is tested in test_bench_verdicts.py)."""

Bench = Callable[..., Result]


@pytest.fixture
def bench(epdctl: Callable[..., Result]) -> Bench:
    def invoke(*args: str, command: str = FAKE_BENCH) -> Result:
        return epdctl("bench", *args, env={"EPDCTL_BENCH_COMMAND": command})

    return invoke


def nothing_runs(state_root: Path) -> None:
    """No state.json and no live recorded process in any run dir."""
    from epdctl.launch.processes import scan_marked
    from epdctl.launch.state import RunState

    for run_dir in state_root.iterdir():
        if not (run_dir / "last-run.json").exists():
            continue
        assert not (run_dir / "state.json").exists(), run_dir
        assert scan_marked(run_dir) == []
        state = RunState.model_validate_json((run_dir / "last-run.json").read_text())
        assert [n for n, r in state.records.items() if is_running(r.pid)] == []


def test_both_arms_report_every_figure(bench: Bench, fake_topology: Callable[..., Path],
                                       state_root: Path, tmp_path: Path) -> None:
    path = fake_topology()
    out = tmp_path / "out"
    result = bench(str(path), *SMALL, "--slo", "ttft=100", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(a["name"], a["mode"]) for a in doc["arms"]] == [("epd", "e-pd"),
                                                             ("aggregated", "pd")]
    assert [i["name"] for i in doc["arms"][1]["instances"]] == ["pd-0", "pd-1"]
    assert [(r["arm"], r["load"]) for r in doc["results"]] == [
        ("epd", "concurrency 1"), ("aggregated", "concurrency 1"),
        ("epd", "concurrency 2"), ("aggregated", "concurrency 2")]
    for row in doc["results"]:
        # every fake request is within the SLO: goodput is req/s
        assert row["figures"]["completed"] == 5 and row["figures"]["request_goodput"] == 2.5
        assert row["figures"]["request_goodput_ci"][0] <= 2.5 <= \
            row["figures"]["request_goodput_ci"][1]
        # 5 requests support no TTFT percentile: shown as what they would need
        assert row["unsupported"] == {"ttft_p50_ms": "n<20", "ttft_p90_ms": "n<100",
                                      "ttft_p99_ms": "n<1000"}
        shown = {k: v for k, v in row["figures"].items()
                 if k.removesuffix("_ci") not in row["unsupported"]}
        assert None not in shown.values(), shown
        assert "--max-concurrency" in row["argv"] and row["argv"][-2:] == ["--goodput", "ttft:100"]
        assert "--save-detailed" in row["argv"]
    # the fake bench answers TTFT p90 = 60 + seed: both arms got the same seeds
    assert [r["rounds"][0]["figures"]["ttft_p90_ms"] for r in doc["results"]] == [
        60.0, 60.0, 61.0, 61.0]
    assert doc["results"][0]["store"] is not None and doc["results"][1]["store"] is None
    assert len(doc["verdicts"]) == 2
    assert doc["verdicts"][0]["text"].startswith(
        "`epd` vs `aggregated`: undecided (one start per arm); figures only, not a verdict: ")
    assert doc["plan"] == {"rounds": 1, "warmup": 3, "until_significant": None}
    assert doc["correctness"]["ok"] is True and len(doc["correctness"]["prompts"]) == 6
    assert doc["correctness"]["answers"]["aggregated"][0] == "hello from fake"
    assert doc["vllm_version"] and doc["epdctl_version"] and doc["devices"]
    assert json.loads((out / "report.json").read_text()) == doc
    assert "| concurrency 2 | aggregated | 5 | 0 |" in (out / "report.md").read_text()
    from epdctl.bench.plot import has_matplotlib

    assert (out / "plot.png").exists() == has_matplotlib()
    assert "[1/2] epd: starting fake (e-pd)" in result.stderr
    assert "epd: load point 2/2 (concurrency 2): done in" in result.stderr
    nothing_runs(state_root)


def test_an_arm_on_another_connector_reports_everything_but_store_figures(
        bench: Bench, fake_topology: Callable[..., Path], state_root: Path,
        tmp_path: Path) -> None:
    """`--arm` with the same topology on vLLM's ECExampleConnector: every figure of both arms,
    store figures only for epdctl's store (the example connector keeps no counters)."""
    example = fake_topology("example", cache="connector: ECExampleConnector")
    out = tmp_path / "out"
    result = bench(str(fake_topology()), *SMALL, "--baseline", "none", "--arm", str(example),
                   "--slo", "ttft=100", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(a["name"], a["kind"], a["mode"]) for a in doc["arms"]] == [
        ("epd", "epd", "e-pd"), ("example", "extra", "e-pd")]
    assert [(r["arm"], r["load"]) for r in doc["results"]] == [
        ("epd", "concurrency 1"), ("example", "concurrency 1"),
        ("epd", "concurrency 2"), ("example", "concurrency 2")]
    for row in doc["results"]:
        assert row["figures"]["completed"] == 5 and row["figures"]["failed"] == 0
        assert [k for k, v in row["figures"].items() if v is None
                and k.removesuffix("_ci") not in row["unsupported"]] == []
        assert set(row["proxy"]) == set(doc["results"][0]["proxy"])
        if row["arm"] == "example":
            assert row["store"] is None and row["ratios"] is not None
        else:
            assert set(row["store"]) >= {"saves", "hits", "misses"}
    assert [v["arm"] for v in doc["verdicts"]] == ["example", "example"]
    assert doc["correctness"]["ok"] is True and set(doc["correctness"]["answers"]) == {
        "epd", "example"}
    table = (out / "report.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| load |"))
    hits = header.strip("|").split(" | ").index("store hits")
    rows = [line.strip("|").split(" | ") for line in table.splitlines()
            if line.startswith("| concurrency ")]
    assert [(r[1], r[hits] != "-") for r in rows] == [
        ("epd", True), ("example", False), ("epd", True), ("example", False)]
    state = json.loads((state_root / "example" / "last-run.json").read_text())
    assert state["ec_connector"] == "ECExampleConnector"
    nothing_runs(state_root)


def test_the_table_on_the_terminal(bench: Bench, fake_topology: Callable[..., Path]) -> None:
    result = bench(str(fake_topology()), *SMALL)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:6] == ["load", "arm", "done", "failed", "req/s", "tok/s"]
    assert "concurrency 1: `epd` vs `aggregated`: undecided (one start per arm); figures " \
        "only, not a verdict: req/s 1.00x [" in result.stdout


def test_an_arm_that_dies_while_starting(bench: Bench, fake_topology: Callable[..., Path],
                                         state_root: Path) -> None:
    dying = fake_topology("dies", pd_args=("--exit-after", "0", "--exit-code", "7"))
    result = bench(str(fake_topology()), *SMALL, "--arm", str(dying))
    assert result.exit_code == 3, result.output
    assert "arm `dies` did not start" in result.stderr
    assert "fake: exiting with code 7" in result.stderr  # the log excerpt
    assert "aggregated: stopping" in result.stderr  # the arms before it ran and went down
    nothing_runs(state_root)


def test_a_greedy_mismatch_fails_the_bench(bench: Bench, fake_topology: Callable[..., Path],
                                           state_root: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from epdctl.bench import runner
    from epdctl.verifier.prompts import ChatAnswer

    other = fake_topology("other")
    port = yaml.safe_load(other.read_text())["proxy"]["port"]
    real = runner.send_chat

    def send(url: str, body: dict[str, Any], headers: Mapping[str, str]) -> ChatAnswer:
        answer = real(url, body, headers)  # the fake proxy's; `other` answers otherwise
        return ChatAnswer("something else", 0.1) if url.endswith(f":{port}") else answer

    monkeypatch.setattr(runner, "send_chat", send)
    out = tmp_path / "out"
    result = bench(str(fake_topology()), *SMALL, "--baseline", "none", "--arm", str(other),
                   "--out", str(out))
    assert result.exit_code == 1, result.output
    assert "Error: the greedy subset differs between arms (other: " in result.stderr
    doc = json.loads((out / "report.json").read_text())
    assert doc["ok"] is False and doc["reference"] == "epd"
    assert {m["got"] for m in doc["correctness"]["mismatches"]} == {"something else"}
    nothing_runs(state_root)


def test_a_failing_workload_names_its_log(bench: Bench, fake_topology: Callable[..., Path],
                                          state_root: Path) -> None:
    failing = shlex.join([sys.executable, "-c", "import sys; print('boom'); sys.exit(2)"])
    result = bench(str(fake_topology()), *SMALL, command=failing)
    assert result.exit_code == 1
    assert "`vllm bench serve` against `epd` exited with code 2" in result.stderr
    assert "  boom" in result.stderr
    nothing_runs(state_root)


def test_ctrl_c_takes_the_running_arm_down(bench: Bench, fake_topology: Callable[..., Path],
                                          state_root: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from epdctl.bench import runner

    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_run_bench", interrupted)
    result = bench(str(fake_topology()), *SMALL)
    assert result.exit_code == 130
    assert "epd: stopping" in result.stderr and "Interrupted; every arm is down." in result.stderr
    nothing_runs(state_root)


@pytest.mark.parametrize(("args", "message"), [
    (("--repeat", "1.5"), "--repeat: expected a fraction from 0 to below 1, got 1.5"),
    (("--repeat", "0.5", "--images", "0"), "--repeat needs images"),
    (("--slo", "ttft"), "--slo: expected METRIC=TIME pairs"),
    (("--request-rate", "1,2", "--max-concurrency", "1,2"), "sweep one of --request-rate"),
    (("--request-rate", "fast"), "--request-rate: expected a comma-separated list"),
    (("--images", "2"), "the workload sends 2 image(s) per request; `epd` accepts at most 1"),
    (("--baseline", "tp"), "--baseline tp needs `device: cuda`"),
    (("--dataset", "/nonexistent.jsonl"), "--dataset /nonexistent.jsonl: no such file"),
    (("--reference", "nope"), "--reference nope: no such arm (the arms: epd, aggregated)"),
])
def test_bad_options_are_refused_before_anything_starts(
        bench: Bench, fake_topology: Callable[..., Path], state_root: Path,
        args: tuple[str, ...], message: str) -> None:
    path = fake_topology(pd_args=("--limit-mm-per-prompt", '{"image": 1}'))
    result = bench(str(path), *args)
    assert result.exit_code == 1, result.output
    assert result.stderr == f"Error: {message}" + result.stderr.split(message, 1)[1]
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(state_root.iterdir()) == []


def test_ratios_and_verdicts_against_the_arm_named_by_reference(
        bench: Bench, fake_topology: Callable[..., Path]) -> None:
    result = bench(str(fake_topology()), *SMALL, "--reference", "epd", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["reference"] == "epd"
    assert [(v["arm"], v["reference"]) for v in doc["verdicts"]] == [("aggregated", "epd")] * 2
    assert [r["ratios"] is None for r in doc["results"]] == [True, False, True, False]


def test_an_arm_of_another_model_is_refused(bench: Bench, fake_topology: Callable[..., Path],
                                            state_root: Path, tmp_path: Path) -> None:
    other = fake_topology("other")
    other.write_text(other.read_text().replace("model: fake-model", "model: another-model"))
    result = bench(str(fake_topology()), "--arm", str(other))
    assert result.exit_code == 1
    assert f"--arm {other}: model `another-model` is not the topology's `fake-model`" in \
        result.stderr
    assert list(state_root.iterdir()) == []


def test_dry_run_prints_plans_and_commands(bench: Bench, fake_topology: Callable[..., Path],
                                           state_root: Path) -> None:
    result = bench(str(fake_topology()), *SMALL, "--repeat", "0.5", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "## arm `epd`: fake (e-pd)" in out and "## arm `aggregated`: fake-agg (pd)" in out
    assert "#   2 prefill+decode instance(s), as many as the topology has" in out
    assert out.count("# load point 2: concurrency 2") == 2
    assert "--dataset-name custom_image --dataset-path '<work dir>/datasets/point-1.jsonl'" in out
    assert list(state_root.iterdir()) == []


def test_point_seconds_sets_a_rate_points_request_count(
        bench: Bench, fake_topology: Callable[..., Path], state_root: Path) -> None:
    result = bench(str(fake_topology()), "--request-rate", "1,40", "--num-prompts", "20",
                   "--point-seconds", "5", "--dry-run")
    assert result.exit_code == 0, result.output
    counts = [line.split("--num-prompts ")[1].split()[0] for line in result.stdout.splitlines()
              if "--num-prompts" in line and "--request-rate" in line]
    assert counts == ["20", "200"] * 2  # 1 req/s: num_prompts; 40 req/s: 5 s of them
    assert list(state_root.iterdir()) == []
    result = bench(str(fake_topology()), "--point-seconds", "-1")
    assert result.exit_code == 2 and "--point-seconds" in result.stderr


def test_without_matplotlib_everything_but_the_plot_is_written(
        bench: Bench, fake_topology: Callable[..., Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from epdctl.bench import plot

    monkeypatch.setattr(plot, "has_matplotlib", lambda: False)
    out = tmp_path / "out"
    result = bench(str(fake_topology()), *SMALL, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "plot.png not written: matplotlib is not installed (pip install 'epdctl[bench]')" \
        in result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "runs"]


def test_two_rounds_then_compare_two_saved_runs(bench: Bench, epdctl: Callable[..., Result],
                                                fake_topology: Callable[..., Path],
                                                state_root: Path, tmp_path: Path) -> None:
    """--rounds 2 alternates the arms (the second stays up across the round's end); two
    saved runs compare through `bench compare`, as a table and as JSON."""
    path = fake_topology()
    for name in ("a", "b"):
        result = bench(str(path), "--max-concurrency", "2", "--num-prompts", "6",
                       "--rounds", "2", "--warmup", "2", "--out", str(tmp_path / name))
        assert result.exit_code == 0, result.output
    assert "round 2: aggregated epd" in result.stderr
    assert result.stderr.count("[1/2] epd: starting") == 2
    assert result.stderr.count("[2/2] aggregated: starting") == 1
    assert result.stderr.count("epd: warm-up, 2 requests (not counted)") == 2
    assert "2 round(s), arms in turn: epd aggregated | aggregated epd" in result.stdout
    doc = json.loads((tmp_path / "a" / "report.json").read_text())
    assert [r["n"] for r in doc["results"]] == [12, 12]
    assert (tmp_path / "a" / "runs" / "epd-warmup-2.json").exists()

    shown = epdctl("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b" / "report.json"))
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith(f"A = {tmp_path / 'a'}\nB = ")
    assert "concurrency 2: `B:epd` vs `A:epd`: no significant difference at n=12" in shown.stdout
    assert "B:aggregated" in shown.stdout
    as_json = epdctl("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--arm", "epd",
                     "--json")
    assert as_json.exit_code == 0, as_json.output
    out = json.loads(as_json.stdout)
    assert [r["arm"] for r in out["results"]] == ["A:epd", "B:epd"]
    assert [v["kind"] for v in out["verdicts"]] in (["undecided"], ["on_par"])
    nothing_runs(state_root)


def test_compare_errors_and_help(epdctl: Callable[..., Result], tmp_path: Path) -> None:
    result = epdctl("bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {tmp_path / 'a.json'}: not a bench report")
    assert len(result.stderr.strip().splitlines()) == 1
    helped = epdctl("bench", "compare", "--help")
    assert helped.exit_code == 0 and " bench compare [OPTIONS] A B" in helped.stdout
    assert "bench compare A/report.json B/report.json" in epdctl("bench", "--help").stdout


def test_an_audio_workload_sends_generated_clips_through_custom_audio(
        bench: Bench, fake_topology: Callable[..., Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = bench(str(fake_topology()), *SMALL, "--audios", "1", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["workload"]["kind"], doc["workload"]["audios"], doc["workload"]["images"]) == (
        "audio", 1, 0)
    for row in doc["results"]:
        args = row["argv"]
        assert args[args.index("--dataset-name") + 1] == "custom_audio"
        assert "--enable-multimodal-chat" in args
        lines = Path(args[args.index("--dataset-path") + 1]).read_text().splitlines()
        assert len(lines) == 5 and all(Path(json.loads(x)["audio"]).is_file() for x in lines)
    assert "- workload: audio, 1 clip(s) of generated audio" in (out / "report.md").read_text()
    refused = bench(str(fake_topology("other")), *SMALL, "--audios", "1", "--images", "1")
    assert refused.exit_code == 1
    assert "--audios sends one clip and text per request" in refused.stderr
