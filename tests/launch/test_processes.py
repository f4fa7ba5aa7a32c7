from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from epdctl.cache.store_root import record_namespace
from epdctl.errors import InstanceDiedError, StartupError
from epdctl.launch.plan import LaunchSpec
from epdctl.launch.processes import (
    Proc,
    describe_failure,
    group_alive,
    likely_cause,
    probe,
    spawn,
    stop_all,
)
from epdctl.launch.run import prepare
from epdctl.launch.state import StateDir
from epdctl.launch.supervisor import Supervisor
from tests.conftest import FAKE_SERVER, free_ports
from tests.conftest import is_running as running

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Proc]]:
    """Procs a test spawned; all stopped afterwards."""
    procs: list[Proc] = []
    yield procs
    stop_all(procs, 1.0)


def fake_spec(tmp_path: Path, *args: str, name: str = "pd-0") -> LaunchSpec:
    port = free_ports(1)
    return LaunchSpec(name=name, role="prefill_decode",
                      command=(sys.executable, str(FAKE_SERVER)), args=tuple(args),
                      port=port, log_path=tmp_path / "logs" / f"{name}.log")


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_spawn_logs_header_and_becomes_ready(tmp_path: Path, started: list[Proc]) -> None:
    spec = fake_spec(tmp_path, "--ready-after", "0.5")
    started.append(proc := spawn(spec, tmp_path))
    assert os.getpgid(proc.pid) == proc.pid  # a session of its own
    wait_for(lambda: probe(spec.health_url) == 503)
    wait_for(lambda: probe(spec.health_url) == 200)
    first = spec.log_path.read_text().splitlines()[0]
    assert re.fullmatch(r"--- epdctl start \S+ .*fake_server\.py --host 127\.0\.0\.1 "
                        r"--port \d+ --ready-after 0\.5", first)
    env = psutil.Process(proc.pid).environ()
    assert env["EPDCTL_RUN_DIR"] == str(tmp_path) and env["EPDCTL_INSTANCE"] == "pd-0"


def test_sigterm_then_sigkill_and_no_grandchild(tmp_path: Path, started: list[Proc]) -> None:
    spec = fake_spec(tmp_path, "--ignore-sigterm", "--spawn-grandchild")
    started.append(proc := spawn(spec, tmp_path))
    wait_for(lambda: probe(spec.health_url) == 200)
    grandchild = int(re.search(r"grandchild pid (\d+)", spec.log_path.read_text())[1])
    begin = time.monotonic()
    result = stop_all([proc], 0.5)
    assert result.killed == ["pd-0"] and result.stopped == [] and result.stale == []
    assert 0.5 <= time.monotonic() - begin < 5
    assert not group_alive(proc.pgid) and not running(grandchild)


def test_polite_process_is_stopped_not_killed(tmp_path: Path, started: list[Proc]) -> None:
    spec = fake_spec(tmp_path)
    started.append(proc := spawn(spec, tmp_path))
    wait_for(lambda: probe(spec.health_url) == 200)
    result = stop_all([proc], 10.0)
    assert result.stopped == ["pd-0"] and result.killed == []
    # Stopped means its group is gone; the exit status is ours to reap (a zombie until then).
    assert proc.popen is not None and proc.popen.wait(timeout=10) == -signal.SIGTERM


def test_stale_pid_is_never_signalled(tmp_path: Path, started: list[Proc]) -> None:
    spec = fake_spec(tmp_path)
    started.append(real := spawn(spec, tmp_path))
    stale = Proc("pd-0", real.pid, real.pgid, real.create_time - 50.0)  # as if the pid was reused
    result = stop_all([stale], 0.5)
    assert result.stale == ["pd-0"] and result.stopped == [] and result.killed == []
    assert real.popen is not None and real.popen.poll() is None


def test_escalation_with_a_fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    alive = {11: True, 22: True}

    def killpg(pgid: int, sig: int) -> None:
        sent.append((pgid, sig))
        alive[pgid] = alive[pgid] and sig != signal.SIGKILL

    monkeypatch.setattr("epdctl.launch.processes.os.killpg", killpg)
    monkeypatch.setattr("epdctl.launch.processes.still_ours", lambda proc: True)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] >= 1.0:
            alive[22] = False  # proxy exits after 1s; pd-0 ignores SIGTERM

    result = stop_all([Proc("proxy", 22, 22, 0.0), Proc("pd-0", 11, 11, 0.0)], 3.0,
                      clock=lambda: now[0], sleep=sleep,
                      is_alive=lambda p: alive[p.pgid])
    assert sent == [(22, signal.SIGTERM), (11, signal.SIGTERM), (11, signal.SIGKILL)]
    assert result.stopped == ["proxy"] and result.killed == ["pd-0"]
    assert 3.0 <= now[0] < 3.2


@pytest.mark.parametrize(("line", "cause"), [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", "out of memory"),
    ("Killed", "out of memory"),
    ("OSError: [Errno 98] Address already in use", "address already in use"),
    ("ModuleNotFoundError: No module named 'vllm'", "a missing Python package"),
    ("RuntimeError: Found no NVIDIA driver on your system (NVML Shared Library Not Found)",
     "a CUDA/NVML driver problem"),
])
def test_likely_cause(line: str, cause: str) -> None:
    found = likely_cause(["INFO starting", line])
    assert found is not None and found.startswith(cause)


