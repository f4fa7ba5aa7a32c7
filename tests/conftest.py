"""Shared fixtures: the `epdctl` CliRunner, free ports, and fake-server topologies."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.vllm_harness import free_ports


@pytest.fixture(autouse=True)
def _no_epdctl_env_left() -> Iterator[None]:
    """A test leaves epdctl's environment as it found it: an in-process `tune` on fake GPUs
    points EPDCTL_BENCH_COMMAND at the simulated load generator, and a later real-vLLM bench
    (a subprocess given this environment) would run that instead of `vllm bench serve`."""
    import os

    before = {k: v for k, v in os.environ.items() if k.startswith("EPDCTL_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("EPDCTL_")}
    if after != before:
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test left the environment changed: {changed}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """An async test's deadline ends the run with every thread's stack (pytest-timeout's
    "thread" method): the "signal" method raises inside the event loop, whose teardown
    can then hang past any deadline. Sync tests keep "signal" (they fail, the run goes on,
    their topologies are taken down). The test's own timeout, if it has one, is kept."""
    for item in items:
        if item.get_closest_marker("anyio") is None:
            continue
        marker = item.get_closest_marker("timeout")
        seconds = None
        if marker is not None:
            seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        item.add_marker(pytest.mark.timeout(seconds, method="thread"))


FAKE_SERVER = Path(__file__).parent / "fake_server.py"
FAKE_PROXY = shlex.join([sys.executable, str(FAKE_SERVER)])


@pytest.fixture
def state_root(tmp_path: Path) -> Iterator[Path]:
    """EPDCTL_STATE_DIR for a test; whatever a test leaves running there is stopped after it."""
    root = tmp_path / "state"
    root.mkdir()
    yield root
    from epdctl.launcher import scan_marked, stop_all

    for run_dir in root.iterdir():
        leftovers = scan_marked(run_dir)
        if leftovers:
            stop_all(leftovers, 2.0)
        remove_ipc_dirs(run_dir)


def remove_ipc_dirs(run_dir: Path) -> None:
    """The engines' IPC directories of a run a test did not `down` (outside the state dir,
    in the temp dir, where its path is too long for a socket's)."""
    from epdctl import ipc

    ipc.remove_all(run_dir)


@pytest.fixture
def epdctl(state_root: Path) -> Callable[..., Result]:
    """Run `epdctl ARGS...` in-process, as a user with a clean state root would."""

    from epdctl.cli import cli

    def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
        base = {"EPDCTL_STATE_DIR": str(state_root), "NO_COLOR": "1", "COLUMNS": "100",
                "EPDCTL_PROXY_COMMAND": FAKE_PROXY}
        return CliRunner().invoke(cli, list(args), env={**base, **(env or {})},
                                  catch_exceptions=False)

    return invoke


@pytest.fixture
def fake_topology(tmp_path: Path) -> Callable[..., Path]:
    """Write a `device: cpu` topology whose engines are tests/fake_server.py; returns its path."""

    def write(name: str = "fake", *, pd_args: tuple[str, ...] = (),
              encode_args: tuple[str, ...] | None = (), extra: str = "",
              cache: str = "") -> Path:
        base = free_ports(8)
        roles = ""
        if encode_args is not None:
            roles += f"  encode: {{args: {list(encode_args)!r}}}\n"
        roles += f"  prefill_decode: {{args: {list(pd_args)!r}}}\n"
        text = (
            f"name: {name}\nmodel: fake-model\ndevice: cpu\n"
            f"engine: {{command: [{sys.executable!r}, {str(FAKE_SERVER)!r}]}}\n"
            f"cache: {{dir: {str(tmp_path / 'shm')!r}{', ' + cache if cache else ''}}}\n"
            f"ports: {{base: {base}, side_channel_base: {base + 5}}}\n"
            f"proxy: {{port: {base + 4}}}\n{extra}roles:\n{roles}"
        )
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        return path

    return write


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lingers until init reaps it)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_pids(state_root: Path, name: str = "fake") -> dict[str, int]:
    """Recorded pids (supervisor included) of a run, from state.json or last-run.json."""
    from epdctl.state import RunState

    run_dir = state_root / name
    path = run_dir / "state.json"
    if not path.exists():
        path = run_dir / "last-run.json"
    state = RunState.model_validate_json(path.read_text())
    pids = {n: r.pid for n, r in state.records.items()}
    if state.supervisor:
        pids["supervisor"] = state.supervisor.pid
    return pids
