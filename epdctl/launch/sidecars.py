"""Processes that serve a run beside its supervisor, not supervised by it (the rebalancer):
each started in a session of its own, marked for the run (`down --force` finds it), and
recorded in `<run dir>/sidecars/<name>.json`, so that `down` stops it with the rest. A
sidecar leaves by itself once the run is no longer running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from epdctl.host.private import open_append, write_file
from epdctl.launch.identity import start_ticks
from epdctl.launch.processes import MARK_DIR, MARK_NAME, Proc
from epdctl.launch.state import Record

FOLDER = "sidecars"


def spawn(run_dir: Path, name: str, argv: list[str]) -> None:
    """Start `argv` as the run's sidecar `name` (its output to logs/<name>.log)."""
    env = {**os.environ, MARK_DIR: str(run_dir), MARK_NAME: name}
    with open_append(run_dir / "logs" / f"{name}.log") as log:
        popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    import psutil

    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.Error:
        return  # gone at once: nothing to stop
    record = Record(name=name, pid=popen.pid, pgid=popen.pid, create_time=create_time,
                    start_ticks=start_ticks(popen.pid), started_at=time.time())
    folder = run_dir / FOLDER
    folder.mkdir(mode=0o700, exist_ok=True)
    write_file(folder / f"{name}.json", record.model_dump_json().encode())


def recorded(run_dir: Path) -> list[Proc]:
    """The run's sidecars as `down` stops them."""
    try:
        paths = sorted((run_dir / FOLDER).glob("*.json"))
    except OSError:
        return []
    procs = []
    for path in paths:
        try:
            procs.append(Proc.of(Record.model_validate_json(path.read_bytes())))
        except (OSError, ValidationError):
            continue
    return procs


def forget(run_dir: Path) -> None:
    for path in (run_dir / FOLDER).glob("*.json"):
        path.unlink(missing_ok=True)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
