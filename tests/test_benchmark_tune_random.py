"""benchmarks/tune.py on random machines (--random N --seed S), its spread line, and the
private EC store each run process keeps."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from epdctl.sim.costmodel import load_cost_model
from epdctl.sim.machines import draw
from tests.test_benchmark_tune import bench_tune

SCRIPT = Path(bench_tune.__file__ or "")
CHILD = """
import importlib.util, signal, sys, time
from pathlib import Path
# Ctrl+C raises KeyboardInterrupt even where the test runner inherited SIGINT ignored (a
# background job of a non-interactive shell).
signal.signal(signal.SIGINT, signal.default_int_handler)
spec = importlib.util.spec_from_file_location("bench_tune", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
from epdctl.topology.model import load_topology
tmp = Path(sys.argv[2])
dirs = {load_topology(m._base(tmp, tmp / "cost.yaml", offset, f"-{offset}")).cache.dir
        for offset in (0, 100)}
assert len(dirs) == 1, dirs  # one store a process, made once
print(dirs.pop(), flush=True)
if sys.argv[3:]:
    time.sleep(60)
"""


def _child(tmp: Path, *extra: str) -> subprocess.Popen[str]:
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(SCRIPT), str(tmp), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _private(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() \
        and stat.S_IMODE(st.st_mode) == 0o700


def test_every_run_process_keeps_its_own_private_store(tmp_path: Path) -> None:
    a, b = _child(tmp_path / "a", "wait"), _child(tmp_path / "b", "wait")
    try:
        assert a.stdout and b.stdout
        first, second = Path(a.stdout.readline().strip()), Path(b.stdout.readline().strip())
        assert first != second and first.parent == second.parent
        assert first.name.startswith("epdctl-tune-bench-")
        assert _private(first) and _private(second)  # both alive: both there
        a.send_signal(signal.SIGINT)  # Ctrl+C
        assert a.wait(timeout=30) != 0 and not first.exists() and second.exists()
    finally:
        for child in (a, b):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)  # SIGKILL would leave its store behind
                child.wait(timeout=30)
    assert not second.exists()
    done = _child(tmp_path / "c")  # ends by itself
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    assert not Path(out.strip()).exists()


def test_a_random_machine_is_written_as_drawn(tmp_path: Path) -> None:
    name, path = bench_tune.random_machine(11, 4, tmp_path)
    assert name == "random-11" and path == tmp_path / "random-11-4" / "random-11.yaml"
    assert load_cost_model(path) == draw(11)
    assert bench_tune.random_machine(11, 4, tmp_path) == (name, path)  # resumed: the same
    path.write_text(path.read_text().replace("time_scale: 4.0", "time_scale: 2.0"))
    with pytest.raises(SystemExit, match="not the machine seed 11 draws"):
        bench_tune.random_machine(11, 4, tmp_path)
    assert bench_tune.slo_for("random-11", 8) == "ttft=6000,tpot=120"


def test_random_machines_run_as_named_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    for env in ("EPDCTL_FAKE_GPUS", "EPDCTL_BENCH_COMMAND"):
        monkeypatch.setenv(env, "")  # restored after: run_one sets them
    costs: list[Path] = []

    def tuned(run_dir: Path, base: Path, model: str, gpus: int, cost: Path,
              args: argparse.Namespace) -> tuple[dict, float]:
        costs.append(cost)
        pick = f"sim-{gpus}pd"
        return {"best": pick, "candidates": [
            {"name": pick, "kind": "aggregated", "predicted_goodput": 1.0}]}, 10.0

    monkeypatch.setattr(bench_tune, "_tuned", tuned)
    monkeypatch.setattr(bench_tune, "_sweep_one", lambda c, *a: 2.0 if "pd" in c.name else 1.0)
    monkeypatch.setattr(bench_tune, "_one_measure", lambda *a: (1.0, {}))  # no live confirms
    monkeypatch.setattr(sys, "argv", ["tune.py", "--random", "2", "--seed", "5", "--gpus",
                                      "4,8", "--sweep", "3", "--out", str(tmp_path)])
    bench_tune.main()
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines[:4]]
    assert [(r["model"], r["gpus"]) for r in rows] == [
        ("random-5", 4), ("random-6", 4), ("random-5", 8), ("random-6", 8)]
    assert lines[5].startswith("pick_ratio_worst=1.000 pick_ratio_median=1.000 ")
    assert lines[5].endswith(" agg_call=4/4")
    for seed in (5, 6):
        assert load_cost_model(tmp_path / f"random-{seed}-8" / f"random-{seed}.yaml") \
            == draw(seed)  # as drawn; the run's is twice as slow, beside it
    assert [load_cost_model(c).time_scale for c in costs] == [4.0, 4.0, 8.0, 8.0]


def test_the_spread_line() -> None:
    rows = [{"pick_ratio": p, "rank_spearman": r, "cost_ratio": c, "agg_call": a}
            for p, r, c, a in ((1.0, 0.9, 0.1, True), (0.8, float("nan"), 0.3, False),
                               (0.9, 0.5, 0.2, True))]
    assert bench_tune.spread(rows) == (
        "pick_ratio_worst=0.800 pick_ratio_median=0.900 rank_spearman_worst=0.500 "
        "rank_spearman_median=0.700 cost_ratio_worst=0.300 cost_ratio_median=0.200 "
        "agg_call=2/3")
