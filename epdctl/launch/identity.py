"""Whether a recorded pid is still the process epdctl started: its start, as the kernel
keeps it, told apart from a pid the system gave to another process since."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BOOT_TIME_SLACK_S = 2
"""Whole seconds a recorded start time may be off for the same process, where its start
ticks were not recorded (state written before they were). psutil gives a start as the
seconds since boot plus /proc/stat's `btime`, and btime moves whenever the clock is set or
slewed: by a second now and then on a VM, by minutes where NTP steps a fresh VM's clock."""


def start_ticks(pid: int) -> int | None:
    """When pid started, in clock ticks since boot (`starttime` of /proc/<pid>/stat): what the
    kernel keeps for the process's life, whatever happens to the clock. None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return int(stat.rpartition(b")")[2].split()[19])  # field 22; the name may hold ") "


def process_matches(pid: int, create_time: float, ticks: int | None = None) -> bool | None:
    """True: that very process is alive; False: gone (or a zombie); None: pid reused (stale).
    The process is the one recorded when it started on the recorded tick since boot; with no
    ticks recorded, when its start differs from `create_time` by whole seconds only, at most
    BOOT_TIME_SLACK_S of them (to the tick: 0.01 s)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if ticks is not None:
            now = start_ticks(pid)
            if now is None:
                return False  # gone since
            if now != ticks:
                return None
        else:
            off = proc.create_time() - create_time
            if abs(off - round(off)) > 0.01 or abs(round(off)) > BOOT_TIME_SLACK_S:
                return None
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return None


class Started(Protocol):
    """A process as recorded when it started (a Record, a Proc)."""

    @property
    def pid(self) -> int: ...
    @property
    def create_time(self) -> float: ...
    @property
    def start_ticks(self) -> int | None: ...


def still_ours(started: Started) -> bool | None:
    """process_matches for what was recorded of a process."""
    return process_matches(started.pid, started.create_time, started.start_ticks)
