"""A shipped CPU topology run by the real CLI (`python -m epdctl ... up -d`), for e2e tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.baselines import Baselines
from tests.vllm_harness import (
    TOPOLOGIES,
    Server,
    copy_topology,
    wait_all_ready,
)

READY_TIMEOUT_S = 400
MEDIA_PROBE = Path(__file__).parent / "probe"


@dataclass
class TopologyRun:
    """A test copy of a topology, its state root, private EC store root and CLI env."""

    path: Path
    state_root: Path
    cache_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    semaphores_before: frozenset[str] = frozenset()
    """The named semaphores in /dev/shm before its `up` (someone else's)."""

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

    def state(self) -> Any:
        """state.json (or last-run.json after `down`) as the RunState model."""
        from epdctl.launch.state import RunState

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


def cli_env() -> dict[str, str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("EPDCTL_PROXY_COMMAND", None)
    env.pop("EPDCTL_STATE_DIR", None)
    return env


@contextmanager
def topology_up(path: Path, cache_dir: Path, state_root: Path, *,
                baseline: Server | None = None) -> Iterator[TopologyRun]:
    """`up -d` the topology (and wait for the baseline starting meanwhile); down and clean
    up after."""
    from tests.e2e.leftovers import semaphores

    run = TopologyRun(path, state_root, cache_dir, cli_env(), frozenset(semaphores()))
    with release_new_semaphores():
        try:
            up = run.cli("up", str(path), "-d", "--timeout", str(READY_TIMEOUT_S),
                         timeout_s=READY_TIMEOUT_S + 60)
            assert up.returncode == 0, f"up failed:\n{up.stdout}\n{up.stderr}"
            if baseline is not None:
                wait_all_ready([baseline], READY_TIMEOUT_S, stop_on_failure=False)
            yield run
        finally:
            if run.is_up():
                run.cli("down", "--name", run.name, timeout_s=90)
            _stop_leftovers(run)
            shutil.rmtree(cache_dir, ignore_errors=True)


@contextmanager
def topology_with_baseline(
    path: Path, cache_dir: Path, state_root: Path, baselines: Baselines, baseline_model: Path,
    baseline_args: Sequence[str] = (),
) -> Iterator[tuple[TopologyRun, Server]]:
    """`up -d` the topology while the session's baseline for the model starts (if it is not
    up yet); down and clean up after (the baseline stays, tests/baselines.py)."""
    base = baselines.start(baseline_model, baseline_args)
    with topology_up(path, cache_dir, state_root, baseline=base) as run:
        yield run, baselines.ready(baseline_model, baseline_args)


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
    from epdctl.host.shm import release

    before = _semaphores()
    try:
        yield
    finally:
        release(_semaphores() - before)


def _stop_leftovers(run: TopologyRun) -> None:
    from epdctl.launch.processes import scan_marked, stop_all

    leftovers = scan_marked(run.run_dir)
    if leftovers:
        stop_all(leftovers, 5.0)


def wait_for(predicate: Any, timeout_s: float = 30.0, interval_s: float = 0.1) -> Any:
    """Poll until predicate() is truthy (the EC store's counters flush once a second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def leftovers(run: TopologyRun) -> list[str]:
    """Recorded processes (supervisor included) or their groups still alive after `down`."""
    from epdctl.launch.processes import group_alive
    from tests.conftest import is_running

    state = run.state()
    records = [*state.records.values(), *([state.supervisor] if state.supervisor else [])]
    assert records, "nothing was recorded"
    return [r.name for r in records if is_running(r.pid) or group_alive(r.pgid)]


def store_files(cache_dir: Path) -> list[Path]:
    """Every file or directory left under a store root."""
    return sorted(cache_dir.rglob("*")) if cache_dir.exists() else []


def check_all_ready(run: TopologyRun, instances: Sequence[str]) -> None:
    """`status --json`: exit 0, every instance (and the proxy) ready, the supervisor alive."""
    result = run.cli("status", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["ready"] is True and doc["phase"] == "running"
    assert {i["name"]: i["state"] for i in doc["instances"]} == dict.fromkeys(
        [*instances, "proxy"], "ready")
    assert doc["supervisor"]["alive"] is True


def check_logs(run: TopologyRun, instances: Sequence[str]) -> None:
    """`logs -n 5`: lines of every instance and the proxy, each with its name prefix."""
    import re

    result = run.cli("logs", "-n", "5")
    assert result.returncode == 0, result.stderr
    for name in [*instances, "proxy"]:
        assert re.search(rf"^\d\d:\d\d:\d\d {re.escape(name)}\s+\| ", result.stdout, re.M), name


def check_verify(run: TopologyRun, baseline: Server) -> dict[str, Any]:
    """`verify --baseline-url` on the running topology passes, and leaves it running."""
    result = run.cli("verify", str(run.path), "--baseline-url", baseline.url, "--json",
                     timeout_s=300)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["started_topology"] is False
    assert doc["baseline"] == {"url": baseline.url, "model": baseline.model, "pid": None,
                               "log": None}
    with_images = [p for p in doc["prompts"] if p["images"]]
    assert len(with_images) >= 4
    assert all(p["equal"] for p in doc["prompts"])
    assert all(p["cache"]["verdict"] == "hit" for p in with_images), with_images
    assert run.cli("status").returncode == 0  # still running
    return doc


def check_down(run: TopologyRun, *, sigkill: bool = False) -> None:
    """`down` stops every recorded process group and leaves no store or vLLM shm files, no
    named semaphore, and none of the sockets or temp files the run held (its IPC sockets
    were all in directories of the run, removed too). With `sigkill`, the supervisor and
    every engine group get SIGKILL first, so nothing of theirs cleans up after them."""
    import signal

    from tests.conftest import is_running
    from tests.e2e.leftovers import (
        check_held_privately,
        check_nothing_left,
        ipc_dirs,
        semaphores,
        tmp_sockets,
        unmapped,
    )

    namespace_dir = Path(run.state().store_dir)
    assert namespace_dir.is_dir()
    shm = shm_files(run)
    assert shm, "the instances map no /dev/shm file: the check below would prove nothing"
    recorded = {f for r in run.state().records.values() for f in r.shm_files}
    assert any(Path(f).name.startswith("sem.") for f in recorded), recorded
    held, dirs, sockets = check_held_privately(run), ipc_dirs(run), tmp_sockets()
    if sigkill:
        state = run.state()
        engines = [r for r in state.records.values() if r.name != "proxy"]
        os.kill(state.supervisor.pid, signal.SIGKILL)
        for record in engines:
            os.killpg(record.pgid, signal.SIGKILL)
        assert wait_for(lambda: not any(is_running(r.pid) for r in [state.supervisor,
                                                                     *engines]))
        assert [s for s in held.sockets if not os.path.lexists(s)] == []  # none unlinked
        assert [f for f in recorded if not os.path.exists(f)] == []
    result = run.cli("down", timeout_s=90)
    assert result.returncode == 0, result.stderr
    assert not (run.run_dir / "state.json").exists()
    assert not (left := leftovers(run)), left  # a helper: pytest shows no diff here
    assert not namespace_dir.exists()
    assert store_files(run.cache_dir) == []
    assert [p for p in shm | recorded if Path(p).exists()] == []
    check_nothing_left(held, dirs)
    assert tmp_sockets() - sockets == set()  # and no new socket in the temp dir at all
    assert unmapped(semaphores() - run.semaphores_before) == set()  # (a baseline's is mapped)


def shm_files(run: TopologyRun) -> set[str]:
    """/dev/shm files mapped by any process of the running instances (vLLM's queues)."""
    import psutil

    paths: set[str] = set()
    for record in run.state().records.values():
        try:
            root = psutil.Process(record.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                maps = proc.memory_maps(grouped=True)
            except psutil.Error:
                continue
            paths |= {m.path for m in maps
                      if m.path.startswith("/dev/shm/") and not m.path.endswith("(deleted)")}
    return paths


def cache_entry(run: TopologyRun, key: str) -> dict[str, Any] | None:
    """The store entry `key` as `cache inspect --entries --json` shows it (None: absent)."""
    doc = run.cli_json("cache", "inspect", "--entries")
    for ns in doc["namespaces"]:
        if ns["active"]:
            for item in ns["items"]:
                if item["key"] == key:
                    return dict(item)
    return None


def proxy_counters(run: TopologyRun, url: str | None = None) -> dict[str, float]:
    """The proxy's (or the one at `url`'s) store lookups, items skipped and sent, requests
    overlapped (/metrics)."""
    import re
    import urllib.request

    key = run.state().proxy_api_key
    request = urllib.request.Request(f"{url or run.proxy_url}/metrics", headers={
        "authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    names = {"lookups": "epdctl_proxy_store_lookups_total",
             "skipped": "epdctl_proxy_items_skipped_total",
             "sent": "epdctl_proxy_items_sent_total",
             "overlapped": "epdctl_proxy_overlapped_requests_total"}
    return {k: float(m[1]) if (m := re.search(rf"^{v} (\S+)$", text, re.M)) else 0.0
            for k, v in names.items()}


def store_counters(run: TopologyRun) -> dict[str, Any]:
    """The running namespace's row of `cache inspect --json` (counters, hit ratio)."""
    doc = run.cli_json("cache", "inspect")
    (row,) = [ns for ns in doc["namespaces"] if ns["active"]]
    return dict(row)


def encoder_posts(log: str) -> int:
    """Completion requests an engine's log shows (uvicorn's access lines)."""
    return log.count('"POST /v1/chat/completions HTTP/1.1"')
