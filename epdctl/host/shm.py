"""Files an instance maps from /dev/shm, released once its process group is gone.

vLLM's processes talk through shared-memory files (`psm_*` message queues of hundreds of
MiB; Python multiprocessing's named semaphores, `sem.mp-*`) that they unlink on a clean
exit. A SIGKILLed engine leaves them behind (its resource tracker dies with it), and tmpfs
keeps them until someone unlinks them: the supervisor and `down` do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
_PROC = Path("/proc")
_DELETED = " (deleted)"


def _maps(pid: int) -> tuple[set[str], set[int]]:
    """The files right in /dev/shm that `pid` maps: their paths, and every mapped /dev/shm
    inode (a named semaphore shows as the temporary name sem_open made it under and then
    unlinked, `sem.XXXXXX (deleted)`: only its inode still names it)."""
    try:
        text = (_PROC / str(pid) / "maps").read_text()
    except OSError:
        return set(), set()
    paths, inodes = set(), set()
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""  # anonymous mappings have no path
        # Only files right in /dev/shm: the EC store's entries live in sub-directories and
        # are the janitor's business.
        if path.startswith(f"{SHM}/") and "/" not in path[len(str(SHM)) + 1:]:
            inodes.add(int(parts[4]))
            if not path.endswith(_DELETED):
                paths.add(path)
    return paths, inodes


def _pids() -> list[int]:
    try:
        return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def _semaphores_of(inodes: set[int]) -> set[str]:
    """The named semaphores (`sem.*`) in /dev/shm whose inode is one of `inodes`."""
    found = set()
    try:
        with os.scandir(SHM) as entries:
            for entry in entries:
                if entry.name.startswith("sem.") and entry.inode() in inodes:
                    found.add(entry.path)
    except OSError:
        pass
    return found


def mapped_files(pgid: int) -> list[str]:
    """The /dev/shm files the processes of group `pgid` map right now, named semaphores
    (Python multiprocessing's `sem.mp-*`) included."""
    files: set[str] = set()
    inodes: set[int] = set()
    for pid in _pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:
            continue
        paths, mapped = _maps(pid)
        files |= paths
        inodes |= mapped
    return sorted(files | _semaphores_of(inodes))


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def release(paths: Iterable[str]) -> list[str]:
    """Unlink the files no live process maps any more; returns those removed."""
    wanted = {p for p in paths if p.startswith(f"{SHM}/")}
    if not wanted:
        return []
    in_use: set[int] = set()  # inodes, so a semaphore mapped under its temporary name counts
    for pid in _pids():
        in_use |= _maps(pid)[1]
    removed = []
    for path in sorted(wanted):
        inode = _inode(path)
        if inode is None or inode in in_use:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError:
            continue  # not ours to remove after all (permissions): leave it
    return removed
