"""SIGTERM to `epdctl bench`, `tune`, `verify` or `up -d` takes down what it started, then
ends the process of the signal (as a service manager, `timeout` or `kill` expects).

Each command runs as a real subprocess on fake engines. The signal lands while a topology it
started is up: epdctl is frozen (SIGSTOP) once one is seen, the state dir looked at while
nothing moves, and SIGTERM sent before it is thawed; so the command cannot slip past the
moment, whatever the machine's speed.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli.test_bench import SMALL, nothing_runs
from tests.cli.test_tune import _base
from tests.conftest import is_running
from tests.reliability.helpers import cli_env, spawn_epdctl, wait_for

pytestmark = pytest.mark.timeout(180)
NEVER_READY = ("--ready-after", "3600")
# `vllm bench serve` that writes its pid and then runs until it is stopped.
STUCK_BENCH = ("import os, sys, time; open(os.environ['STUCK_PID'], 'w').write(str(os.getpid()));"
               " time.sleep(3600)")


def _up_now(state_root: Path) -> bool:
    """A topology's state.json is there and every process it records runs."""
    from epdctl.launch.state import RunState

    for path in state_root.glob("*/state.json"):
        try:
            state = RunState.model_validate_json(path.read_bytes())
        except (OSError, ValueError):
            continue
        if state.records and all(is_running(r.pid) for r in state.records.values()):
            return True
    return False


def terminate_while(proc: subprocess.Popen[str], is_moment: Callable[[], bool]) -> str:
    """SIGTERM `proc` at a moment `is_moment` sees while `proc` is frozen; its stderr."""
    while True:
        assert wait_for(lambda: proc.poll() is not None or is_moment(), 120)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGSTOP)
        if is_moment():
            break
        os.kill(proc.pid, signal.SIGCONT)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    return err


def _check_gone(proc: subprocess.Popen[str], err: str, state_root: Path) -> None:
    assert proc.returncode == -signal.SIGTERM, err  # the signal's own end, after clean-up
    assert "Traceback" not in err, err
    assert [p for p in state_root.iterdir() if (p / "state.json").exists()] == []
    nothing_runs(state_root)


def test_bench_takes_its_arm_and_its_load_down(fake_topology: Callable[..., Path],
                                               state_root: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "bench.pid"
    env = {**cli_env(state_root), "STUCK_PID": str(pid_file),
           "EPDCTL_BENCH_COMMAND": shlex.join([sys.executable, "-c", STUCK_BENCH])}
    proc = spawn_epdctl(env, "bench", str(fake_topology()), *SMALL)
    err = terminate_while(proc, lambda: pid_file.exists() and _up_now(state_root))
    _check_gone(proc, err, state_root)
    assert "epd: stopping" in err
    assert not is_running(int(pid_file.read_text()))


def test_tune_takes_the_topology_it_profiles_down(state_root: Path, tmp_path: Path) -> None:
    env = {**cli_env(state_root, fake_proxy=False), "EPDCTL_FAKE_GPUS": "1",
           "EPDCTL_FAKE_GPU_MEMORY": "24GiB", "EPDCTL_BENCH_COMMAND": ""}
    proc = spawn_epdctl(env, "tune", str(_base(tmp_path)), "--slo", "ttft=2000,tpot=200",
                        "--images", "1", "--image-size", "64x64", "--input-len", "16",
                        "--output-len", "8", "--num-prompts", "4", "--model-facts",
                        str(tmp_path / "cost.yaml"), "--out", str(tmp_path / "out"))
    err = terminate_while(proc, lambda: _up_now(state_root))
    _check_gone(proc, err, state_root)


@pytest.mark.parametrize("command", [["verify"], ["up", "-d"]], ids=["verify", "up-d"])
def test_a_start_under_way_is_abandoned(command: list[str], fake_topology: Callable[..., Path],
                                        state_root: Path) -> None:
    """verify: the baseline it started beside the topology, too (it runs marked for the
    run dir, as the engines do: nothing_runs sees it)."""
    proc = spawn_epdctl(cli_env(state_root), *command, str(fake_topology(pd_args=NEVER_READY)))
    baseline_log = state_root / "fake" / "logs" / "verify-baseline.log"
    err = terminate_while(proc, lambda: _up_now(state_root) and (
        command != ["verify"] or baseline_log.exists()))
    _check_gone(proc, err, state_root)
