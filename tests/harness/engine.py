"""Engines started outside a topology (baselines, a bare E and PD): epdctl's own spawn and
stop_all, so each runs as `epdctl up` runs an instance (its own session, marked with its
run dir, an IPC directory of its own) and is stopped by process group."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from epdctl.host import ipc
from epdctl.host.shm import mapped_files, release
from epdctl.launch.plan import CPU_IN_PROCESS_WORKER
from epdctl.launch.processes import Proc, describe_failure, exit_text, group_alive, spawn, stop_all
from epdctl.launch.readiness import is_ready
from epdctl.launch.spec import LaunchSpec
from tests.harness.ports import free_port

# The flags that worked on a 2-core CPU machine (see /work/shared/vllm-cpu.md).
CPU_ARGS: tuple[str, ...] = (
    "--dtype", "float32",
    "--max-model-len", "512",
    "--max-num-seqs", "4",
    "--max-num-batched-tokens", "512",
    "--enforce-eager",
    "--limit-mm-per-prompt", '{"image":2}',
    "--kv-cache-memory-bytes", "64M",
)
CPU_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    # The worker in the engine core's process, as `epdctl up` starts a CPU instance.
    CPU_IN_PROCESS_WORKER[0]: CPU_IN_PROCESS_WORKER[1],
}
ENGINE_MODULE = "epdctl.engines.vllm_cpu"
READY_TIMEOUT_S = 240.0
PROCESS_READY_S = 60.0
"""For a process that imports no vLLM (a proxy)."""
STOP_TIMEOUT_S = 20.0
POLL_S = 0.5
_cores = itertools.count()


def next_core() -> str:
    """Round-robin core for VLLM_CPU_OMP_THREADS_BIND (the default pins all to core 0)."""
    return str(next(_cores) % (os.cpu_count() or 1))


class ServerStartError(RuntimeError):
    """A server exited or missed its deadline while starting."""


@dataclass
class Server:
    """One process group started by start_engine() or start_process()."""

    spec: LaunchSpec
    run_dir: Path
    """Its mark (launcher.MARK_DIR): scan_marked(run_dir) finds it even if this object is lost."""
    proc: Proc
    model: str = ""
    shm_files: list[str] = field(default_factory=list)
    """/dev/shm files it mapped (vLLM's queues outlive a SIGKILLed server): released by stop."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def port(self) -> int:
        return self.spec.port

    @property
    def log_path(self) -> Path:
        return self.spec.log_path

    @property
    def argv(self) -> tuple[str, ...]:
        return self.spec.argv

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (the server root: /health, /metrics)."""
        return self.spec.url

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return f"{self.url}/v1"

    def alive(self) -> bool:
        return self.proc.popen is None or self.proc.popen.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True when GET /health answers 200."""
        return is_ready(self.spec.health_url, timeout_s)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def note_shm(self) -> None:
        """Remember the /dev/shm files its group maps now (before it is signalled)."""
        self.shm_files = sorted(set(self.shm_files) | set(mapped_files(self.proc.pgid)))

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        stop_servers([self], timeout_s)


def start_process(spec: LaunchSpec, run_dir: Path, *, model: str = "") -> Server:
    """Spawn `spec` as epdctl spawns an instance: launcher.spawn (own session, log appended,
    marked for run_dir, its IPC directory made when its env names one of run_dir's)."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    return Server(spec, run_dir, spawn(spec, run_dir), model)


def start_engine(
    model: str | Path,
    *,
    log_path: str | Path,
    port: int | None = None,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    python: str = sys.executable,
) -> Server:
    """Spawn `python -m epdctl.engines.vllm_cpu serve MODEL` in its own process group.

    CPU_ARGS come first, so `args` can override any of them (argparse keeps the last). Its
    run dir is the log's directory; its IPC sockets and temp files go where epdctl's plan
    puts an instance's (epdctl/host/ipc.py), unless `env` names a VLLM_RPC_BASE_PATH.
    """
    port = port or free_port()
    log_path = Path(log_path)
    run_dir = log_path.parent
    name = name or f"vllm-{port}"
    full_env = {**CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": next_core(), **(env or {})}
    if ipc.RPC_ENV not in {**os.environ, **full_env}:  # vLLM's sockets would stay in /tmp
        full_env = {**ipc.engine_env(run_dir, name), **full_env}
    spec = LaunchSpec(name=name, role="prefill_decode",
                      command=(python, "-m", ENGINE_MODULE, "serve", str(model)), port=port,
                      log_path=log_path, args=(*CPU_ARGS, *args), env=full_env)
    return start_process(spec, run_dir, model=str(model))


def proxy_spec(name: str, log_path: Path, args: Sequence[str],
               env: Mapping[str, str] | None = None) -> LaunchSpec:
    """`python -m epdctl.proxy ARGS` on a free port (upstreams and knobs in `args`)."""
    return LaunchSpec(name=name, role="proxy", command=(sys.executable, "-m", "epdctl.proxy"),
                      port=free_port(), log_path=log_path, args=tuple(args), env=dict(env or {}))


def with_port(spec: LaunchSpec, name: str, port: int, log_path: Path,
              args: Sequence[str] = ()) -> LaunchSpec:
    """Another process like `spec` (a second proxy): its name, port, log, and `args` added."""
    return replace(spec, name=name, port=port, log_path=log_path, args=(*spec.args, *args))


@contextmanager
def process_up(spec: LaunchSpec, run_dir: Path,
               timeout_s: float = PROCESS_READY_S) -> Iterator[Server]:
    """start_process, then ready (/health 200) within `timeout_s`; stopped on the way out."""
    server = start_process(spec, run_dir)
    try:
        wait_all_ready([server], timeout_s)
        yield server
    finally:
        stop_servers([server])


def wait_all_ready(
    servers: Iterable[Server], timeout_s: float = READY_TIMEOUT_S, *,
    stop_on_failure: bool = True,
) -> None:
    """Wait until every server answers /health 200; on a death or the deadline, raise."""
    servers = list(servers)
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            for server in list(pending):
                if not server.alive():
                    code = server.proc.popen.returncode if server.proc.popen else -1
                    raise ServerStartError(describe_failure(
                        server.name, f"{exit_text(code)} while starting", server.log_path, code))
                if server.healthy():
                    pending.remove(server)
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"== {s.name} ({s.log_path}):\n{s.log_tail(20)}" for s in pending)
                raise ServerStartError(f"not ready after {timeout_s:.0f}s:\n{tails}")
            time.sleep(POLL_S)
    except BaseException:
        if stop_on_failure:
            stop_servers(servers)
        raise


def stop_servers(servers: Iterable[Server], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """launcher.stop_all over their groups (SIGTERM all, one deadline, SIGKILL the rest),
    then their /dev/shm files and IPC directories."""
    servers = list(servers)
    for server in servers:
        server.note_shm()
    stop_all([s.proc for s in servers], timeout_s)
    for server in servers:
        if group_alive(server.proc.pgid, server.proc.popen):  # past stop_all's last wait
            continue
        release(server.shm_files)
        ipc.remove(ipc.ours(server.spec.env, server.run_dir, server.name))


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lingers until init reaps it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
