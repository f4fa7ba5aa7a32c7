"""`epdctl bench`'s default rounds and what it says with one start per arm: fake engines and
a fake `vllm bench serve` whose every start of an arm lands its own distance away
(FAKE_BENCH_START_SCALES), as starts on a CPU machine did (2.30x apart on req/s)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

pytestmark = pytest.mark.timeout(120)
FAKE_BENCH = shlex.join([sys.executable, str(Path(__file__).parents[1] / "fake_bench.py")])
WORKLOAD = ("--max-concurrency", "1,2", "--num-prompts", "5", "--input-len", "8",
            "--output-len", "4")
APART = json.dumps({"epd": [1.0, 2.3], "copy": [2.3]})
"""`epd`'s first start 2.3x faster than the copy's (and than its own second): the copy of one
topology, judged from one start each, would look 2.3x slower."""
VERDICT_WORDS = re.compile(r"\b(better|worse|on par|mixed)\b")

Bench = Callable[..., Result]


@pytest.fixture
def bench(epdctl: Callable[..., Result]) -> Bench:
    def invoke(*args: str) -> Result:
        return epdctl("bench", *args, env={"EPDCTL_BENCH_COMMAND": FAKE_BENCH,
                                           "FAKE_BENCH_START_SCALES": APART})

    return invoke


@pytest.fixture
def a_a(fake_topology: Callable[..., Path]) -> tuple[str, ...]:
    """A topology and an identical copy of it (another name and ports) as the only arms."""
    return (str(fake_topology()), "--baseline", "none", "--arm", str(fake_topology("copy")))


def test_an_a_a_bench_with_its_defaults_gives_no_verdict(bench: Bench, a_a: tuple[str, ...],
                                                         tmp_path: Path) -> None:
    """Defaults (2 rounds, 3 warm-up requests): `epd` is brought up twice, so how far its
    starts land apart is measured, and no load point gets a verdict. Under one round a
    start each (the old default on cpu) this printed "`epd` is better than `copy`"."""
    out = tmp_path / "out"
    result = bench(*a_a, *WORKLOAD, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert not VERDICT_WORDS.search(result.stdout), result.stdout
    verdicts = [line for line in result.stdout.splitlines() if "`copy` vs `epd`" in line]
    assert len(verdicts) == 2  # one per load point
    assert "plan: 2 rounds, arms in turn: epd copy | copy epd; 3 starts (`epd` 2, `copy` 1), " \
        "each followed by 3 warm-up requests; 8 load-point runs (2 points x 2 arms x 2) of 5 " \
        "requests" in result.stderr
    assert re.search(r"round 2: copy epd \(about \d+s to go, as the earlier rounds took\)",
                     result.stderr)
    doc = json.loads((out / "report.json").read_text())
    assert [(a["name"], a["starts"]) for a in doc["arms"]] == [("epd", 2), ("copy", 1)]
    for v in doc["verdicts"]:
        assert v["kind"] == "undecided" and v["starts_measured"] is True, v
        assert v["reason"] is None
        assert "no significant difference at n=10" in v["text"]
    assert not VERDICT_WORDS.search((out / "report.md").read_text().split("## Verdicts")[1]
                                    .split("## Greedy")[0])


def test_one_round_gives_figures_and_no_verdict(bench: Bench, a_a: tuple[str, ...],
                                                tmp_path: Path) -> None:
    """--rounds 1 stays allowed: the figures and ratios, each verdict `undecided` (one start
    per arm), in the text, the JSON and report.md."""
    out = tmp_path / "out"
    result = bench(*a_a, *WORKLOAD, "--rounds", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "plan: one start per arm: figures only, no verdict (how far one start of an arm " \
        "lands from the next is not measured; --rounds 2 for one)" in result.stderr
    lines = [line for line in result.stdout.splitlines() if "`copy` vs `epd`" in line]
    assert [line.split(" [")[0] for line in lines] == [
        "concurrency 1: `copy` vs `epd`: undecided (one start per arm); figures only, not a "
        "verdict: req/s 0.43x",
        "concurrency 2: `copy` vs `epd`: undecided (one start per arm); figures only, not a "
        "verdict: req/s 0.43x"]
    assert all(line.endswith("(intervals over requests within one start; how far one start "
                             "of an arm lands from the next is not measured: --rounds 2 or more "
                             "for a verdict)") for line in lines)
    assert not VERDICT_WORDS.search(result.stdout), result.stdout
    doc = json.loads((out / "report.json").read_text())
    for v in doc["verdicts"]:
        assert (v["kind"], v["decided"], v["reason"]) == ("undecided", False,
                                                          "one start per arm")
        assert v["figures"]["tpot_mean_ms"]["ratio"] == pytest.approx(2.3)
        assert f"- {v['load']}: {v['text']}" in (out / "report.md").read_text()


def test_until_significant_goes_on_from_one_round(bench: Bench, a_a: tuple[str, ...],
                                                 tmp_path: Path) -> None:
    """--rounds 1 --until-significant 2: round 1 decides nothing (one start per arm), so
    round 2 runs, and its verdicts weigh the spread between `epd`'s two starts."""
    result = bench(*a_a, *WORKLOAD, "--rounds", "1", "--until-significant", "2", "--warmup",
                   "1", "--json")
    assert result.exit_code == 0, result.output
    assert re.search(r"round 2: copy epd \(about \d+s more, as the earlier rounds took\)",
                     result.stderr)
    doc = json.loads(result.stdout)
    assert doc["rounds"] == 2 and [a["starts"] for a in doc["arms"]] == [2, 1]
    assert all(v["starts_measured"] and v["reason"] is None for v in doc["verdicts"])