def test_likely_cause_unknown_and_sigkill() -> None:
    assert likely_cause(["ValueError: bad"]) is None
    assert likely_cause([], -signal.SIGKILL).startswith("killed by SIGKILL")


def test_describe_failure_has_the_last_40_lines(tmp_path: Path) -> None:
    log = tmp_path / "pd-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "OSError: Address already in use\n")
    text = describe_failure("pd-0", "exited with code 1 while starting", log)
    lines = text.splitlines()
    assert lines[0] == f"`pd-0` exited with code 1 while starting; last lines of {log}:"
    assert lines[1] == "  line 61" and lines[40] == "  OSError: Address already in use"
    assert lines[41].startswith("likely cause: address already in use")


def supervisor_for(tmp_path: Path, topo: Path, **kwargs: object) -> Supervisor:
    run = prepare(topo, tmp_path / "state")
    state = run.initial_state()
    sdir = StateDir(run.plan.state_dir)
    sdir.write(state)
    return Supervisor(sdir, state, stop_timeout_s=2.0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def fake_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import FAKE_PROXY

    monkeypatch.setenv("EPDCTL_PROXY_COMMAND", FAKE_PROXY)


def test_supervisor_ready_then_sigterm(tmp_path: Path, fake_topology, fake_proxy) -> None:
    seen: list[str] = []

    def ready(state) -> None:
        seen.append(state.phase)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop, not by pytest

    sup = supervisor_for(tmp_path, fake_topology(pd_args=("--ready-after", "0.5")), on_ready=ready)
    pids = []
    sup.on_change = lambda s: pids.extend(r.pid for r in s.records.values())
    assert sup.run() == 143
    assert seen == ["running"]
    assert sup.sdir.read().phase == "stopped"
    assert pids and not any(running(p) for p in pids)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_supervisor_early_death_is_startup_error(tmp_path, fake_topology, fake_proxy) -> None:
    sup = supervisor_for(tmp_path, fake_topology(pd_args=("--exit-after", "0.2",
                                                          "--ready-after", "30")))
    with pytest.raises(StartupError) as info:
        sup.run()
    text = str(info.value)
    assert text.startswith("`pd-0` exited with code 1 while starting; last lines of ")
    assert "  fake: exiting with code 1" in text
    state = sup.sdir.read()
    assert state.phase == "failed" and state.error == text


def test_supervisor_missed_deadline(tmp_path, fake_topology, fake_proxy) -> None:
    sup = supervisor_for(tmp_path, fake_topology(encode_args=("--ready-after", "60")),
                         timeout_s=1.0)
    with pytest.raises(StartupError, match=r"^`encode-0` was not ready within 1s; last lines"):
        sup.run()


def test_instance_death_without_policy(tmp_path, fake_topology, fake_proxy) -> None:
    sup = supervisor_for(tmp_path, fake_topology(pd_args=("--exit-after", "2")))
    with pytest.raises(InstanceDiedError, match=r"^`pd-0` exited with code 1 while serving;"):
        sup.run()
    assert sup.sdir.read().phase == "exited"


def test_on_failure_restarts_then_gives_up(tmp_path, fake_topology, fake_proxy) -> None:
    extra = "restart: {policy: on-failure, max_restarts: 1, backoff: 0.1}\n"
    sup = supervisor_for(tmp_path, fake_topology(pd_args=("--exit-after", "2"), extra=extra))
    with pytest.raises(InstanceDiedError, match=r"while serving \(after 1 restart\(s\)\)"):
        sup.run()
    assert sup.state.records["pd-0"].restarts == 1
    log = sup.state.specs[1].log_path
    assert Path(log).read_text().count("--- epdctl start") == 2


def test_janitor_keeps_the_namespace_budget_and_drops_stale_own_namespaces(
    tmp_path, fake_topology, fake_proxy, monkeypatch
) -> None:
    calls = []

    def enforce(root, **kwargs) -> None:
        calls.append((root, kwargs))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr("epdctl.cache.janitor.enforce", enforce)
    sup = supervisor_for(tmp_path, fake_topology(cache="capacity: 1MiB, ttl: 60"))
    store = Path(sup.state.store_dir)
    root = store.parent
    root.mkdir(mode=0o700)
    for ns in (f"{sup.state.name}-0123456789ab", "other-topology-0123456789ab", store.name):
        (root / ns).mkdir(mode=0o700)
        (root / ns / "entries").mkdir(mode=0o700)
    # Only a namespace an earlier run of this topology recorded is its own to drop.
    record_namespace(sup.sdir.path, root, f"{sup.state.name}-0123456789ab")
    assert sup.run() == 143
    assert calls[0] == (store, {"capacity_bytes": 1 << 20, "ttl_s": 60.0, "grace_s": 120.0})
    assert calls[1][0] == root
    assert calls[1][1]["keep_namespaces"] == {"other-topology-0123456789ab", store.name}
