"""What a running topology holds outside its state dir (unix sockets, /tmp files, named
semaphores), seen from its processes, so that a test can show `down` leaves none of it."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TMP = Path(tempfile.gettempdir())
SHM = Path("/dev/shm")


def run_processes(run: Any) -> list[Any]:
    """Every live process in a group the run recorded (engines' workers too)."""
    import psutil

    state = run.state()
    groups = {r.pgid for r in state.records.values()}
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) in groups:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def _unix_paths() -> dict[int, str]:
    """Bound unix sockets by inode (/proc/net/unix; abstract ones, `@…`, have no file)."""
    paths = {}
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/"):
                paths[int(fields[6])] = fields[7]
    return paths


@dataclass(frozen=True)
class Held:
    """Files of a running topology outside its state dir."""

    sockets: frozenset[str]
    """Paths of the unix sockets its processes have open (vLLM's ZMQ IPC endpoints)."""
    tmp_files: frozenset[str]
    """Other files under the temp dir its processes have open."""


def held(run: Any) -> Held:
    unix = _unix_paths()
    sockets, files = set(), set()
    for proc in run_processes(run):
        fd_dir = f"/proc/{proc.pid}/fd"
        try:
            links = [os.readlink(f"{fd_dir}/{fd}") for fd in os.listdir(fd_dir)]
        except OSError:
            continue
        for link in links:
            if link.startswith("socket:[") and int(link[8:-1]) in unix:
                sockets.add(unix[int(link[8:-1])])
            elif link.startswith(f"{TMP}/") and not link.startswith(f"{run.state_root}/"):
                files.add(link.removesuffix(" (deleted)"))  # (its logs stay, in the state dir)
    return Held(frozenset(sockets), frozenset(files))


def tmp_sockets() -> set[str]:
    """Unix sockets right in the temp dir (where vLLM puts its IPC endpoints by default)."""
    import stat

    found = set()
    try:
        entries = list(os.scandir(TMP))
    except OSError:
        return found
    for entry in entries:
        try:
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                found.add(entry.path)
        except OSError:
            continue
    return found


def semaphores() -> set[str]:
    """Named semaphores (Python multiprocessing's `sem.mp-*`) in /dev/shm."""
    try:
        return {str(SHM / n) for n in os.listdir(SHM) if n.startswith("sem.")}
    except OSError:
        return set()


def unmapped(paths: set[str]) -> set[str]:
    """Those of `paths` (in /dev/shm) that no live process maps: nobody's any more."""
    inodes = set()
    for proc_dir in Path("/proc").iterdir():
        try:
            text = (proc_dir / "maps").read_text() if proc_dir.name.isdigit() else ""
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                inodes.add(int(fields[4]))
    found = set()
    for path in paths:
        try:
            if os.stat(path).st_ino not in inodes:
                found.add(path)
        except OSError:
            continue
    return found


def ipc_dirs(run: Any) -> set[Path]:
    """The instances' IPC directories (VLLM_RPC_BASE_PATH) that epdctl made for the run."""
    from epdctl.host import ipc

    state = run.state()
    return {p for s in state.specs
            if (p := ipc.ours(s.env, run.run_dir, s.name)) is not None}


def check_held_privately(run: Any) -> Held:
    """While it runs: it has IPC sockets, every one in an IPC directory of the run."""
    now = held(run)
    dirs = ipc_dirs(run)
    assert now.sockets, "the run has no unix socket: the checks after `down` prove nothing"
    assert {s for s in now.sockets if not any(Path(s).parent == d for d in dirs)} == set(), (
        dirs, now.sockets)
    return now


def check_nothing_left(before: Held, dirs: set[Path]) -> None:
    """After `down`: none of the sockets or temp files it held, nor its IPC directories."""
    assert [p for p in (*before.sockets, *before.tmp_files) if os.path.lexists(p)] == []
    assert [d for d in dirs if d.exists()] == []
