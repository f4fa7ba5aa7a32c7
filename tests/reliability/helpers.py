"""Helpers for the reliability suite: the CLI as a subprocess, topology edits, process checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.conftest import FAKE_PROXY
from tests.harness import edit_topology as edit_topology  # re-exported for the suite
from tests.harness import wait_for as wait_for


def cli_env(state_root: Path, *, fake_proxy: bool = True) -> dict[str, str]:
    """The environment a user's shell would give `python -m epdctl`, with this state root."""
    env = {**os.environ, "EPDCTL_STATE_DIR": str(state_root), "NO_COLOR": "1",
           "COLUMNS": "200"}
    env.pop("EPDCTL_PROXY_COMMAND", None)
    if fake_proxy:
        env["EPDCTL_PROXY_COMMAND"] = FAKE_PROXY
    return env


def epdctl(env: Mapping[str, str], *args: str,
           timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epdctl", *args], env=dict(env), text=True,
                          capture_output=True, timeout=timeout_s)


def _interruptible() -> None:
    """In the child: SIGINT does what Ctrl+C does. A test run started in the background by a
    shell inherits SIGINT ignored (POSIX background jobs), and Python then installs no
    KeyboardInterrupt: a test that interrupts epdctl must undo that for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_epdctl(env: Mapping[str, str], *args: str) -> subprocess.Popen[str]:
    """`python -m epdctl ARGS` in the background (its own session: signals reach only it;
    SIGINT at its default whatever this test run inherited)."""
    return subprocess.Popen([sys.executable, "-m", "epdctl", *args], env=dict(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_interruptible)


def marked_pids(run_dir: Path) -> set[int]:
    """Every live process (not a zombie) whose environment marks it as started for run_dir."""
    import psutil

    from epdctl.launch.processes import MARK_DIR

    found = set()
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(MARK_DIR) == str(run_dir):
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def kill_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal the process group `pid` leads (an instance: start_new_session)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def finish(proc: subprocess.Popen[str], timeout_s: float = 30) -> tuple[int, str, str]:
    """Wait for a background epdctl; its exit code, stdout and stderr."""
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err
