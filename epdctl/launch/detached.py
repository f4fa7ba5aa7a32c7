"""`up -d`: the supervisor loop in a process of its own (`python -m epdctl.launch.detached`),
started in a session of its own with the run's lock handed over."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from epdctl.errors import EpdctlError
from epdctl.host.private import open_append
from epdctl.launch.identity import start_ticks
from epdctl.launch.readiness import STARTUP_TIMEOUT_S
from epdctl.launch.state import Record, StateDir
from epdctl.launch.supervisor import Supervisor


def self_record() -> Record:
    """This process as a Record (the detached supervisor writes itself into state.json)."""
    import psutil

    me = psutil.Process()
    return Record(name="supervisor", pid=me.pid, pgid=os.getpgid(0),
                  create_time=me.create_time(), start_ticks=start_ticks(me.pid),
                  started_at=time.time())


def spawn_detached(sdir: StateDir, lock_fd: int, timeout_s: float) -> subprocess.Popen[bytes]:
    """Start `python -m epdctl.launch.detached` in a session of its own, handing it the lock."""
    from epdctl.launch.processes import MARK_DIR, MARK_NAME

    log_path = sdir.logs_dir / "supervisor.log"
    argv = [sys.executable, "-m", "epdctl.launch.detached", str(sdir.path),
            "--lock-fd", str(lock_fd), "--timeout", str(timeout_s)]
    env = {**os.environ, MARK_DIR: str(sdir.path), MARK_NAME: "supervisor"}
    with open_append(log_path) as log:
        # The child inherits our locked open file, so the lock passes to it without a gap.
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(lock_fd,))


def main(argv: list[str] | None = None) -> int:
    """`python -m epdctl.launch.detached STATE_DIR --lock-fd N --timeout S`: the `up -d` loop."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m epdctl.launch.detached")
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--lock-fd", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=STARTUP_TIMEOUT_S)
    args = parser.parse_args(argv)
    sdir = StateDir(args.state_dir)
    sdir.adopt_lock(args.lock_fd)
    try:
        state = sdir.read()
        state.supervisor = self_record()
        sdir.write(state)
        return Supervisor(sdir, state, timeout_s=args.timeout).run()
    except EpdctlError as exc:
        print(f"epdctl: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
