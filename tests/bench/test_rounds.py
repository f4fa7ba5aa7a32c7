"""Rounds: the arms in alternating order, an arm brought up again only when another ran in
between, the warm-up after each start, --until-significant's extra rounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from epdctl.bench import runner
from epdctl.bench.arms import derive_arms
from epdctl.bench.runner import ArmRun, Plan, PointRun, round_order, run_arms
from epdctl.bench.workload import LoadPoint, Workload
from epdctl.topology.model import parse_topology

TOPOLOGY = parse_topology({"name": "t", "model": "m", "device": "cpu",
                           "roles": {"encode": {}, "prefill_decode": {}}})
OTHER = parse_topology({"name": "u", "model": "m", "device": "cpu",
                        "roles": {"encode": {}, "prefill_decode": {"replicas": 2}}})
EPD, AGG, EXTRA = derive_arms(TOPOLOGY, Path("t.yaml"), extra=[(Path("u.yaml"), OTHER)])
WORKLOAD = Workload(points=(LoadPoint(1.0), LoadPoint(2.0)), num_prompts=4, seed=10)


class Quiet:
    def line(self, text: str) -> None:
        pass

    def tick(self, text: str) -> None:
        pass

    def on_change(self, state: object) -> None:
        pass

    def done_starting(self) -> None:
        pass


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """What the runner did, without starting anything: up, down, and each point's run."""
    log: list[tuple[Any, ...]] = []

    def start(arm: Any, result: ArmRun, workload: Workload, state_root: Path, work_dir: Path,
              plan: Plan, *rest: Any) -> runner._Up:
        result.starts += 1
        log.append(("up", arm.name))
        return runner._Up(arm, None, None, None)  # type: ignore[arg-type]

    def stop(up: runner._Up, progress: object) -> None:
        log.append(("down", up.arm.name))

    def point(arm: Any, workload: Workload, index: int, state: object, work_dir: Path,
              datasets: object, ns_dir: object, progress: object, earlier: object,
              round_: int) -> PointRun:
        log.append(("point", arm.name, round_, index))
        return PointRun(index, [], {}, {}, None, 1.0, round_)

    monkeypatch.setattr(runner, "_start", start)
    monkeypatch.setattr(runner, "_stop", stop)
    monkeypatch.setattr(runner, "_run_point", point)
    return log


def test_round_order_alternates() -> None:
    assert [[a.name for a in round_order([EPD, AGG], r)] for r in range(4)] == [
        ["epd", "aggregated"], ["aggregated", "epd"]] * 2
    assert [a.name for a in round_order([EPD, AGG, EXTRA], 1)] == ["u", "aggregated", "epd"]


def test_an_arm_that_runs_last_and_first_stays_up(events: list[tuple[Any, ...]],
                                                   tmp_path: Path) -> None:
    runs = run_arms([EPD, AGG], WORKLOAD, tmp_path, tmp_path, timeout_s=1.0, progress=Quiet(),
                    prompts=[], plan=Plan(rounds=3))
    ups = [e for e in events if e[0] != "point"]
    assert ups == [("up", "epd"), ("down", "epd"), ("up", "aggregated"), ("down", "aggregated"),
                   ("up", "epd"), ("down", "epd"), ("up", "aggregated"), ("down", "aggregated")]
    turns = [(e[1], e[2]) for e in events if e[0] == "point"][::2]  # each arm's turns
    assert turns == [("epd", 0), ("aggregated", 0), ("aggregated", 1), ("epd", 1), ("epd", 2),
                     ("aggregated", 2)]
    assert [r.starts for r in runs] == [2, 2]
    epd = runs[0]
    assert [(p.round, p.index) for p in epd.points] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                          (2, 0), (2, 1)]
    assert [p.seq for p in epd.points] == [1, 2, 7, 8, 9, 10]


class Lines(Quiet):
    def __init__(self) -> None:
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)


