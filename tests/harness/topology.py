"""Topologies started for real through epdctl's run API (prepare, start_detached, find, stop:
what `epdctl up -d` and `down` run), each in a temp state root, with what it leaves cleaned up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from epdctl.errors import EpdctlError
from epdctl.host import ipc
from epdctl.host.shm import release
from epdctl.launch.processes import STOP_TIMEOUT_S, scan_marked, stop_all
from epdctl.launch.run import PROXY_COMMAND_ENV, find, prepare, start_detached, stop
from epdctl.launch.state import RunState
from tests.e2e.leftovers import semaphores
from tests.harness.engine import Server, wait_all_ready
from tests.harness.ports import free_port, free_ports

if TYPE_CHECKING:
    from tests.baselines import Baselines

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = REPO / "topologies"
READY_TIMEOUT_S = 400


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


def write_topology(
    src: str, dest: Path, model: Path, *, env: Mapping[str, str] = (),  # type: ignore[assignment]
    role_env: Mapping[str, Mapping[str, str]] = (),  # type: ignore[assignment]
    proxy: Mapping[str, Any] = (),  # type: ignore[assignment]
) -> tuple[Path, Path]:
    """Copy topologies/<src>.yaml with free ports and a private store root under /dev/shm."""
    data = yaml.safe_load((TOPOLOGIES / f"{src}.yaml").read_text())
    engine = data.get("engine") or {}
    engine["env"] = {**engine.get("env", {}), **dict(env)}
    roles = data["roles"]
    for role, extra in dict(role_env).items():
        roles[role] = {**(roles.get(role) or {}), "env": {**dict(extra)}}
    cache_dir = Path(f"/dev/shm/epdctl-test-{uuid.uuid4().hex[:8]}")
    path = copy_topology(src, dest, model=model, cache_dir=cache_dir, engine=engine,
                         roles=roles)
    if proxy:
        data = yaml.safe_load(path.read_text())
        data["proxy"] = {**data["proxy"], **dict(proxy)}
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, cache_dir


def edit_topology(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """Load the topology YAML, let `change` edit the dict in place, write it back."""
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cli_env() -> dict[str, str]:
    """The environment a user's shell gives `python -m epdctl` (and `up` its supervisor)."""
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop(PROXY_COMMAND_ENV, None)
    env.pop("EPDCTL_STATE_DIR", None)
    return env


