"""Process groups: spawn, health probes, log tails, and stop_all (SIGTERM, deadline, SIGKILL)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from epdctl.host import ipc
from epdctl.host.private import open_append
from epdctl.launch.identity import start_ticks, still_ours
from epdctl.launch.readiness import probe
from epdctl.launch.spec import LaunchSpec
from epdctl.launch.state import Record

__all__ = ["Proc", "StopResult", "describe_failure", "exit_text", "group_alive", "likely_cause",
           "probe", "scan_marked", "spawn", "stop_all", "tail"]

STOP_TIMEOUT_S = 30.0
TAIL_LINES = 40
# Every process we start carries these, so `down --force` can find it by identity even when
# state.json is gone. Not EPDCTL_STATE_DIR: that is the CLI's root option, and an epdctl run
# inside an instance would then look in the wrong place.
MARK_DIR = "EPDCTL_RUN_DIR"
MARK_NAME = "EPDCTL_INSTANCE"

_CAUSES = (
    (re.compile(r"out of memory|OutOfMemoryError|\bOOM\b|^Killed\s*$", re.I | re.M),
     "out of memory: lower gpu_memory_utilization or --max-model-len, or free memory"),
    (re.compile(r"address already in use|EADDRINUSE|Errno 98", re.I),
     "address already in use: another process holds the port (see `ss -ltnp`)"),
    (re.compile(r"ModuleNotFoundError|ImportError|No module named", re.I),
     "a missing Python package (is vLLM installed in this environment? pip install -e '.[vllm]')"),
    (re.compile(r"NVML|CUDA driver|no CUDA-capable device|cudaError|CUDA error|"
                r"Driver Not Loaded|nvidia-smi", re.I),
     "a CUDA/NVML driver problem (check `nvidia-smi` and CUDA_VISIBLE_DEVICES)"),
)


@dataclass
class Proc:
    """A process group epdctl started (popen set) or found again from state.json."""

    name: str
    pid: int
    pgid: int
    create_time: float
    popen: subprocess.Popen[bytes] | None = None
    start_ticks: int | None = None

    @classmethod
    def of(cls, record: Record) -> Proc:
        return cls(record.name, record.pid, record.pgid, record.create_time,
                   start_ticks=record.start_ticks)


@dataclass
class StopResult:
    stopped: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    """Still alive at the deadline: got SIGKILL."""
    stale: list[str] = field(default_factory=list)
    """Recorded pid now belongs to another process: never signalled."""


def spawn(spec: LaunchSpec, run_dir: Path) -> Proc:
    """Start spec in a new session, output appended to its log file."""
    import psutil

    env = {**os.environ, **spec.env, MARK_DIR: str(run_dir), MARK_NAME: spec.name}
    if (rpc := ipc.ours(spec.env, run_dir, spec.name)) is not None:
        ipc.make(rpc)
    with open_append(spec.log_path) as log:  # 0600: a log shows prompts' traces
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        log.write(f"--- epdctl start {stamp} {shlex.join(spec.argv)}\n".encode())
        log.flush()
        # A session per instance: terminal Ctrl+C reaches only epdctl, and one killpg
        # reaches vLLM's engine-core and worker grandchildren.
        popen = subprocess.Popen(
            spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        created = psutil.Process(popen.pid).create_time()
    except psutil.NoSuchProcess:  # died at once and was reaped by no one yet: keep going
        created = time.time()
    return Proc(spec.name, popen.pid, popen.pid, created, popen, start_ticks(popen.pid))


def tail(path: Path, n: int = TAIL_LINES) -> list[str]:
    """The last n lines of a text file (empty if it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024 * max(1, n // 40)))
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


def likely_cause(lines: Iterable[str], returncode: int | None = None) -> str | None:
    """A one-line guess at why a process died, from its log tail."""
    text = "\n".join(lines)
    for pattern, cause in _CAUSES:
        if pattern.search(text):
            return cause
    if returncode == -signal.SIGKILL:
        return "killed by SIGKILL (often the kernel OOM killer: see `dmesg`)"
    return None


def describe_failure(name: str, what: str, log_path: Path, returncode: int | None = None) -> str:
    """`name` what; last lines of log: ... likely cause: ...  (the StartupError text)."""
    lines = tail(log_path)
    body = "\n".join(f"  {line}" for line in lines) or "  (the log is empty)"
    message = f"`{name}` {what}; last lines of {log_path}:\n{body}"
    cause = likely_cause(lines, returncode)
    return f"{message}\nlikely cause: {cause}" if cause else message


def exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def group_alive(pgid: int, popen: subprocess.Popen[bytes] | None = None) -> bool:
    """Whether any process of the group is alive; reaps our own zombie leader first."""
    if popen is not None:
        popen.poll()  # a zombie leader would keep killpg(pgid, 0) succeeding
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    # Someone else's zombie leader (its parent not reaping yet) also answers killpg.
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue
    if popen is not None:
        popen.poll()  # it became a zombie since the first poll: reap it now
    return False


def _signal(proc: Proc, sig: int) -> bool:
    try:
        os.killpg(proc.pgid, sig)
        return True
    except ProcessLookupError:
        return False


def stop_all(
    procs: Sequence[Proc],
    timeout_s: float = STOP_TIMEOUT_S,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    is_alive: Callable[[Proc], bool] | None = None,
    should_force: Callable[[], bool] = lambda: False,
) -> StopResult:
    """SIGTERM every group in order, wait on one shared deadline, SIGKILL the survivors."""
    alive_fn = is_alive or (lambda p: group_alive(p.pgid, p.popen))
    result = StopResult()
    pending: list[Proc] = []
    for proc in procs:
        # A dead leader cannot be reused while its group lives; a live one must still be ours.
        if proc.popen is None and still_ours(proc) is None:
            result.stale.append(proc.name)
        elif _signal(proc, signal.SIGTERM):
            pending.append(proc)
        else:
            result.stopped.append(proc.name)
    deadline = clock() + timeout_s
    while pending:
        for proc in [p for p in pending if not alive_fn(p)]:
            pending.remove(proc)
            result.stopped.append(proc.name)
        if not pending or clock() >= deadline or should_force():
            break
        sleep(0.05)
    for proc in pending:
        _signal(proc, signal.SIGKILL)
        result.killed.append(proc.name)
    for proc in pending:
        end = clock() + 5.0
        while alive_fn(proc) and clock() < end:
            sleep(0.05)
    return result


def scan_marked(run_dir: Path) -> list[Proc]:
    """Processes whose environment marks them as started for run_dir, one per group."""
    import psutil

    found: dict[int, Proc] = {}
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            env = proc.environ()
            if env.get(MARK_DIR) != str(run_dir) or MARK_NAME not in env:
                continue
            pgid = os.getpgid(proc.pid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
        if pgid == proc.pid or pgid not in found:
            found[pgid] = Proc(env[MARK_NAME], proc.pid, pgid, proc.info["create_time"],
                               start_ticks=start_ticks(proc.pid))
    return list(found.values())


