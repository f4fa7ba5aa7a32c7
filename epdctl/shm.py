"""Files an instance maps from /dev/shm, released once its process group is gone.

vLLM's processes talk through shared-memory files (`psm_*` message queues of hundreds of
MiB, `sem.*`) that they unlink on a clean exit. A SIGKILLed engine leaves them behind, and
tmpfs keeps their memory until someone unlinks them: the supervisor and `down` do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
_PROC = Path("/proc")


def _maps(pid: int) -> set[str]:
    try:
        text = (_PROC / str(pid) / "maps").read_text()
    except OSError:
        return set()
    found = set()
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""  # anonymous mappings have no path
        # Only files right in /dev/shm: the EC store's entries live in sub-directories and
        # are the janitor's business.
        if path.startswith(f"{SHM}/") and "/" not in path[len(str(SHM)) + 1:]:
            found.add(path)
    return found


def _pids() -> list[int]:
    try:
        return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def mapped_files(pgid: int) -> list[str]:
    """The /dev/shm files the processes of group `pgid` map right now."""
    files: set[str] = set()
    for pid in _pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:
            continue
        files |= _maps(pid)
    return sorted(files)


def release(paths: Iterable[str]) -> list[str]:
    """Unlink the files no live process maps any more; returns those removed."""
    wanted = {p for p in paths if p.startswith(f"{SHM}/")}
    if not wanted:
        return []
    in_use: set[str] = set()
    for pid in _pids():
        in_use |= _maps(pid) & wanted
    removed = []
    for path in sorted(wanted - in_use):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue  # not ours to remove after all (permissions): leave it
    return removed
