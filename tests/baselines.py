"""Aggregated vLLM servers shared by the whole session: the references answers are compared
with, one per (model, flags), started on first use and stopped when the session ends.

A CPU start is ~20 s of two cores' time; each e2e module used to start its own baseline of
the same model with the same flags. A baseline only answers (temperature 0, a decisive tiny
model: tests/README.md), so what one module asked it changes no answer another gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.harness import Server, ServerStartError, start_engine, stop_servers, wait_all_ready

READY_TIMEOUT_S = 400.0

# The flags each model's baseline runs with, wherever it is asked for (more flags, more
# servers: keep one set a model unless answers would differ).
QWEN2VL_ARGS: tuple[str, ...] = ("--limit-mm-per-prompt", '{"image": 2, "video": 2}')
AUDIO_ARGS: tuple[str, ...] = ("--limit-mm-per-prompt", '{"audio": 2}', "--max-model-len",
                               "1024", "--max-num-batched-tokens", "1024")


class Baselines:
    """The session's baselines by (model dir, extra flags)."""

    def __init__(self, logs: Path) -> None:
        self._logs = logs
        self._servers: dict[tuple[str, tuple[str, ...]], Server] = {}

    def start(self, model: Path, args: Sequence[str] = ()) -> Server:
        """The baseline for `model` with `args`, starting it if none runs (not waited for:
        `ready` waits, so that it can start beside a topology)."""
        key = (str(model), tuple(args))
        server = self._servers.get(key)
        if server is None or not server.alive():
            name = f"baseline-{Path(model).name}-{len(self._servers)}"
            server = start_engine(model, log_path=self._logs / f"{name}.log", name=name, args=args)
            self._servers[key] = server
        return server

    def ready(self, model: Path, args: Sequence[str] = ()) -> Server:
        """The baseline for `model` with `args`, answering /health (started if need be)."""
        server = self.start(model, args)
        try:
            wait_all_ready([server], READY_TIMEOUT_S)
        except ServerStartError:
            self._servers.pop((str(model), tuple(args)), None)  # stopped by wait_all_ready
            raise
        return server

    def stop_all(self) -> None:
        stop_servers(self._servers.values())
        self._servers.clear()
