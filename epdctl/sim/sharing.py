"""Fake GPUs shared across processes: a directory per GPU, a busy mark per stepping instance.

Each fake engine marks the GPUs it runs on (CUDA_VISIBLE_DEVICES) while a step runs; when a
step starts, the marks of other live processes on its GPUs are its busy neighbours, and the
cost model stretches the step by them. Plain files, so any number of processes agree.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

SIM_DIR_ENV = "EPDCTL_SIM_DIR"
RUN_DIR_ENV = "EPDCTL_RUN_DIR"  # the launcher's mark (epdctl.launch.processes.MARK_DIR)


def sim_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$EPDCTL_SIM_DIR, else `sim-gpus` in the run's state dir, else one under /tmp."""
    environ = os.environ if environ is None else environ
    if environ.get(SIM_DIR_ENV):
        return Path(environ[SIM_DIR_ENV])
    if environ.get(RUN_DIR_ENV):
        return Path(environ[RUN_DIR_ENV]) / "sim-gpus"
    return Path(tempfile.gettempdir()) / f"epdctl-sim-{os.getuid()}"


class GpuShare:
    """This process's busy marks on its fake GPUs."""

    def __init__(self, root: Path, gpus: Sequence[str], pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.dirs = [root / f"gpu-{gpu}" for gpu in gpus]
        for path in self.dirs:
            path.mkdir(parents=True, exist_ok=True)

    def neighbours(self) -> int:
        """Other live processes busy on the busiest of my GPUs now."""
        most = 0
        for path in self.dirs:
            count = 0
            for mark in path.glob("*.busy"):
                pid = int(mark.stem) if mark.stem.isdigit() else -1
                if pid != self.pid and pid > 0 and psutil.pid_exists(pid):
                    count += 1
            most = max(most, count)
        return most

    def busy(self, is_busy: bool) -> None:
        """Set or clear my mark on each of my GPUs."""
        for path in self.dirs:
            mark = path / f"{self.pid}.busy"
            if is_busy:
                mark.touch()
            else:
                mark.unlink(missing_ok=True)
