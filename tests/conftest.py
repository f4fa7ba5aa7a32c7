"""Shared fixtures: the `epdctl` CliRunner, free ports, fake-server topologies, and for the
modules that run real vLLM the tiny models and the session's baseline servers."""

from __future__ import annotations

import functools
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tests.baselines import Baselines
from tests.harness import free_ports, stop_marked
from tests.harness import is_running as is_running  # re-exported for the suite


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


VLLM_SCOPE = "real vLLM"
TESTS = Path(__file__).parent


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n N` (pytest-xdist), every module runs whole on one worker (its module
    fixtures once), and the modules that start real vLLM (marked e2e) all on one worker, one
    after another: they share the session's baselines there, and each is CPU-bound (two at
    once would only slow both, and could see each other's files in /dev/shm and /tmp, which
    their leftover checks look at). The other modules run beside them on the other workers.
    (`--dist loadgroup` would say this with markers, but pytest-xdist 3.8 cannot rename a
    test under pytest 9.2, so its groups are lost.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return Scheduling(config, log)


def scope_of(nodeid: str) -> str:
    """The scope a test runs in under `-n N`: VLLM_SCOPE, or its module."""
    module = nodeid.split("::", 1)[0]
    return VLLM_SCOPE if runs_real_vllm(module) else module


@functools.cache
def runs_real_vllm(module: str) -> bool:
    """Whether a test module (a path from the rootdir) starts real vLLM: tests/e2e, and every
    module marked e2e (its `pytestmark`)."""
    path = TESTS.parent / module
    return TESTS / "e2e" in path.parents or "pytest.mark.e2e" in path.read_text()


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


def _tiny_model(kind: str, request: pytest.FixtureRequest) -> Path:
    pytest.importorskip("vllm", reason="e2e tests need vLLM (scripts/setup-cpu.sh)")
    import os

    from epdctl.dev.tiny_models import CACHE_ENV, ensure_model

    # Built once into the pytest cache (reused across runs while the recipe is unchanged),
    # or this run's temp dir under `-p no:cacheprovider`; $EPDCTL_TINY_MODEL_DIR overrides.
    cache = getattr(request.config, "cache", None)
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    elif cache is not None:
        root = cache.mkdir("tiny-models")
    else:
        root = request.getfixturevalue("tmp_path_factory").getbasetemp() / "tiny-models"
    return ensure_model(kind, root)


@pytest.fixture(scope="session")
def tiny_llava(request: pytest.FixtureRequest) -> Path:
    """Directory of the tiny random-weight LLaVA (CLIP 56 px, 16 image tokens, Llama LM)."""
    return _tiny_model("llava", request)


@pytest.fixture(scope="session")
def tiny_qwen2vl(request: pytest.FixtureRequest) -> Path:
    """Directory of the tiny random-weight Qwen2-VL (M-RoPE, images up to 112x112)."""
    return _tiny_model("qwen2vl", request)


@pytest.fixture(scope="session")
def tiny_qwen2audio(request: pytest.FixtureRequest) -> Path:
    """Directory of the tiny random-weight Qwen2-Audio (Whisper-style tower, Qwen2 LM)."""
    return _tiny_model("qwen2audio", request)


@pytest.fixture(scope="session")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Baselines]:
    """The session's aggregated servers (tests/baselines.py), stopped at its end."""
    pool = Baselines(tmp_path_factory.mktemp("baselines"))
    try:
        yield pool
    finally:
        pool.stop_all()


FAKE_SERVER = Path(__file__).parent / "fake_server.py"
FAKE_PROXY = shlex.join([sys.executable, str(FAKE_SERVER)])


@pytest.fixture
def state_root(tmp_path: Path) -> Iterator[Path]:
    """EPDCTL_STATE_DIR for a test; whatever a test leaves running there is stopped after it."""
    root = tmp_path / "state"
    root.mkdir()
    yield root
    for run_dir in root.iterdir():
        # With the engines' IPC directories a test did not `down` (outside the state dir,
        # in the temp dir, where its path is too long for a socket's).
        stop_marked(run_dir, 2.0)


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


def run_pids(state_root: Path, name: str = "fake") -> dict[str, int]:
    """Recorded pids (supervisor included) of a run, from state.json or last-run.json."""
    from epdctl.launch.state import RunState

    run_dir = state_root / name
    path = run_dir / "state.json"
    if not path.exists():
        path = run_dir / "last-run.json"
    state = RunState.model_validate_json(path.read_text())
    pids = {n: r.pid for n, r in state.records.items()}
    if state.supervisor:
        pids["supervisor"] = state.supervisor.pid
    return pids