def test_each_round_after_the_first_says_about_how_long_the_rest_takes(
        events: list[tuple[Any, ...]], tmp_path: Path) -> None:
    """From the starts and load points already run (each of these points took 1 s; the
    stand-in starts take no time)."""
    progress = Lines()
    run_arms([EPD, AGG], WORKLOAD, tmp_path, tmp_path, timeout_s=1.0, progress=progress,
             prompts=[], plan=Plan(rounds=3, max_rounds=4), undecided=lambda runs: True)
    rounds = [line for line in progress.lines if line.startswith("round ")]
    assert rounds == ["round 1: epd aggregated",
                      "round 2: aggregated epd (about 8s to go, as the earlier rounds took)",
                      "round 3: epd aggregated (about 4s to go, as the earlier rounds took)",
                      "round 4: aggregated epd (about 4s more, as the earlier rounds took)"]


def test_until_significant_adds_rounds_while_undecided(events: list[tuple[Any, ...]],
                                                      tmp_path: Path) -> None:
    asked: list[int] = []

    def undecided(runs: Sequence[ArmRun]) -> bool:
        asked.append(len(runs[0].points))
        return len(asked) < 2  # decided after the third round

    runs = run_arms([EPD, AGG], WORKLOAD, tmp_path, tmp_path, timeout_s=1.0, progress=Quiet(),
                    prompts=[], plan=Plan(rounds=2, max_rounds=5), undecided=undecided)
    assert asked == [4, 6]  # asked after rounds 2 and 3
    assert max(p.round for p in runs[0].points) == 2
    assert events[-1][0] == "down"


def test_until_significant_stops_at_its_limit(events: list[tuple[Any, ...]],
                                              tmp_path: Path) -> None:
    runs = run_arms([EPD, AGG], WORKLOAD, tmp_path, tmp_path, timeout_s=1.0, progress=Quiet(),
                    prompts=[], plan=Plan(rounds=1, max_rounds=3), undecided=lambda r: True)
    assert sorted({p.round for p in runs[1].points}) == [0, 1, 2]


def test_points_not_wanted_are_skipped(events: list[tuple[Any, ...]], tmp_path: Path) -> None:
    workload = Workload(points=tuple(LoadPoint(r) for r in (8.0, 4.0, 2.0, 1.0)), num_prompts=4)
    seen: list[tuple[int, list[int]]] = []

    def wanted(index: int, done: Sequence[PointRun]) -> bool:
        seen.append((index, [p.index for p in done]))
        return index != 1 and len(done) < 2  # skip the second, stop after two

    runs = run_arms([EPD, AGG], workload, tmp_path, tmp_path, timeout_s=1.0, progress=Quiet(),
                    prompts=[], wanted=wanted)
    assert [[p.index for p in run.points] for run in runs] == [[0, 2], [0, 2]]
    assert seen[:4] == [(0, []), (1, [0]), (2, [0]), (3, [0, 2])]  # each arm's own points
    assert [e for e in events if e[0] != "point"] == [
        ("up", "epd"), ("down", "epd"), ("up", "aggregated"), ("down", "aggregated")]


def test_each_round_and_the_warm_up_get_their_own_requests() -> None:
    seeds = {WORKLOAD.seed_at(i, r) for i in range(2) for r in range(3)}
    assert len(seeds) == 6 and WORKLOAD.warmup_seed() not in seeds
    from epdctl.bench.workload import argv

    args = argv(["b"], WORKLOAD, 0, url="u", model="m", served_model_name="m",
                result_dir=Path("/r"), result_name="w.json", warmup=3)
    assert args[args.index("--num-prompts") + 1] == "3"
    assert args[args.index("--seed") + 1] == str(WORKLOAD.warmup_seed())


def test_a_point_with_a_seed_of_its_own_sends_that_seed_wherever_it_stands() -> None:
    from epdctl.bench.workload import argv

    mine = LoadPoint(8.0, seed=1_000_012)
    first = replace(WORKLOAD, points=(mine, LoadPoint(4.0)))
    second = replace(WORKLOAD, points=(LoadPoint(2.0), LoadPoint(4.0), mine))
    assert first.seed_at(0) == second.seed_at(2) == 1_000_012
    # the others keep the workload's numbering
    assert second.seed_at(0) == WORKLOAD.seed and second.seed_at(1) == WORKLOAD.seed + 1
    args = argv(["b"], second, 2, url="u", model="m", served_model_name="m",
                result_dir=Path("/r"), result_name="p.json")
    assert args[args.index("--seed") + 1] == "1000012"
    assert mine.as_json()["seed"] == 1_000_012 and "seed" not in LoadPoint(8.0).as_json()