def test_dry_run_says_the_rounds_starts_and_runs(bench: Bench,
                                                 fake_topology: Callable[..., Path]) -> None:
    path = str(fake_topology())
    result = bench(path, "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        "# plan: 2 rounds, arms in turn: epd aggregated | aggregated epd; 3 starts (`epd` 2, "
        "`aggregated` 1), each followed by 3 warm-up requests; 12 load-point runs (3 points x "
        "2 arms x 2) of 100 requests\n"
        "# plan: a verdict weighs how far one start of an arm lands from the next (measured by "
        "bringing `epd` up again); 2 rounds are the fewest that give one, more decide smaller "
        "differences; --rounds 1: 2 starts and 6 runs, figures without a verdict\n## arm `epd`")
    one = bench(path, "--rounds", "1", "--warmup", "0", "--dry-run")
    assert one.stdout.startswith(
        "# plan: 1 round, arms in turn: epd aggregated; 2 starts (`epd` 1, `aggregated` 1); "
        "6 load-point runs (3 points x 2 arms x 1) of 100 requests\n"
        "# plan: one start per arm: figures only, no verdict")
    as_json = json.loads(bench(path, "--dry-run", "--json").stdout)
    assert as_json["plan"] == {"rounds": 2, "warmup": 3, "until_significant": None,
                               "starts": {"epd": 2, "aggregated": 1}, "runs": 12,
                               "can_decide": True}
    assert json.loads(bench(path, "--rounds", "1", "--dry-run", "--json").stdout)["plan"][
        "can_decide"] is False


def test_the_help_gives_the_default_and_why(bench: Bench) -> None:
    result = bench("--help")
    text = " ".join(result.stdout.split())
    assert "Default 2, the fewest that give a verdict, on cpu and cuda alike" in text
    assert "1 gives the figures without a verdict." in text



@pytest.mark.timeout(300)
def test_two_requests_at_six_rates_give_a_report(bench: Bench, epdctl: Callable[..., Result],
                                                a_a: tuple[str, ...], tmp_path: Path) -> None:
    """6 load points of 2 requests each in 2 rounds (12 ratios, each interval at
    1 - 0.05 / 12) once ended in a StatisticsError traceback: the figures, and no verdict;
    `bench compare` of such a run too. (One warm-up request: the fake bench learns from it
    which start of an arm it runs on.)"""
    out = tmp_path / "out"
    result = bench(*a_a, "--request-rate", "1,2,3,4,5,6", "--num-prompts", "2",
                   "--input-len", "8", "--output-len", "4", "--warmup", "1", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stdout.splitlines() if "`copy` vs `epd`" in line]
    assert [line.split(": req/s")[0] for line in lines] == [
        f"{rate} req/s: `copy` vs `epd`: no significant difference at n=4"
        for rate in range(1, 7)], result.stdout
    assert not VERDICT_WORDS.search(result.stdout), result.stdout
    doc = json.loads((out / "report.json").read_text())
    assert [r["n"] for r in doc["results"]] == [4] * 12
    for v in doc["verdicts"]:
        assert (v["kind"], v["reason"], v["level"]) == ("undecided", None, 0.99583), v
        assert all(f["ci"] for f in v["figures"].values()) and v["figures"]
    shown = epdctl("bench", "compare", str(out), str(out))
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.count("`B:epd` vs `A:epd`: no significant difference at n=4") == 6
