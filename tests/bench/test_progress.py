"""`epdctl bench` progress: elapsed / estimated time per load point, on a fake clock (how
the CLI shows it: tests/cli/test_bench_progress.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from epdctl.bench import runner
from epdctl.bench.arms import derive_arms
from epdctl.bench.runner import ArmRun, PointRun, _estimate, _run_point
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.launch.plan import plan
from epdctl.launch.state import RunState, Settings
from epdctl.topology.model import parse_topology

TOPOLOGY = parse_topology({
    "name": "t", "model": "org/vl", "served_model_name": "vl", "device": "cpu",
    "roles": {"encode": {}, "prefill_decode": {}}})
EPD, AGGREGATED = derive_arms(TOPOLOGY, Path("t.yaml"))
WORKLOAD = Workload(points=(LoadPoint(2.0), LoadPoint(0.5, 4), LoadPoint(math.inf, 8)),
                    num_prompts=10)
RESULT = {"completed": 10, "failed": 0, "duration": 5.0}


def point(index: int, elapsed_s: float) -> PointRun:
    return PointRun(index, [], {}, {}, None, elapsed_s)


def test_the_first_arm_expects_the_planned_prompts_at_the_point_s_rate() -> None:
    assert [_estimate(WORKLOAD, i, []) for i in range(3)] == [5.0, 20.0, None]
    assert _estimate(Workload(points=(LoadPoint(4.0),), num_prompts=30), 0, []) == 7.5


def test_a_later_arm_expects_what_the_point_took_on_the_arm_before() -> None:
    first = ArmRun(EPD, points=[point(0, 7.5), point(1, 31.0), point(2, 12.0)])
    second = ArmRun(AGGREGATED, points=[point(0, 9.0)])  # stopped after its first point
    assert [_estimate(WORKLOAD, i, [first]) for i in range(3)] == [7.5, 31.0, 12.0]
    assert [_estimate(WORKLOAD, i, [first, second]) for i in range(3)] == [9.0, 31.0, 12.0]


class Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ticks: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)

    def tick(self, text: str) -> None:
        self.ticks.append(text)

    def on_change(self, state: RunState) -> None:
        pass

    def done_starting(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """runner's clock, moved by hand: [now]."""
    now = [1000.0]
    monkeypatch.setattr(runner, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def run_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: list[float],
              index: int, moments: Sequence[float], earlier: Sequence[ArmRun] = ()
              ) -> Recorder:
    """_run_point with a `vllm bench serve` that polls at the given seconds after its start
    and ends at the last, writing its result file."""
    state = RunState.of(plan(TOPOLOGY, tmp_path / "t"), "t.yaml", Settings())

    def fake_bench(args: Sequence[str], log_path: Path, env: object,
                   tick: Callable[[], None]) -> int:
        start = clock[0]
        for moment in moments[:-1]:
            clock[0] = start + moment
            tick()
        clock[0] = start + moments[-1]
        result_dir = Path(args[args.index("--result-dir") + 1])
        (result_dir / args[args.index("--result-filename") + 1]).write_text(json.dumps(RESULT))
        return 0

    monkeypatch.setattr(runner, "_run_bench", fake_bench)
    monkeypatch.setattr(runner, "proxy_counters", lambda state: None)
    progress = Recorder()
    done = _run_point(EPD, WORKLOAD, index, state, tmp_path, {}, None, progress, earlier)
    assert done.elapsed_s == pytest.approx(moments[-1])
    return progress


def test_each_tick_shows_the_time_since_the_point_started_against_its_estimate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> None:
    progress = run_point(tmp_path, monkeypatch, clock, 1, [1.0, 59.7, 60.2, 125.0, 130.4])
    what = "  epd: load point 2/3 (0.5 req/s, concurrency 4)"
    assert progress.ticks == [f"{what}: {t} / ~20s" for t in ("1s", "59s", "1m00s", "2m05s")]
    assert progress.lines == [f"{what}, 10 requests",
                              f"{what}: done in 2m10s, 10 completed, 0 failed"]


def test_after_an_earlier_arm_the_estimate_is_what_the_point_took_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> None:
    earlier = [ArmRun(AGGREGATED, points=[point(0, 3.0), point(1, 95.0), point(2, 42.0)])]
    progress = run_point(tmp_path, monkeypatch, clock, 2, [2.0, 3.0], earlier)
    assert progress.ticks == ["  epd: load point 3/3 (concurrency 8): 2s / ~42s"]


def test_a_point_without_a_rate_has_no_estimate_on_the_first_arm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: list[float]) -> None:
    progress = run_point(tmp_path, monkeypatch, clock, 2, [61.0, 62.0])
    assert progress.ticks == ["  epd: load point 3/3 (concurrency 8): 1m01s / ?"]