@dataclass
class TopologyRun:
    """A test copy of a topology, its state root, private EC store root and CLI env."""

    path: Path
    state_root: Path
    cache_dir: Path
    env: dict[str, str] = field(default_factory=cli_env)
    semaphores_before: frozenset[str] = frozenset()
    """The named semaphores in /dev/shm before it started (someone else's)."""

    @property
    def name(self) -> str:
        return str(yaml.safe_load(self.path.read_text())["name"])

    @property
    def run_dir(self) -> Path:
        return self.state_root / self.name

    def cli(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """`python -m epdctl ARGS` with this run's state dir, as a user would type it."""
        return subprocess.run(
            [sys.executable, "-m", "epdctl", "--state-dir", str(self.state_root), *args],
            env=self.env, text=True, capture_output=True, timeout=timeout_s,
        )

    def cli_json(self, *args: str) -> Any:
        result = self.cli(*args, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def state(self) -> RunState:
        """state.json (or last-run.json after `down`) as the RunState model."""
        path = self.run_dir / "state.json"
        if not path.exists():
            path = self.run_dir / "last-run.json"
        return RunState.model_validate_json(path.read_text())

    @property
    def proxy_url(self) -> str:
        return self.state().proxy.health_url.removesuffix("/health")

    def instance_url(self, instance: str) -> str:
        """An engine instance's root URL (what the proxy sends it requests on)."""
        spec = next(s for s in self.state().specs if s.name == instance)
        return spec.health_url.removesuffix("/health")

    def log(self, instance: str) -> str:
        return (self.run_dir / "logs" / f"{instance}.log").read_text(errors="replace")

    def is_up(self) -> bool:
        return (self.run_dir / "state.json").exists()


@contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ is `env` inside (the supervisor and engines inherit it), restored after."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_topology(run: TopologyRun, timeout_s: float = READY_TIMEOUT_S) -> RunState:
    """`up -d`: prepare and start_detached in the run's environment; returns once every
    instance is ready (StartupError, with the log tail, when one exits or misses the
    deadline: then nothing of it is left running)."""
    with _environ(run.env):
        return start_detached(prepare(run.path, run.state_root), timeout_s)


def stop_marked(run_dir: Path, timeout_s: float = 5.0) -> None:
    """Every process group marked as started for run_dir (launcher.MARK_DIR), and the IPC
    directories of its instances: what nothing recorded any more (`down --force`)."""
    if leftovers := scan_marked(run_dir):
        stop_all(leftovers, timeout_s)
    ipc.remove_all(run_dir)


def stop_topology(run: TopologyRun, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """`down` through the run API while it is up (a test may have run `down` itself), then
    whatever still carries its mark."""
    if run.is_up():
        sdir = find(run.state_root, run.name)
        try:
            state: RunState | None = sdir.read()
        except EpdctlError:
            state = None
        stop(sdir, state, timeout_s, should_scan=True)
    stop_marked(run.run_dir)


def _semaphores() -> set[str]:
    try:
        return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}
    except OSError:
        return set()


@contextmanager
def release_new_semaphores() -> Iterator[None]:
    """Unlink the Python multiprocessing semaphores (`sem.mp-*`) that appeared inside and
    that no live process maps: a SIGKILLed engine's helper processes can leave them, created
    after the last snapshot the supervisor took, so neither it nor `down` knows them."""
    before = _semaphores()
    try:
        yield
    finally:
        release(_semaphores() - before)


@contextmanager
def topology_up(path: Path, cache_dir: Path, state_root: Path, *,
                baseline: Server | None = None, should_remove_cache: bool = True,
                timeout_s: float = READY_TIMEOUT_S) -> Iterator[TopologyRun]:
    """Start the topology (and wait for the baseline starting meanwhile); stop it and clean
    up after: its store root too, unless `should_remove_cache` is off (a root it shares).
    The named semaphores there before it starts are someone else's to its leftover checks
    (an earlier run's that something killed, say)."""
    run = TopologyRun(path, state_root, cache_dir, cli_env(), frozenset(semaphores()))
    with release_new_semaphores():
        try:
            start_topology(run, timeout_s)
            if baseline is not None:
                wait_all_ready([baseline], timeout_s, stop_on_failure=False)
            yield run
        finally:
            stop_topology(run)
            if should_remove_cache:
                shutil.rmtree(cache_dir, ignore_errors=True)


@contextmanager
def topology_with_baseline(
    path: Path, cache_dir: Path, state_root: Path, baselines: Baselines, baseline_model: Path,
    baseline_args: Sequence[str] = (),
) -> Iterator[tuple[TopologyRun, Server]]:
    """Start the topology while the session's baseline for the model starts (if it is not
    up yet); stop and clean up after (the baseline stays, tests/baselines.py)."""
    base = baselines.start(baseline_model, baseline_args)
    with topology_up(path, cache_dir, state_root, baseline=base) as run:
        yield run, baselines.ready(baseline_model, baseline_args)


@contextmanager
def edited_topology(src: str, tmp: Path, model: Path, cache_dir: Path,
                    change: Callable[[dict[str, Any]], None]) -> Iterator[TopologyRun]:
    """A test copy of topologies/<src>.yaml (free ports, this store root, `change`d),
    started; stopped after (the store root is the caller's: store_root())."""
    path = edit_topology(copy_topology(src, tmp, model=model, cache_dir=cache_dir), change)
    with topology_up(path, cache_dir, tmp / "state", should_remove_cache=False) as run:
        yield run


@contextmanager
def store_root(tmp: Path, size: str = "4m") -> Iterator[tuple[Path, bool]]:
    """A store root on a tmpfs of its own (so a test can really fill it), when this process
    may mount one (root); else a private directory under /dev/shm. Yields (path, is_small).

    EPDCTL_TEST_NO_TMPFS=1 takes the second way as root too (what CI without root does).
    """
    small = tmp / "small-shm"
    small.mkdir()
    may_mount = os.geteuid() == 0 and not os.environ.get("EPDCTL_TEST_NO_TMPFS")
    is_mounted = may_mount and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "epdctl-test", str(small)],
        capture_output=True).returncode == 0
    path = small if is_mounted else Path(f"/dev/shm/epdctl-test-{uuid.uuid4().hex[:8]}")
    try:
        yield path, is_mounted
    finally:
        if is_mounted:
            subprocess.run(["umount", "-l", str(small)], capture_output=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
