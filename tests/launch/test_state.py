from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from epdctl.errors import AlreadyRunningError, EpdctlError, NotRunningError, StateError
from epdctl.launch.identity import process_matches, start_ticks
from epdctl.launch.state import (
    Record,
    RunState,
    SpecModel,
    StateDir,
    find_state_dir,
)


def make_state(name: str = "demo") -> RunState:
    spec = SpecModel(name="pd-0", role="prefill_decode", command=["x"], env={}, port=1,
                     log_path="/l")
    return RunState(name=name, topology_path="/t.yaml", created_at=1.0, mode="pd",
                    namespace="ns", store_dir="/s", model_name="m", specs=[spec])


def test_write_read_round_trip(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "demo")
    state = make_state()
    state.records["pd-0"] = Record(name="pd-0", pid=1, pgid=1, create_time=2.5, started_at=3.0)
    sdir.write(state)
    assert sdir.read() == state
    assert [p.name for p in sdir.path.iterdir()] == ["state.json"]  # no tmp file left


def test_missing_state_is_not_running(tmp_path: Path) -> None:
    with pytest.raises(NotRunningError, match="`demo` is not running"):
        StateDir(tmp_path / "demo").read()


@pytest.mark.parametrize("text", ["{not json", '{"name": 3}', ""])
def test_corrupt_state_points_at_down_force(tmp_path: Path, text: str) -> None:
    sdir = StateDir(tmp_path / "demo")
    sdir.path.mkdir()
    sdir.state_file.write_text(text)
    with pytest.raises(StateError, match=r"corrupt .*`epdctl down --force --name demo`"):
        sdir.read()


def test_lock_is_exclusive_until_released(tmp_path: Path) -> None:
    first, second = StateDir(tmp_path / "demo"), StateDir(tmp_path / "demo")
    first.lock()
    assert second.is_locked()
    with pytest.raises(AlreadyRunningError, match="already running"):
        second.lock()
    first.unlock()
    assert not second.is_locked()
    second.lock()
    second.unlock()


def test_finish_retires_state_and_removes_store(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "demo")
    store = tmp_path / "shm" / "ns"
    store.mkdir(parents=True)
    state = make_state().model_copy(update={"store_dir": str(store)})
    sdir.write(state)
    sdir.finish(state)
    assert not sdir.exists() and not store.exists()
    assert sdir.last_run() == state


def test_finish_keeps_store_when_asked(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "demo")
    store = tmp_path / "ns"
    store.mkdir()
    state = make_state().model_copy(update={"store_dir": str(store)})
    sdir.write(state)
    sdir.finish(state, keep_cache=True)
    assert store.exists()


def test_process_matches_live_dead_and_reused() -> None:
    me = psutil.Process()
    assert process_matches(me.pid, me.create_time()) is True
    assert process_matches(me.pid, me.create_time() - 100) is None  # pid reused: stale
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(child.pid).create_time()
    child.wait()
    assert process_matches(child.pid, created) is False


@pytest.mark.parametrize(("off", "matches"), [(1.0, True), (-1.0, True), (2.0, True),
                                              (0.5, None), (1.02, None), (3.0, None)])
def test_process_matches_through_a_boot_time_step(monkeypatch: pytest.MonkeyPatch, off: float,
                                                  matches: bool | None) -> None:
    """/proc/stat's btime moves by whole seconds on a slewed clock (what psutil adds to a
    start): the same process then reads a second or two off, never a fraction of one."""
    me = psutil.Process()
    recorded = me.create_time()
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: recorded + off)
    assert process_matches(me.pid, recorded) is matches


def test_recorded_start_ticks_decide_whatever_the_clock_did() -> None:
    """With its start ticks recorded, a process is ours however far its read start moved (a
    clock set by minutes), and a pid whose ticks differ is someone else's."""
    me = psutil.Process()
    ticks = start_ticks(me.pid)
    assert ticks is not None and ticks > 0
    assert process_matches(me.pid, me.create_time() - 600, ticks) is True
    assert process_matches(me.pid, me.create_time(), ticks + 1) is None
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_ticks = start_ticks(child.pid)
    child.wait()
    assert start_ticks(child.pid) is None
    assert process_matches(child.pid, 0.0, child_ticks) is False


def test_find_state_dir(tmp_path: Path) -> None:
    with pytest.raises(NotRunningError, match="nothing is running"):
        find_state_dir(tmp_path, None)
    StateDir(tmp_path / "a").write(make_state("a"))
    assert find_state_dir(tmp_path, None).path == tmp_path / "a"
    StateDir(tmp_path / "b").write(make_state("b"))
    with pytest.raises(EpdctlError, match=r"several topologies .*\(a, b\); pick one with --name"):
        find_state_dir(tmp_path, None)
    assert find_state_dir(tmp_path, "b").path == tmp_path / "b"


def test_find_state_dir_past_runs_and_topology_file(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "state" / "gone")
    sdir.write(make_state("gone"))
    sdir.retire()
    with pytest.raises(NotRunningError):
        find_state_dir(tmp_path / "state", None)
    assert find_state_dir(tmp_path / "state", None, past_runs=True).path == sdir.path
    topo = tmp_path / "t.yaml"
    topo.write_text("name: other\nmodel: m\ndevice: cpu\nroles: {prefill_decode: {}}\n")
    assert find_state_dir(tmp_path / "state", str(topo)).path == tmp_path / "state" / "other"


def test_retire_gets_rid_of_a_state_json_that_is_a_directory(tmp_path: Path) -> None:
    sdir = StateDir(tmp_path / "demo")
    sdir.state_file.mkdir(parents=True)
    (sdir.path / "last-run.json").write_text("{}")
    sdir.retire()
    assert not sdir.state_file.exists()
