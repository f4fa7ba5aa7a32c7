"""An interrupted `doctor` or `up` takes its engine probe with it.

The probe runs in a session of its own (the terminal's Ctrl+C does not reach it), so
epdctl must stop it itself. The engine command here is a fake whose every invocation
serves (on a port, with a helper process in its group) instead of answering and exiting,
as a wrong `engine.command` would; epdctl is interrupted while it waits for the probe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import is_running
from tests.reliability.helpers import cli_env, spawn_epdctl, wait_for

# A shell script (starts in milliseconds): it writes "its pid, its helper's pid" once both
# run, then waits on the helper, a small HTTP server, for as long as nobody stops it.
FAKE = """#!/bin/sh
"$FAKE_PYTHON" -m http.server --bind 127.0.0.1 0 >/dev/null 2>&1 &
echo "$$ $!" > "$FAKE_PIDS.tmp" && mv "$FAKE_PIDS.tmp" "$FAKE_PIDS"
wait
"""


def _fake(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(FAKE)
    path.chmod(0o755)
    return path


def _group_members(pgid: int) -> list[int]:
    """Live processes (zombies aside) of process group `pgid`."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _interrupt_during_probe(tmp_path: Path, fake: Path, args: list[str],
                            signum: int) -> tuple[subprocess.Popen[str], list[int]]:
    pids_file = tmp_path / "fake.pids"
    env = {**cli_env(tmp_path / "state"), "FAKE_PYTHON": sys.executable,
           "FAKE_PIDS": str(pids_file)}
    topology = tmp_path / "t.yaml"
    topology.write_text(
        "name: probe\nmodel: fake-model\ndevice: cpu\n"
        f"engine: {{command: [{str(fake)!r}, serve]}}\n"
        # A custom EC connector, so that `up` probes the engines' Python for it.
        f"cache: {{dir: {str(tmp_path / 'shm')!r}, connector: 'no_such_pkg.ec:Connector'}}\n"
        "roles: {encode: {}, prefill_decode: {}}\n")
    proc = spawn_epdctl(env, *args, str(topology))
    try:
        wait_for(pids_file.exists, timeout_s=60)
        probe = [int(p) for p in pids_file.read_text().split()]
        assert all(is_running(p) for p in probe)  # serving, as epdctl waits on it
        os.kill(proc.pid, signum)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc, probe


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(("command", "fake_name"), [
    ("doctor", "vllm"),  # a shell script: no Python to probe, so `--version` is first
    ("up", "python3"),  # the engines' Python itself: `up` probes it for the connector
])
def test_interrupt_stops_the_probe(tmp_path: Path, command: str, fake_name: str,
                                   signum: int) -> None:
    fake = _fake(tmp_path, fake_name)
    proc, (leader, helper) = _interrupt_during_probe(tmp_path, fake, [command], signum)
    try:
        # Click answers Ctrl+C with `Aborted!` and 1; SIGTERM ends epdctl as it ends anything.
        assert proc.returncode == (1 if signum == signal.SIGINT else -signal.SIGTERM)
        # epdctl SIGKILLed the probe's group before it exited; a killed process may still be
        # finishing its exit for a moment (state R), so wait for that, not for a duration.
        assert wait_for(lambda: _group_members(leader) == [], timeout_s=15), (
            _group_members(leader))
        assert not is_running(leader) and not is_running(helper)
    finally:
        for pid in (leader, helper):
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
