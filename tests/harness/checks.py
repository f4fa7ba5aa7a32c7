"""What a running topology shows and leaves: `status`, `logs`, `verify` and `down` checked,
its /dev/shm files, store entries and counters."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from epdctl.launch.processes import group_alive
from tests.e2e.leftovers import (
    check_held_privately,
    check_nothing_left,
    ipc_dirs,
    semaphores,
    tmp_sockets,
    unmapped,
)
from tests.harness.engine import Server, is_running
from tests.harness.topology import TopologyRun
from tests.waits import wait_for


def leftovers(run: TopologyRun) -> list[str]:
    """Recorded processes (supervisor included) or their groups still alive after `down`."""
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
    namespace_dir = Path(run.state().store_dir)
    assert namespace_dir.is_dir()
    shm = shm_files(run)
    assert shm, "the instances map no /dev/shm file: the check below would prove nothing"
    recorded = {f for r in run.state().records.values() for f in r.shm_files}
    assert any(Path(f).name.startswith("sem.") for f in recorded), recorded
    held, dirs, sockets = check_held_privately(run), ipc_dirs(run), tmp_sockets()
    if sigkill:
        state: Any = run.state()
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
    assert not (left := leftovers(run)), (left, result.stderr)  # pytest shows no diff here
    assert not namespace_dir.exists()
    assert store_files(run.cache_dir) == []
    assert [p for p in shm | recorded if Path(p).exists()] == []
    check_nothing_left(held, dirs)
    assert tmp_sockets() - sockets == set()  # and no new socket in the temp dir at all
    assert unmapped(semaphores() - run.semaphores_before) == set()  # (a baseline's is mapped)


def shm_files(run: TopologyRun) -> set[str]:
    """/dev/shm files mapped by any process of the running instances (vLLM's queues)."""
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
